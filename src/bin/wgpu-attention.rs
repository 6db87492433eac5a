//! `wgpu-attention`: inspect the GPU, run attention on `.npy` files, verify against the CPU
//! reference and benchmark named shapes.

use std::path::{Path as FsPath, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::builder::TypedValueParser;
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use ndarray::{ArrayD, Ix4};
use ndarray_npy::{read_npy, write_npy, ReadNpyError, WritableElement};
use wgpu_attention::check::{self, F32_TOLERANCE};
use wgpu_attention::reference::{self, MhaInputs, Spec};
use wgpu_attention::shapes::mha::{self as mha_shapes, MhaShape};
use wgpu_attention::shapes::{self, GpuInputs, Shape};
use wgpu_attention::{
    wgpu, Causal, Context, MhaWeights, MultiHeadAttention, NeedWeights, Output, Path, Sdpa,
};

/// Errors are reported on stderr; the process exits with this status.
const EXIT_ERROR: u8 = 2;
/// `demo` exits with this status when the GPU result disagrees with the reference.
const EXIT_CHECK_FAILED: u8 = 1;

type CliResult<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser)]
#[command(
    name = "wgpu-attention",
    version,
    about = "Scaled dot-product attention on the GPU (wgpu/WGSL), checked against a CPU reference",
    long_about = "Scaled dot-product attention, softmax(scale * Q K^T + bias, masks) V, with \
                  PyTorch semantics, on any wgpu backend (Vulkan, Metal, DX12, GL), checked \
                  against an f64 CPU reference.\n\n\
                  Shapes: q [B, Hq, L, E], k [B, Hkv, S, E], v [B, Hkv, S, Ev] -> out [B, Hq, L, Ev].",
    after_help = "Environment: WGPU_BACKEND (vulkan|metal|dx12|gl), WGPU_ADAPTER_NAME (substring of \
                  the adapter name) and WGPU_POWER_PREF (low|high) choose the adapter.\n\
                  Exit status: 0 on success, 1 when `demo` finds a mismatch with the reference, \
                  2 on any error.",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the GPU adapter, backend, driver and the limits and features that matter.
    Info,
    /// Random inputs on the GPU: time them and verify the output against the CPU reference.
    Demo(DemoArgs),
    /// Attention on .npy files (f32 q/k/v/bias, bool mask); writes f32 .npy outputs.
    Run(RunArgs),
    /// Multi-head attention layer (PyTorch nn.MultiheadAttention weights) on .npy inputs.
    Mha(MhaArgs),
    /// Time named shapes on every path and print a table (median of several runs).
    Bench(BenchArgs),
}

#[derive(Args)]
struct MhaArgs {
    /// Query input [B, L, d_model] (f32); also keys and values unless --key/--value are given.
    #[arg(long, value_name = "X.npy")]
    query: PathBuf,
    /// Key input [B, S, kdim] for cross-attention (needs --value).
    #[arg(long, value_name = "XK.npy", requires = "value")]
    key: Option<PathBuf>,
    /// Value input [B, S, vdim] for cross-attention (needs --key).
    #[arg(long, value_name = "XV.npy", requires = "key")]
    value: Option<PathBuf>,
    /// safetensors state dict of torch.nn.MultiheadAttention (in_proj_weight or
    /// q/k/v_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias).
    #[arg(long, value_name = "MHA.safetensors")]
    weights: PathBuf,
    /// Prefix of the layer's keys in the state dict (e.g. "encoder.layers.0.self_attn.").
    #[arg(long, default_value = "")]
    prefix: String,
    /// Query heads.
    #[arg(long)]
    heads: usize,
    /// Key/value heads (grouped-query); checked against the weights, which determine it.
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Boolean mask broadcastable to [B, H, L, S]; true = may attend (see --torch-masks).
    #[arg(long, value_name = "M.npy")]
    mask: Option<PathBuf>,
    /// Key padding mask [B, S]; true = real key (see --torch-masks). Combined with --mask.
    #[arg(long, value_name = "KPM.npy")]
    key_padding_mask: Option<PathBuf>,
    /// --mask and --key-padding-mask use PyTorch's nn.MultiheadAttention convention
    /// (true = masked out / padding).
    #[arg(long)]
    torch_masks: bool,
    /// Causal mask.
    #[arg(long, value_enum, default_value_t = CausalArg::None)]
    causal: CausalArg,
    /// Valid key length of each batch element (masks key tails).
    #[arg(long, value_delimiter = ',', value_name = "LEN,..")]
    kv_lens: Option<Vec<usize>>,
    /// Output [B, L, d_model] (f32).
    #[arg(long, value_name = "O.npy")]
    out: PathBuf,
    /// Write the attention weights: [B, H, L, S], or [B, L, S] with --average-weights.
    #[arg(long, value_name = "W.npy")]
    weights_out: Option<PathBuf>,
    /// Average the weights over heads (PyTorch's average_attn_weights=True).
    #[arg(long)]
    average_weights: bool,
    /// Draw the first batch element's attention weights as a PNG (one panel per head, or one
    /// for --average-weights).
    #[arg(long, value_name = "MAP.png")]
    heatmap: Option<PathBuf>,
    /// Pixels per weight in the heatmap.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    cell: u32,
    /// Run the f64 CPU reference instead of the GPU.
    #[arg(long)]
    cpu: bool,
}

