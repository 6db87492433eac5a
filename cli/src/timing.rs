//! Wall-clock timing of repeated blocking runs (`Sdpa::run_blocking`, `Backward::run_blocking`),
//! and the units reported.

use std::time::{Duration, Instant};

use wgpu_attention::Context;

/// Wall-clock times of a blocking run.
pub(crate) struct Timing<T> {
    pub(crate) first: Duration,
    pub(crate) median: Duration,
    pub(crate) min: Duration,
    /// The result of the last timed run.
    pub(crate) last: T,
}

/// `warmup` untimed runs (the first one's time is kept), then `iters` timed runs;
/// `tick` is called after each run.
pub(crate) fn time_runs<T>(
    ctx: &Context,
    mut run: impl FnMut() -> wgpu_attention::Result<T>,
    warmup: u32,
    iters: u32,
    mut tick: impl FnMut(),
) -> wgpu_attention::Result<Timing<T>> {
    let mut first = Duration::ZERO;
    for i in 0..warmup {
        let t = Instant::now();
        run()?;
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
        let out = run()?;
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

/// [`time_runs`] of one call, either recorded between GPU timestamps (`gpu_times` gets every
/// run's GPU time, warm-ups first) or run as the blocking call `run`.
#[allow(clippy::too_many_arguments)] // the two ways to run, the counts, the sink, the tick
pub(crate) fn time_call<R>(
    ctx: &Context,
    gpu_time: bool,
    record: impl Fn(&mut wgpu_attention::wgpu::CommandEncoder) -> wgpu_attention::Result<R>,
    run: impl Fn() -> wgpu_attention::Result<()>,
    warmup: u32,
    iters: u32,
    gpu_times: &mut Vec<Duration>,
    tick: impl FnMut(),
) -> wgpu_attention::Result<Timing<()>> {
    if gpu_time {
        time_runs(
            ctx,
            || {
                let t = ctx.time_gpu_blocking(&record)?;
                gpu_times.extend(t.gpu);
                Ok(())
            },
            warmup,
            iters,
            tick,
        )
    } else {
        time_runs(ctx, run, warmup, iters, tick)
    }
}

/// The median of the last `iters` GPU times (the timed runs'), if there are that many.
pub(crate) fn gpu_median(gpu_times: &[Duration], iters: u32) -> Option<Duration> {
    let n = iters as usize;
    (n > 0 && gpu_times.len() >= n).then(|| {
        let mut timed = gpu_times[gpu_times.len() - n..].to_vec();
        timed.sort();
        timed[timed.len() / 2]
    })
}

/// Milliseconds.
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// GFLOP/s of `flops` done in `d`.
pub(crate) fn gflops(flops: f64, d: Duration) -> f64 {
    flops / d.as_secs_f64() / 1e9
}
