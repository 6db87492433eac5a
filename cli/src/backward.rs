//! `backward`: the SDPA backward on `.npy` files (it runs the forward itself), on the GPU or the
//! CPU reference.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use wgpu_attention::{reference, Tensor};

use crate::input::InputArgs;
use crate::npy::{read_qkv, write_array};
use crate::timing::ms;
use crate::{context, CliResult};

#[derive(Args)]
pub(crate) struct BackwardArgs {
    #[command(flatten)]
    input: InputArgs,
    /// Upstream gradient dL/dO, f32 or f16 .npy [B, Hq, L, Ev] (rounded to --storage).
    #[arg(long, value_name = "DO.npy")]
    dout: PathBuf,
    /// Where to write dL/dQ, f32 .npy [B, Hq, L, E].
    #[arg(long, value_name = "DQ.npy")]
    dq_out: PathBuf,
    /// Where to write dL/dK, f32 .npy [B, Hkv, S, E] (summed over each group's query heads).
    #[arg(long, value_name = "DK.npy")]
    dk_out: PathBuf,
    /// Where to write dL/dV, f32 .npy [B, Hkv, S, Ev] (summed over each group's query heads).
    #[arg(long, value_name = "DV.npy")]
    dv_out: PathBuf,
    /// Where to write dL/d(bias), f32 .npy in the bias's shape (needs --bias).
    #[arg(long, value_name = "DB.npy", requires = "bias")]
    dbias_out: Option<PathBuf>,
    /// Where to write dL/d(sink logits), f32 .npy [Hq] (needs --sink-logits).
    #[arg(long, value_name = "DSINK.npy", requires = "sink_logits")]
    dsink_out: Option<PathBuf>,
    /// Where to write dL/d(capture NAME), f32 .npy in the capture's shape (repeatable; needs
    /// --mod with a score_mod_dcapture and --capture NAME=...).
    #[arg(long, value_name = "NAME=FILE.npy", requires = "user_mod")]
    dcapture_out: Vec<String>,
}

/// `--dcapture-out NAME=FILE.npy`: each name one of the --capture names (once), each path
/// writable; checked before any work.
fn dcapture_outs(a: &BackwardArgs) -> CliResult<Vec<(String, PathBuf)>> {
    let mut out: Vec<(String, PathBuf)> = Vec::new();
    for d in &a.dcapture_out {
        let Some((name, file)) = d.split_once('=') else {
            return Err(format!("--dcapture-out {d:?}: give NAME=FILE.npy").into());
        };
        if out.iter().any(|(n, _)| n == name) {
            return Err(format!("--dcapture-out: {name:?} is given twice").into());
        }
        out.push((name.to_string(), PathBuf::from(file)));
    }
    crate::npy::check_writable(out.iter().map(|(_, p)| ("--dcapture-out", Some(p.as_path()))))?;
    Ok(out)
}

/// Each `--dcapture-out` name is a `--capture` name, and the source gives the captures'
/// gradients (defines `score_mod_dcapture`).
fn check_dcapture_names(
    outs: &[(String, PathBuf)],
    input: &InputArgs,
    x: &crate::input::Inputs,
) -> CliResult<()> {
    let Some((name, _)) = outs.first() else {
        return Ok(());
    };
    let caps = x.user_mod.as_ref().map(|(_, c)| c.as_slice()).unwrap_or_default();
    if let Some((n, _)) = outs.iter().find(|(n, _)| !caps.iter().any(|(c, _, _)| c == n)) {
        return Err(format!("--dcapture-out {n}: no --capture {n}=... was given").into());
    }
    let gives = input
        .options(x)
        .user_mod
        .map(|m| m.gives_capture_gradients())
        .transpose()?
        .unwrap_or(false);
    if !gives {
        return Err(format!(
            "--dcapture-out {name}: the --mod source defines no \
             fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32)"
        )
        .into());
    }
    Ok(())
}

