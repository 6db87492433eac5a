//! `bench-ring`: ring attention against the sequence length and the number of devices (in
//! this process, or MPI ranks with `--mpi` under mpirun): time, GFLOP/s, per-device memory
//! (planned and measured) and bytes sent per device, against one device running plain `Sdpa`;
//! the causal balance of the zigzag and contiguous layouts; and what overlapping the
//! exchanges with the kernels saves.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use ndarray::Array4;
use rand::{Rng, SeedableRng};
use wgpu_attention::{Causal, Context, Layout, Ring, RingReport, Sdpa};

use crate::timing::{gflops, ms};
use crate::CliResult;

#[derive(Args)]
pub(crate) struct BenchRingArgs {
    /// Sequence lengths L = S.
    #[arg(long, value_delimiter = ',', default_value = "16384,32768,65536,131072")]
    lengths: Vec<usize>,
    /// Ring sizes in this process (1: one device running plain Sdpa, the baseline).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    devices: Vec<usize>,
    /// Heads (B = 1).
    #[arg(long, default_value_t = 1)]
    heads: usize,
    /// Head dim E = Ev.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// No causal mask (the default is top-left causal).
    #[arg(long)]
    no_causal: bool,
    /// Run as one rank of an MPI ring of every rank (start with mpirun -np N); rank 0 prints.
    #[cfg(feature = "mpi")]
    #[arg(long)]
    mpi: bool,
    /// Also compare the layouts (zigzag, contiguous) and overlap on/off at this length on the
    /// largest ring, interleaved over --rounds rounds (0: skip).
    #[arg(long, default_value_t = 32768)]
    compare_len: usize,
    /// Rounds of the comparisons.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
}

fn random(seed: u64, shape: (usize, usize, usize, usize)) -> Array4<f32> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    Array4::from_shape_simple_fn(shape, || r.random_range(-1.0..1.0))
}

/// One measured point.
struct Point {
    time: Duration,
    report: Option<RingReport>,
    /// One device: its measured buffer memory during the call.
    single_memory: u64,
}

fn mib(b: u64) -> f64 {
    b as f64 / 1048576.0
}

