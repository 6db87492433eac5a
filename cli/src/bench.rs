//! `bench`: time named shapes on every path, the multi-head attention layers and the crate's
//! matmul, and print a table.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use wgpu_attention::shapes::mha::{self as mha_shapes, MhaShape};
use wgpu_attention::shapes::{self, GpuInputs, Shape};
use wgpu_attention::{wgpu, Context, Path, Storage};

use crate::timing::{gflops, gpu_median, ms, time_call};
use crate::CliResult;

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Shapes to time, comma separated, or `all` [default: all but c_h8_s4096_causal,
    /// prefill_h32_s4096_e128, long_h1_s32768_causal, causal_h8_s16384, window_h8_s16384, softcap_h8_s1024,
    /// alibi_h8_s1024, sinks_h8_s1024, docs8_h8_s8192, docs8_dense_h8_s8192,
    /// window_mod_h8_s16384, relbias_mod_h8_s1024, paged_d, paged_d_f16, paged_d_int8,
    /// paged_d_fp8, paged_long_f16, paged_long_int8, paged_d_token_major, contiguous_d,
    /// ragged8, ragged8_padded,
    /// cascade64, cascade64_unshared and mha_gqa_h32_kv8_d128_l128]. Attention:
    /// small_h4_s128,
    /// a_h8_s1024, b_h8_s1024_causal, c_h8_s4096_causal, prefill_h32_s4096_e128 (GQA 32/8,
    /// E 128, causal: an LLM's prefill), d_decode_h32_s4096_e128,
    /// e_b4_h12_s256_padmask, long_h1_s32768_causal, gpt2_h12_t1024_causal, causal_h8_s16384,
    /// window_h8_s16384 (window (1023, 0)), softcap_h8_s1024 (a_h8_s1024 with softcap 50),
    /// alibi_h8_s1024 (a_h8_s1024 with ALiBi, the paper's slopes), sinks_h8_s1024 (with sink
    /// logits), docs8_h8_s8192 (8 packed documents of 1024 tokens, causal, as document ids),
    /// docs8_dense_h8_s8192 (the same as a dense boolean mask), window_mod_h8_s16384 (the
    /// window of window_h8_s16384 as a user mask_mod), relbias_mod_h8_s1024 (a_h8_s1024 with a
    /// captured relative-position bias in a user score_mod), paged_d and contiguous_d (d's
    /// decode, causal, through a block table of 16-token blocks, head-major as KvCache lays them
    /// out, and contiguous), paged_d_f16, paged_d_int8 and paged_d_fp8 (paged_d with f16, int8
    /// and fp8 pages whatever --storage says: the 8-bit caches' decode), paged_long_f16 and
    /// paged_long_int8 (one decode query over 32768 keys, GQA 32/8, E 128, f16 and int8 pages),
    /// paged_d_token_major (paged_d in vLLM's layout), ragged8 and
    /// ragged8_padded (8 decode sequences of 512 to 4096 keys, GQA 32/8: paged, and padded to
    /// 4096 with key lengths), cascade64 and cascade64_unshared (64 forks of a 4096-token
    /// prompt, 64 keys each of their own, one decode query each, GQA 32/8, a PagedAttention
    /// batch: the prompt's keys read once, and per fork). Multi-head
    /// attention layers: mha_bert_base_l128, mha_bert_base_l512, mha_gqa_h32_kv8_d128_l128.
    #[arg(long, value_delimiter = ',', value_name = "NAME,..")]
    shapes: Vec<String>,
    /// Paths to time, comma separated [default: every concrete path]: the forward's auto,
    /// unfused, fused, decode, and the backward's fused-bwd, unfused-bwd (timed on the
    /// forward's saved output and logsumexp; GFLOP/s counted as 2.5x the forward's FLOPs,
    /// FlashAttention's convention).
    #[arg(long, value_delimiter = ',', value_parser = bench_path_parser(), value_name = "PATH,..")]
    paths: Vec<BenchPath>,
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
    /// Storage formats to time, comma separated (f32, f16, bf16): q, k, v and the output (and
    /// the layers' weights and activations, and the matmul operands) in that format.
    #[arg(long, value_delimiter = ',', value_parser = crate::storage_parser(), default_value = "f32", value_name = "FORMAT,..")]
    storage: Vec<Storage>,
    /// Skip the 1024^3 matmul rows.
    #[arg(long)]
    no_matmul: bool,
    /// Also time each run on the GPU with timestamp queries (the dispatches alone, without
    /// the host's work, uploads or readback), reported beside the wall time with GFLOP/s from
    /// both. On an adapter without timestamp queries: a one-line note and the wall-time table.
    #[arg(long)]
    gpu_time: bool,
    /// Whose device to run on: the crate's own (`Context::new`), or an application's
    /// (`own`: its adapter request and device handed over with `Context::from_parts`;
    /// `adopted`: with `Context::from_device` alone): `scripts/bench_vs.sh device` compares them.
    #[arg(long, value_enum, default_value = "crate")]
    device: crate::DeviceKind,
    /// Instead of the table: a generation loop's calls, each with the host microseconds
    /// `record` takes (median of this many calls after as many warm-up calls) beside the wall
    /// and GPU milliseconds of the call submitted (`--warmup`, `--iters`): decode and a
    /// 16-query chunk over 4096 f16 keys in `[B, S, H, E]` buffers, a ragged paged batch, a
    /// 32-layer `KvCache` token step per layer over about 500 keys, and `decode_step_32l` (one
    /// token step of 4 sequences over a 32-layer cache at 4096 positions, Hq 32, Hkv 8, E 128,
    /// f16); every input in GPU buffers made once and the outputs in the caller's buffers
    /// (`wgpu_attention::shapes::host`).
    #[arg(long, value_name = "CALLS")]
    host: Option<usize>,
}

