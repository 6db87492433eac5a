//! `demo`: random inputs on the GPU, timed and checked against the CPU reference.

use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use wgpu_attention::check::{self, F32_TOLERANCE};
use wgpu_attention::reference;
use wgpu_attention::shapes::{GpuInputs, Shape};
use wgpu_attention::Path;

use crate::timing::{gflops, ms, time_runs};
use crate::{context, path_label, path_parser, CausalArg, CliResult, EXIT_CHECK_FAILED};

#[derive(Args)]
pub(crate) struct DemoArgs {
    /// Batch size B.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Query heads Hq.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads Hkv (must divide Hq) [default: same as --heads].
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Query length L.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Key/value length S [default: same as --seq].
    #[arg(long)]
    seq_kv: Option<usize>,
    /// Query/key head dimension E.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Value head dimension Ev [default: same as --head-dim].
    #[arg(long)]
    head_dim_v: Option<usize>,
    /// Causal mask alignment.
    #[arg(long, value_enum, default_value_t = CausalArg::TopLeft)]
    causal: CausalArg,
    /// Implementation to run.
    #[arg(long, value_parser = path_parser(), default_value = "auto")]
    path: Path,
    /// Timed runs after the warm-up.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Seed of the random inputs (uniform in [-1, 1)).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Skip the comparison with the CPU reference (which is slow for large shapes).
    #[arg(long)]
    no_check: bool,
}

/// `demo`: time random inputs and check them against the CPU reference (exit status 1 on a
/// mismatch).
pub(crate) fn demo(a: &DemoArgs) -> CliResult<ExitCode> {
    let shape = Shape::custom(
        a.batch,
        a.heads,
        a.kv_heads.unwrap_or(a.heads),
        a.seq,
        a.seq_kv.unwrap_or(a.seq),
        a.head_dim,
        a.head_dim_v.unwrap_or(a.head_dim),
        a.causal.into(),
    );
    let ctx = context()?;
    println!("adapter: {}", ctx.describe());
    println!("shape:   {}", shape.describe());
    shape.check_fits(&ctx)?;

    let host = shape.random_inputs(a.seed);
    let gpu = GpuInputs::upload(&ctx, &shape, &host)?;
    let sdpa = gpu.sdpa().path(a.path);
    let problem = sdpa.problem()?;
    println!("path:    {}", path_label(&sdpa, &ctx, a.path));

    let timing = time_runs(&ctx, || sdpa.run_blocking(&ctx), 1, a.iters, || {})?;
    let flops = problem.flops();
    println!(
        "time:    first {:.3} ms (incl. shader compilation); median {:.3} ms, min {:.3} ms over {} runs",
        ms(timing.first),
        ms(timing.median),
        ms(timing.min),
        a.iters
    );
    println!("         (wall clock per Sdpa::run incl. output readback; inputs pre-uploaded)");
    println!(
        "speed:   {:.2} GFLOP/s ({:.3} GFLOP per call)",
        gflops(flops, timing.median),
        flops / 1e9
    );

    if a.no_check {
        println!("check:   skipped (--no-check)");
        return Ok(ExitCode::SUCCESS);
    }
    println!("checking against the CPU reference (f64)...");
    let started = Instant::now();
    let spec = wgpu_attention::Options {
        causal: shape.causal,
        ..Default::default()
    };
    let want = reference::sdpa(host.q.view(), host.k.view(), host.v.view(), &spec)?;
    let report = check::compare(
        timing.last.output.iter().copied(),
        want.out.iter().copied(),
        F32_TOLERANCE,
    );
    println!("         reference took {:.1} s", started.elapsed().as_secs_f64());
    println!(
        "max abs error: {:.3e} (tolerance atol {:e} + rtol {:e} * |expected|)",
        report.max_abs_err, F32_TOLERANCE.atol, F32_TOLERANCE.rtol
    );
    if report.passed() {
        println!("check:   PASS ({} elements)", report.count);
        Ok(ExitCode::SUCCESS)
    } else {
        println!("check:   FAIL: {report}");
        Ok(ExitCode::from(EXIT_CHECK_FAILED))
    }
}
