//! Golden tests against PyTorch (float64) fixtures written by `scripts/make_goldens.py`.
//! Both the CPU reference (to 1e-10) and every GPU path (to the crate tolerance) must match.

mod common;

use common::{assert_report, ctx, goldens};
use ndarray_npy::read_npy;
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

/// One case of `tests/fixtures/mods` (scripts/make_mod_goldens.py): its inputs as options, and
/// PyTorch's float64 and float32 results.
struct ModGolden {
    name: String,
    dir: std::path::PathBuf,
    meta: serde_json::Value,
    q: ndarray::Array4<f32>,
    k: ndarray::Array4<f32>,
    v: ndarray::Array4<f32>,
    dout: ndarray::Array4<f32>,
    bias: Option<ndarray::ArrayD<f32>>,
    rel: Vec<f32>,
    hs: Vec<f32>,
}

impl ModGolden {
    fn load(dir: &std::path::Path) -> ModGolden {
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let f32s = |n: &str| -> Option<ndarray::ArrayD<f32>> {
            dir.join(n).exists().then(|| read_npy(dir.join(n)).unwrap())
        };
        let four = |n: &str| f32s(n).unwrap().into_dimensionality().unwrap();
        let flat = |n: &str| f32s(n).map(|a| a.iter().copied().collect()).unwrap_or_default();
        ModGolden {
            name: dir.file_name().unwrap().to_string_lossy().into_owned(),
            dir: dir.to_path_buf(),
            q: four("q.npy"),
            k: four("k.npy"),
            v: four("v.npy"),
            dout: four("dout.npy"),
            bias: f32s("bias.npy"),
            rel: flat("rel.npy"),
            hs: flat("hs.npy"),
            meta,
        }
    }

    /// A float64 (`.npy` f64) or float32 golden, flattened.
    fn want(&self, n: &str) -> Option<Vec<f64>> {
        let p = self.dir.join(n);
        if !p.exists() {
            return None;
        }
        if n.ends_with("_f32.npy") {
            let a: ndarray::ArrayD<f32> = read_npy(p).unwrap();
            return Some(a.iter().map(|&x| f64::from(x)).collect());
        }
        let a: ndarray::ArrayD<f64> = read_npy(p).unwrap();
        Some(a.iter().copied().collect())
    }

    fn options(&self) -> wgpu_attention::Options<'_> {
        let m = &self.meta;
        let f32s = |v: &serde_json::Value| -> Option<Vec<f32>> {
            v.as_array()
                .map(|a| a.iter().map(|x| x.as_f64().unwrap() as f32).collect())
        };
        let ints = |n: &str| -> Option<Vec<i64>> {
            let p = self.dir.join(n);
            p.exists().then(|| {
                if n.ends_with("docs.npy") {
                    let a: ndarray::ArrayD<i32> = read_npy(p).unwrap();
                    a.iter().map(|&x| i64::from(x)).collect()
                } else {
                    let a: ndarray::ArrayD<i64> = read_npy(p).unwrap();
                    a.iter().copied().collect()
                }
            })
        };
        let user = m["user"].as_object().map(|u| {
            wgpu_attention::UserMod::wgsl(u["wgsl"].as_str().unwrap())
                .capture("rel", &self.rel)
                .capture("hs", &self.hs)
                // The fixture's functions (scripts/make_mod_goldens.py) as closures.
                .cpu_score(|s, [_, h, i, j], c| {
                    let bucket = (j as i64 - i as i64).clamp(-4, 4) + 4;
                    3.0 * (s / 3.0).tanh() * c.get("hs", h) + c.get("rel", h * 9 + bucket as usize)
                })
                .cpu_mask(|[_, _, i, j]| (j < 3 || j <= i + 8) && i % 7 != 4)
        });
        wgpu_attention::Options {
            causal: match m["causal"].as_str().unwrap() {
                "top_left" => wgpu_attention::Causal::TopLeft,
                "bottom_right" => wgpu_attention::Causal::BottomRight,
                _ => wgpu_attention::Causal::None,
            },
            scale: m["scale"].as_f64(),
            bias: self.bias.as_ref().map(wgpu_attention::Tensor::from),
            kv_lens: ints("kv_lens.npy").map(|v| v.into_iter().map(|x| x as usize).collect()),
            window: m["window"]
                .as_array()
                .map(|w| (w[0].as_i64().unwrap(), w[1].as_i64().unwrap())),
            sink_tokens: m["sink_tokens"].as_u64().unwrap() as usize,
            softcap: m["softcap"].as_f64().map(|c| c as f32),
            alibi: f32s(&m["alibi"]),
            sink_logits: self.dir.join("sinks.npy").exists().then(|| {
                let a: ndarray::ArrayD<f32> = read_npy(self.dir.join("sinks.npy")).unwrap();
                a.iter().copied().collect()
            }),
            doc_ids: ints("q_docs.npy").map(|q| wgpu_attention::DocIds {
                q: q.into_iter().map(|x| x as i32).collect(),
                k: ints("k_docs.npy")
                    .unwrap()
                    .into_iter()
                    .map(|x| x as i32)
                    .collect(),
            }),
            user_mod: user,
            ..Default::default()
        }
    }
}