/// Causal masking, by alignment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CausalArg {
    /// No causal mask.
    None,
    /// PyTorch is_causal=True: query i sees keys j <= i.
    TopLeft,
    /// KV-cache / FlashAttention alignment: query i sees keys j <= i + S - L.
    BottomRight,
}

impl From<CausalArg> for Causal {
    fn from(c: CausalArg) -> Causal {
        match c {
            CausalArg::None => Causal::None,
            CausalArg::TopLeft => Causal::TopLeft,
            CausalArg::BottomRight => Causal::BottomRight,
        }
    }
}

/// Parses `auto` or any concrete path name, listing them in `--help`.
fn path_parser() -> impl TypedValueParser<Value = Path> {
    let names: Vec<&'static str> = std::iter::once(Path::Auto)
        .chain(Path::ALL)
        .map(Path::name)
        .collect();
    // A listed name that did not parse would be refused, never replaced by a default.
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<Path>())
}

#[derive(Args)]
struct DemoArgs {
    /// Batch size B.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Query heads Hq.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads Hkv (must divide Hq) [default: same as --heads].
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Query length L.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Key/value length S [default: same as --seq].
    #[arg(long)]
    seq_kv: Option<usize>,
    /// Query/key head dimension E.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Value head dimension Ev [default: same as --head-dim].
    #[arg(long)]
    head_dim_v: Option<usize>,
    /// Causal mask alignment.
    #[arg(long, value_enum, default_value_t = CausalArg::TopLeft)]
    causal: CausalArg,
    /// Implementation to run.
    #[arg(long, value_parser = path_parser(), default_value = "auto")]
    path: Path,
    /// Timed runs after the warm-up.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Seed of the random inputs (uniform in [-1, 1)).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Skip the comparison with the CPU reference (which is slow for large shapes).
    #[arg(long)]
    no_check: bool,
}

#[derive(Args)]
struct RunArgs {
    /// Queries, f32 .npy [B, Hq, L, E].
    #[arg(long, value_name = "Q.npy")]
    q: PathBuf,
    /// Keys, f32 .npy [B, Hkv, S, E].
    #[arg(long, value_name = "K.npy")]
    k: PathBuf,
    /// Values, f32 .npy [B, Hkv, S, Ev].
    #[arg(long, value_name = "V.npy")]
    v: PathBuf,
    /// Boolean mask .npy (true = may attend), rank 1-4, broadcastable to [B, Hq, L, S].
    #[arg(long, value_name = "M.npy")]
    mask: Option<PathBuf>,
    /// Additive f32 bias .npy, rank 1-4, broadcastable to [B, Hq, L, S] (-inf masks a key).
    #[arg(long, value_name = "B.npy")]
    bias: Option<PathBuf>,
    /// Per-batch key lengths (key padding), comma separated: batch b attends keys j < len[b].
    #[arg(long, value_delimiter = ',', value_name = "LEN,..")]
    kv_lens: Option<Vec<usize>>,
    /// Causal mask alignment.
    #[arg(long, value_enum, default_value_t = CausalArg::None)]
    causal: CausalArg,
    /// Softmax scale [default: 1/sqrt(E)].
    #[arg(long, allow_negative_numbers = true)]
    scale: Option<f32>,
    /// Implementation to run on the GPU.
    #[arg(long, value_parser = path_parser(), default_value = "auto")]
    path: Path,
    /// Run the CPU reference (f64, slow) instead of the GPU; outputs are written as f32.
    #[arg(long, conflicts_with = "path")]
    cpu: bool,
    /// Where to write the output, f32 .npy [B, Hq, L, Ev].
    #[arg(long, value_name = "O.npy")]
    out: PathBuf,
    /// Also write the attention weights, f32 .npy [B, Hq, L, S].
    #[arg(long, value_name = "W.npy")]
    weights_out: Option<PathBuf>,
    /// Also write the row logsumexp, f32 .npy [B, Hq, L] (-inf on fully masked rows).
    #[arg(long, value_name = "LSE.npy")]
    lse_out: Option<PathBuf>,
}