/// The captures' gradients to write: for each `--dcapture-out`, its file and the capture's
/// gradient in the capture's shape (names checked by [`check_dcapture_names`]).
fn dcapture_arrays(
    outs: &[(String, PathBuf)],
    x: &crate::input::Inputs,
    dcaps: Option<&[ndarray::Array1<f32>]>,
) -> CliResult<Vec<(PathBuf, ndarray::ArrayD<f32>)>> {
    let caps = x.user_mod.as_ref().map(|(_, c)| c.as_slice()).unwrap_or_default();
    let mut w = Vec::new();
    for (name, file) in outs {
        let k = caps
            .iter()
            .position(|(n, _, _)| n == name)
            .ok_or("unknown capture")?;
        let d = dcaps.and_then(|d| d.get(k)).ok_or("no captures' gradients")?;
        let a = ndarray::ArrayD::from_shape_vec(caps[k].2.clone(), d.to_vec())
            .map_err(|e| format!("--dcapture-out {name}: {e}"))?;
        w.push((file.clone(), a));
    }
    Ok(w)
}

/// `backward`: gradients of sum(dO ∘ O) with respect to q, k, v (and the bias).
pub(crate) fn backward(a: &BackwardArgs) -> CliResult<ExitCode> {
    crate::npy::check_writable([
        ("--dq-out", Some(a.dq_out.as_path())),
        ("--dk-out", Some(a.dk_out.as_path())),
        ("--dv-out", Some(a.dv_out.as_path())),
        ("--dbias-out", a.dbias_out.as_deref()),
        ("--dsink-out", a.dsink_out.as_deref()),
    ])?;
    let dcap_outs = dcapture_outs(a)?;
    let x = a.input.load()?;
    check_dcapture_names(&dcap_outs, &a.input, &x)?;
    let st = a.input.storage;
    let dout = read_qkv(&a.dout, "dout", "[B, Hq, L, Ev]")?.mapv(|v| st.round(v));
    let (dq, dk, dv, dbias, dsink, dcaps, how) = if a.input.cpu {
        let started = Instant::now();
        let g = reference::sdpa_backward(
            x.q.view(),
            x.k.view(),
            x.v.view(),
            dout.view(),
            &a.input.options(&x),
        )?;
        let f = |v: f64| st.round(v as f32);
        let how = format!(
            "ran the CPU reference backward (f64 on {st} inputs, gradients rounded to {st}, written as f32) in {:.3} ms",
            ms(started.elapsed())
        );
        (
            g.dq.mapv(f).into_dyn(),
            g.dk.mapv(f).into_dyn(),
            g.dv.mapv(f).into_dyn(),
            g.dbias.map(|d| d.mapv(f)),
            g.dsink.map(|d| d.mapv(|x| x as f32).into_dyn()),
            None,
            how,
        )
    } else {
        let bwd = a
            .input
            .sdpa(&x)
            .backward(Tensor::from(&dout).with_storage(st))
            .path(a.input.path);
        // Validate before creating the device, so input errors come first.
        bwd.problem()?;
        let started = Instant::now();
        let (g, how) = match crate::ring::target(&a.input)? {
            crate::ring::Target::One => {
                let ctx = context()?;
                let path = bwd.resolved_path(&ctx)?;
                let g = bwd.run_blocking(&ctx)?;
                let how = format!(
                    "ran the forward and the backward on {}, backward path {}, storage {st}, in {:.3} ms (incl. upload, shader compilation and readback)",
                    ctx.describe(),
                    path.name(),
                    ms(started.elapsed())
                );
                (g, how)
            }
            ring => match ring.backward(&bwd, &a.input)? {
                Some(done) => done,
                None => return Ok(ExitCode::SUCCESS),
            },
        };
        (
            g.dq.into_dyn(),
            g.dk.into_dyn(),
            g.dv.into_dyn(),
            g.dbias,
            g.dsink.map(|d| d.into_dyn()),
            g.dcaptures,
            how,
        )
    };
    let dcap_arrays = dcapture_arrays(&dcap_outs, &x, dcaps.as_deref())?;
    println!("{how}");
    write_array(&a.dq_out, "dq", &dq)?;
    write_array(&a.dk_out, "dk", &dk)?;
    write_array(&a.dv_out, "dv", &dv)?;
    if let Some(p) = &a.dbias_out {
        write_array(p, "dbias", &dbias.ok_or("no bias was given")?)?;
    }
    if let Some(p) = &a.dsink_out {
        write_array(p, "dsink", &dsink.ok_or("no sink logits were given")?)?;
    }
    for (p, d) in &dcap_arrays {
        write_array(p, "dcapture", d)?;
    }
    Ok(ExitCode::SUCCESS)
}
