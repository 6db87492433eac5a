//! Criterion benchmarks of [`Sdpa::run_blocking`] on the small and medium named shapes, one
//! group per shape and one benchmark per concrete [`Path`], plus the backward (`fused-bwd`,
//! `unfused-bwd`, on the forward's saved output and logsumexp, FLOPs counted as 2.5x the
//! forward's); of multi-head attention layers (whole forward pass, its projection /
//! attention / output stages, and the layer's backward); and (`host`) of the host time `record`
//! takes per call of a generation loop.
//!
//! Inputs are uploaded once as GPU storage buffers; each iteration records and submits the
//! kernels, waits for the GPU and reads the output back (as the CLI's `bench` does).
//!
//! Throughput is given as `Throughput::Elements(flops)` with the FLOP count of
//! [`wgpu_attention::Problem::flops`], so criterion's "elem/s" (e.g. `Gelem/s`) reads as
//! FLOP/s (`GFLOP/s`).
//!
//! Settings are small (10 flat samples, 2 s measurement) so that `cargo bench` finishes in a
//! few minutes even on a software renderer such as lavapipe. Without a GPU adapter the
//! benchmarks print a message and do nothing.
//!
//! [`Sdpa::run_blocking`]: wgpu_attention::Sdpa::run_blocking

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use wgpu_attention::shapes::{self, mha as mha_shapes};
use wgpu_attention::{Context, Path};

/// The shapes timed here (the larger ones are left to `wgpu-attention bench`).
const SHAPES: [&str; 5] = [
    "small_h4_s128",
    "e_b4_h12_s256_padmask",
    "a_h8_s1024",
    "b_h8_s1024_causal",
    "d_decode_h32_s4096_e128",
];

/// Every group's settings: 10 flat samples, 0.5 s warm-up, 2 s of measurement. Where one run
/// takes over 0.2 s, criterion warns that it cannot complete 10 samples in this time and takes
/// 10 single-run samples instead: expected on slow devices.
fn settings<'a, 'g, M: criterion::measurement::Measurement>(
    group: &'g mut criterion::BenchmarkGroup<'a, M>,
) -> &'g mut criterion::BenchmarkGroup<'a, M> {
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

fn attention(c: &mut Criterion) {
    let ctx = match Context::new_blocking() {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("skipping attention benchmarks: no GPU context: {e}");
            return;
        }
    };
    eprintln!("adapter: {}", ctx.describe());
    eprintln!("throughput below: elem/s = FLOP/s");
    for name in SHAPES {
        let Some(shape) = shapes::find(name) else {
            eprintln!("{name}: unknown shape, skipped");
            continue;
        };
        let gpu = match shapes::GpuInputs::upload(&ctx, shape, &shape.random_inputs(0)) {
            Ok(gpu) => gpu,
            Err(e) => {
                eprintln!("{name}: skipped: {e}");
                continue;
            }
        };
        let flops = match gpu.sdpa().problem() {
            Ok(p) => p.flops(),
            Err(e) => {
                eprintln!("{name}: skipped: {e}");
                continue;
            }
        };
        let mut group = c.benchmark_group(name);
        // "elements" are FLOPs: criterion's elem/s is FLOP/s.
        settings(&mut group).throughput(Throughput::Elements(flops as u64));
        for path in Path::ALL {
            let sdpa = gpu.sdpa().path(path);
            // One untimed run first: it compiles the shaders, and a path that cannot serve
            // this shape on this device is skipped instead of panicking inside criterion.
            // Then wait for the fastest forms (CPU adapters compile them in the background).
            if let Err(e) = sdpa.run_blocking(&ctx).and_then(|_| ctx.wait_idle()) {
                eprintln!("{name}/{}: skipped: {e}", path.name());
                continue;
            }
            group.bench_function(path.name(), |b| {
                b.iter(|| sdpa.run_blocking(&ctx).expect("attention run failed"))
            });
        }
        group.finish();
        // The backward on the forward's saved output and logsumexp: 2.5x the forward's FLOPs
        // (FlashAttention's convention).
        let saved = match gpu.saved_forward(&ctx, 0) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{name}: backward skipped: {e}");
                continue;
            }
        };
        let mut group = c.benchmark_group(name);
        settings(&mut group).throughput(Throughput::Elements((2.5 * flops) as u64));
        for (label, path) in [("fused-bwd", Path::Fused), ("unfused-bwd", Path::Unfused)] {
            let bwd = saved.backward(&gpu).path(path);
            if let Err(e) = bwd.run_blocking(&ctx).and_then(|_| ctx.wait_idle()) {
                eprintln!("{name}/{label}: skipped: {e}");
                continue;
            }
            group.bench_function(label, |b| {
                b.iter(|| bwd.run_blocking(&ctx).expect("backward failed"))
            });
        }
        group.finish();
    }
}