fn mod_goldens() -> Vec<ModGolden> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mods");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    let g: Vec<ModGolden> = dirs.iter().map(|d| ModGolden::load(d)).collect();
    assert!(g.len() >= 4, "expected the modifier goldens, found {}", g.len());
    g
}

/// The score modifiers and user functions against PyTorch's float64 autograd
/// (`tests/fixtures/mods`: a window with sink tokens, sink logits and key lengths; a softcap
/// with ALiBi and a bias; unordered document ids with fully masked rows; a user score_mod with
/// two captures and a mask_mod): the f64 reference to 1e-9, every forward path to the crate
/// tolerance, and both backward paths by FlashAttention's rule (PyTorch's float32 autograd the
/// plain implementation), d(bias), d(sink logits) and the captures' gradients included.
#[test]
fn modifier_goldens_forward_and_backward() {
    let tight = Tolerance {
        atol: 1e-9,
        rtol: 1e-9,
    };
    let goldens = mod_goldens();
    for g in &goldens {
        let o = g.options();
        let r = reference::sdpa_backward(g.q.view(), g.k.view(), g.v.view(), g.dout.view(), &o).unwrap();
        let extras = [
            (
                "dbias",
                r.dbias.as_ref().map(|a| a.iter().copied().collect::<Vec<f64>>()),
            ),
            ("dsinks", r.dsink.as_ref().map(|a| a.to_vec())),
            ("drel", r.dcaptures.as_ref().map(|d| d[0].to_vec())),
            ("dhs", r.dcaptures.as_ref().map(|d| d[1].to_vec())),
        ];
        let main = [
            ("out", Some(r.out.iter().copied().collect::<Vec<f64>>())),
            ("lse", Some(r.lse.iter().copied().collect())),
            ("dq", Some(r.dq.iter().copied().collect())),
            ("dk", Some(r.dk.iter().copied().collect())),
            ("dv", Some(r.dv.iter().copied().collect())),
        ];
        for (n, got) in main.into_iter().chain(extras) {
            match (got, g.want(&format!("{n}.npy"))) {
                (Some(got), Some(want)) => assert_report(
                    compare(got.iter().copied(), want.iter().copied(), tight),
                    &format!("{} reference {n}", g.name),
                ),
                (None, None) => {}
                (got, want) => panic!(
                    "{} {n}: reference {} golden {}",
                    g.name,
                    got.is_some(),
                    want.is_some()
                ),
            }
        }
    }
    let Some(ctx) = ctx() else { return };
    for g in &goldens {
        let sdpa = || wgpu_attention::Sdpa::new(&g.q, &g.k, &g.v).options(g.options());
        for path in Path::ALL {
            let got = sdpa().path(path).return_lse().run_blocking(ctx).unwrap();
            let label = format!("{} {path:?}", g.name);
            assert_report(
                compare(
                    got.output.iter().copied(),
                    g.want("out.npy").unwrap(),
                    common::TOL,
                ),
                &format!("{label} out"),
            );
            assert_report(
                compare(
                    got.lse.unwrap().iter().copied(),
                    g.want("lse.npy").unwrap(),
                    common::TOL,
                ),
                &format!("{label} lse"),
            );
        }
        for path in [Path::Fused, Path::Unfused] {
            let got = sdpa().backward(&g.dout).path(path).run_blocking(ctx).unwrap();
            let caps = got.dcaptures.as_ref();
            for (n, a) in [
                ("dq", Some(got.dq.iter().copied().collect::<Vec<f32>>())),
                ("dk", Some(got.dk.iter().copied().collect())),
                ("dv", Some(got.dv.iter().copied().collect())),
                ("dbias", got.dbias.as_ref().map(|a| a.iter().copied().collect())),
                ("dsinks", got.dsink.as_ref().map(|a| a.to_vec())),
                ("drel", caps.map(|d| d[0].to_vec())),
                ("dhs", caps.map(|d| d[1].to_vec())),
            ] {
                let label = format!("{} {path:?} {n}", g.name);
                match (a, g.want(&format!("{n}.npy")), g.want(&format!("{n}_f32.npy"))) {
                    (Some(a), Some(want), Some(plain)) => assert_report(
                        wgpu_attention::check::flash_rule(a.iter().copied(), want, plain),
                        &label,
                    ),
                    (None, None, None) => {}
                    (a, w, _) => panic!("{label}: GPU {} golden {}", a.is_some(), w.is_some()),
                }
            }
        }
    }
}
