//! `bench-variants`: time and device memory of exact fused SDPA, Nyström and Linformer against
//! the sequence length, their error against exact attention, drawn as log-log PNG plots; and
//! the interleaved comparisons the variants are held to (Nyström m = 64 against exact fused,
//! the additive score's fused path against its unfused one).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use ndarray::{Array1, Array2};
use wgpu_attention::plot::LineChart;
use wgpu_attention::shapes::{GpuInputs, Shape};
use wgpu_attention::{Causal, Context, Path, VariantParams};

use crate::timing::ms;
use crate::{context, CliResult};

#[derive(Args)]
pub(crate) struct BenchVariantsArgs {
    /// Sequence lengths L = S (H = 8, E = Ev = 64, B = 1).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,2048,4096,8192,16384,32768"
    )]
    lengths: Vec<usize>,
    /// Timed runs per point (the median is reported), after one untimed run.
    #[arg(long, default_value_t = 1)]
    reps: u32,
    /// Rounds of the interleaved comparisons (exact, Nyström, exact, ...).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Length of the Nyström-against-exact comparison.
    #[arg(long, default_value_t = 16384)]
    compare_len: usize,
    /// Skip the sweep; run only the comparisons.
    #[arg(long)]
    compare_only: bool,
    /// Write the time plot here (and the memory plot beside it, `-memory` before the extension).
    #[arg(long, value_name = "PLOT.png")]
    plot: Option<PathBuf>,
}

/// The methods of the sweep: a name and its parameters (`None`: exact fused SDPA).
fn methods(n: usize) -> Vec<(&'static str, Option<VariantParams>)> {
    vec![
        ("exact fused SDPA", None),
        ("Nystrom m=64", Some(VariantParams::Nystrom { landmarks: 64 })),
        (
            "Nystrom m=256",
            Some(VariantParams::Nystrom {
                landmarks: 256.min(n),
            }),
        ),
        (
            "Linformer k=256",
            Some(VariantParams::Linformer {
                e: VariantParams::segment_means(256.min(n), n),
                f: VariantParams::segment_means(256.min(n), n),
            }),
        ),
    ]
}

/// Record `var` (or exact fused SDPA), submit, wait; the wall time and the output buffer.
fn time_once(
    ctx: &Context,
    gpu: &GpuInputs,
    p: Option<&VariantParams>,
    path: Path,
) -> CliResult<(Duration, wgpu_attention::wgpu::Buffer)> {
    let device = ctx.device();
    let started = Instant::now();
    let mut enc = device.create_command_encoder(&Default::default());
    let out = match p {
        None => gpu.sdpa().path(Path::Fused).record(ctx, &mut enc)?.output,
        Some(p) => gpu.variant(p).path(path).record(ctx, &mut enc)?.output,
    };
    ctx.queue().submit([enc.finish()]);
    ctx.wait_idle()?;
    Ok((started.elapsed(), out))
}

fn median(mut t: Vec<Duration>) -> Duration {
    t.sort();
    t[t.len() / 2]
}

fn read(ctx: &Context, buf: &wgpu_attention::wgpu::Buffer, n: usize) -> CliResult<Vec<f32>> {
    Ok(pollster::block_on(ctx.read_f32(buf, 0, 4 * n as u64))?)
}

/// Named series of (L = S, value) points.
type Series = Vec<(String, Vec<(f64, f64)>)>;

/// The time chart at `path` and the memory chart beside it (`NAME-memory.EXT`).
fn plot_series(path: &std::path::Path, time_series: &Series, mem_series: &Series) -> CliResult<()> {
    let mut chart = LineChart::new(
        "Attention variants on this adapter (H = 8, E = 64)",
        "sequence length L = S",
        "time (ms)",
    )
    .axes(true, true);
    for (name, pts) in time_series {
        chart = chart.with_series(name.clone(), pts.clone());
    }
    chart.write(path, 960, 600)?;
    let mem_path = path.with_file_name(format!(
        "{}-memory.{}",
        path.file_stem().unwrap_or_default().to_string_lossy(),
        path.extension().unwrap_or_default().to_string_lossy()
    ));
    let mut chart = LineChart::new(
        "Device memory of one call (H = 8, E = 64)",
        "sequence length L = S",
        "device memory (MiB)",
    )
    .axes(true, true);
    for (name, pts) in mem_series {
        chart = chart.with_series(name.clone(), pts.clone());
    }
    chart.write(&mem_path, 960, 600)?;
    println!("wrote {} and {}", path.display(), mem_path.display());
    Ok(())
}

