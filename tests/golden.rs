//! Golden tests against PyTorch (float64) fixtures written by `scripts/make_goldens.py`.
//! Both the CPU reference (to 1e-10) and every GPU path (to the crate tolerance) must match.

mod common;

use common::{ctx, goldens};
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
