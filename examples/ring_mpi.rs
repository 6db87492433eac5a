//! Ring attention over MPI ranks, one GPU context per rank:
//!
//! ```text
//! cargo build --release -p wgpu-attention --features mpi --example ring_mpi
//! mpirun -np 4 target/release/examples/ring_mpi --seq 16384 --causal
//! ```
//!
//! (as root add `--allow-run-as-root`; more ranks than cores need `--oversubscribe`.)
//! Every rank makes the same random inputs (one seed), the ranks compute attention as a ring,
//! and, for sequences up to `--check-max`, each rank checks its rows against one device's
//! result on its own GPU (rank 0 also the assembled output, and with `--backward` the
//! gradients by FlashAttention's rule against the f64 reference). Rank 0 prints what each rank
//! did. Exit status: 0 when every check passes, 1 on a mismatch, 2 on an error.

use std::time::Instant;

use clap::Parser;
use mpi::traits::*;
use ndarray::{s, Array4};
use rand::{Rng, SeedableRng};
use wgpu_attention::check::{compare, flash_rule, F32_TOLERANCE};
use wgpu_attention::ring::mpi::{abort_on_panic, fail, MpiOutput, MpiRing};
use wgpu_attention::{reference, Causal, Context, Layout, Options, RingReport, Sdpa};

#[derive(Parser)]
#[command(about = "Ring attention over MPI ranks (one GPU context per rank)")]
struct Args {
    /// Sequence length L = S.
    #[arg(long, default_value_t = 4096)]
    seq: usize,
    /// Heads.
    #[arg(long, default_value_t = 1)]
    heads: usize,
    /// Head dim E = Ev.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Causal (top-left) masking.
    #[arg(long)]
    causal: bool,
    /// zigzag or contiguous.
    #[arg(long, default_value = "zigzag")]
    layout: Layout,
    /// Also run the backward through the ring.
    #[arg(long)]
    backward: bool,
    /// Check against one device up to this length (the f64 reference for the backward).
    #[arg(long, default_value_t = 2048)]
    check_max: usize,
    /// Seconds a message may take before the rank fails.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Wait for each step's kernels before exchanging (no overlap).
    #[arg(long)]
    no_overlap: bool,
    /// Fault drill: this rank uses a sequence one longer than the others' (every rank must
    /// fail with a mismatch error).
    #[arg(long, value_name = "RANK")]
    mismatch_rank: Option<usize>,
    /// Fault drill: this rank stalls for --stall-secs before starting (the others must fail
    /// with a timeout error when it exceeds --timeout).
    #[arg(long, value_name = "RANK")]
    stall_rank: Option<usize>,
    /// Fault drill: how long the stalled rank sleeps.
    #[arg(long, default_value_t = 0)]
    stall_secs: u64,
    /// Fault drill: this rank exits without a word before starting (the job must end, not
    /// hang).
    #[arg(long, value_name = "RANK")]
    die_rank: Option<usize>,
}

fn random(seed: u64, shape: (usize, usize, usize, usize)) -> Array4<f32> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    Array4::from_shape_simple_fn(shape, || r.random_range(-1.0..1.0))
}

