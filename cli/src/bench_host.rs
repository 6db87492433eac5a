//! `bench --host`: a generation loop's calls, each with the host time `record` takes beside
//! the wall time of a submitted call and its GPU time (`wgpu_attention::shapes::host`).

use std::time::{Duration, Instant};

use wgpu_attention::shapes::host::{median_us, median_us_of, DecodeStep, HostBench, HostCall};
use wgpu_attention::{wgpu, Context};

use crate::timing::ms;
use crate::CliResult;

/// The host table: `calls` host-timed records per call (the KV steps fewer), then `warmup`
/// and `iters` submitted runs for the wall and GPU times.
pub(crate) fn host_table(ctx: &Context, calls: usize, warmup: u32, iters: u32) -> CliResult<()> {
    let calls = calls.max(8);
    let timer = ctx.has_gpu_timer();
    println!(
        "host us: median host time of record per call ({calls} calls, unsubmitted, no GPU work beside \
         it); wall ms: record + submit + wait, no readback; GPU ms: between timestamps around \
         the call's commands{}; medians of {iters} runs after {warmup}",
        if timer {
            ""
        } else {
            " (this adapter has no timestamp queries)"
        }
    );
    println!(
        "{:<18} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "call", "host us", "per", "wall ms", "GPU ms", "host/GPU"
    );
    // Every host time is taken before any call is submitted: a CPU adapter's GPU work (and
    // its background compiles of faster kernel forms) would share the cores.
    let mut bench = HostBench::new(ctx)?;
    let mut host = Vec::new();
    for call in HostCall::ALL {
        let n = if call == HostCall::KvStep {
            calls.div_ceil(8).max(8)
        } else {
            calls
        };
        host.push(median_us(ctx, &mut bench, call, n, n)?);
    }
    for (call, us) in HostCall::ALL.into_iter().zip(host) {
        let per = if call == HostCall::KvStep { "layer" } else { "call" };
        let (wall, gpu) = submitted(ctx, warmup, iters, |enc| bench.record(ctx, enc, call))?;
        // A KV step's wall and GPU time are the whole step's (32 layers): per layer beside the
        // host's per-layer time.
        let layers = if call == HostCall::KvStep { 32.0 } else { 1.0 };
        print_row(call.name(), us, per, wall / layers, gpu.map(|g| g / layers));
    }
    drop(bench);
    let mut step = DecodeStep::new(ctx)?;
    ctx.wait_idle()?;
    let n = calls.div_ceil(8).max(8);
    let us = median_us_of(ctx, n, n, |enc| step.record(ctx, enc))?;
    let layers = DecodeStep::DIMS[4] as f64;
    let (wall, gpu) = submitted(ctx, warmup, iters, |enc| step.record(ctx, enc))?;
    print_row(DecodeStep::NAME, us * layers, "step", wall, gpu);
    println!(
        "{}: {:.1} us host per layer; {:.2} GFLOP/s by wall{}",
        DecodeStep::NAME,
        us,
        DecodeStep::flops() / wall / 1e6,
        gpu.map_or(String::new(), |g| format!(
            ", {:.2} by GPU time",
            DecodeStep::flops() / g / 1e6
        ))
    );
    Ok(())
}

fn print_row(name: &str, host_us: f64, per: &str, wall_ms: f64, gpu_ms: Option<f64>) {
    let (gpu, ratio) = match gpu_ms {
        Some(g) => (format!("{g:.3}"), format!("{:.2}", host_us / 1e3 / g)),
        None => ("-".into(), "-".into()),
    };
    println!("{name:<18} {host_us:>10.1} {per:>10} {wall_ms:>10.3} {gpu:>10} {ratio:>9}");
}

/// Median wall and GPU milliseconds of `iters` submitted runs after `warmup`.
fn submitted(
    ctx: &Context,
    warmup: u32,
    iters: u32,
    mut record: impl FnMut(&mut wgpu::CommandEncoder) -> wgpu_attention::Result<(f64, usize)>,
) -> CliResult<(f64, Option<f64>)> {
    let (mut walls, mut gpus) = (Vec::new(), Vec::new());
    for i in 0..warmup + iters.max(1) {
        let t = Instant::now();
        let timed = ctx.time_gpu_blocking(|enc| record(enc))?;
        let wall = t.elapsed();
        if i >= warmup {
            walls.push(wall);
            gpus.extend(timed.gpu);
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        ms(v[v.len() / 2])
    };
    let wall = median(&mut walls);
    Ok((wall, (!gpus.is_empty()).then(|| median(&mut gpus))))
}
