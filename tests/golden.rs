//! Golden tests against PyTorch (float64) fixtures written by `scripts/make_goldens.py`.
//! Both the CPU reference (to 1e-10) and every GPU path (to the crate tolerance) must match.

mod common;

use common::{assert_report, ctx, goldens};
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::reference;
use wgpu_attention::Path;

#[test]
fn reference_matches_pytorch_goldens() {
    let tight = Tolerance {
        atol: 1e-10,
        rtol: 1e-10,
    };
    for g in goldens() {
        let c = &g.case;
        // Half goldens' inputs were rounded by PyTorch (.half() / .bfloat16()): they are values
        // of the format, which our rounding leaves alone.
        let st = c.storage;
        for (what, a) in [("q", &c.q), ("k", &c.k), ("v", &c.v)] {
            assert!(
                a.iter().all(|&x| st.round(x) == x),
                "{} {what}: not {st} values",
                g.name
            );
        }
        let r = reference::sdpa(c.q.view(), c.k.view(), c.v.view(), &c.options()).unwrap();
        for (what, rep) in [
            (
                "out",
                compare(r.out.iter().copied(), g.pytorch.out.iter().copied(), tight),
            ),
            (
                "lse",
                compare(r.lse.iter().copied(), g.pytorch.lse.iter().copied(), tight),
            ),
            (
                "weights",
                compare(
                    r.weights.iter().copied(),
                    g.pytorch.weights.iter().copied(),
                    tight,
                ),
            ),
        ] {
            assert!(rep.passed(), "{} {what}: {rep}", g.name);
        }
    }
}

/// Every path against PyTorch (the kernels' other forms: `tests/forms.rs`).
#[test]
fn every_path_matches_pytorch_goldens() {
    let Some(ctx) = ctx() else { return };
    for g in goldens() {
        for path in Path::ALL {
            let got = g
                .case
                .checked_sdpa(path)
                .run_blocking(ctx)
                .unwrap_or_else(|e| panic!("{} {path:?}: {e}", g.name));
            g.assert_matches(&got, path, g.tolerance(), &format!("{path:?}"));
        }
    }
}

/// The f64 reference backward matches PyTorch's float64 autograd on every golden that has
/// gradients (every f32 one: combined masks, GQA, fully masked rows, odd dims, large logits).
#[test]
fn reference_backward_matches_pytorch_autograd() {
    let mut n = 0;
    for g in goldens() {
        let Some(gr) = &g.grads else { continue };
        n += 1;
        let c = &g.case;
        let r = reference::sdpa_backward(c.q.view(), c.k.view(), c.v.view(), gr.dout.view(), &c.options())
            .unwrap();
        let tol = wgpu_attention::check::Tolerance {
            atol: 1e-9,
            rtol: 1e-9,
        };
        for (name, got, want) in [
            ("dq", &r.dq, &gr.f64[0]),
            ("dk", &r.dk, &gr.f64[1]),
            ("dv", &r.dv, &gr.f64[2]),
        ] {
            assert_report(
                compare(got.iter().copied(), want.iter().copied(), tol),
                &format!("{} {name}", g.name),
            );
        }
        if let Some((want, _)) = &gr.dbias {
            let got = r.dbias.as_ref().expect("dbias");
            assert_eq!(got.shape(), want.shape(), "{}", g.name);
            assert_report(
                compare(got.iter().copied(), want.iter().copied(), tol),
                &format!("{} dbias", g.name),
            );
        }
    }
    assert!(n >= 12, "expected backward goldens, found {n}");
}

/// Both GPU backward paths meet FlashAttention's rule against PyTorch's float64 autograd, with
/// PyTorch's float32 autograd as the plain implementation.
#[test]
fn gpu_backward_matches_pytorch_autograd_by_flash_rule() {
    let Some(ctx) = ctx() else { return };
    for g in goldens() {
        let Some(gr) = &g.grads else { continue };
        for path in [Path::Fused, Path::Unfused] {
            let got = g
                .case
                .sdpa()
                .backward(&gr.dout)
                .path(path)
                .run_blocking(ctx)
                .unwrap();
            for (i, (name, a)) in [("dq", &got.dq), ("dk", &got.dk), ("dv", &got.dv)]
                .into_iter()
                .enumerate()
            {
                let r = wgpu_attention::check::flash_rule(
                    a.iter().copied(),
                    gr.f64[i].iter().copied(),
                    gr.f32[i].iter().copied(),
                );
                assert_report(r, &format!("{} {path:?} {name}", g.name));
            }
            if let Some((want, plain)) = &gr.dbias {
                let a = got.dbias.as_ref().expect("dbias");
                let r = wgpu_attention::check::flash_rule(
                    a.iter().copied(),
                    want.iter().copied(),
                    plain.iter().copied(),
                );
                assert_report(r, &format!("{} {path:?} dbias", g.name));
            }
        }
    }
}