fn main() {
    let args = Args::parse();
    let universe = mpi::initialize().expect("MPI could not be initialised");
    let world = universe.world();
    abort_on_panic();
    let rank = world.rank() as usize;
    let ctx = Context::new_blocking().unwrap_or_else(|e| fail(&world, &e));
    let seq = args.seq + usize::from(args.mismatch_rank == Some(rank));
    let shape = (1, args.heads, seq, args.dim);
    if args.die_rank == Some(rank) {
        eprintln!("rank {rank}: exiting (fault drill)");
        std::process::exit(9);
    }
    if args.stall_rank == Some(rank) {
        std::thread::sleep(std::time::Duration::from_secs(args.stall_secs));
    }
    let (q, k, v) = (random(1, shape), random(2, shape), random(3, shape));
    let causal = if args.causal {
        Causal::TopLeft
    } else {
        Causal::None
    };
    let sdpa = Sdpa::new(&q, &k, &v).causal(causal).return_lse();
    let ring = MpiRing::new(&world, &ctx)
        .layout(args.layout)
        .overlap(!args.no_overlap)
        .timeout(std::time::Duration::from_secs(args.timeout));
    let started = Instant::now();
    let out = ring.run(&sdpa).unwrap_or_else(|e| fail(&world, &e));
    let forward_s = started.elapsed().as_secs_f64();
    let flops = sdpa.problem().unwrap_or_else(|e| fail(&world, &e)).flops();
    if rank == 0 {
        print_report("forward", &out.report, forward_s, flops);
    }
    let mut failed = false;
    if args.seq <= args.check_max {
        // This rank's rows against one device on its own GPU.
        let one = sdpa.run_blocking(&ctx).unwrap_or_else(|e| fail(&world, &e));
        failed |= !rows_match(rank, &out, &one.output);
    }
    if args.backward {
        let dout = random(4, shape);
        let started = Instant::now();
        let g = ring
            .backward(&Sdpa::new(&q, &k, &v).causal(causal).backward(&dout))
            .unwrap_or_else(|e| fail(&world, &e));
        let backward_s = started.elapsed().as_secs_f64();
        if let Some(grads) = g.grads {
            print_report("backward (with its forward)", &g.report, backward_s, 2.5 * flops);
            if args.seq <= args.check_max {
                let one = Sdpa::new(&q, &k, &v)
                    .causal(causal)
                    .backward(&dout)
                    .run_blocking(&ctx)
                    .unwrap_or_else(|e| fail(&world, &e));
                let opts = Options {
                    causal,
                    ..Options::default()
                };
                let r64 = reference::sdpa_backward(q.view(), k.view(), v.view(), dout.view(), &opts)
                    .unwrap_or_else(|e| fail(&world, &e));
                for (name, got, plain, want) in [
                    ("dq", &grads.dq, &one.dq, &r64.dq),
                    ("dk", &grads.dk, &one.dk, &r64.dk),
                    ("dv", &grads.dv, &one.dv, &r64.dv),
                ] {
                    let report = flash_rule(got.iter().copied(), want.iter().copied(), plain.iter().copied());
                    println!("rank 0: {name} by FlashAttention's rule (ring vs one device vs f64): {report}");
                    failed |= !report.passed();
                }
            }
        }
    }
    if failed {
        eprintln!("rank {rank}: check failed");
        world.abort(1);
    }
}

/// This rank's rows of the ring's output (and rank 0's assembled output) against `one`, the
/// output of one device: whether they match.
fn rows_match(rank: usize, out: &MpiOutput, one: &Array4<f32>) -> bool {
    let mut ok = true;
    let want: Vec<f32> = out
        .rows
        .iter()
        .flat_map(|r| one.slice(s![.., .., r.clone(), ..]).to_owned().into_iter())
        .collect();
    // Chunk by chunk within each (batch, head): reorder the local rows the same way.
    let got: Vec<f32> = {
        let mut at = 0;
        let mut v = vec![];
        for r in &out.rows {
            v.extend(
                out.local_output
                    .slice(s![.., .., at..at + r.len(), ..])
                    .iter()
                    .copied(),
            );
            at += r.len();
        }
        v
    };
    let report = compare(got, want, F32_TOLERANCE);
    println!("rank {rank}: rows {:?} against one device: {report}", out.rows);
    ok &= report.passed();
    if let Some(full) = &out.output {
        let report = compare(full.output.iter().copied(), one.iter().copied(), F32_TOLERANCE);
        println!("rank 0: assembled output against one device: {report}");
        ok &= report.passed();
    }
    ok
}

fn print_report(what: &str, r: &RingReport, seconds: f64, flops: f64) {
    println!(
        "{what}: {} ranks, {} layout, {:.1} ms, {:.2} GFLOP/s; causal work balance (max/mean) {:.3}",
        r.devices.len(),
        r.layout.name(),
        seconds * 1e3,
        flops / seconds / 1e9,
        r.balance()
    );
    println!("rank  rows      work  sent MiB  peak MiB   total ms  compute ms  exchange ms  wait ms");
    for d in &r.devices {
        println!(
            "{:>4} {:>5} {:>9} {:>9.2} {:>9.2} {:>10.1} {:>11.1} {:>12.1} {:>8.1}",
            d.rank,
            d.rows,
            d.work,
            d.bytes_sent as f64 / 1048576.0,
            d.peak_memory as f64 / 1048576.0,
            d.total.as_secs_f64() * 1e3,
            d.compute.as_secs_f64() * 1e3,
            d.exchange.as_secs_f64() * 1e3,
            d.wait_after_exchange.as_secs_f64() * 1e3,
        );
    }
}
