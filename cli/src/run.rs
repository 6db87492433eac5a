//! `run`: attention on `.npy` files, on the GPU or the CPU reference.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use wgpu_attention::reference;

use crate::input::InputArgs;
use crate::npy::write_array;
use crate::timing::ms;
use crate::{context, path_label, CliResult};

#[derive(Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    input: InputArgs,
    /// Where to write the output, f32 .npy [B, Hq, L, Ev].
    #[arg(long, value_name = "O.npy")]
    out: PathBuf,
    /// Also write the attention weights, f32 .npy [B, Hq, L, S].
    #[arg(long, value_name = "W.npy")]
    weights_out: Option<PathBuf>,
    /// Also write the row logsumexp, f32 .npy [B, Hq, L] (-inf on fully masked rows).
    #[arg(long, value_name = "LSE.npy")]
    lse_out: Option<PathBuf>,
}

/// `run`: attention on the `.npy` inputs, on the GPU or (`--cpu`) the CPU reference.
pub(crate) fn run(a: &RunArgs) -> CliResult<ExitCode> {
    crate::npy::check_writable([
        ("--out", Some(a.out.as_path())),
        ("--weights-out", a.weights_out.as_deref()),
        ("--lse-out", a.lse_out.as_deref()),
    ])?;
    let x = a.input.load()?;
    let st = a.input.storage;
    let options = a.input.options(&x);
    let (q, k, v) = (&x.q, &x.k, &x.v);
    let (out, weights, lse, how) = if a.input.cpu {
        let started = Instant::now();
        let r = reference::sdpa(q.view(), k.view(), v.view(), &options)?;
        let elapsed = started.elapsed();
        let to_f32 = |x: f64| x as f32;
        (
            r.out.mapv(|x| st.round(x as f32)).into_dyn(),
            Some(r.weights.mapv(to_f32).into_dyn()),
            Some(r.lse.mapv(to_f32).into_dyn()),
            format!(
                "ran the CPU reference (f64 on {st} inputs, output rounded to {st}, written as f32) in {:.3} ms",
                ms(elapsed)
            ),
        )
    } else {
        let mut sdpa = a.input.sdpa(&x).path(a.input.path);
        if a.weights_out.is_some() {
            sdpa = sdpa.return_weights();
        }
        if a.lse_out.is_some() {
            sdpa = sdpa.return_lse();
        }
        // Validate before creating the device, so input errors come first.
        sdpa.problem()?;
        let started = Instant::now();
        let (r, how) = match crate::ring::target(&a.input)? {
            crate::ring::Target::One => {
                let ctx = context()?;
                let r = sdpa.run_blocking(&ctx)?;
                let how = format!(
                    "ran on {}, path {}, storage {st}, in {:.3} ms (incl. upload, shader compilation and readback)",
                    ctx.describe(),
                    path_label(&sdpa, &ctx, a.input.path),
                    ms(started.elapsed())
                );
                (r, how)
            }
            ring => match ring.run(&sdpa, &a.input)? {
                Some(done) => done,
                // An MPI rank other than 0: the outputs are rank 0's to write.
                None => return Ok(ExitCode::SUCCESS),
            },
        };
        (
            r.output.into_dyn(),
            r.weights.map(|w| w.into_dyn()),
            r.lse.map(|l| l.into_dyn()),
            how,
        )
    };
    println!("{how}");

    write_array(&a.out, "output", &out)?;
    if let Some(p) = &a.weights_out {
        let w = weights.ok_or("the path did not return attention weights")?;
        write_array(p, "weights", &w)?;
    }
    if let Some(p) = &a.lse_out {
        let l = lse.ok_or("the path did not return the logsumexp")?;
        write_array(p, "lse", &l)?;
    }
    Ok(ExitCode::SUCCESS)
}
