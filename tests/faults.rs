//! Faults: a device lost mid-run (the test destroys it) makes every later call return
//! `Error::DeviceLost` quickly, and a new `Context` works in the same process; an
//! out-of-memory at any allocation of a call, and a failed readback, return their errors, free
//! what the call allocated, and the next call succeeds; a call whose future is dropped before
//! it finishes (cancelled) leaves the context usable.

mod common;

use std::future::Future;
use std::pin::pin;
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use common::*;
use ndarray::Array3;
use wgpu_attention::{Causal, Context, Error, Fault, MhaConfig, MhaWeights, MultiHeadAttention, Path};

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

/// One call of each kind whose faults are tested: its name and a closure making it (with the
/// result checked against the reference when it succeeds).
type Call<'a> = (&'static str, Box<dyn Fn(&Context) -> Result<(), Error> + 'a>);

fn calls<'a>(
    case: &'a Case,
    decode: &'a Case,
    layer: &'a MultiHeadAttention,
    x: &'a Array3<f32>,
) -> Vec<Call<'a>> {
    let reference = case.reference();
    let dout = rand_array(&mut rng(21), (2, 3, 37, 8));
    let layer_output = std::sync::Mutex::new(None);
    let mut out: Vec<Call> = Vec::new();
    for path in [Path::Fused, Path::Unfused] {
        let reference = reference.clone();
        out.push((
            if path == Path::Fused { "fused" } else { "unfused" },
            Box::new(move |ctx| {
                let got = case.checked_sdpa(path).run_blocking(ctx)?;
                case.assert_output(&got, &reference, path, TOL, "after faults");
                Ok(())
            }),
        ));
    }
    let decode_reference = decode.reference();
    out.push((
        "decode",
        Box::new(move |ctx| {
            let got = decode.checked_sdpa(Path::Decode).run_blocking(ctx)?;
            decode.assert_output(&got, &decode_reference, Path::Decode, TOL, "after faults");
            Ok(())
        }),
    ));
    out.push((
        "backward",
        Box::new(move |ctx| {
            let g = case.sdpa().backward(&dout).run_blocking(ctx)?;
            assert_grads(case, &g, &dout, "after faults");
            Ok(())
        }),
    ));
    out.push((
        "layer",
        Box::new(move |ctx| {
            let got = layer.forward(x).run_blocking(ctx)?;
            // The layer is deterministic: every successful call gives the first one's output.
            let mut first = layer_output.lock().unwrap();
            let first = first.get_or_insert_with(|| got.output.clone());
            assert_eq!(*first, got.output, "the layer after faults");
            Ok(())
        }),
    ));
    out
}

/// Out-of-memory at the first, second, ... allocation of every kind of call (the forward on
/// each path, the backward, the layer) until the call makes no more: each time the call
/// returns `Error::OutOfMemory`, the device's buffer memory is back where it was before it,
/// and the same call then succeeds with the right answer. The same for a failed readback.
#[test]
fn out_of_memory_and_failed_readbacks_free_everything_and_the_next_call_succeeds() {
    let Some(_) = ctx() else { return };
    // A context of its own, whose memory figure no other test moves.
    let ctx = Context::new_blocking().unwrap();
    let case = Case::random((2, 3, 1, 37, 41, 16, 8), 11).with_random_mask(12);
    let decode = Case::random((2, 4, 2, 1, 300, 16, 16), 13).with_kv_lens();
    let w = MhaWeights::xavier_uniform(MhaConfig::new(32, 4), 14).unwrap();
    let layer = MultiHeadAttention::new(&ctx, &w).unwrap();
    let x: Array3<f32> = rand_array(&mut rng(15), (2, 9, 32));
    let mut faults = 0;
    for (name, call) in calls(&case, &decode, &layer, &x) {
        // Twice: the context caches what a call asks for a second time (its parameter
        // buffers, constant inputs and bind groups), which stays allocated by design.
        for _ in 0..2 {
            call(&ctx).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        ctx.wait_idle().unwrap();
        let base = ctx
            .buffer_memory()
            .expect("the tests turn on the `counters` feature");
        // After a fault: every buffer freed, and the same call right again.
        let recovered = |fault: &str| {
            ctx.wait_idle().unwrap();
            assert_eq!(ctx.buffer_memory(), Some(base), "{name}: memory after {fault}");
            call(&ctx).unwrap_or_else(|e| panic!("{name}: the call after {fault}: {e}"));
        };
        let mut after = 0;
        loop {
            ctx.inject_fault(Fault::OutOfMemory { after });
            match call(&ctx) {
                Err(Error::OutOfMemory(_)) => faults += 1,
                Err(e) => panic!("{name}: out of memory at allocation {after}: {e}"),
                // The call made `after` allocations or fewer: every one has been failed.
                Ok(()) => break,
            }
            recovered(&format!("an out-of-memory at allocation {after}"));
            after += 1;
        }
        ctx.clear_faults();
        assert!(after >= 2, "{name}: {after} allocations");
        ctx.inject_fault(Fault::Readback);
        match call(&ctx) {
            Err(Error::Readback(_)) => faults += 1,
            other => panic!("{name}: failed readback gave {other:?}"),
        }
        recovered("a failed readback");
    }
    println!("{faults} faults survived");
}
