//! The attention variants (general, additive, lowrank-v, Nyström, Linformer) on the GPU
//! against the f64 reference (`reference::variant`) and PyTorch's float64 goldens
//! (`tests/fixtures/variants/`): grids with tails, L ≠ S, E ≠ Ev, grouped heads, every mask
//! kind where the variant takes masks, every attention path of the additive score, half
//! storage, the caller's buffers, and the typed errors.

mod common;

use common::*;
use ndarray::{Array1, Array2, Array4};
use wgpu_attention::check::{compare, Tolerance, F32_TOLERANCE};
use wgpu_attention::reference;
use wgpu_attention::{
    Context, Error, Options, Path, Storage, Tensor, Variant, VariantKind, VariantOutput, VariantParams,
};

fn tolerance(kind: VariantKind, storage: Storage, reference: &Array4<f64>) -> Tolerance {
    let base = Tolerance::for_storage(storage);
    if kind == VariantKind::Nystrom {
        let n = nystrom_tolerance(reference);
        Tolerance {
            atol: base.atol.max(n.atol),
            rtol: base.rtol.max(n.rtol),
        }
    } else {
        base
    }
}

/// Random parameters of `kind` for inputs with head dim `e`, key length `s`, value dim `ev`.
fn params(kind: VariantKind, e: usize, s: usize, ev: usize, seed: u64) -> VariantParams {
    let mut r = rng(seed);
    let mut mat = |rows: usize, cols: usize, scale: f32| -> Array2<f32> {
        rand_array(&mut r, (rows, cols)).mapv(|x| x * scale)
    };
    match kind {
        VariantKind::General => VariantParams::General {
            w: mat(e, e, 1.0 / (e as f32).sqrt()),
        },
        VariantKind::Additive => {
            let a = e + 3;
            let w_q = mat(a, e, 1.0);
            let w_k = mat(a, e, 1.0);
            let u = mat(1, a, 1.5).into_shape_with_order(a).unwrap();
            let b = mat(1, a, 0.5).into_shape_with_order(a).unwrap();
            VariantParams::Additive {
                w_q,
                w_k,
                u,
                b: Some(b),
            }
        }
        VariantKind::LowRankV => VariantParams::LowRankV { a: mat(ev, 9, 1.0) },
        VariantKind::Nystrom => VariantParams::Nystrom { landmarks: 6 },
        VariantKind::Linformer => VariantParams::Linformer {
            e: mat(7, s, 1.0 / (s as f32).sqrt()),
            f: mat(7, s, 1.0 / (s as f32).sqrt()),
        },
        other => panic!("no parameters for {other:?}"),
    }
}

/// Run `var` and compare its output (and weights, when asked for) with the reference.
#[allow(clippy::too_many_arguments)]
fn check(
    ctx: &Context,
    case: &Case,
    params: &VariantParams,
    path: Path,
    weights: bool,
    pinv_iters: usize,
    label: &str,
) -> VariantOutput {
    let t = |a| Tensor::from(a).with_storage(case.storage);
    let mut var = Variant::new(t(&case.q), t(&case.k), t(&case.v), params)
        .options(case.options())
        .path(path)
        .pinv_iters(pinv_iters);
    if weights {
        var = var.return_weights();
    }
    let got = var.run_blocking(ctx).unwrap_or_else(|e| panic!("{label}: {e}"));
    let want = reference::variant(
        params,
        case.q.view(),
        case.k.view(),
        case.v.view(),
        &case.options(),
        weights,
        pinv_iters,
    )
    .unwrap();
    let tol = tolerance(params.kind(), case.storage, &want.out);
    assert_report(
        compare(got.output.iter().copied(), want.out.iter().copied(), tol),
        label,
    );
    if weights {
        let (g, w) = (
            got.weights.as_ref().expect("weights"),
            want.weights.as_ref().unwrap(),
        );
        assert_report(
            compare(g.iter().copied(), w.iter().copied(), F32_TOLERANCE),
            &format!("{label} weights"),
        );
    }
    got
}