/// Multi-head attention layers (BERT-base at L = 128 and 512): the whole forward pass, and
/// its three stages timed separately (`proj`, `attn`, `out` from profiled passes).
fn layers(c: &mut Criterion) {
    let ctx = match Context::new_blocking() {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("skipping layer benchmarks: no GPU context: {e}");
            return;
        }
    };
    for shape in mha_shapes::MHA_SHAPES.iter().filter(|s| s.default) {
        let bench = match shape.prepare(&ctx) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("{}: skipped: {e}", shape.name);
                continue;
            }
        };
        if let Err(e) = bench.forward().run_blocking(&ctx).and_then(|_| ctx.wait_idle()) {
            eprintln!("{}: skipped: {e}", shape.name);
            continue;
        }
        let (proj, attn) = shape.flops();
        let mut group = c.benchmark_group(shape.name);
        settings(&mut group).throughput(Throughput::Elements((proj + attn) as u64));
        group.bench_function("forward", |b| {
            b.iter(|| bench.forward().run_blocking(&ctx).expect("forward failed"))
        });
        group.finish();
        // The layer's backward (its forward included): 3x the forward's FLOPs in the
        // projections (dx and dW per product), 3.5x in the attention (forward + 2.5x).
        let mut group = c.benchmark_group(format!("{}_backward", shape.name));
        settings(&mut group).throughput(Throughput::Elements((3.0 * proj + 3.5 * attn) as u64));
        if let Err(e) = bench.backward().run_blocking(&ctx).and_then(|_| ctx.wait_idle()) {
            eprintln!("{}: backward skipped: {e}", shape.name);
        } else {
            group.bench_function("forward+backward", |b| {
                b.iter(|| bench.backward().run_blocking(&ctx).expect("backward failed"))
            });
        }
        group.finish();
        // The stages, each measured inside a profiled pass (submitted and waited for alone);
        // no throughput here (the FLOPs above are the whole pass's).
        let mut group = c.benchmark_group(format!("{}_stages", shape.name));
        settings(&mut group);
        for (stage, pick) in [("proj", 0usize), ("attn", 1), ("out", 2)] {
            group.bench_function(stage, |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t = bench
                            .forward()
                            .profile()
                            .run_blocking(&ctx)
                            .expect("profiled forward failed")
                            .timings
                            .expect("timings");
                        total += [t.projections, t.attention, t.output][pick];
                    }
                    total
                })
            });
        }
        group.finish();
    }
}

/// The host time of `record` per call of a generation loop (`wgpu_attention::shapes::host`:
/// decode, a 16-query chunk, a ragged paged batch, a 32-layer `KvCache` step per layer, and
/// `decode_step_32l`, one step of a 32-layer cache at 4096 positions, per step), the
/// inputs in GPU buffers made once and the outputs in the caller's. Each iteration records into
/// an encoder that is dropped unsubmitted (the device polled every 8), so no GPU work shares
/// the cores with the timing.
fn host(c: &mut Criterion) {
    use wgpu_attention::shapes::host::{HostBench, HostCall};
    let Ok(ctx) = Context::new_blocking() else {
        eprintln!("skipping host benchmarks: no GPU context");
        return;
    };
    let mut bench = match HostBench::new(&ctx) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipping host benchmarks: {e}");
            return;
        }
    };
    let mut group = c.benchmark_group("host");
    settings(&mut group);
    for call in HostCall::ALL {
        group.bench_function(call.name(), |b| {
            b.iter_custom(|iters| host_time(&ctx, iters, |enc| bench.record(&ctx, enc, call)))
        });
    }
    drop(bench);
    // One token step over 32 layers at 4096 positions (per step).
    match wgpu_attention::shapes::host::DecodeStep::new(&ctx) {
        Ok(mut step) => {
            group.bench_function(wgpu_attention::shapes::host::DecodeStep::NAME, |b| {
                b.iter_custom(|iters| {
                    host_time(&ctx, iters, |enc| step.record(&ctx, enc).map(|(s, _)| (s, 1)))
                })
            });
        }
        Err(e) => eprintln!("skipping decode_step_32l: {e}"),
    }
    group.finish();
}

/// The host time of `iters` records per call counted, into encoders dropped unsubmitted (the
/// device polled every 8).
fn host_time(
    ctx: &Context,
    iters: u64,
    mut record: impl FnMut(&mut wgpu_attention::wgpu::CommandEncoder) -> wgpu_attention::Result<(f64, usize)>,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    for i in 0..iters {
        let (s, calls) = record(&mut enc).expect("record");
        total += Duration::from_secs_f64(s / calls as f64);
        if (i + 1) % 8 == 0 {
            enc = ctx.device().create_command_encoder(&Default::default());
            let _ = ctx.device().poll(wgpu_attention::wgpu::PollType::Poll);
        }
    }
    total
}

criterion_group!(benches, attention, layers, host);
criterion_main!(benches);
