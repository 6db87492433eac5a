//! The soak's short form (`examples/soak.rs` runs the long one): 100 different mixed calls
//! (every path, mask kind, format and direction, the shared layer; random batch, heads and
//! lengths over three head-dim pairs) made three times over by two threads on one context,
//! every result checked against the reference. After the first two passes (the warm-up: the
//! first compiles the kernels, the second fills the context's cache of what a call asks for a
//! second time) the process's memory, the device's buffer memory and its live buffers stay flat
//! (under 5% growth), and no kernel is compiled again. `WGPU_ATTENTION_SOAK_CALLS` sets the calls
//! (default 300).

mod common;

use common::*;

#[test]
fn repeated_mixed_calls_hold_memory_flat() {
    let Some(ctx) = ctx() else { return };
    let calls = std::env::var("WGPU_ATTENTION_SOAK_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let options = SoakOptions {
        calls,
        distinct: 100,
        threads: 2,
        every: 50,
        seed: 1,
        shapes: SoakShapes {
            dims: vec![(16, 16), (32, 32), (8, 20)],
            new_dims_every: 0,
        },
    };
    println!("{}", SoakPoint::HEADER);
    let soak = soak(ctx, &options, &|p| println!("{}", p.line()));
    let (process, device, buffers) = soak.growth();
    println!(
        "growth after warm-up: process {:.1}%, device {:.1}%, live buffers {:.1}%",
        process * 100.0,
        device * 100.0,
        buffers * 100.0
    );
    let (warm, last) = (soak.points[soak.warm], *soak.points.last().unwrap());
    assert_eq!(last.calls, calls);
    assert_eq!(
        last.pipelines, warm.pipelines,
        "kernels compiled after the warm-up"
    );
    assert!(
        process < 0.05 && device < 0.05 && buffers < 0.05,
        "memory grew after warm-up"
    );
}