/// The table's header.
fn header() {
    println!(
        "| where | N | L = S | time ms | GFLOP/s | planned MiB/device | measured MiB/device | MiB sent/device | causal work max/mean | exchange ms | waiting after exchange ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
}

fn row(label: &str, n: usize, l: usize, flops: f64, p: &Point) {
    match &p.report {
        Some(r) => {
            let max = |f: fn(&wgpu_attention::DeviceReport) -> Duration| {
                r.devices.iter().map(f).max().unwrap_or_default()
            };
            println!(
                "| {label} | {n} | {l} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.0} | {:.0} |",
                ms(p.time),
                gflops(flops, p.time),
                mib(r.max_peak_memory()),
                // The tool turns on the `counters` feature: the figure is counted.
                mib(r.max_measured_memory().unwrap_or(0)),
                mib(r.max_bytes_sent()),
                r.balance(),
                ms(max(|d| d.exchange)),
                ms(max(|d| d.wait_after_exchange)),
            );
        }
        None => println!(
            "| one device, Sdpa | 1 | {l} | {:.0} | {:.2} | - | {:.2} | 0 | - | - | - |",
            ms(p.time),
            gflops(flops, p.time),
            mib(p.single_memory),
        ),
    }
}

/// `bench-ring`.
pub(crate) fn bench_ring(a: &BenchRingArgs) -> CliResult<ExitCode> {
    #[cfg(feature = "mpi")]
    if a.mpi {
        return bench_mpi(a);
    }
    let most = a.devices.iter().copied().max().unwrap_or(1);
    let ctxs = Context::devices_blocking(most).map_err(|e| format!("could not set up the GPU: {e}"))?;
    println!("{} devices on {}", most, ctxs[0].describe());
    let causal = if a.no_causal {
        Causal::None
    } else {
        Causal::TopLeft
    };
    header();
    for &l in &a.lengths {
        let shape = (1, a.heads, l, a.dim);
        let (q, k, v) = (random(1, shape), random(2, shape), random(3, shape));
        let sdpa = Sdpa::new(&q, &k, &v).causal(causal);
        let flops = sdpa.problem()?.flops();
        for &n in &a.devices {
            // One untimed run compiles every device's kernels.
            let p = if n == 1 {
                single(&ctxs[0], &sdpa)?;
                single(&ctxs[0], &sdpa)?
            } else {
                let ring = Ring::new(&ctxs[..n]);
                ring.run_blocking(&sdpa)?;
                idle(&ctxs[..n]);
                let t = Instant::now();
                let r = ring.run_blocking(&sdpa)?;
                Point {
                    time: t.elapsed(),
                    report: Some(r.report),
                    single_memory: 0,
                }
            };
            row("this process", n, l, flops, &p);
        }
    }
    if a.compare_len > 0 && most > 1 {
        compare(&ctxs, a, causal)?;
    }
    idle(&ctxs);
    Ok(ExitCode::SUCCESS)
}

fn idle(ctxs: &[Context]) {
    for c in ctxs {
        let _ = c.wait_idle();
    }
}

/// Plain Sdpa on one device: time and measured buffer memory (after the submission, before
/// the readback).
fn single(ctx: &Context, sdpa: &Sdpa<'_>) -> CliResult<Point> {
    let _ = ctx.wait_idle();
    let base = ctx.buffer_memory().unwrap_or(0);
    let t = Instant::now();
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    let g = sdpa.record(ctx, &mut encoder)?;
    ctx.queue().submit([encoder.finish()]);
    let memory = ctx.buffer_memory().unwrap_or(0).saturating_sub(base);
    let p = &g.problem;
    let n: usize = p.out_shape().iter().product();
    pollster::block_on(ctx.read_as_f32(&g.output, g.output_offset, n, p.storage.out))?;
    Ok(Point {
        time: t.elapsed(),
        report: None,
        single_memory: memory,
    })
}

/// Zigzag against contiguous, and overlap on against off, interleaved round by round.
fn compare(ctxs: &[Context], a: &BenchRingArgs, causal: Causal) -> CliResult<()> {
    let l = a.compare_len;
    let shape = (1, a.heads, l, a.dim);
    let (q, k, v) = (random(1, shape), random(2, shape), random(3, shape));
    let sdpa = Sdpa::new(&q, &k, &v).causal(causal);
    let n = ctxs.len();
    let runs = [
        ("zigzag, overlap", Ring::new(ctxs)),
        ("contiguous, overlap", Ring::new(ctxs).layout(Layout::Contiguous)),
        ("zigzag, no overlap", Ring::new(ctxs).overlap(false)),
    ];
    for (_, r) in &runs {
        r.run_blocking(&sdpa)?;
    }
    idle(ctxs);
    println!("\n{n} devices, L = S = {l}, {} rounds (interleaved):", a.rounds);
    println!("| round | run | time ms | causal work max/mean | device compute ms max/mean | exchange ms (max) | waiting after exchange ms (max) |");
    println!("|---|---|---|---|---|---|---|");
    let mut ratios = vec![];
    for round in 1..=a.rounds {
        let mut times = vec![];
        for (label, r) in &runs {
            let t = Instant::now();
            let out = r.run_blocking(&sdpa)?;
            let took = t.elapsed();
            times.push(took);
            let rep = &out.report;
            let compute: Vec<f64> = rep.devices.iter().map(|d| ms(d.compute)).collect();
            let mean = compute.iter().sum::<f64>() / compute.len() as f64;
            let max = compute.iter().cloned().fold(0.0, f64::max);
            let ex = rep.devices.iter().map(|d| ms(d.exchange)).fold(0.0, f64::max);
            let wait = rep
                .devices
                .iter()
                .map(|d| ms(d.wait_after_exchange))
                .fold(0.0, f64::max);
            println!(
                "| {round} | {label} | {:.0} | {:.3} | {:.3} | {ex:.0} | {wait:.0} |",
                ms(took),
                rep.balance(),
                max / mean
            );
        }
        ratios.push((ms(times[1]) / ms(times[0]), ms(times[2]) / ms(times[0])));
    }
    let range = |f: fn(&(f64, f64)) -> f64| {
        let v: Vec<f64> = ratios.iter().map(f).collect();
        (
            v.iter().cloned().fold(f64::MAX, f64::min),
            v.iter().cloned().fold(0.0, f64::max),
        )
    };
    let (c, o) = (range(|r| r.0), range(|r| r.1));
    println!(
        "contiguous / zigzag time: {:.2}-{:.2}x; no overlap / overlap time: {:.2}-{:.2}x (per-round ratios)",
        c.0, c.1, o.0, o.1
    );
    Ok(())
}

/// The sweep as MPI ranks: every rank runs each length; rank 0 prints.
#[cfg(feature = "mpi")]
fn bench_mpi(a: &BenchRingArgs) -> CliResult<ExitCode> {
    use mpi::traits::{Communicator, CommunicatorCollectives};
    use wgpu_attention::ring::mpi::{abort_on_panic, fail, MpiRing};
    let universe = mpi::initialize().ok_or("MPI could not be initialised (start with mpirun)")?;
    let world = universe.world();
    abort_on_panic();
    let ctx = Context::new_blocking().unwrap_or_else(|e| fail(&world, &e));
    let rank0 = world.rank() == 0;
    let causal = if a.no_causal {
        Causal::None
    } else {
        Causal::TopLeft
    };
    if rank0 {
        println!("{} MPI ranks, each on {}", world.size(), ctx.describe());
        header();
    }
    for &l in &a.lengths {
        let shape = (1, a.heads, l, a.dim);
        let (q, k, v) = (random(1, shape), random(2, shape), random(3, shape));
        let sdpa = Sdpa::new(&q, &k, &v).causal(causal);
        let flops = sdpa.problem()?.flops();
        let ring = MpiRing::new(&world, &ctx);
        ring.run(&sdpa).unwrap_or_else(|e| fail(&world, &e));
        let _ = ctx.wait_idle();
        world.barrier();
        let t = Instant::now();
        let r = ring.run(&sdpa).unwrap_or_else(|e| fail(&world, &e));
        let took = t.elapsed();
        if rank0 {
            let p = Point {
                time: took,
                report: Some(r.report),
                single_memory: 0,
            };
            row("MPI ranks", world.size() as usize, l, flops, &p);
        }
    }
    let _ = ctx.wait_idle();
    Ok(ExitCode::SUCCESS)
}
