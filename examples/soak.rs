//! The soak: hours of mixed calls in one process, with memory figures.
//!
//! `cargo run --release --example soak -- --calls 10000 --distinct 1000` makes 10,000 calls
//! cycling through 1,000 different ones (every path, mask kind, storage format and direction,
//! a shared multi-head attention layer; random batch, heads and lengths), every result checked
//! against the CPU reference, on `--threads` threads sharing one context. It prints the
//! process's resident memory, the device's buffer memory, its live buffers, the pipeline
//! cache's size and the distinct shapes so far, every `--every` calls, then the growth of each
//! after the first two cycles (the warm-up). It exits with status 1 if any grew by more than
//! `--max-growth` percent, 101 (a panic naming the call) on an error or a wrong answer.
//!
//! `--new-dims-every K` makes one call in K use a head-dim pair drawn from 1 to 96: more
//! kernels than the pipeline cache holds, so the cache's bound is what keeps it in check.
//! The short form runs in CI as `tests/soak.rs`.

#[path = "../tests/common/mod.rs"]
mod common;

use clap::Parser;
use common::*;
use wgpu_attention::Context;

#[derive(Parser)]
#[command(about = "Mixed calls for as long as asked, with memory figures")]
struct Args {
    /// Calls in all.
    #[arg(long, default_value_t = 10_000)]
    calls: usize,
    /// Different calls, cycled through (the first two cycles are the warm-up).
    #[arg(long, default_value_t = 1_000)]
    distinct: usize,
    /// Threads sharing the context.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Calls between figures.
    #[arg(long, default_value_t = 500)]
    every: usize,
    /// Head-dim pairs `E x Ev` the shapes use.
    #[arg(long, value_delimiter = ',', default_value = "16x16,32x32,8x20,64x64")]
    dims: Vec<String>,
    /// One call in K uses a head-dim pair drawn from 1 to 96 (0: never).
    #[arg(long, default_value_t = 0)]
    new_dims_every: usize,
    /// The growth after warm-up (percent) that fails the soak.
    #[arg(long, default_value_t = 5.0)]
    max_growth: f64,
    /// Seed of the shapes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() {
    let a = Args::parse();
    let dims = a
        .dims
        .iter()
        .map(|d| {
            let (e, ev) = d
                .split_once('x')
                .unwrap_or_else(|| panic!("--dims: {d:?} is not ExEv"));
            (e.parse().expect("--dims: E"), ev.parse().expect("--dims: Ev"))
        })
        .collect();
    let ctx = Context::new_blocking().unwrap_or_else(|e| {
        eprintln!("soak: {e}");
        std::process::exit(2)
    });
    println!(
        "soak on {}: {} calls cycling through {} on {} threads",
        ctx.describe(),
        a.calls,
        a.distinct,
        a.threads
    );
    let options = SoakOptions {
        calls: a.calls,
        distinct: a.distinct,
        threads: a.threads,
        every: a.every,
        seed: a.seed,
        shapes: SoakShapes {
            dims,
            new_dims_every: a.new_dims_every,
        },
    };
    println!("{}", SoakPoint::HEADER);
    let soak = soak(&ctx, &options, &|p| println!("{}", p.line()));
    let (process, device, buffers) = soak.growth();
    let (warm, last) = (soak.points[soak.warm], *soak.points.last().unwrap());
    println!(
        "after warm-up ({} calls): process memory {:+.1}%, device memory {:+.1}%, live buffers {:+.1}%, \
         pipelines {} -> {}; {} calls in {:.2} h, every result checked",
        warm.calls,
        process * 100.0,
        device * 100.0,
        buffers * 100.0,
        warm.pipelines,
        last.pipelines,
        last.calls,
        last.seconds / 3600.0
    );
    if process.max(device).max(buffers) * 100.0 > a.max_growth {
        println!("FAIL: memory grew by more than {}% after warm-up", a.max_growth);
        std::process::exit(1);
    }
    println!("PASS");
}