/// `bench`: the table of timings.
pub(crate) fn bench(a: &BenchArgs) -> CliResult<ExitCode> {
    let (shapes, layers) = select_shapes(&a.shapes)?;
    let paths: Vec<BenchPath> = if a.paths.is_empty() {
        BenchPath::ALL.to_vec()
    } else {
        dedup(a.paths.clone())
    };
    let ctx = crate::context_on(a.device)?;
    println!("adapter: {}", ctx.describe());
    if let Some(calls) = a.host {
        crate::bench_host::host_table(&ctx, calls, a.warmup, a.iters)?;
        return Ok(ExitCode::SUCCESS);
    }
    let gpu_time = print_header(&ctx, a);
    let storages = dedup(a.storage.clone());
    let per_row = u64::from(a.warmup + a.iters);
    let pb = ProgressBar::new(per_row * (shapes.len() * paths.len() * storages.len()) as u64);
    pb.set_style(ProgressStyle::with_template(
        "[{elapsed_precise}] {bar:24} {pos}/{len} runs  {wide_msg}",
    )?);
    for (shape, &st) in shapes
        .iter()
        .flat_map(|s| storages.iter().map(move |st| (*s, st)))
    {
        pb.set_message(shape.name);
        let prepared = shape
            .check_fits(&ctx)
            .and_then(|()| GpuInputs::upload_as(&ctx, shape, &shape.random_inputs(a.seed), st));
        let gpu = match prepared {
            Ok(g) => g,
            Err(e) => {
                for path in &paths {
                    pb.suspend(|| println!("{:<24} {:<11} {st:<5} error: {e}", shape.name, path.name()));
                    pb.inc(per_row);
                }
                continue;
            }
        };
        // The forward's output and logsumexp and a dO, for the backward rows.
        let mut saved: Option<wgpu_attention::shapes::SavedForward> = None;
        for &path in &paths {
            pb.set_message(format!("{} / {}", shape.name, path.name()));
            let done_before = pb.position();
            // GPU times of every run, warm-ups first: the last `iters` are the timed runs'.
            let mut gpu_times: Vec<Duration> = Vec::new();
            let row = measure(
                &ctx,
                a,
                (shape, &gpu, path),
                &mut saved,
                (gpu_time, &mut gpu_times),
                &pb,
            );
            let gpu_median = gpu_median(&gpu_times, a.iters).filter(|_| gpu_time);
            let line = match row {
                Ok(m) => format_row(shape.name, path.name(), st, m, gpu_median, gpu_time),
                Err(e) => {
                    pb.set_position(done_before + per_row);
                    format!("{:<24} {:<11} {st:<5} error: {e}", shape.name, path.name())
                }
            };
            pb.suspend(|| println!("{line}"));
        }
    }
    pb.finish_and_clear();
    bench_layers(&ctx, &layers, a, &storages)?;
    if !a.no_matmul {
        for &st in &storages {
            for trans_b in [true, false] {
                println!("{}", matmul_row(&ctx, a, st, trans_b, gpu_time)?);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The table's preamble and column heads; whether GPU times are measured.
fn print_header(ctx: &Context, a: &BenchArgs) -> bool {
    let gpu_time = a.gpu_time && ctx.has_gpu_timer();
    if a.gpu_time && !gpu_time {
        println!("--gpu-time: this adapter has no timestamp queries (TIMESTAMP_QUERY); wall time only");
    }
    println!(
        "{} warm-up + {} timed runs per row; wall clock per {}, inputs pre-uploaded; \"first\" \
         includes shader compilation, timed runs use the fastest forms",
        a.warmup,
        a.iters,
        if gpu_time {
            "record + submit + wait (no readback)"
        } else {
            "Sdpa::run incl. output readback"
        }
    );
    if gpu_time {
        println!(
            "GPU ms: median GPU time between timestamps written before and after the run's \
             dispatches (same runs); GPU GF/s from it"
        );
    }
    println!(
        "{:<24} {:<11} {:<5} {:>10} {:>10} {:>10} {:>9} {:>9}{}",
        "shape",
        "path",
        "fmt",
        "first ms",
        "median ms",
        "min ms",
        "GFLOP/s",
        "GPU MiB",
        if gpu_time {
            format!(" {:>10} {:>10}", "GPU ms", "GPU GF/s")
        } else {
            String::new()
        }
    );

    gpu_time
}

/// FLOPs, first, median and min wall times, and the device memory of one row.
type Measured = (f64, Duration, Duration, Duration, Option<u64>);

/// One row: `path` on `shape`'s inputs `gpu` (the backward reads the forward `saved` once per
/// shape), every run's GPU time pushed to `gpu_times`.
fn measure(
    ctx: &Context,
    a: &BenchArgs,
    (shape, gpu, path): (&Shape, &GpuInputs, BenchPath),
    saved: &mut Option<wgpu_attention::shapes::SavedForward>,
    (gpu_time, gpu_times): (bool, &mut Vec<Duration>),
    pb: &ProgressBar,
) -> wgpu_attention::Result<Measured> {
    match path {
        BenchPath::Forward(path) if gpu.paged_attention().is_some() => {
            // A batch of forks: one PagedAttention call (the FLOPs are the batch's
            // as one paged call would count them).
            let call = gpu.paged_attention().expect("checked").path(path);
            gpu.sdpa().problem().and_then(|p| {
                call.validate()?;
                let t = time_call(
                    ctx,
                    gpu_time,
                    |enc| call.record(ctx, enc),
                    || call.run_blocking(ctx).map(drop),
                    a.warmup,
                    a.iters,
                    gpu_times,
                    || pb.inc(1),
                )?;
                Ok((shape.counted_flops(&p), t.first, t.median, t.min, None))
            })
        }
        BenchPath::Forward(path) => {
            let sdpa = gpu.sdpa().path(path);
            sdpa.problem().and_then(|p| {
                let mem = sdpa.device_memory(ctx)?;
                let t = time_call(
                    ctx,
                    gpu_time,
                    |enc| sdpa.record(ctx, enc),
                    || sdpa.run_blocking(ctx).map(drop),
                    a.warmup,
                    a.iters,
                    gpu_times,
                    || pb.inc(1),
                )?;
                Ok((shape.counted_flops(&p), t.first, t.median, t.min, Some(mem)))
            })
        }
        BenchPath::Backward(path) => (|| {
            if saved.is_none() {
                *saved = Some(gpu.saved_forward(ctx, a.seed)?);
            }
            let bwd = saved.as_ref().expect("made above").backward(gpu).path(path);
            let flops = 2.5 * shape.counted_flops(&bwd.problem()?);
            let t = time_call(
                ctx,
                gpu_time,
                |enc| bwd.record(ctx, enc),
                || bwd.run_blocking(ctx).map(drop),
                a.warmup,
                a.iters,
                gpu_times,
                || pb.inc(1),
            )?;
            Ok((flops, t.first, t.median, t.min, None))
        })(),
    }
}

/// One row of the table.
fn format_row(
    name: &str,
    path: String,
    st: Storage,
    (flops, first, median, min, mem): Measured,
    gpu_median: Option<Duration>,
    gpu_time: bool,
) -> String {
    format!(
        "{:<24} {:<11} {st:<5} {:>10.3} {:>10.3} {:>10.3} {:>9.2} {:>9}{}",
        name,
        path,
        ms(first),
        ms(median),
        ms(min),
        gflops(flops, median),
        mem.map_or("-".to_string(), |m| format!(
            "{:.1}",
            m as f64 / (1024.0 * 1024.0)
        )),
        match gpu_median {
            Some(g) => format!(" {:>10.3} {:>10.2}", ms(g), gflops(flops, g)),
            None if gpu_time => format!(" {:>10} {:>10}", "-", "-"),
            None => String::new(),
        }
    )
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
fn bench_layers(
    ctx: &Context,
    layers: &[&'static MhaShape],
    a: &BenchArgs,
    storages: &[Storage],
) -> CliResult<()> {
    if layers.is_empty() {
        return Ok(());
    }
    println!(
        "\nmulti-head attention layers (self-attention, path auto); split from {} profiled runs:",
        a.iters
    );
    println!(
        "{:<26} {:<5} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "layer", "fmt", "first ms", "median ms", "GFLOP/s", "proj ms", "attn ms", "out ms", "proj %"
    );
    for (shape, &st) in layers.iter().flat_map(|s| storages.iter().map(move |st| (s, st))) {
        let bench = match shape.prepare_as(ctx, st) {
            Ok(b) => b,
            Err(e) => {
                println!("{:<26} {st:<5} error: {e}", shape.name);
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
        let parts = [med(&mut split[0]), med(&mut split[1]), med(&mut split[2])];
        // The projections' share: the Q/K/V projections and the output projection (whose
        // stage also holds the head merge and the readback) over the profiled total.
        let share = 100.0 * (parts[0] + parts[2]) / parts.iter().sum::<f64>();
        println!(
            "{:<26} {st:<5} {:>10.3} {:>10.3} {:>9.2} {:>9.3} {:>9.3} {:>9.3} {:>7.1}",
            shape.name,
            ms(first),
            ms(median),
            gflops(proj + attn, median),
            parts[0],
            parts[1],
            parts[2],
            share,
        );
    }
    Ok(())
}

/// A row's path: a forward path, or the backward on a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BenchPath {
    /// The forward on a path.
    Forward(Path),
    /// The backward on a path (fused or unfused).
    Backward(Path),
}

impl BenchPath {
    /// Every concrete row path, the default.
    const ALL: [BenchPath; 5] = [
        BenchPath::Forward(Path::Unfused),
        BenchPath::Forward(Path::Fused),
        BenchPath::Forward(Path::Decode),
        BenchPath::Backward(Path::Fused),
        BenchPath::Backward(Path::Unfused),
    ];

    /// `fused`, `fused-bwd`, ...
    fn name(self) -> String {
        match self {
            BenchPath::Forward(p) => p.name().to_string(),
            BenchPath::Backward(p) => format!("{}-bwd", p.name()),
        }
    }
}

/// Parses the forward's path names and `fused-bwd`, `unfused-bwd`, listing them in `--help`.
fn bench_path_parser() -> impl clap::builder::TypedValueParser<Value = BenchPath> {
    use clap::builder::TypedValueParser;
    let all: Vec<BenchPath> = std::iter::once(BenchPath::Forward(Path::Auto))
        .chain(BenchPath::ALL)
        .collect();
    let names: Vec<&'static str> = all.iter().map(|p| &*p.name().leak()).collect();
    clap::builder::PossibleValuesParser::new(names).try_map(move |s| {
        all.iter()
            .copied()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown path {s}"))
    })
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

/// The crate's own matmul kernel on a 1024 x 1024 x 1024 product, `A Bᵀ` (`trans_b`, as in
/// the projections and scores) or `A B`, operands in `storage` (inputs pre-uploaded, f32
/// output read back), the yardstick for the attention paths' GFLOP/s. With `gpu_time`, the
/// product is recorded into a pre-made f32 buffer (`record_matmul`, no readback) and the GPU
/// time of the same runs is added.
fn matmul_row(
    ctx: &Context,
    a: &BenchArgs,
    storage: Storage,
    trans_b: bool,
    gpu_time: bool,
) -> CliResult<String> {
    use wgpu::util::DeviceExt;
    let n = 1024usize;
    let data: Vec<f32> = (0..n * n)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let buf = ctx
        .device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("matmul bench"),
            contents: &storage.encode(&data),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let c = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("matmul bench c"),
        size: (4 * n * n) as u64,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let t = || wgpu_attention::Tensor::from_buffer(&buf, storage, &[1, n, n]);
    let mut gpu_times: Vec<Duration> = Vec::new();
    let timing = time_call(
        ctx,
        gpu_time,
        |enc| {
            let c = wgpu_attention::Tensor::from_buffer(&c, Storage::F32, &[1, n, n]);
            wgpu_attention::record_matmul(ctx, enc, t(), t(), c, trans_b, 1.0)
        },
        || wgpu_attention::matmul_blocking(ctx, t(), t(), trans_b, 1.0).map(drop),
        a.warmup.max(1),
        a.iters,
        &mut gpu_times,
        || {},
    )?;
    let flops = 2.0 * (n * n * n) as f64;
    let gpu = gpu_median(&gpu_times, a.iters).map_or(String::new(), |g| {
        format!(" {:>9} {:>10.3} {:>10.2}", "-", ms(g), gflops(flops, g))
    });
    Ok(format!(
        "{:<24} {:<11} {storage:<5} {:>10.3} {:>10.3} {:>10.3} {:>9.2}{gpu}",
        if trans_b {
            "matmul_1024^3_ABt"
        } else {
            "matmul_1024^3_AB"
        },
        "matmul",
        ms(timing.first),
        ms(timing.median),
        ms(timing.min),
        gflops(flops, timing.median)
    ))
}
