//! The host cost of a generation loop's calls: the median microseconds `record` takes on the
//! CPU per call (decode, a 16-query chunk, a ragged paged batch, a 32-layer `KvCache` token
//! step per layer), over `--calls` calls after a warm-up, the inputs in GPU buffers made once
//! and the key lengths growing between calls (`wgpu_attention::shapes::host`).
//!
//! ```sh
//! cargo run --release --example host_cost -- --calls 200
//! ```

use clap::Parser;
use wgpu_attention::shapes::host::{median_us, HostBench, HostCall};
use wgpu_attention::Context;

#[derive(Parser)]
struct Args {
    /// Calls timed per call kind (after as many warm-up calls, at least 8).
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Only this call (decode_record, chunk16_record, paged_record, kv_step_per_layer).
    #[arg(long)]
    only: Option<String>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let ctx = Context::new_blocking()?;
    println!("adapter: {}", ctx.describe());
    let mut bench = HostBench::new(&ctx)?;
    for call in HostCall::ALL {
        if args.only.as_deref().is_some_and(|o| o != call.name()) {
            continue;
        }
        let n = if call == HostCall::KvStep {
            args.calls.div_ceil(8)
        } else {
            args.calls
        };
        let us = median_us(&ctx, &mut bench, call, n.max(8), n)?;
        println!("{:<18} {us:8.1} us host per call (median of {n})", call.name());
    }
    Ok(())
}