pub(crate) fn bench_variants(a: &BenchVariantsArgs) -> CliResult<ExitCode> {
    crate::npy::check_writable([("--plot", a.plot.as_deref())])?;
    let ctx = context()?;
    println!("adapter: {}", ctx.describe());
    let mut time_series: Series = Vec::new();
    let mut mem_series: Series = Vec::new();
    if !a.compare_only {
        println!(
            "{:>6} {:<18} {:>10} {:>10} {:>12} {:>12}",
            "L=S", "method", "ms", "MiB", "max err", "rel err"
        );
        for &n in &a.lengths {
            let shape = Shape::custom(1, 8, 8, n, n, 64, 64, Causal::None);
            let gpu = GpuInputs::upload(&ctx, &shape, &shape.random_inputs(7))?;
            let mut exact: Option<Vec<f32>> = None;
            for (i, (name, p)) in methods(n).into_iter().enumerate() {
                let (_, out) = time_once(&ctx, &gpu, p.as_ref(), Path::Auto)?;
                let mut times = Vec::new();
                for _ in 0..a.reps.max(1) {
                    times.push(time_once(&ctx, &gpu, p.as_ref(), Path::Auto)?.0);
                }
                let t = median(times);
                let bytes = match &p {
                    None => gpu.sdpa().path(Path::Fused).device_memory(&ctx)?,
                    Some(p) => gpu.variant(p).device_memory(&ctx)?,
                };
                let values = read(&ctx, &out, 8 * n * 64)?;
                let (max_err, rel) = match &exact {
                    None => (0.0, 0.0),
                    Some(x) => {
                        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                        let err = x
                            .iter()
                            .zip(&values)
                            .fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64));
                        (err, err / scale)
                    }
                };
                if exact.is_none() {
                    exact = Some(values);
                }
                println!(
                    "{n:>6} {name:<18} {:>10.1} {:>10.1} {max_err:>12.3e} {rel:>12.3e}",
                    ms(t),
                    bytes as f64 / (1 << 20) as f64
                );
                if time_series.len() <= i {
                    time_series.push((name.to_string(), Vec::new()));
                    mem_series.push((name.to_string(), Vec::new()));
                }
                time_series[i].1.push((n as f64, ms(t)));
                mem_series[i].1.push((n as f64, bytes as f64 / (1 << 20) as f64));
            }
        }
        if let Some(path) = &a.plot {
            plot_series(path, &time_series, &mem_series)?;
        }
    }

    // Interleaved comparisons: peer (the slower baseline) then ours, per round.
    let n = a.compare_len;
    let shape = Shape::custom(1, 8, 8, n, n, 64, 64, Causal::None);
    let gpu = GpuInputs::upload(&ctx, &shape, &shape.random_inputs(7))?;
    let nys = VariantParams::Nystrom { landmarks: 64 };
    interleave(
        &format!("Nystrom m=64 vs exact fused SDPA at L = S = {n}"),
        a.rounds,
        || time_once(&ctx, &gpu, None, Path::Fused).map(|r| r.0),
        || time_once(&ctx, &gpu, Some(&nys), Path::Auto).map(|r| r.0),
    )?;
    let shape = Shape::custom(1, 8, 8, 1024, 1024, 64, 64, Causal::None);
    let gpu = GpuInputs::upload(&ctx, &shape, &shape.random_inputs(8))?;
    let mut rng = wgpu_attention::shapes::SplitMix64(9);
    let mut mat = |rows, cols| Array2::from_shape_simple_fn((rows, cols), || rng.next_f32() / 8.0);
    let additive = VariantParams::Additive {
        w_q: mat(64, 64),
        w_k: mat(64, 64),
        u: Array1::from_iter((0..64).map(|i| ((i % 7) as f32 - 3.0) / 4.0)),
        b: None,
    };
    interleave(
        "additive (A = 64) fused vs unfused at L = S = 1024",
        a.rounds,
        || time_once(&ctx, &gpu, Some(&additive), Path::Unfused).map(|r| r.0),
        || time_once(&ctx, &gpu, Some(&additive), Path::Fused).map(|r| r.0),
    )?;
    Ok(ExitCode::SUCCESS)
}

/// `rounds` of (baseline, ours) after one untimed run of each; prints each round's times and
/// the range of the per-round speed-ups.
fn interleave(
    label: &str,
    rounds: u32,
    mut base: impl FnMut() -> CliResult<Duration>,
    mut ours: impl FnMut() -> CliResult<Duration>,
) -> CliResult<()> {
    base()?;
    ours()?;
    let mut ratios = Vec::new();
    println!("{label}:");
    for r in 0..rounds.max(1) {
        let b = base()?;
        let o = ours()?;
        let ratio = b.as_secs_f64() / o.as_secs_f64();
        println!(
            "  round {}: baseline {:.1} ms, ours {:.1} ms, speed-up {ratio:.2}x",
            r + 1,
            ms(b),
            ms(o)
        );
        ratios.push(ratio);
    }
    let (lo, hi) = ratios
        .iter()
        .fold((f64::MAX, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
    println!(
        "  speed-up range over {} rounds: {lo:.2}x - {hi:.2}x",
        ratios.len()
    );
    Ok(())
}