/// General, additive and lowrank-v take every mask kind: each one alone and combined (fully
/// masked rows included), with tails (L = 19, S = 23), grouped heads, E ≠ Ev; the additive
/// score on every path; weights from the unfused path.
#[test]
fn masked_variants_match_reference_under_every_mask() {
    let Some(ctx) = ctx() else { return };
    let shape = (2, 4, 2, 19, 23, 12, 10);
    for kind in [VariantKind::General, VariantKind::Additive, VariantKind::LowRankV] {
        let params = params(kind, 12, 23, 10, 5);
        for (name, make) in mask_kinds() {
            let case = make(Case::random(shape, 3));
            // The additive score is a user score_mod: every path runs it (decode under two
            // mask kinds, the combined one's fully masked rows included: each pair is a
            // pipeline CI compiles cold).
            let decode = ["none", "all_combined"].contains(&name);
            let paths: &[Path] = if kind == VariantKind::Additive && decode {
                &[Path::Fused, Path::Unfused, Path::Decode]
            } else if kind == VariantKind::Additive {
                &[Path::Fused, Path::Unfused]
            } else {
                &[Path::Auto]
            };
            for &path in paths {
                check(
                    ctx,
                    &case,
                    &params,
                    path,
                    false,
                    6,
                    &format!("{} {name} {path:?}", kind.name()),
                );
            }
            check(
                ctx,
                &case,
                &params,
                Path::Unfused,
                true,
                6,
                &format!("{} {name} weights", kind.name()),
            );
        }
    }
}

/// A scale other than the default, a head dim that is not a multiple of 4, one key, one query.
#[test]
fn masked_variants_edge_shapes() {
    let Some(ctx) = ctx() else { return };
    for shape in [
        (1, 2, 1, 1, 9, 5, 3),
        (2, 1, 1, 7, 1, 6, 4),
        (1, 3, 3, 66, 70, 7, 5),
    ] {
        let (_, _, _, _, s, e, ev) = shape;
        for kind in [VariantKind::General, VariantKind::Additive, VariantKind::LowRankV] {
            let params = params(kind, e, s, ev, 11);
            let mut case = Case::random(shape, 4).with_causal(wgpu_attention::Causal::BottomRight);
            case.scale = Some(0.7);
            for path in [Path::Auto, Path::Unfused] {
                check(
                    ctx,
                    &case,
                    &params,
                    path,
                    false,
                    6,
                    &format!("{} {shape:?} {path:?}", kind.name()),
                );
            }
        }
    }
}

/// Nyström over landmark counts from 1 to min(L, S), unequal segments, grouped heads, more
/// iterations, L ≠ S both ways; Linformer with random and segment-mean projections.
#[test]
fn nystrom_and_linformer_match_reference() {
    let Some(ctx) = ctx() else { return };
    for (shape, m, iters) in [
        ((2, 2, 2, 37, 29, 6, 5), 8, 6),
        ((1, 4, 2, 50, 23, 8, 8), 7, 6),
        ((1, 2, 1, 10, 7, 3, 4), 1, 6),
        ((1, 1, 1, 12, 12, 4, 4), 12, 14),
        ((2, 3, 3, 130, 97, 16, 12), 32, 6),
    ] {
        let case = Case::random(shape, 21);
        let params = VariantParams::Nystrom { landmarks: m };
        check(
            ctx,
            &case,
            &params,
            Path::Auto,
            false,
            iters,
            &format!("nystrom {shape:?} m {m}"),
        );
    }
    for (shape, kp) in [((2, 2, 2, 9, 23, 6, 5), 5), ((1, 4, 2, 70, 81, 8, 12), 16)] {
        let case = Case::random(shape, 22);
        let s = shape.4;
        let mut r = rng(23);
        let random = VariantParams::Linformer {
            e: rand_array(&mut r, (kp, s)).mapv(|x| x / (s as f32).sqrt()),
            f: rand_array(&mut r, (kp, s)).mapv(|x| x / (s as f32).sqrt()),
        };
        let means = VariantParams::Linformer {
            e: VariantParams::segment_means(kp, s),
            f: VariantParams::segment_means(kp, s),
        };
        for (name, p) in [("random", &random), ("segment means", &means)] {
            check(
                ctx,
                &case,
                p,
                Path::Auto,
                false,
                6,
                &format!("linformer {name} {shape:?}"),
            );
        }
    }
}

/// Every kind with f16 and bf16 inputs and output (f32 parameters and intermediates), at the
/// format's tolerance against the reference on the rounded inputs.
#[test]
fn half_storage() {
    let Some(ctx) = ctx() else { return };
    let shape = (1, 2, 1, 21, 18, 8, 6);
    for storage in [Storage::F16, Storage::Bf16] {
        for kind in VariantKind::ALL {
            let mut case = Case::random(shape, 31).with_storage(storage);
            if kind.takes_masks() {
                case = case
                    .with_random_mask(32)
                    .with_causal(wgpu_attention::Causal::TopLeft);
            }
            let params = params(kind, 8, 18, 6, 33);
            check(
                ctx,
                &case,
                &params,
                Path::Auto,
                false,
                6,
                &format!("{} {}", kind.name(), storage.name()),
            );
        }
    }
}

