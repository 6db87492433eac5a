//! One `Context` and one `MultiHeadAttention` layer shared by 8 threads, each making mixed
//! calls (every path, shapes with tails, every mask kind, every storage format, forward and
//! backward, the layer) on a fresh device, so that the kernels' background compilation races
//! with the calls. Every result is checked against the reference on its own inputs (each
//! call's inputs differ, so a crossed or lost result fails). `WGPU_ATTENTION_STRESS_CALLS` sets
//! the calls per thread (default 30: the CI's short form).

mod common;

use common::*;

const THREADS: usize = 8;

fn calls_per_thread() -> usize {
    std::env::var("WGPU_ATTENTION_STRESS_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30)
}

/// 8 threads × `calls_per_thread()` mixed calls on one fresh context and one layer: every
/// result right, none lost, no deadlock (the test would hang), background compilation racing
/// with the calls.
#[test]
fn eight_threads_share_one_context_and_one_layer() {
    let Some(ctx) = ctx() else { return };
    let layer = SharedLayer::new(ctx);
    let calls = calls_per_thread();
    // Two shapes (tails, L < S and L > S, GQA, MQA): each compiles its kernels per mask kind,
    // format and path, and the calls race with those compilations on a cold shader cache (this
    // test runs among the first). Their head dims are the grids' (tests/common SHAPES), so that
    // the grids' tests find these kernels compiled (40 of their own took 49 s of a cold run).
    let shapes = [(2, 4, 2, 17, 23, 16, 16), (1, 3, 1, 33, 9, 8, 20)];
    let done: Vec<Vec<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let layer = &layer;
                s.spawn(move || {
                    (0..calls)
                        .map(|i| {
                            let n = t * 1000 + i;
                            mixed_call(ctx, n, shapes[(n / 3) % shapes.len()], Some(layer))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a thread panicked"))
            .collect()
    });
    assert_eq!(done.iter().map(Vec::len).sum::<usize>(), THREADS * calls);
    let layer_calls = done
        .iter()
        .flatten()
        .filter(|l| l.contains("shared layer"))
        .count();
    assert!(layer_calls >= THREADS * (calls / 6), "{layer_calls} layer calls");
    ctx.wait_idle().unwrap();
}
