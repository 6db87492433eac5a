//! `variant`: the literature's attention variants on `.npy` files, on the GPU or the CPU
//! reference.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use wgpu_attention::reference;
use wgpu_attention::{Tensor, Variant, VariantKind, VariantParams};

use crate::input::InputArgs;
use crate::npy::write_array;
use crate::timing::ms;
use crate::{context, CliResult};

#[derive(Args)]
pub(crate) struct VariantArgs {
    /// Which variant: general (Luong), additive (Bahdanau), lowrank-v (--v holds U [B, Hkv, S, r]),
    /// nystrom, linformer.
    #[arg(long, value_parser = kind_parser())]
    kind: VariantKind,
    #[command(flatten)]
    input: InputArgs,
    /// The parameters, safetensors: general `w` [E, E]; additive `w_q` [A, E], `w_k` [A, E],
    /// `u` [A], optional `b` [A]; lowrank-v `a` [r, Ev]; linformer `e` [k_p, S], `f` [k_p, S].
    /// Nyström takes none.
    #[arg(long, value_name = "P.safetensors")]
    params: Option<PathBuf>,
    /// Nyström's landmarks (1 ..= min(L, S)).
    #[arg(long, default_value_t = 64)]
    landmarks: usize,
    /// Nyström's pseudo-inverse iterations.
    #[arg(long, default_value_t = 6)]
    pinv_iters: usize,
    /// Where to write the output, f32 .npy [B, Hq, L, Ev].
    #[arg(long, value_name = "O.npy")]
    out: PathBuf,
    /// Also write the attention weights, f32 .npy [B, Hq, L, S] (general, additive, lowrank-v).
    #[arg(long, value_name = "W.npy")]
    weights_out: Option<PathBuf>,
}

fn kind_parser() -> impl clap::builder::TypedValueParser<Value = VariantKind> {
    use clap::builder::TypedValueParser;
    let names: Vec<&'static str> = VariantKind::ALL.iter().map(|k| k.name()).collect();
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<VariantKind>())
}

/// `variant`: one variant on the `.npy` inputs.
pub(crate) fn variant(a: &VariantArgs) -> CliResult<ExitCode> {
    crate::npy::check_writable([
        ("--out", Some(a.out.as_path())),
        ("--weights-out", a.weights_out.as_deref()),
    ])?;
    let params = match (a.kind, &a.params) {
        (VariantKind::Nystrom, None) => VariantParams::Nystrom {
            landmarks: a.landmarks,
        },
        (VariantKind::Nystrom, Some(_)) => {
            return Err("nystrom takes no --params (it has no learned parameters)".into())
        }
        (kind, Some(p)) => VariantParams::from_safetensors_file(kind, p)?,
        (kind, None) => return Err(format!("--kind {} needs --params P.safetensors", kind.name()).into()),
    };
    let x = a.input.load()?;
    let st = a.input.storage;
    let options = a.input.options(&x);
    let weights = a.weights_out.is_some();
    let (out, w, how) = if a.input.cpu {
        let started = Instant::now();
        let r = reference::variant(
            &params,
            x.q.view(),
            x.k.view(),
            x.v.view(),
            &options,
            weights,
            a.pinv_iters,
        )?;
        let how = format!(
            "ran the CPU reference of {} (f64 on {st} inputs, output rounded to {st}, written as f32) in {:.3} ms",
            a.kind.name(),
            ms(started.elapsed())
        );
        (
            r.out.mapv(|v| st.round(v as f32)).into_dyn(),
            r.weights.map(|w| w.mapv(|v| v as f32).into_dyn()),
            how,
        )
    } else {
        let t = |arr| Tensor::from(arr).with_storage(st);
        let mut var = Variant::new(t(&x.q), t(&x.k), t(&x.v), &params)
            .options(options.clone())
            .path(a.input.path)
            .pinv_iters(a.pinv_iters);
        if weights {
            var = var.return_weights();
        }
        // Validate before creating the device, so input errors come first.
        var.output_shape()?;
        let ctx = context()?;
        let started = Instant::now();
        let r = var.run_blocking(&ctx)?;
        let how = format!(
            "ran {} on {}, storage {st}, in {:.3} ms (incl. upload, shader compilation and readback)",
            a.kind.name(),
            ctx.describe(),
            ms(started.elapsed())
        );
        (r.output.into_dyn(), r.weights.map(|w| w.into_dyn()), how)
    };
    println!("{how}");
    write_array(&a.out, "output", &out)?;
    if let Some(p) = &a.weights_out {
        write_array(p, "weights", &w.ok_or("no attention weights were returned")?)?;
    }
    Ok(ExitCode::SUCCESS)
}