/// The caller's GPU buffers as q, k, v give the host inputs' results.
#[test]
fn gpu_buffer_inputs() {
    let Some(ctx) = ctx() else { return };
    use wgpu_attention::wgpu::util::DeviceExt;
    let case = Case::random((1, 2, 2, 17, 19, 8, 8), 41);
    let buf = |a: &Array4<f32>| {
        ctx.device()
            .create_buffer_init(&wgpu_attention::wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytemuck::cast_slice(a.as_slice().unwrap()),
                usage: wgpu_attention::wgpu::BufferUsages::STORAGE,
            })
    };
    let (qb, kb, vb) = (buf(&case.q), buf(&case.k), buf(&case.v));
    for kind in VariantKind::ALL {
        let params = params(kind, 8, 19, 8, 42);
        let host = Variant::new(&case.q, &case.k, &case.v, &params)
            .run_blocking(ctx)
            .unwrap();
        let gpu = Variant::new(
            Tensor::from_buffer(&qb, wgpu_attention::Storage::F32, case.q.shape()),
            Tensor::from_buffer(&kb, wgpu_attention::Storage::F32, case.k.shape()),
            Tensor::from_buffer(&vb, wgpu_attention::Storage::F32, case.v.shape()),
            &params,
        )
        .run_blocking(ctx)
        .unwrap();
        assert_eq!(host.output, gpu.output, "{}", kind.name());
    }
}

/// A variant golden directory: the case, the parameters and PyTorch's output (and weights).
struct VariantGolden {
    name: String,
    case: Case,
    params: VariantParams,
    pinv_iters: usize,
    out: Array4<f64>,
    weights: Option<Array4<f64>>,
}

fn variant_goldens() -> Vec<VariantGolden> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/variants");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    dirs.iter()
        .map(|dir| {
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            let file = |f: &str| std::fs::read(dir.join(f)).ok();
            let (case, meta) = golden_case(&name, &file);
            let kind: VariantKind = meta["kind"].as_str().unwrap().parse().unwrap();
            let params = match kind {
                VariantKind::Nystrom => VariantParams::Nystrom {
                    landmarks: meta["landmarks"].as_u64().unwrap() as usize,
                },
                _ => VariantParams::from_safetensors(kind, &file("params.safetensors").unwrap()).unwrap(),
            };
            VariantGolden {
                name,
                case,
                params,
                pinv_iters: meta["pinv_iters"].as_u64().unwrap_or(6) as usize,
                out: npy(file("out.npy").unwrap()),
                weights: file("weights.npy").map(npy),
            }
        })
        .collect()
}

/// PyTorch's float64 goldens: the reference to 1e-9, the GPU at the crate's tolerance (the
/// weights too, where the golden has them).
#[test]
fn pytorch_goldens() {
    let goldens = variant_goldens();
    assert!(goldens.len() >= 13, "found {} variant goldens", goldens.len());
    for kind in VariantKind::ALL {
        assert!(
            goldens.iter().any(|g| g.params.kind() == kind),
            "no golden for {}",
            kind.name()
        );
    }
    let tight = Tolerance {
        atol: 1e-9,
        rtol: 1e-9,
    };
    for g in &goldens {
        let c = &g.case;
        let weights = g.weights.is_some();
        let r = reference::variant(
            &g.params,
            c.q.view(),
            c.k.view(),
            c.v.view(),
            &c.options(),
            weights,
            g.pinv_iters,
        )
        .unwrap();
        assert_report(
            compare(r.out.iter().copied(), g.out.iter().copied(), tight),
            &format!("{} reference", g.name),
        );
        if let (Some(rw), Some(gw)) = (&r.weights, &g.weights) {
            assert_report(
                compare(rw.iter().copied(), gw.iter().copied(), tight),
                &format!("{} reference weights", g.name),
            );
        }
    }
    let Some(ctx) = ctx() else { return };
    for g in &goldens {
        let c = &g.case;
        let mut var = Variant::new(&c.q, &c.k, &c.v, &g.params)
            .options(c.options())
            .pinv_iters(g.pinv_iters);
        if g.weights.is_some() {
            var = var.return_weights();
        }
        let got = var
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{}: {e}", g.name));
        let tol = tolerance(g.params.kind(), Storage::F32, &g.out);
        assert_report(
            compare(got.output.iter().copied(), g.out.iter().copied(), tol),
            &g.name,
        );
        if let Some(w) = &g.weights {
            let gw = got.weights.as_ref().unwrap();
            assert_report(
                compare(gw.iter().copied(), w.iter().copied(), F32_TOLERANCE),
                &format!("{} weights", g.name),
            );
        }
    }
}

