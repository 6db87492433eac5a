//! `wgpu-attention`: inspect the GPU, run attention on `.npy` files, verify against the CPU
//! reference and benchmark named shapes.
//!
//! One module per command (`info`, `demo`, `run`, `backward`, `mha`, `variant`, `bench`,
//! `bench-variants`, `bench-ring`; `ring` holds `--devices`/`--mpi`); every `.npy` read and
//! write is in `npy`, the timing of repeated runs in `timing`. This file holds the command
//! line, the exit codes and what the commands share.

mod backward;
mod bench;
mod bench_host;
mod bench_ring;
mod bench_variants;
mod demo;
mod info;
mod input;
mod mha;
mod npy;
mod paged;
mod paged_quant;
mod ring;
mod run;
mod timing;
mod variant;

use std::process::ExitCode;

use clap::builder::TypedValueParser;
use clap::{Parser, Subcommand, ValueEnum};
use wgpu_attention::{wgpu, Causal, Context, Path, Sdpa};

use backward::BackwardArgs;
use bench::BenchArgs;
use bench_ring::BenchRingArgs;
use bench_variants::BenchVariantsArgs;
use demo::DemoArgs;
use mha::MhaArgs;
use run::RunArgs;
use variant::VariantArgs;

/// Errors are reported on stderr; the process exits with this status.
pub(crate) const EXIT_ERROR: u8 = 2;
/// `demo` exits with this status when the GPU result disagrees with the reference.
pub(crate) const EXIT_CHECK_FAILED: u8 = 1;

/// What a command returns; an error is printed and exits with [`EXIT_ERROR`].
pub(crate) type CliResult<T> = Result<T, Box<dyn std::error::Error>>;

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
                  the adapter name) and WGPU_POWER_PREF (low|high) choose the adapter; \
                  WGPU_ATTENTION_FORMS (e.g. fused=loop:3,decode=gpu) pins the kernels' forms.\n\
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
    /// Gradients of attention on .npy files: dQ, dK, dV (and d(bias)) for an upstream
    /// gradient dO; runs the forward itself.
    Backward(BackwardArgs),
    /// Multi-head attention layer (PyTorch nn.MultiheadAttention weights) on .npy inputs.
    Mha(MhaArgs),
    /// The literature's attention variants (Luong's general, Bahdanau's additive, low-rank V,
    /// Nyström, Linformer) on .npy files, on the GPU or the CPU reference.
    Variant(VariantArgs),
    /// Paged attention of a ragged batch: queries packed [T, Hq, E] over paged KV caches read
    /// through a block table (vLLM's layout), with RoPE and the built-in modifiers.
    Paged(paged::PagedArgs),
    /// Time named shapes on every path and print a table (median of several runs).
    Bench(BenchArgs),
    /// Time and device memory of exact fused SDPA, Nyström and Linformer against the sequence
    /// length (log-log PNG plots), their error against exact attention, and the variants'
    /// interleaved comparisons (Nyström vs exact, additive fused vs unfused).
    BenchVariants(BenchVariantsArgs),
    /// Ring attention against the sequence length and the number of devices (in this process,
    /// or MPI ranks with --mpi under mpirun): time, per-device memory and bytes sent, against
    /// one device; the causal balance of the layouts and what the overlap saves.
    BenchRing(BenchRingArgs),
}

/// Causal masking, by alignment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum CausalArg {
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
pub(crate) fn storage_parser() -> impl TypedValueParser<Value = wgpu_attention::Storage> {
    let names: Vec<&'static str> = wgpu_attention::Storage::ALL.iter().map(|s| s.name()).collect();
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<wgpu_attention::Storage>())
}

pub(crate) fn path_parser() -> impl TypedValueParser<Value = Path> {
    let names: Vec<&'static str> = std::iter::once(Path::Auto)
        .chain(Path::ALL)
        .map(Path::name)
        .collect();
    // A listed name that did not parse would be refused, never replaced by a default.
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<Path>())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info::info(),
        Command::Demo(args) => demo::demo(&args),
        Command::Run(args) => run::run(&args),
        Command::Backward(args) => backward::backward(&args),
        Command::Mha(args) => mha::mha(&args),
        Command::Variant(args) => variant::variant(&args),
        Command::Paged(args) => paged::paged(&args),
        Command::Bench(args) => bench::bench(&args),
        Command::BenchVariants(args) => bench_variants::bench_variants(&args),
        Command::BenchRing(args) => bench_ring::bench_ring(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("wgpu-attention: error: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// The GPU context, or an error saying it could not be set up.
pub(crate) fn context() -> CliResult<Idle> {
    Context::new_blocking()
        .map(Idle)
        .map_err(|e| format!("could not set up the GPU: {e}").into())
}

/// Whose device a command runs on: the crate's own (`Context::new`), or one made the way an
/// application makes it (its own adapter request and `request_device` with the adapter's
/// limits and `Context::wanted_features`), handed over with `Context::from_parts` (`own`) or
/// with `Context::from_device` alone (`adopted`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DeviceKind {
    Crate,
    Own,
    Adopted,
}

/// [`context`] on the device `kind` names.
pub(crate) fn context_on(kind: DeviceKind) -> CliResult<Idle> {
    if kind == DeviceKind::Crate {
        return context();
    }
    pollster::block_on(async {
        let backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
        let instance = Context::compute_instance(backends);
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("could not set up the GPU: {e}"))?;
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("application device"),
                required_features: adapter.features() & Context::wanted_features(),
                required_limits: adapter.limits(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("could not set up the GPU: {e}"))?;
        Ok(Idle(match kind {
            DeviceKind::Own => Context::from_parts(&adapter, device, queue),
            _ => Context::from_device(device, queue),
        }))
    })
}

/// The context, waited on when a command ends, so that no kernel the adapter compiles in the
/// background (CPU adapters, after a kernel's first use) is cut off by the process exiting.
pub(crate) struct Idle(Context);

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

/// `unfused`, or `auto -> unfused`.
pub(crate) fn path_label(sdpa: &Sdpa, ctx: &Context, requested: Path) -> String {
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
