//! One `Context` shared by 8 threads, each making mixed calls (every path, shapes with tails,
//! every mask kind, every storage format, forward and backward) on a fresh device, so that the
//! kernels' background compilation races with the calls. Every result is checked against the
//! reference on its own inputs (each call's inputs differ, so a crossed or lost result fails).
//! `WGPU_ATTENTION_STRESS_CALLS` sets the calls per thread (default 40: the CI's short form).

mod common;

use common::*;
use wgpu_attention::{Context, Path, Storage, Tensor};

const THREADS: usize = 8;

fn calls_per_thread() -> usize {
    std::env::var("WGPU_ATTENTION_STRESS_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
}

/// Call `i` of thread `t`: a case, a path and whether it runs the backward.
fn call(ctx: &Context, t: usize, i: usize) -> String {
    let n = t * 1000 + i;
    let shapes = [
        (2, 4, 2, 17, 23, 16, 8),
        (1, 2, 2, 5, 129, 8, 20),
        (1, 3, 1, 33, 9, 12, 12),
    ];
    let kinds = mask_kinds();
    let (name, kind) = &kinds[n % kinds.len()];
    let shape = shapes[(n / 3) % shapes.len()];
    let storage = [Storage::F32, Storage::F32, Storage::F16, Storage::Bf16][(n / 7) % 4];
    let case = kind(Case::random(shape, n as u64)).with_storage(storage);
    let label = format!("thread {t} call {i}: {shape:?} {name} {storage}");
    if n % 5 == 4 {
        // The backward (fused or unfused), checked by FlashAttention's rule.
        let path = [Path::Fused, Path::Unfused][(n / 5) % 2];
        let (b, h, l, _) = case.dims();
        let dout = rand_array(&mut rng(n as u64 + 7), (b, h, l, case.v.dim().3)).mapv(|x| storage.round(x));
        let g = case
            .sdpa()
            .backward(Tensor::from(&dout).with_storage(storage))
            .path(path)
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_grads(&case, &g, &dout, &label);
        return format!("{label} backward {path:?}");
    }
    let path = [Path::Auto, Path::Fused, Path::Unfused, Path::Decode][n % 4];
    let sdpa = case.checked_sdpa(path);
    if path == Path::Decode && sdpa.resolved_path(ctx).is_err() {
        // Shapes the decode path does not take run on the automatic path instead.
        let got = case
            .checked_sdpa(Path::Auto)
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        case.assert_output(&got, &case.reference(), Path::Auto, tolerance(storage), &label);
        return label;
    }
    let got = sdpa
        .run_blocking(ctx)
        .unwrap_or_else(|e| panic!("{label} {path:?}: {e}"));
    case.assert_output(
        &got,
        &case.reference(),
        path,
        tolerance(storage),
        &format!("{label} {path:?}"),
    );
    format!("{label} {path:?}")
}

fn tolerance(s: Storage) -> wgpu_attention::check::Tolerance {
    if s == Storage::F32 {
        TOL
    } else {
        wgpu_attention::check::Tolerance::for_storage(s)
    }
}

/// 8 threads × `calls_per_thread()` mixed calls on one fresh context: every result right, none
/// lost, no deadlock (the test would hang), background compilation racing with the calls.
#[test]
fn eight_threads_share_one_context() {
    let Some(ctx) = ctx() else { return };
    let calls = calls_per_thread();
    let done: Vec<Vec<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| s.spawn(move || (0..calls).map(|i| call(ctx, t, i)).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a thread panicked"))
            .collect()
    });
    assert_eq!(done.iter().map(Vec::len).sum::<usize>(), THREADS * calls);
    ctx.wait_idle().unwrap();
}