/// The inputs of the error tests: q `[1, 2, 8, 4]`, k `[1, 2, 6, 4]`, v `[1, 2, 6, 3]`.
fn error_inputs() -> (Array4<f32>, Array4<f32>, Array4<f32>) {
    (
        Array4::<f32>::zeros((1, 2, 8, 4)),
        Array4::<f32>::zeros((1, 2, 6, 4)),
        Array4::<f32>::zeros((1, 2, 6, 3)),
    )
}

fn m2(r: usize, c: usize) -> Array2<f32> {
    Array2::<f32>::zeros((r, c))
}

fn v1(n: usize) -> Array1<f32> {
    Array1::<f32>::zeros(n)
}

fn additive(w_q: Array2<f32>, w_k: Array2<f32>, u: Array1<f32>, b: Option<Array1<f32>>) -> VariantParams {
    VariantParams::Additive { w_q, w_k, u, b }
}

/// The error of variant `p` with `opts` on the GPU, which the reference gives too.
fn run_err(
    ctx: &Context,
    (q, k, v): (&Array4<f32>, &Array4<f32>, &Array4<f32>),
    p: &VariantParams,
    opts: Options,
) -> Error {
    let gpu = Variant::new(q, k, v, p).options(opts.clone()).run_blocking(ctx);
    let cpu = reference::variant(p, q.view(), k.view(), v.view(), &opts, false, 6);
    let (g, c) = (gpu.expect_err("an error"), cpu.expect_err("an error"));
    assert_eq!(g.to_string(), c.to_string());
    g
}

/// Parameters of the wrong shape: typed errors naming the parameter, before any GPU work (the
/// reference gives the same errors).
#[test]
fn bad_parameter_shapes_are_typed_errors() {
    let Some(ctx) = ctx() else { return };
    let (q, k, v) = error_inputs();
    let run = |p: &VariantParams, opts: Options| run_err(ctx, (&q, &k, &v), p, opts);
    let shape_err = |e: Error, name: &str| match e {
        Error::ShapeMismatch { tensor, .. } => assert_eq!(tensor, name),
        other => panic!("{name}: {other}"),
    };
    shape_err(
        run(&VariantParams::General { w: m2(4, 5) }, Options::default()),
        "w",
    );
    shape_err(
        run(&additive(m2(5, 4), m2(6, 4), v1(5), None), Options::default()),
        "w_k",
    );
    shape_err(
        run(&additive(m2(5, 4), m2(5, 4), v1(4), None), Options::default()),
        "u",
    );
    shape_err(
        run(
            &additive(m2(5, 4), m2(5, 4), v1(5), Some(v1(3))),
            Options::default(),
        ),
        "b",
    );
    shape_err(
        run(&additive(m2(5, 3), m2(5, 3), v1(5), None), Options::default()),
        "w_q",
    );
    shape_err(
        run(&VariantParams::LowRankV { a: m2(2, 7) }, Options::default()),
        "a",
    );
    shape_err(
        run(
            &VariantParams::Linformer {
                e: m2(3, 6),
                f: m2(4, 6),
            },
            Options::default(),
        ),
        "f",
    );
    shape_err(
        run(
            &VariantParams::Linformer {
                e: m2(3, 5),
                f: m2(3, 5),
            },
            Options::default(),
        ),
        "e",
    );
}

