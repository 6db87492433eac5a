//! Golden tests against PyTorch (float64) fixtures written by `scripts/make_goldens.py`.
//! Both the CPU reference (to 1e-10) and every GPU path (to the crate tolerance) must match.

mod common;

use std::path::{Path as FsPath, PathBuf};

use common::{ctx, TOL};
use ndarray::{Array3, Array4, ArrayD, Ix1};
use ndarray_npy::read_npy;
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::reference::{self, Spec};
use wgpu_attention::{Causal, Path, Sdpa};

struct Golden {
    name: String,
    q: Array4<f32>,
    k: Array4<f32>,
    v: Array4<f32>,
    mask: Option<ArrayD<bool>>,
    bias: Option<ArrayD<f32>>,
    kv_lens: Option<Vec<usize>>,
    causal: Causal,
    scale: Option<f64>,
    out: Array4<f64>,
    lse: Array3<f64>,
    weights: Array4<f64>,
}

fn opt<T>(dir: &FsPath, file: &str, f: impl FnOnce(PathBuf) -> T) -> Option<T> {
    let p = dir.join(file);
    p.exists().then(|| f(p))
}

fn load(dir: &FsPath) -> Golden {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let causal = match meta["causal"].as_str().unwrap() {
        "none" => Causal::None,
        "top_left" => Causal::TopLeft,
        "bottom_right" => Causal::BottomRight,
        other => panic!("unknown causal {other}"),
    };
    Golden {
        name: dir.file_name().unwrap().to_string_lossy().into_owned(),
        q: read_npy(dir.join("q.npy")).unwrap(),
        k: read_npy(dir.join("k.npy")).unwrap(),
        v: read_npy(dir.join("v.npy")).unwrap(),
        mask: opt(dir, "mask.npy", |p| read_npy(p).unwrap()),
        bias: opt(dir, "bias.npy", |p| read_npy(p).unwrap()),
        kv_lens: opt(dir, "kv_lens.npy", |p| {
            let a: ndarray::Array<i64, Ix1> = read_npy(p).unwrap();
            a.iter().map(|&x| x as usize).collect()
        }),
        causal,
        scale: meta["scale"].as_f64(),
        out: read_npy(dir.join("out.npy")).unwrap(),
        lse: read_npy(dir.join("lse.npy")).unwrap(),
        weights: read_npy(dir.join("weights.npy")).unwrap(),
    }
}

fn goldens() -> Vec<Golden> {
    let root = FsPath::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sdpa");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    let g: Vec<Golden> = dirs.iter().map(|d| load(d)).collect();
    assert!(
        g.len() >= 12,
        "expected at least a dozen golden cases, found {}",
        g.len()
    );
    g
}

#[test]
fn reference_matches_pytorch_goldens() {
    let tight = Tolerance {
        atol: 1e-10,
        rtol: 1e-10,
    };
    for g in goldens() {
        let spec = Spec {
            scale: g.scale,
            causal: g.causal,
            mask: g.mask.as_ref().map(|m| m.view()),
            bias: g.bias.as_ref().map(|b| b.view()),
            kv_lens: g.kv_lens.as_deref(),
        };
        let r = reference::sdpa(g.q.view(), g.k.view(), g.v.view(), &spec).unwrap();
        for (what, rep) in [
            (
                "out",
                compare(r.out.iter().copied(), g.out.iter().copied(), tight),
            ),
            (
                "lse",
                compare(r.lse.iter().copied(), g.lse.iter().copied(), tight),
            ),
            (
                "weights",
                compare(r.weights.iter().copied(), g.weights.iter().copied(), tight),
            ),
        ] {
            assert!(rep.passed(), "{} {what}: {rep}", g.name);
        }
    }
}

#[test]
fn every_path_matches_pytorch_goldens() {
    let Some(ctx) = ctx() else { return };
    for g in goldens() {
        for path in Path::ALL {
            let mut s = Sdpa::new(&g.q, &g.k, &g.v)
                .causal(g.causal)
                .path(path)
                .return_lse();
            if let Some(m) = &g.mask {
                s = s.mask(m);
            }
            if let Some(b) = &g.bias {
                s = s.bias(b);
            }
            if let Some(l) = &g.kv_lens {
                s = s.kv_lens(l);
            }
            if let Some(sc) = g.scale {
                s = s.scale(sc as f32);
            }
            let weights = path == Path::Unfused;
            if weights {
                s = s.return_weights();
            }
            let got = s
                .run_blocking(ctx)
                .unwrap_or_else(|e| panic!("{} {path:?}: {e}", g.name));
            let tol = TOL;
            let rep = compare(got.output.iter().copied(), g.out.iter().copied(), tol);
            assert!(rep.passed(), "{} {path:?} out: {rep}", g.name);
            let rep = compare(got.lse.unwrap().iter().copied(), g.lse.iter().copied(), tol);
            assert!(rep.passed(), "{} {path:?} lse: {rep}", g.name);
            if weights {
                let rep = compare(
                    got.weights.unwrap().iter().copied(),
                    g.weights.iter().copied(),
                    tol,
                );
                assert!(rep.passed(), "{} {path:?} weights: {rep}", g.name);
            }
        }
    }
}