#[derive(Args)]
struct BenchArgs {
    /// Shapes to time, comma separated, or `all` [default: all but c_h8_s4096_causal,
    /// long_h1_s32768_causal and mha_gqa_h32_kv8_d128_l128]. Attention: small_h4_s128,
    /// a_h8_s1024, b_h8_s1024_causal, c_h8_s4096_causal, d_decode_h32_s4096_e128,
    /// e_b4_h12_s256_padmask, long_h1_s32768_causal, gpt2_h12_t1024_causal. Multi-head
    /// attention layers: mha_bert_base_l128, mha_bert_base_l512, mha_gqa_h32_kv8_d128_l128.
    #[arg(long, value_delimiter = ',', value_name = "NAME,..")]
    shapes: Vec<String>,
    /// Paths to time, comma separated [default: every concrete path].
    #[arg(long, value_delimiter = ',', value_parser = path_parser(), value_name = "PATH,..")]
    paths: Vec<Path>,
    /// Timed runs per shape and path.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Untimed warm-up runs (the first is reported as "first": it includes shader compilation;
    /// the timed runs start once the kernels' fastest forms are compiled).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    warmup: u32,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
        Command::Demo(args) => demo(&args),
        Command::Run(args) => run(&args),
        Command::Mha(args) => mha(&args),
        Command::Bench(args) => bench(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("wgpu-attention: error: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

fn context() -> CliResult<Idle> {
    Context::new_blocking()
        .map(Idle)
        .map_err(|e| format!("could not set up the GPU: {e}").into())
}

/// The context, waited on when a command ends, so that no kernel the adapter compiles in the
/// background (CPU adapters, after a kernel's first use) is cut off by the process exiting.
struct Idle(Context);

impl std::ops::Deref for Idle {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.0
    }
}

impl Drop for Idle {
    fn drop(&mut self) {
        let _ = self.0.wait_idle();
    }
}

// ---------------------------------------------------------------------------------------------
// info

fn info() -> CliResult<ExitCode> {
    let ctx = context()?;
    println!("adapter: {}", ctx.describe());
    if let Some(i) = ctx.adapter_info() {
        println!("  name:          {}", i.name);
        println!("  backend:       {:?}", i.backend);
        println!("  device type:   {:?}", i.device_type);
        println!("  driver:        {} ({})", i.driver, i.driver_info);
        println!("  vendor/device: {:#06x} / {:#06x}", i.vendor, i.device);
        println!(
            "  subgroup size: min {}, max {}",
            i.subgroup_min_size, i.subgroup_max_size
        );
    }
    let l = ctx.limits();
    println!("limits:");
    let rows: [(&str, String); 6] = [
        (
            "max_storage_buffer_binding_size",
            bytes(l.max_storage_buffer_binding_size),
        ),
        ("max_buffer_size", bytes(l.max_buffer_size)),
        (
            "max_compute_workgroup_storage_size",
            bytes(l.max_compute_workgroup_storage_size.into()),
        ),
        (
            "max_compute_invocations_per_workgroup",
            l.max_compute_invocations_per_workgroup.to_string(),
        ),
        (
            "max_compute_workgroups_per_dimension",
            l.max_compute_workgroups_per_dimension.to_string(),
        ),
        (
            "min_storage_buffer_offset_alignment",
            l.min_storage_buffer_offset_alignment.to_string(),
        ),
    ];
    for (name, value) in rows {
        println!("  {name:<38} {value}");
    }
    println!("features (enabled on this device when the adapter has them):");
    let f = ctx.features();
    for (name, feature) in [
        ("SHADER_F16", wgpu::Features::SHADER_F16),
        ("SUBGROUP", wgpu::Features::SUBGROUP),
        ("TIMESTAMP_QUERY", wgpu::Features::TIMESTAMP_QUERY),
    ] {
        println!("  {name:<38} {}", if f.contains(feature) { "yes" } else { "no" });
    }
    Ok(ExitCode::SUCCESS)
}

/// `n` bytes, with a binary-unit rendering when large.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = "B";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{n} ({v:.1} {unit})")
}

// ---------------------------------------------------------------------------------------------
// demo

fn demo(a: &DemoArgs) -> CliResult<ExitCode> {
    let shape = Shape::custom(
        a.batch,
        a.heads,
        a.kv_heads.unwrap_or(a.heads),
        a.seq,
        a.seq_kv.unwrap_or(a.seq),
        a.head_dim,
        a.head_dim_v.unwrap_or(a.head_dim),
        a.causal.into(),
    );
    let ctx = context()?;
    println!("adapter: {}", ctx.describe());
    println!("shape:   {}", shape.describe());
    shape.check_fits(&ctx)?;

    let host = shape.random_inputs(a.seed);
    let gpu = GpuInputs::upload(&ctx, &shape, &host)?;
    let sdpa = gpu.sdpa().path(a.path);
    let problem = sdpa.problem()?;
    println!("path:    {}", path_label(&sdpa, &ctx, a.path));

    let timing = time_runs(&ctx, &sdpa, 1, a.iters, || {})?;
    let flops = problem.flops();
    println!(
        "time:    first {:.3} ms (incl. shader compilation); median {:.3} ms, min {:.3} ms over {} runs",
        ms(timing.first),
        ms(timing.median),
        ms(timing.min),
        a.iters
    );
    println!("         (wall clock per Sdpa::run incl. output readback; inputs pre-uploaded)");
    println!(
        "speed:   {:.2} GFLOP/s ({:.3} GFLOP per call)",
        gflops(flops, timing.median),
        flops / 1e9
    );

    if a.no_check {
        println!("check:   skipped (--no-check)");
        return Ok(ExitCode::SUCCESS);
    }
    println!("checking against the CPU reference (f64)...");
    let started = Instant::now();
    let spec = Spec {
        causal: shape.causal,
        ..Spec::default()
    };
    let want = reference::sdpa(host.q.view(), host.k.view(), host.v.view(), &spec)?;
    let report = check::compare(
        timing.last.output.iter().copied(),
        want.out.iter().copied(),
        F32_TOLERANCE,
    );
    println!("         reference took {:.1} s", started.elapsed().as_secs_f64());
    println!(
        "max abs error: {:.3e} (tolerance atol {:e} + rtol {:e} * |expected|)",
        report.max_abs_err, F32_TOLERANCE.atol, F32_TOLERANCE.rtol
    );
    if report.passed() {
        println!("check:   PASS ({} elements)", report.count);
        Ok(ExitCode::SUCCESS)
    } else {
        println!("check:   FAIL: {report}");
        Ok(ExitCode::from(EXIT_CHECK_FAILED))
    }
}

/// `unfused`, or `auto -> unfused`.
fn path_label(sdpa: &Sdpa, ctx: &Context, requested: Path) -> String {
    let resolved = match sdpa.resolved_path(ctx) {
        Ok(p) => p,
        Err(e) => return format!("{} (cannot run: {e})", requested.name()),
    };
    if requested == resolved {
        resolved.name().to_string()
    } else {
        format!("{} -> {}", requested.name(), resolved.name())
    }
}

/// Wall-clock times of [`Sdpa::run_blocking`].
struct Timing {
    first: Duration,
    median: Duration,
    min: Duration,
    /// The result of the last timed run.
    last: Output,
}

/// `warmup` untimed runs (the first one's time is kept), then `iters` timed runs;
/// `tick` is called after each run.
fn time_runs(
    ctx: &Context,
    sdpa: &Sdpa,
    warmup: u32,
    iters: u32,
    mut tick: impl FnMut(),
) -> wgpu_attention::Result<Timing> {
    let mut first = Duration::ZERO;
    for i in 0..warmup {
        let t = Instant::now();
        sdpa.run_blocking(ctx)?;
        if i == 0 {
            first = t.elapsed();
        }
        tick();
    }
    // Time the steady state: the fastest forms, which CPU adapters compile in the background
    // after a kernel's first use.
    ctx.wait_idle()?;
    let mut times = Vec::with_capacity(iters as usize);
    let mut last = None;
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        let out = sdpa.run_blocking(ctx)?;
        times.push(t.elapsed());
        last = Some(out);
        tick();
    }
    times.sort();
    let n = times.len();
    let median = if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2
    };
    Ok(Timing {
        first,
        median,
        min: times[0],
        last: last.expect("at least one timed run"),
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn gflops(flops: f64, d: Duration) -> f64 {
    flops / d.as_secs_f64() / 1e9
}

// ---------------------------------------------------------------------------------------------
// run

fn run(a: &RunArgs) -> CliResult<ExitCode> {
    let q = read_qkv(&a.q, "q", "[B, Hq, L, E]")?;
    let k = read_qkv(&a.k, "k", "[B, Hkv, S, E]")?;
    let v = read_qkv(&a.v, "v", "[B, Hkv, S, Ev]")?;
    let mask = a
        .mask
        .as_deref()
        .map(|p| read_array::<bool>(p, "mask", "bool ('|b1')", "np.asarray(m, dtype=bool)"))
        .transpose()?;
    let bias = a
        .bias
        .as_deref()
        .map(|p| read_array::<f32>(p, "bias", "float32 ('<f4')", "b.astype(np.float32)"))
        .transpose()?;
    let causal: Causal = a.causal.into();

    let (out, weights, lse, how) = if a.cpu {
        let spec = Spec {
            scale: a.scale.map(f64::from),
            causal,
            mask: mask.as_ref().map(|m| m.view()),
            bias: bias.as_ref().map(|b| b.view()),
            kv_lens: a.kv_lens.as_deref(),
        };
        let started = Instant::now();
        let r = reference::sdpa(q.view(), k.view(), v.view(), &spec)?;
        let elapsed = started.elapsed();
        let to_f32 = |x: f64| x as f32;
        (
            r.out.mapv(to_f32).into_dyn(),
            Some(r.weights.mapv(to_f32).into_dyn()),
            Some(r.lse.mapv(to_f32).into_dyn()),
            format!(
                "ran the CPU reference (f64, written as f32) in {:.3} ms",
                ms(elapsed)
            ),
        )
    } else {
        let mut sdpa = Sdpa::new(&q, &k, &v).causal(causal).path(a.path);
        if let Some(m) = &mask {
            sdpa = sdpa.mask(m);
        }
        if let Some(b) = &bias {
            sdpa = sdpa.bias(b);
        }
        if let Some(l) = &a.kv_lens {
            sdpa = sdpa.kv_lens(l);
        }
        if let Some(s) = a.scale {
            sdpa = sdpa.scale(s);
        }
        if a.weights_out.is_some() {
            sdpa = sdpa.return_weights();
        }
        if a.lse_out.is_some() {
            sdpa = sdpa.return_lse();
        }
        // Validate before creating the device, so input errors come first.
        sdpa.problem()?;
        let ctx = context()?;
        let started = Instant::now();
        let r = sdpa.run_blocking(&ctx)?;
        let how = format!(
            "ran on {}, path {}, in {:.3} ms (incl. upload, shader compilation and readback)",
            ctx.describe(),
            path_label(&sdpa, &ctx, a.path),
            ms(started.elapsed())
        );
        (
            r.output.into_dyn(),
            r.weights.map(|w| w.into_dyn()),
            r.lse.map(|l| l.into_dyn()),
            how,
        )
    };
    println!("{how}");

    write_array(&a.out, "output", &out)?;
    if let Some(p) = &a.weights_out {
        let w = weights.ok_or("the path did not return attention weights")?;
        write_array(p, "weights", &w)?;
    }
    if let Some(p) = &a.lse_out {
        let l = lse.ok_or("the path did not return the logsumexp")?;
        write_array(p, "lse", &l)?;
    }
    Ok(ExitCode::SUCCESS)
}

// ---------------------------------------------------------------------------------------------
// mha

/// A key padding mask `[B, S]` as `[B, 1, 1, S]`, and-ed with the attention mask if both.
fn combine_masks(mask: Option<ArrayD<bool>>, kpm: Option<ArrayD<bool>>) -> CliResult<Option<ArrayD<bool>>> {
    let Some(kpm) = kpm else { return Ok(mask) };
    let &[b, s] = kpm.shape() else {
        return Err(format!(
            "key padding mask: shape {:?}, expected 2 dimensions [B, S]",
            kpm.shape()
        )
        .into());
    };
    let kpm = kpm.into_shape_with_order(ndarray::IxDyn(&[b, 1, 1, s]))?;
    let Some(mask) = mask else { return Ok(Some(kpm)) };
    // Broadcast both to the larger of each dimension (mask shapes are right-aligned).
    let mut m4 = vec![1usize; 4usize.saturating_sub(mask.ndim())];
    m4.extend_from_slice(mask.shape());
    if m4.len() != 4 {
        return Err(format!("mask: shape {:?} has more than 4 dimensions", mask.shape()).into());
    }
    let mask = mask.into_shape_with_order(ndarray::IxDyn(&m4))?;
    let target: Vec<usize> = (0..4).map(|i| m4[i].max(kpm.shape()[i])).collect();
    let (mb, kb) = (
        mask.broadcast(target.clone()).ok_or_else(|| {
            format!("mask {m4:?} and key padding mask [{b}, {s}] do not broadcast together")
        })?,
        kpm.broadcast(target.clone()).ok_or_else(|| {
            format!("mask {m4:?} and key padding mask [{b}, {s}] do not broadcast together")
        })?,
    );
    Ok(Some(
        ndarray::Zip::from(&mb).and(&kb).map_collect(|&x, &y| x && y),
    ))
}

/// Read an f32 `.npy` of exactly 3 dimensions.
fn read_3d(path: &FsPath, what: &str, layout: &str) -> CliResult<ndarray::Array3<f32>> {
    let a = read_array::<f32>(path, what, "float32 ('<f4')", "x.astype(np.float32)")?;
    let shape = a.shape().to_vec();
    a.into_dimensionality::<ndarray::Ix3>().map_err(|_| {
        format!(
            "{what}: {} has shape {shape:?} ({} dimensions); expected 3 dimensions {layout}",
            path.display(),
            shape.len()
        )
        .into()
    })
}

fn mha(a: &MhaArgs) -> CliResult<ExitCode> {
    let weights = MhaWeights::from_safetensors_prefixed(
        &std::fs::read(&a.weights)
            .map_err(|e| format!("weights: cannot read {}: {e}", a.weights.display()))?,
        &a.prefix,
        a.heads,
    )?;
    if let Some(g) = a.kv_heads {
        if g != weights.config.num_kv_heads {
            return Err(format!(
                "--kv-heads {g}, but the weights have {} key/value heads",
                weights.config.num_kv_heads
            )
            .into());
        }
    }
    let x = read_3d(&a.query, "query", "[B, L, d_model]")?;
    let key = a
        .key
        .as_deref()
        .map(|p| read_3d(p, "key", "[B, S, kdim]"))
        .transpose()?;
    let value = a
        .value
        .as_deref()
        .map(|p| read_3d(p, "value", "[B, S, vdim]"))
        .transpose()?;
    let mask = a
        .mask
        .as_deref()
        .map(|p| read_array::<bool>(p, "mask", "bool ('|b1')", "np.asarray(m, dtype=bool)"))
        .transpose()?
        .map(|m| if a.torch_masks { m.mapv(|x| !x) } else { m });
    let kpm = a
        .key_padding_mask
        .as_deref()
        .map(|p| read_array::<bool>(p, "key padding mask", "bool ('|b1')", "np.asarray(m, dtype=bool)"))
        .transpose()?
        .map(|m| if a.torch_masks { m.mapv(|x| !x) } else { m });
    let mask = combine_masks(mask, kpm)?;
    let causal: Causal = a.causal.into();
    let need = match (a.weights_out.is_some() || a.heatmap.is_some(), a.average_weights) {
        (false, _) => NeedWeights::No,
        (true, false) => NeedWeights::PerHead,
        (true, true) => NeedWeights::Averaged,
    };
    let (out, w, how) = if a.cpu {
        let inputs = match (&key, &value) {
            (Some(k), Some(v)) => MhaInputs::cross(x.view(), k.view(), v.view()),
            _ => MhaInputs::self_attention(x.view()),
        };
        let spec = Spec {
            causal,
            mask: mask.as_ref().map(|m| m.view()),
            kv_lens: a.kv_lens.as_deref(),
            ..Default::default()
        };
        let started = Instant::now();
        let r = reference::mha(&weights, &inputs, &spec)?;
        let how = format!(
            "ran the CPU reference (f64, written as f32) in {:.3} ms",
            ms(started.elapsed())
        );
        let w = match need {
            NeedWeights::No => None,
            NeedWeights::PerHead => Some(r.weights.mapv(|x| x as f32).into_dyn()),
            NeedWeights::Averaged => Some(
                reference::mean_over_heads(&r.weights)
                    .mapv(|x| x as f32)
                    .into_dyn(),
            ),
        };
        (r.out.mapv(|x| x as f32).into_dyn(), w, how)
    } else {
        let ctx = context()?;
        let layer = MultiHeadAttention::new(&ctx, &weights)?;
        let mut f = layer.forward(&x).causal(causal).need_weights(need);
        if let (Some(k), Some(v)) = (&key, &value) {
            f = f.key_value(k, v);
        }
        if let Some(m) = &mask {
            f = f.mask(m);
        }
        if let Some(l) = &a.kv_lens {
            f = f.kv_lens(l);
        }
        let started = Instant::now();
        let r = f.run_blocking(&ctx)?;
        let how = format!(
            "ran on {} in {:.3} ms (incl. upload, shader compilation and readback)",
            ctx.describe(),
            ms(started.elapsed())
        );
        let w = r
            .weights
            .map(|w| w.into_dyn())
            .or(r.avg_weights.map(|w| w.into_dyn()));
        (r.output.into_dyn(), w, how)
    };
    println!("{how}");
    write_array(&a.out, "output", &out)?;
    if let Some(p) = &a.weights_out {
        write_array(p, "weights", w.as_ref().ok_or("no attention weights")?)?;
    }
    if let Some(p) = &a.heatmap {
        let w = w.as_ref().ok_or("no attention weights")?;
        // Batch element 0: [H, L, S] per head, [1, L, S] averaged.
        let first = w.index_axis(ndarray::Axis(0), 0).to_owned();
        let panels = match first.ndim() {
            2 => first.insert_axis(ndarray::Axis(0)),
            _ => first,
        }
        .into_dimensionality::<ndarray::Ix3>()?;
        wgpu_attention::heatmap::write_heatmap(p, panels.view(), a.cell)?;
        println!("wrote heatmap of {} panel(s) to {}", panels.dim().0, p.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Read a `.npy` of element type `T`, with messages naming the file and what was expected.
fn read_array<T: ndarray_npy::ReadableElement>(
    path: &FsPath,
    what: &str,
    dtype: &str,
    fix: &str,
) -> CliResult<ArrayD<T>> {
    read_npy::<_, ArrayD<T>>(path).map_err(|e| {
        let p = path.display();
        match e {
            ReadNpyError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                format!("{what}: {p} is not a valid .npy file (it ends early)")
            }
            ReadNpyError::Io(io) => format!("{what}: cannot read {p}: {io}"),
            ReadNpyError::WrongDescriptor(d) => {
                format!("{what}: {p} has dtype {d}, expected {dtype} (in numpy: {fix})")
            }
            other => format!("{what}: {p} is not a valid .npy file: {other}"),
        }
        .into()
    })
}

/// Read q, k or v: f32 and exactly 4-D.
fn read_qkv(path: &FsPath, what: &str, layout: &str) -> CliResult<ndarray::Array4<f32>> {
    let a = read_array::<f32>(path, what, "float32 ('<f4')", "x.astype(np.float32)")?;
    let shape = a.shape().to_vec();
    a.into_dimensionality::<Ix4>().map_err(|_| {
        format!(
            "{what}: {} has shape {shape:?} ({} dimensions); expected 4 dimensions {layout}",
            path.display(),
            shape.len()
        )
        .into()
    })
}

fn write_array<T: WritableElement>(path: &FsPath, what: &str, a: &ArrayD<T>) -> CliResult<()> {
    write_npy(path, a).map_err(|e| format!("{what}: cannot write {}: {e}", path.display()))?;
    println!("wrote {} {:?} to {}", what, a.shape(), path.display());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// bench

fn bench(a: &BenchArgs) -> CliResult<ExitCode> {
    let (shapes, layers) = select_shapes(&a.shapes)?;
    let paths: Vec<Path> = if a.paths.is_empty() {
        Path::ALL.to_vec()
    } else {
        dedup(a.paths.clone())
    };
    let ctx = context()?;
    println!("adapter: {}", ctx.describe());
    println!(
        "{} warm-up + {} timed runs per row; wall clock per Sdpa::run incl. output readback, \
         inputs pre-uploaded; \"first\" includes shader compilation, timed runs use the \
         fastest forms",
        a.warmup, a.iters
    );
    println!(
        "{:<24} {:<8} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "shape", "path", "first ms", "median ms", "min ms", "GFLOP/s", "GPU MiB"
    );

    let per_row = u64::from(a.warmup + a.iters);
    let pb = ProgressBar::new(per_row * (shapes.len() * paths.len()) as u64);
    pb.set_style(ProgressStyle::with_template(
        "[{elapsed_precise}] {bar:24} {pos}/{len} runs  {wide_msg}",
    )?);
    for shape in shapes {
        pb.set_message(shape.name);
        let prepared = shape
            .check_fits(&ctx)
            .and_then(|()| GpuInputs::upload(&ctx, shape, &shape.random_inputs(a.seed)));
        let gpu = match prepared {
            Ok(g) => g,
            Err(e) => {
                for path in &paths {
                    pb.suspend(|| println!("{:<24} {:<8} error: {e}", shape.name, path.name()));
                    pb.inc(per_row);
                }
                continue;
            }
        };
        for &path in &paths {
            pb.set_message(format!("{} / {}", shape.name, path.name()));
            let sdpa = gpu.sdpa().path(path);
            let done_before = pb.position();
            let row = sdpa.problem().and_then(|p| {
                let mem = sdpa.device_memory(&ctx)?;
                let t = time_runs(&ctx, &sdpa, a.warmup, a.iters, || pb.inc(1))?;
                Ok((p.flops(), t, mem))
            });
            let line = match row {
                Ok((flops, t, mem)) => format!(
                    "{:<24} {:<8} {:>10.3} {:>10.3} {:>10.3} {:>9.2} {:>9.1}",
                    shape.name,
                    path.name(),
                    ms(t.first),
                    ms(t.median),
                    ms(t.min),
                    gflops(flops, t.median),
                    mem as f64 / (1024.0 * 1024.0)
                ),
                Err(e) => {
                    pb.set_position(done_before + per_row);
                    format!("{:<24} {:<8} error: {e}", shape.name, path.name())
                }
            };
            pb.suspend(|| println!("{line}"));
        }
    }
    pb.finish_and_clear();
    bench_layers(&ctx, &layers, a)?;
    println!("{}", matmul_row(&ctx, a.iters)?);
    Ok(ExitCode::SUCCESS)
}

/// The attention and layer shapes named on the command line (`all` for every one), or the
/// default sets.
fn select_shapes(names: &[String]) -> CliResult<(Vec<&'static Shape>, Vec<&'static MhaShape>)> {
    if names.is_empty() {
        return Ok((
            shapes::SHAPES.iter().filter(|s| s.default).collect(),
            mha_shapes::MHA_SHAPES.iter().filter(|s| s.default).collect(),
        ));
    }
    let (mut out, mut layers) = (Vec::new(), Vec::new());
    for name in names {
        let name = name.trim();
        if name == "all" {
            out.extend(shapes::SHAPES.iter());
            layers.extend(mha_shapes::MHA_SHAPES.iter());
        } else if let Some(s) = shapes::find(name) {
            out.push(s);
        } else if let Some(s) = mha_shapes::find(name) {
            layers.push(s);
        } else {
            let layer_names: Vec<&str> = mha_shapes::MHA_SHAPES.iter().map(|s| s.name).collect();
            return Err(format!(
                "unknown shape {name:?}; known shapes: {}, {}, or all",
                shapes::names(),
                layer_names.join(", ")
            )
            .into());
        }
    }
    Ok((dedup(out), dedup(layers)))
}

/// Time the multi-head attention layers: whole forward passes, then profiled passes split
/// into projections (with the head split), attention, and output projection (with readback).
fn bench_layers(ctx: &Context, layers: &[&'static MhaShape], a: &BenchArgs) -> CliResult<()> {
    if layers.is_empty() {
        return Ok(());
    }
    println!(
        "\nmulti-head attention layers (self-attention, path auto); split from {} profiled runs:",
        a.iters
    );
    println!(
        "{:<26} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "layer", "first ms", "median ms", "GFLOP/s", "proj ms", "attn ms", "out ms"
    );
    for shape in layers {
        let bench = match shape.prepare(ctx) {
            Ok(b) => b,
            Err(e) => {
                println!("{:<26} error: {e}", shape.name);
                continue;
            }
        };
        let run = |profile: bool| -> CliResult<(Duration, Option<wgpu_attention::MhaTimings>)> {
            let f = if profile {
                bench.forward().profile()
            } else {
                bench.forward()
            };
            let started = Instant::now();
            let r = f.run_blocking(ctx)?;
            Ok((started.elapsed(), r.timings))
        };
        let first = run(false)?.0;
        for _ in 1..a.warmup {
            run(false)?;
        }
        ctx.wait_idle()?;
        let mut times: Vec<Duration> = (0..a.iters)
            .map(|_| run(false).map(|r| r.0))
            .collect::<CliResult<_>>()?;
        times.sort();
        let median = times[times.len() / 2];
        let mut split = [vec![], vec![], vec![]];
        for _ in 0..a.iters {
            let t = run(true)?.1.ok_or("profiled run without timings")?;
            split[0].push(t.projections);
            split[1].push(t.attention);
            split[2].push(t.output);
        }
        let med = |v: &mut Vec<Duration>| {
            v.sort();
            ms(v[v.len() / 2])
        };
        let (proj, attn) = shape.flops();
        println!(
            "{:<26} {:>10.3} {:>10.3} {:>9.2} {:>9.3} {:>9.3} {:>9.3}",
            shape.name,
            ms(first),
            ms(median),
            gflops(proj + attn, median),
            med(&mut split[0]),
            med(&mut split[1]),
            med(&mut split[2]),
        );
    }
    Ok(())
}

/// Drop repeats, keeping the first occurrence.
fn dedup<T: PartialEq>(items: Vec<T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(items.len());
    for i in items {
        if !out.contains(&i) {
            out.push(i);
        }
    }
    out
}

/// The crate's own matmul kernel on a 1024 x 1024 x 1024 product (inputs pre-uploaded, output
/// read back), the yardstick for the attention paths' GFLOP/s.
fn matmul_row(ctx: &Context, iters: u32) -> CliResult<String> {
    use wgpu::util::DeviceExt;
    let n = 1024usize;
    let data: Vec<f32> = (0..n * n)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let buf = ctx
        .device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("matmul bench"),
            contents: bytemuck::cast_slice(&data),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let t = || wgpu_attention::Tensor::from_buffer(&buf, 0, &[1, n, n]);
    let start = Instant::now();
    wgpu_attention::matmul_blocking(ctx, t(), t(), true, 1.0)?;
    let first = start.elapsed();
    let mut times = Vec::new();
    for _ in 0..iters.max(1) {
        let start = Instant::now();
        wgpu_attention::matmul_blocking(ctx, t(), t(), true, 1.0)?;
        times.push(start.elapsed());
    }
    times.sort();
    let median = times[times.len() / 2];
    Ok(format!(
        "{:<24} {:<8} {:>10.3} {:>10.3} {:>10.3} {:>9.2}",
        "matmul_1024x1024x1024",
        "matmul",
        ms(first),
        ms(median),
        ms(times[0]),
        gflops(2.0 * (n * n * n) as f64, median)
    ))
}