/// Options a variant cannot take, and bad variant options: typed errors naming the option,
/// before any GPU work (the reference gives the same errors).
#[test]
fn options_a_variant_cannot_take_are_typed_errors() {
    let Some(ctx) = ctx() else { return };
    let (q, k, v) = error_inputs();
    let run = |p: &VariantParams, opts: Options| run_err(ctx, (&q, &k, &v), p, opts);
    let option_err = |e: Error, name: &str| match e {
        Error::VariantOption { option, .. } => assert_eq!(option, name),
        other => panic!("{name}: {other}"),
    };
    for m in [0, 7] {
        option_err(
            run(&VariantParams::Nystrom { landmarks: m }, Options::default()),
            "landmarks",
        );
    }
    let mask = ndarray::Array2::from_elem((8, 6), true);
    for p in [
        VariantParams::Nystrom { landmarks: 2 },
        VariantParams::Linformer {
            e: m2(3, 6),
            f: m2(3, 6),
        },
    ] {
        let masked = Options {
            mask: Some((&mask).into()),
            ..Options::default()
        };
        option_err(run(&p, masked), "mask");
        let causal = Options {
            causal: wgpu_attention::Causal::TopLeft,
            ..Options::default()
        };
        option_err(run(&p, causal), "causal");
        let lens = Options {
            kv_lens: Some(vec![3]),
            ..Options::default()
        };
        option_err(run(&p, lens), "kv_lens");
        let capped = Options {
            softcap: Some(5.0),
            ..Options::default()
        };
        option_err(run(&p, capped), "softcap");
        let alibi = Options {
            alibi: Some(vec![0.5, 0.25]),
            ..Options::default()
        };
        option_err(run(&p, alibi), "alibi");
        let e = Variant::new(&q, &k, &v, &p)
            .return_weights()
            .run_blocking(ctx)
            .unwrap_err();
        option_err(e, "weights");
    }
    // No variant takes the softcap or ALiBi (their scores are their own).
    for p in [
        additive(m2(5, 4), m2(5, 4), v1(5), None),
        VariantParams::LowRankV { a: m2(5, 6) },
    ] {
        let capped = Options {
            softcap: Some(5.0),
            ..Options::default()
        };
        option_err(run(&p, capped), "softcap");
        let docs = Options {
            doc_ids: Some(wgpu_attention::DocIds {
                q: vec![0; 8],
                k: vec![0; 6],
            }),
            ..Options::default()
        };
        option_err(run(&p, docs), "doc_ids");
    }
    let nys = VariantParams::Nystrom { landmarks: 2 };
    option_err(
        Variant::new(&q, &k, &v, &nys)
            .pinv_iters(0)
            .run_blocking(ctx)
            .unwrap_err(),
        "pinv_iters",
    );
    let add = additive(m2(5, 4), m2(5, 4), v1(5), None);
    assert!(matches!(
        Variant::new(&q, &k, &v, &add)
            .path(Path::Decode)
            .return_weights()
            .run_blocking(ctx),
        Err(Error::Unsupported { path: "decode", .. })
    ));
    assert!(matches!(
        Variant::new(&q, &k, &v, &add)
            .path(Path::Fused)
            .return_weights()
            .run_blocking(ctx),
        Err(Error::Unsupported { path: "fused", .. })
    ));
}

/// Memory: Nyström and Linformer grow linearly in L = S (doubling the length at most doubles
/// the bytes, plus the fixed parameters), and lowrank-v with r ≪ Ev holds less than the dense
/// V = U A would.
#[test]
fn memory_is_linear_and_low_rank_is_smaller() {
    let Some(ctx) = ctx() else { return };
    let bytes = |n: usize, p: &VariantParams| {
        let empty: &[f32] = &[];
        let t = |shape: [usize; 4]| Tensor::from_slice(empty, &shape);
        Variant::new(t([1, 8, n, 64]), t([1, 8, n, 64]), t([1, 8, n, 64]), p)
            .device_memory(ctx)
            .unwrap()
    };
    for n in [2048, 4096] {
        let nys = VariantParams::Nystrom { landmarks: 64 };
        let lin = |n| VariantParams::Linformer {
            e: VariantParams::segment_means(256, n),
            f: VariantParams::segment_means(256, n),
        };
        let (a, b) = (bytes(n, &nys), bytes(2 * n, &nys));
        assert!(b <= 2 * a && b > a, "nystrom {a} -> {b}");
        let (a, b) = (bytes(n, &lin(n)), bytes(2 * n, &lin(2 * n)));
        assert!(
            b <= 2 * a + 2 * 256 * 4 * 2 * n as u64 && b > a,
            "linformer {a} -> {b}"
        );
    }
    // lowrank-v: U [1, 8, n, 4], A [4, 64] against V [1, 8, n, 64].
    let n = 4096;
    let empty: &[f32] = &[];
    let t = |shape: [usize; 4]| Tensor::from_slice(empty, &shape);
    let low = VariantParams::LowRankV {
        a: Array2::zeros((4, 64)),
    };
    let low_bytes = Variant::new(t([1, 8, n, 64]), t([1, 8, n, 64]), t([1, 8, n, 4]), &low)
        .device_memory(ctx)
        .unwrap();
    let dense = wgpu_attention::Sdpa::new(t([1, 8, n, 64]), t([1, 8, n, 64]), t([1, 8, n, 64]))
        .device_memory(ctx)
        .unwrap();
    assert!(low_bytes < dense, "low rank {low_bytes} vs dense {dense}");
}
