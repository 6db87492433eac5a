//! Faults: a device lost mid-run (the test destroys it) makes every later call return
//! `Error::DeviceLost` quickly, and a new `Context` works in the same process; a call whose
//! future is dropped before it finishes (cancelled) leaves the context usable.

mod common;

use std::future::Future;
use std::pin::pin;
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use common::*;
use wgpu_attention::{Causal, Context, Error, Path};

/// A call that must succeed and match the reference.
fn good_call(ctx: &Context, seed: u64) {
    let case = Case::random((1, 2, 2, 19, 23, 8, 8), seed).with_causal(Causal::TopLeft);
    let got = case
        .checked_sdpa(Path::Auto)
        .run_blocking(ctx)
        .expect("a call on a live device");
    case.assert_output(&got, &case.reference(), Path::Auto, TOL, "after the fault");
}

#[test]
fn a_lost_device_fails_every_later_call_quickly_and_a_new_context_works() {
    let Some(_) = ctx() else { return };
    let ctx = Context::new_blocking().unwrap();
    good_call(&ctx, 1);
    ctx.device().destroy();
    let case = Case::random((1, 2, 2, 19, 23, 8, 8), 2);
    for path in [Path::Auto, Path::Fused, Path::Unfused, Path::Decode] {
        let started = Instant::now();
        let e = case.sdpa().path(path).run_blocking(&ctx).unwrap_err();
        assert!(
            matches!(e, Error::DeviceLost(_)) || matches!(e, Error::Unsupported { .. }),
            "{path:?}: {e}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{path:?} took {:?}",
            started.elapsed()
        );
    }
    let dout = rand_array(&mut rng(3), (1, 2, 19, 8));
    let e = case.sdpa().backward(&dout).run_blocking(&ctx).unwrap_err();
    assert!(matches!(e, Error::DeviceLost(_)), "backward: {e}");
    // A new context in the same process works.
    let fresh = Context::new_blocking().unwrap();
    good_call(&fresh, 4);
}

/// Poll `f` once and drop it: a caller cancelling a call mid-way.
fn poll_once_and_drop<F: Future>(f: F) {
    let mut f = pin!(f);
    let mut cx = TaskContext::from_waker(Waker::noop());
    let _ = matches!(f.as_mut().poll(&mut cx), Poll::Ready(_));
}

#[test]
fn cancelled_calls_leave_the_context_usable() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 4, 2, 64, 77, 16, 16), 5).with_random_mask(6);
    for path in [Path::Fused, Path::Unfused] {
        let sdpa = case.sdpa().path(path);
        for _ in 0..3 {
            poll_once_and_drop(sdpa.run(ctx));
        }
        let dout = rand_array(&mut rng(7), (2, 4, 64, 16));
        poll_once_and_drop(case.sdpa().backward(&dout).path(path).run(ctx));
    }
    good_call(ctx, 8);
    ctx.wait_idle().unwrap();
    good_call(ctx, 9);
}
