//! The test suite inside a real browser: WebGPU in headless Chromium (Dawn/Tint on SwiftShader in
//! CI), run by `scripts/web.sh test` (wasm-bindgen-test). Every path (fused, decode, unfused),
//! every mask kind and their combination, GQA/MQA, weights and logsumexp, every kernel form the
//! browser's adapter offers, the PyTorch goldens, `merge`, the MHA layer, the caller's buffers
//! and `record`, and the error paths, each checked against the CPU reference computed here in
//! the browser. The cases are the native suite's (`tests/common/cases.rs`, included by path).
//! A missing adapter fails every test: nothing here skips.
#![cfg(target_arch = "wasm32")]

#[path = "../../tests/common/cases.rs"]
mod cases;

mod goldens {
    include!(concat!(env!("OUT_DIR"), "/goldens.rs"));
}

use cases::*;
use ndarray::{s, Array, Array3, Array4, ArrayD, IxDyn};
use wasm_bindgen_test::*;
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::reference::{self, MhaInputs};
use wgpu_attention::{
    Causal, Context, Error, Form, Forms, FusedForm, MhaConfig, MhaWeights, MultiHeadAttention, NeedWeights,
    Options, Path, Sdpa, Storage, Tensor,
};

wasm_bindgen_test_configure!(run_in_browser);

/// A context on the browser's WebGPU adapter; no adapter is a failure.
async fn ctx() -> Context {
    match Context::new().await {
        Ok(c) => c,
        Err(e) => panic!("no WebGPU adapter in this browser: {e}"),
    }
}

fn log(msg: &str) {
    web_sys::console::log_1(&msg.into());
}

/// Run `path` (with weights on the unfused path, and lse) and compare with `want` at the
/// tolerance of the case's storage format (the crate's f32 tolerance for f32).
async fn check_against(case: &Case, want: &reference::Output, ctx: &Context, path: Path, label: &str) {
    let got = case
        .checked_sdpa(path)
        .run(ctx)
        .await
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    case.assert_output(&got, want, path, Tolerance::for_storage(case.storage), label);
}

/// [`check_against`] on every path, against one reference.
async fn check_all_paths(case: &Case, ctx: &Context, label: &str) {
    let want = case.reference();
    for path in Path::ALL {
        check_against(case, &want, ctx, path, &format!("{label} [{path:?}]")).await;
    }
}

#[wasm_bindgen_test]
async fn adapter_is_the_browsers_webgpu_within_default_limits() {
    let ctx = ctx().await;
    let info = ctx.adapter_info();
    assert_eq!(info.backend, wgpu_attention::wgpu::Backend::BrowserWebGpu);
    let l = ctx.limits();
    log(&format!(
        "adapter: {}; {:?}; storage buffers per stage {}, workgroup memory {} B, invocations {}",
        ctx.describe(),
        ctx.caps(),
        l.max_storage_buffers_per_shader_stage,
        l.max_compute_workgroup_storage_size,
        l.max_compute_invocations_per_workgroup
    ));
    // WebGPU guarantees 8 storage buffers per stage; every kernel binds at most that many.
    assert!(l.max_storage_buffers_per_shader_stage >= 8);
}

#[wasm_bindgen_test]
async fn grid_of_shapes_and_masks_on_every_path() {
    let ctx = ctx().await;
    for (si, &shape) in SHAPES.iter().enumerate() {
        for (name, apply) in mask_kinds() {
            let case = apply(Case::random(shape, si as u64));
            check_all_paths(&case, &ctx, &format!("{shape:?} {name}")).await;
        }
    }
}

/// f16 and bf16 storage (packed in u32 words by core WGSL: the browser's adapter has no
/// `shader-f16`) on the grid of shapes, with no mask or every mask kind combined in turn, on
/// every path, against the f64
/// reference on the rounded inputs; odd head dims (atomic half stores); the MHA layer in each
/// format.
#[wasm_bindgen_test]
async fn half_storage_formats_on_every_path() {
    let ctx = ctx().await;
    for (fi, st) in [Storage::F16, Storage::Bf16].into_iter().enumerate() {
        for (si, &shape) in SHAPES.iter().enumerate() {
            // No mask or every kind combined (the bias in the format too), taking turns over
            // the shapes and formats: each format meets every shape once and both mask sets
            // (the half loads and stores do not depend on the mask, nor the masks' code on the
            // format). The kinds one at a time run in f32 here (the grid above) and in every
            // format natively (tests/storage.rs on Vulkan and GL).
            let (name, apply) = mask_kinds()
                .into_iter()
                .find(|(name, _)| {
                    *name
                        == if (si + fi) % 2 == 0 {
                            "none"
                        } else {
                            "all_combined"
                        }
                })
                .expect("the grid's mask kinds include none and all_combined");
            let case = apply(Case::random(shape, si as u64)).with_storage(st);
            check_all_paths(&case, &ctx, &format!("{st} {shape:?} {name}")).await;
        }
        for shape in [(2, 2, 2, 3, 9, 37, 5), (1, 8, 2, 1, 1500, 64, 64)] {
            let case = Case::random(shape, 61)
                .with_causal(Causal::BottomRight)
                .with_random_mask(62)
                .with_random_bias(63)
                .with_storage(st);
            check_all_paths(&case, &ctx, &format!("{st} {shape:?}")).await;
        }
        // The layer: weights, activations and output in the format (twice the tolerance: its
        // intermediates are rounded too).
        let config = MhaConfig::new(48, 6).kv_heads(2);
        let w = MhaWeights::xavier_uniform(config, 7).unwrap().with_storage(st);
        let mut r = rng(8);
        let x: Array3<f32> = rand_array(&mut r, (2, 13, 48)).mapv(|v| st.round(v));
        let opts = Options {
            causal: Causal::TopLeft,
            ..Options::default()
        };
        let want = reference::mha(&w, &MhaInputs::self_attention(x.view()), &opts).unwrap();
        let layer = MultiHeadAttention::new(&ctx, &w).unwrap();
        let got = layer
            .forward(Tensor::from(&x).with_storage(st))
            .options(opts)
            .run(&ctx)
            .await
            .unwrap();
        assert_mha_output(
            &got,
            &want,
            NeedWeights::No,
            twice_storage_tolerance(st),
            &format!("{st} layer"),
        );
    }
}

/// Every fused and decode form the browser's device can run, on shapes with tails and every
/// mask kind combined (the default forms run in every other test).
#[wasm_bindgen_test]
async fn every_kernel_form_the_device_offers() {
    let ctx = ctx().await;
    let caps = ctx.caps();
    let cases: Vec<Case> = [
        (1, 2, 2, 70, 130, 33, 65),
        (2, 4, 2, 65, 63, 64, 64),
        (1, 2, 1, 9, 21, 255, 129),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, shape)| {
        Case::random(shape, 30 + i as u64)
            .with_causal(Causal::BottomRight)
            .with_random_mask(31)
            .with_random_bias(32)
            .with_kv_lens()
    })
    .collect();
    let decode = Case::random((2, 4, 2, 3, 700, 16, 24), 33)
        .with_causal(Causal::BottomRight)
        .with_random_mask(34)
        .with_random_bias(35)
        .with_kv_lens();
    let pinned = caps
        .fused_forms()
        .into_iter()
        .map(|f| (Path::Fused, Forms::from(f), Form::Fused(f)))
        .chain(
            caps.decode_forms()
                .into_iter()
                .map(|f| (Path::Decode, Forms::from(f), Form::Decode(f))),
        );
    // One reference per case for all the forms.
    let cases: Vec<(Case, reference::Output)> = cases
        .into_iter()
        .chain([decode])
        .map(|c| {
            let want = c.reference();
            (c, want)
        })
        .collect();
    for (path, forms, form) in pinned {
        let pinned_ctx = ctx.with_forms(forms);
        let label = format!("{path:?} {form:?}");
        for (case, want) in &cases {
            // The pinned form is the one that runs.
            assert_eq!(
                case.sdpa().path(path).plan(&pinned_ctx).unwrap().form(),
                form,
                "{label}"
            );
            check_against(case, want, &pinned_ctx, path, &label).await;
        }
    }
    // The browser exposes no subgroups to wgpu: the subgroup form is refused, typed.
    if !caps.fused_forms().iter().any(|f| f.needs_subgroups()) {
        let e = cases[0]
            .0
            .sdpa()
            .path(Path::Fused)
            .run(&ctx.with_forms(FusedForm::Subgroup { rows: 1 }))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    }
}

/// A large problem (2.5e8 FLOPs, every mask kind, a zero key length) on the fused path.
#[wasm_bindgen_test]
async fn large_case_with_every_mask_on_the_fused_path() {
    let ctx = ctx().await;
    let case = Case::large();
    let want = case.reference();
    let t = web_sys::window().unwrap().performance().unwrap();
    let t0 = t.now();
    check_against(&case, &want, &ctx, Path::Fused, "large fused").await;
    log(&format!(
        "large fused: {:.0} ms, plan {:?}",
        t.now() - t0,
        case.sdpa().plan(&ctx).unwrap()
    ));
}

#[wasm_bindgen_test]
async fn decode_shapes_on_every_path() {
    let ctx = ctx().await;
    let base = Case::random((2, 4, 2, 3, 1500, 16, 24), 15);
    assert_eq!(base.sdpa().resolved_path(&ctx).unwrap(), Path::Decode);
    check_all_paths(&base, &ctx, "decode plain").await;
    let one = Case::random((1, 8, 1, 1, 777, 64, 64), 19).with_causal(Causal::TopLeft);
    check_all_paths(&one, &ctx, "decode L=1 top-left (one key)").await;
}

/// Sliding windows (two-sided with sink tokens; one-sided with bottom-right causal, a mask and
/// key lengths) on every path, on a shape with tails and L != S and on a decode shape.
#[wasm_bindgen_test]
async fn sliding_windows_on_every_path() {
    let ctx = ctx().await;
    for (name, kind) in window_kinds() {
        for (si, shape) in [(1, 2, 2, 70, 130, 33, 65), (2, 4, 2, 3, 700, 16, 24)]
            .into_iter()
            .enumerate()
        {
            let case = kind(Case::random(shape, 80 + si as u64));
            check_all_paths(&case, &ctx, &format!("{shape:?} {name}")).await;
        }
    }
}

#[wasm_bindgen_test]
async fn softcap_alibi_and_sinks_on_every_path() {
    let ctx = ctx().await;
    // The kind that combines them all (with a window, sink tokens, a mask and a bias; the
    // native suites run each alone): CI time.
    // One shape with tails (the decode forms' modifier code is the fused forms', and the
    // native suites run the decode shapes): CI time.
    for (name, kind) in modifier_kinds().into_iter().skip(2) {
        let shape = (1, 2, 2, 70, 130, 33, 65);
        let case = kind(Case::random(shape, 90));
        check_all_paths(&case, &ctx, &format!("{shape:?} {name}")).await;
    }
    // User WGSL (naga on the host in wasm, Tint in the browser): the captured relative-position
    // bias on the tiles shape, the mask_mod with packed documents on the decode shape.
    let shapes = [(1, 2, 2, 70, 130, 33, 65), (2, 4, 2, 3, 700, 16, 24)];
    for ((name, kind), shape) in user_kinds().into_iter().zip(shapes) {
        let case = kind(Case::random(shape, 95));
        check_all_paths(&case, &ctx, &format!("{shape:?} {name}")).await;
    }
}

/// The backward through user functions in the browser: the score_mod with its derivatives in
/// s and in the captures (the capture-gradient kernel on Tint), by FlashAttention's rule.
#[wasm_bindgen_test]
async fn backward_through_user_functions_with_capture_gradients() {
    let ctx = ctx().await;
    let (name, kind) = user_kinds()[0];
    let case = kind(Case::random((1, 2, 2, 19, 27, 8, 8), 96));
    let dout = Array4::from_shape_fn((1, 2, 19, 8), |(b, h, i, j)| {
        ((b + 3 * h + 5 * i + 7 * j) % 13) as f32 / 6.0 - 1.0
    });
    let g = case
        .sdpa()
        .backward(&dout)
        .run(&ctx)
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let opts = case.options();
    let (q, k, v) = (case.q.view(), case.k.view(), case.v.view());
    let r64 = reference::sdpa_backward(q, k, v, dout.view(), &opts).unwrap();
    let r32 = reference::sdpa_backward_f32(q, k, v, dout.view(), &opts).unwrap();
    let (got, want, plain) = (
        g.dcaptures.expect("the captures' gradients"),
        r64.dcaptures.unwrap(),
        r32.dcaptures.unwrap(),
    );
    let mut all = vec![
        (
            "dq",
            g.dq.iter().copied().collect::<Vec<f32>>(),
            r64.dq.iter().copied().collect::<Vec<f64>>(),
            r32.dq.iter().copied().collect::<Vec<f32>>(),
        ),
        (
            "dk",
            g.dk.iter().copied().collect(),
            r64.dk.iter().copied().collect(),
            r32.dk.iter().copied().collect(),
        ),
    ];
    for (k, ((a, b), c)) in got.iter().zip(&want).zip(&plain).enumerate() {
        let n = if k == 0 { "d(rel)" } else { "d(head_scale)" };
        all.push((n, a.to_vec(), b.to_vec(), c.to_vec()));
    }
    for (n, a, b, c) in all {
        let report = wgpu_attention::check::flash_rule(a, b, c);
        assert!(report.passed(), "{name} {n}: {report}");
    }
}

#[wasm_bindgen_test]
async fn head_dims_up_to_256_on_every_path() {
    let ctx = ctx().await;
    for (i, (e, ev)) in [(256, 256), (255, 129), (1, 256)].into_iter().enumerate() {
        let case = Case::random((1, 2, 1, 9, 21, e, ev), 40 + i as u64)
            .with_causal(Causal::BottomRight)
            .with_random_mask(41)
            .with_random_bias(42);
        assert_eq!(
            case.sdpa().resolved_path(&ctx).unwrap(),
            Path::Fused,
            "E {e}, Ev {ev}"
        );
        check_all_paths(&case, &ctx, &format!("E {e}, Ev {ev}")).await;
    }
}

#[wasm_bindgen_test]
async fn fully_masked_rows_are_zero_with_minus_inf_lse() {
    let ctx = ctx().await;
    let case = Case::random((2, 2, 2, 9, 11, 8, 8), 1).with_random_mask(3);
    for path in Path::ALL {
        let out = case.sdpa().path(path).return_lse().run(&ctx).await.unwrap();
        for b in 0..2 {
            for h in 0..2 {
                for i in [0, 4] {
                    assert!(
                        out.output.slice(s![b, h, i, ..]).iter().all(|&x| x == 0.0),
                        "{path:?}"
                    );
                    assert_eq!(
                        out.lse.as_ref().unwrap()[[b, h, i]],
                        f32::NEG_INFINITY,
                        "{path:?}"
                    );
                }
            }
        }
        assert!(out.output.iter().all(|x| x.is_finite()), "{path:?}");
    }
    let mut zero = Case::random((2, 2, 2, 5, 7, 4, 4), 3);
    zero.kv_lens = Some(vec![0, 7]);
    check_all_paths(&zero, &ctx, "kv_len 0").await;
}

#[wasm_bindgen_test]
async fn mask_and_bias_broadcasts_and_minus_inf_bias() {
    let ctx = ctx().await;
    for (name, case) in broadcast_cases() {
        check_all_paths(&case, &ctx, &name).await;
    }
    let mut case = Case::random((1, 1, 1, 4, 5, 4, 4), 6);
    let mut bias = Array::zeros(IxDyn(&[4, 5]));
    bias[[0, 1]] = f32::NEG_INFINITY;
    bias.slice_mut(s![2, ..]).fill(f32::NEG_INFINITY);
    case.bias = Some(bias);
    check_all_paths(&case, &ctx, "-inf bias").await;
}

/// Logits near ±1e4, exact in f32: the max subtraction keeps every value finite.
#[wasm_bindgen_test]
async fn large_magnitude_logits_stay_finite() {
    let ctx = ctx().await;
    let ints = |shape: (usize, usize, usize, usize), seed: u64| {
        Array4::from_shape_fn(shape, |(a, b, c, d)| {
            ((a * 5 + b * 7 + c * 3 + d + seed as usize) % 7) as f32 - 3.0
        })
    };
    for offset in [1.0e4f32, -1.0e4] {
        let case = Case {
            q: ints((1, 2, 9, 16), 1),
            k: ints((1, 2, 13, 16), 2),
            v: ints((1, 2, 13, 8), 3),
            mask: None,
            bias: Some(Array::from_elem(IxDyn(&[1]), offset)),
            kv_lens: None,
            causal: Causal::None,
            window: None,
            sink_tokens: 0,
            softcap: None,
            alibi: None,
            sink_logits: None,
            doc_ids: None,
            user_mod: None,
            scale: Some(1.0),
            storage: wgpu_attention::Storage::F32,
        };
        check_all_paths(&case, &ctx, &format!("logits around {offset}")).await;
    }
}

#[wasm_bindgen_test]
async fn pytorch_goldens_on_every_path() {
    let ctx = ctx().await;
    // Every fixture directory is embedded (web/build.rs); 19 when this was written.
    assert!(
        goldens::GOLDENS.len() >= 19,
        "embedded goldens: {}",
        goldens::GOLDENS.len()
    );
    for (name, files) in goldens::GOLDENS {
        let g = golden(name, |f| {
            files.iter().find(|(n, _)| *n == f).map(|(_, b)| b.to_vec())
        });
        for path in Path::ALL {
            let got = g
                .case
                .checked_sdpa(path)
                .run(&ctx)
                .await
                .unwrap_or_else(|e| panic!("{name} {path:?}: {e}"));
            g.assert_matches(&got, path, g.tolerance(), &format!("{path:?}"));
        }
    }
}

/// Two halves of the keys attended separately and merged on the GPU equal the whole; an empty
/// part contributes nothing; shapes are checked.
#[wasm_bindgen_test]
async fn merge_of_disjoint_key_halves_is_the_whole() {
    let ctx = ctx().await;
    let case = Case::random((1, 2, 2, 7, 30, 8, 5), 20).with_causal(Causal::BottomRight);
    let want = case.reference();
    let half = |a: &Array4<f32>, first: bool| {
        if first {
            a.slice(s![.., .., ..13, ..]).to_owned()
        } else {
            a.slice(s![.., .., 13.., ..]).to_owned()
        }
    };
    let (k1, v1, k2, v2) = (
        half(&case.k, true),
        half(&case.v, true),
        half(&case.k, false),
        half(&case.v, false),
    );
    // Bottom-right causal over the whole keys: the first half is fully visible to every row that
    // sees any key of the second half, so each part is attended with its own visibility mask.
    let (l, s_all) = (7usize, 30usize);
    let part_mask =
        |lo: usize, hi: usize| ArrayD::from_shape_fn(IxDyn(&[l, hi - lo]), |i| lo + i[1] <= i[0] + s_all - l);
    let (m1, m2) = (part_mask(0, 13), part_mask(13, 30));
    let a = Sdpa::new(&case.q, &k1, &v1)
        .mask(&m1)
        .return_lse()
        .run(&ctx)
        .await
        .unwrap();
    let b = Sdpa::new(&case.q, &k2, &v2)
        .mask(&m2)
        .return_lse()
        .run(&ctx)
        .await
        .unwrap();
    let (o, lse) = wgpu_attention::merge(
        &ctx,
        &a.output,
        a.lse.as_ref().unwrap(),
        &b.output,
        b.lse.as_ref().unwrap(),
    )
    .await
    .unwrap();
    assert_report(
        compare(o.iter().copied(), want.out.iter().copied(), TOL),
        "merged output",
    );
    assert_report(
        compare(lse.iter().copied(), want.lse.iter().copied(), TOL),
        "merged lse",
    );
    let empty_o = Array4::<f32>::zeros(a.output.dim());
    let empty_lse = Array3::from_elem(a.lse.as_ref().unwrap().dim(), f32::NEG_INFINITY);
    let (o, lse) = wgpu_attention::merge(&ctx, &a.output, a.lse.as_ref().unwrap(), &empty_o, &empty_lse)
        .await
        .unwrap();
    assert_report(
        compare(o.iter().copied(), a.output.iter().copied(), TOL),
        "merge with empty",
    );
    assert_report(
        compare(lse.iter().copied(), a.lse.as_ref().unwrap().iter().copied(), TOL),
        "lse with empty",
    );
    let bad = Array3::<f32>::zeros((1, 2, 6));
    let e = wgpu_attention::merge(&ctx, &a.output, &bad, &b.output, &bad)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
}

/// The multi-head attention layer against the f64 reference: self-attention with biases,
/// cross-attention with kdim/vdim != d_model, GQA and MQA, every mask kind, weights per head
/// and averaged.
#[wasm_bindgen_test]
async fn mha_layer_matches_reference() {
    let ctx = ctx().await;
    let configs = [
        (MhaConfig::new(32, 4), false),
        (MhaConfig::new(48, 6).kv_heads(2), true),
        (MhaConfig::new(40, 4).kv_heads(1), false),
        (MhaConfig::new(36, 3).kv_dims(20, 28), true),
    ];
    for (ci, (config, cross)) in configs.into_iter().enumerate() {
        let mut r = rng(200 + ci as u64);
        let w = MhaWeights::xavier_uniform(config, 300 + ci as u64).unwrap();
        let (b, l, s) = if cross { (2, 19, 37) } else { (2, 23, 23) };
        let x: Array3<f32> = rand_array(&mut r, (b, l, config.d_model));
        let k: Array3<f32> = rand_array(&mut r, (b, s, config.kdim));
        let v: Array3<f32> = rand_array(&mut r, (b, s, config.vdim));
        let mut mask = ArrayD::from_shape_fn(IxDyn(&[b, 1, l, s]), |i| (i[2] * 7 + i[3] * 3 + i[0]) % 5 != 0);
        mask.slice_mut(s![0, 0, l / 2, ..]).fill(false);
        let bias: ArrayD<f32> = rand_array(&mut r, IxDyn(&[1, config.num_heads, l, s]));
        let lens = vec![s / 2 + 1, 0];
        for (variant, weights) in [
            ("plain", NeedWeights::No),
            ("causal + lens", NeedWeights::Averaged),
            ("every mask", NeedWeights::PerHead),
        ] {
            let mut opts = Options::default();
            if variant != "plain" {
                opts.causal = Causal::BottomRight;
                opts.kv_lens = Some(lens.clone());
            }
            if variant == "every mask" {
                opts.mask = Some((&mask).into());
                opts.bias = Some((&bias).into());
            }
            let inputs = if cross {
                MhaInputs::cross(x.view(), k.view(), v.view())
            } else {
                MhaInputs::self_attention(x.view())
            };
            let want = reference::mha(&w, &inputs, &opts).unwrap();
            let layer = MultiHeadAttention::new(&ctx, &w).unwrap();
            let mut f = layer.forward(&x).options(opts.clone()).need_weights(weights);
            if cross {
                f = f.key_value(&k, &v);
            }
            let label = format!("{config:?} cross {cross} {variant}");
            let got = f.run(&ctx).await.unwrap_or_else(|e| panic!("{label}: {e}"));
            assert_mha_output(&got, &want, weights, TOL, &label);
        }
    }
}

/// The caller's buffers in and out, and `record` into the caller's encoder.
#[wasm_bindgen_test]
async fn caller_buffers_and_record() {
    use wgpu_attention::wgpu::{self, util::DeviceExt};
    let ctx = ctx().await;
    let case = Case::random((1, 2, 2, 10, 12, 8, 6), 12).with_causal(Causal::TopLeft);
    let want = case.reference();
    let dev = ctx.device();
    let upload = |a: &Array4<f32>| {
        dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("caller input"),
            contents: bytemuck::cast_slice(a.as_slice().unwrap()),
            usage: wgpu::BufferUsages::STORAGE,
        })
    };
    let (qb, kb, vb) = (upload(&case.q), upload(&case.k), upload(&case.v));
    let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
    let out_buf = dev.create_buffer(&wgpu::BufferDescriptor {
        label: Some("caller output"),
        size: align + 2 * 10 * 6 * 4,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    for path in Path::ALL {
        let got = Sdpa::new(
            Tensor::from_buffer(&qb, wgpu_attention::Storage::F32, &[1, 2, 10, 8]),
            Tensor::from_buffer(&kb, wgpu_attention::Storage::F32, &[1, 2, 12, 8]),
            Tensor::from_buffer(&vb, wgpu_attention::Storage::F32, &[1, 2, 12, 6]),
        )
        .causal(Causal::TopLeft)
        .path(path)
        .output_into(
            Tensor::from_buffer(&out_buf, wgpu_attention::Storage::F32, &[1, 2, 10, 6]).at_offset(align),
        )
        .run(&ctx)
        .await
        .unwrap();
        assert_report(
            compare(got.output.iter().copied(), want.out.iter().copied(), TOL),
            &format!("caller buffers {path:?}"),
        );
        let back = ctx.read_f32(&out_buf, align, 2 * 10 * 6 * 4).await.unwrap();
        assert_report(
            compare(back.iter().copied(), want.out.iter().copied(), TOL),
            "output buffer",
        );
    }
    let mut enc = dev.create_command_encoder(&Default::default());
    let gpu = case.sdpa().record(&ctx, &mut enc).unwrap();
    ctx.queue().submit([enc.finish()]);
    let v = ctx
        .read_f32(&gpu.output, gpu.output_offset, 2 * 10 * 6 * 4)
        .await
        .unwrap();
    assert_report(
        compare(v.iter().copied(), want.out.iter().copied(), TOL),
        "record",
    );
}

/// Bad input is a typed error before any GPU work; a device error from the browser (a destroyed
/// buffer) comes back as the crate's typed error, and the context stays usable.
#[wasm_bindgen_test]
async fn errors_are_typed() {
    let ctx = ctx().await;
    let q = Array4::<f32>::zeros((1, 4, 5, 8));
    let k = Array4::<f32>::zeros((1, 3, 6, 8));
    let v = Array4::<f32>::zeros((1, 3, 6, 8));
    let e = Sdpa::new(&q, &k, &v).run(&ctx).await.unwrap_err();
    assert!(matches!(e, Error::HeadsNotDivisible { .. }), "{e}");
    let k2 = Array4::<f32>::zeros((1, 4, 6, 7));
    let e = Sdpa::new(&q, &k2, &k2).run(&ctx).await.unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let k4 = Array4::<f32>::zeros((1, 4, 6, 8));
    let bad_mask = ArrayD::from_elem(IxDyn(&[3, 6]), true);
    let e = Sdpa::new(&q, &k4, &k4)
        .mask(&bad_mask)
        .run(&ctx)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotBroadcastable { .. }), "{e}");
    let e = Sdpa::new(&q, &k4, &k4).kv_lens(&[7]).run(&ctx).await.unwrap_err();
    assert!(matches!(e, Error::KvLenOutOfRange { .. }), "{e}");
    let e = Sdpa::new(&q, &k4, &k4)
        .path(Path::Fused)
        .return_weights()
        .run(&ctx)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { path: "fused", .. }), "{e}");
    let data = [0f32; 10];
    let e = Sdpa::new(Tensor::from_slice(&data, &[1, 4, 5, 8]), &k4, &k4)
        .run(&ctx)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::DataLength { .. }), "{e}");

    use wgpu_attention::wgpu::{self, util::DeviceExt};
    let buf = ctx
        .device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: &[0u8; 48],
            usage: wgpu::BufferUsages::STORAGE,
        });
    buf.destroy();
    let kk = Array4::<f32>::zeros((1, 1, 3, 4));
    let e = Sdpa::new(
        Tensor::from_buffer(&buf, wgpu_attention::Storage::F32, &[1, 1, 3, 4]),
        &kk,
        &kk,
    )
    .run(&ctx)
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Validation(_)), "{e}");
    let case = Case::random((1, 1, 1, 2, 3, 2, 2), 2);
    check_all_paths(&case, &ctx, "after a device error").await;
}

/// A device lost mid-session (destroyed here) gives typed errors, never a panic or a hang, and
/// a new context works again.
#[wasm_bindgen_test]
async fn lost_device_is_a_typed_error_and_a_new_context_works() {
    let ctx = ctx().await;
    let case = Case::random((1, 2, 2, 5, 9, 8, 8), 50);
    check_all_paths(&case, &ctx, "before the loss").await;
    ctx.device().destroy();
    let first = case.sdpa().run(&ctx).await;
    assert!(first.is_err(), "a call on a destroyed device must fail");
    let e = case.sdpa().run(&ctx).await.unwrap_err();
    assert!(matches!(e, Error::DeviceLost(_)), "{e}");
    let again = Context::new().await.expect("a new context after a lost device");
    check_all_paths(&case, &again, "after the loss, new context").await;
}

/// A NaN input makes its row NaN on every path (no mask: docs/semantics.md notes where a compiler may
/// fold NaN away under masks) and leaves the other rows finite; nothing crashes or hangs.
#[wasm_bindgen_test]
async fn nan_input_propagates_on_every_path() {
    let ctx = ctx().await;
    let mut case = Case::random((1, 1, 1, 3, 4, 2, 2), 11);
    case.q[[0, 0, 1, 0]] = f32::NAN;
    for path in Path::ALL {
        let out = case.sdpa().path(path).run(&ctx).await.unwrap();
        assert!(
            out.output.slice(s![0, 0, 1, ..]).iter().all(|x| x.is_nan()),
            "{path:?}"
        );
        for row in [0, 2] {
            assert!(
                out.output.slice(s![0, 0, row, ..]).iter().all(|x| x.is_finite()),
                "{path:?}"
            );
        }
    }
}

/// Paged KV caches in the browser: `Sdpa::paged` (decode and a prefill chunk, GQA, causal with
/// a window and ALiBi, RoPE on q) on the fused and decode paths against the reference on the
/// contiguous keys, and a ragged batch in one `PagedAttention` call against its reference.
#[wasm_bindgen_test]
async fn paged_caches_ragged_batches_rope_and_shared_prefixes() {
    let ctx = ctx().await;
    paged_calls(&ctx).await;
    ragged_batch(&ctx).await;
    shared_prefix(&ctx).await;
}

/// The RoPE of the ragged batch and the shared prefix.
const PAGED_ROPE: wgpu_attention::Rope = wgpu_attention::Rope {
    style: wgpu_attention::RopeStyle::HalfSplit,
    theta: 1e4,
    dim: None,
};

/// A paged call's output and logsumexp against its reference at f32's tolerance.
fn assert_paged(got: &wgpu_attention::PagedOutput, want: &wgpu_attention::PagedOutput, label: &str) {
    let tol = Tolerance::for_storage(Storage::F32);
    let r = compare(
        got.output.iter().copied(),
        want.output.iter().map(|&x| x as f64),
        tol,
    );
    assert!(r.passed(), "{label} output: {r}");
    let r = compare(got.lse.iter().copied(), want.lse.iter().map(|&x| x as f64), tol);
    assert!(r.passed(), "{label} lse: {r}");
}

/// `Sdpa::paged` (decode and a prefill chunk, GQA, causal with a window and ALiBi) on the fused
/// and decode paths against the reference on the contiguous keys.
async fn paged_calls(ctx: &Context) {
    for (shape, block) in [((3, 4, 2, 1, 77, 32, 32), 16), ((2, 2, 1, 5, 40, 16, 24), 3)] {
        let mut case = Case::random(shape, 130)
            .with_causal(Causal::BottomRight)
            .with_window(9, 0, 2)
            .with_alibi();
        case.kv_lens = Some(seq_lens(&case));
        let want = case.reference();
        let pg = page(&case, case.kv_lens.as_ref().unwrap(), block, 131);
        let mut options = case.options();
        options.kv_lens = None;
        for path in [Path::Fused, Path::Decode] {
            let pages = wgpu_attention::Pages::new(&pg.k, &pg.v, wgpu_attention::PagedLayout::TokenMajor);
            let got = Sdpa::paged(Tensor::from(&case.q), pages, &pg.table, &pg.lens)
                .options(options.clone())
                .path(path)
                .return_lse()
                .run(ctx)
                .await
                .unwrap_or_else(|e| panic!("paged {shape:?} {path:?}: {e}"));
            case.assert_output(
                &got,
                &want,
                path,
                Tolerance::for_storage(case.storage),
                &format!("paged {shape:?} [{path:?}]"),
            );
        }
    }
}

/// A ragged batch with RoPE in one `PagedAttention` call (the caches hold rotated keys; the
/// reference rotates q).
async fn ragged_batch(ctx: &Context) {
    use wgpu_attention::PagedAttention;
    let q_lens = [4usize, 1, 2];
    let lens = [30usize, 9, 17];
    let case = Case::random((3, 4, 2, 1, 30, 16, 16), 132);
    let pg = page(&case, &lens, 8, 133);
    let q: Array3<f32> = rand_array(&mut rng(134), (7, 4, 16));
    let pages = wgpu_attention::Pages::new(&pg.k, &pg.v, wgpu_attention::PagedLayout::TokenMajor);
    let call = PagedAttention::new(&q, &q_lens, pages, &pg.table, &lens)
        .causal(Causal::BottomRight)
        .rope(PAGED_ROPE);
    let want = call.reference().unwrap();
    for path in [Path::Auto, Path::Fused, Path::Decode] {
        let got = call
            .clone()
            .path(path)
            .run(ctx)
            .await
            .unwrap_or_else(|e| panic!("ragged {path:?}: {e}"));
        assert_paged(&got, &want, &format!("ragged [{path:?}]"));
    }
}

/// Three forks sharing 20 blocks of 16 keys, read once (cascade) with RoPE and causal.
async fn shared_prefix(ctx: &Context) {
    use wgpu_attention::PagedAttention;
    let (bs, hkv, e) = (16, 2, 16);
    let lens = [330usize, 325, 340];
    let q_lens = [1usize, 2, 1];
    let mb = 22;
    let mut table = vec![-1i32; 3 * mb];
    let mut next = 20;
    for (s, &l) in lens.iter().enumerate() {
        for blk in 0..l.div_ceil(bs) {
            table[s * mb + blk] = if blk < 20 {
                blk as i32
            } else {
                next += 1;
                next - 1
            };
        }
    }
    let mut r = rng(135);
    let k: Array4<f32> = rand_array(&mut r, (next as usize, bs, hkv, e));
    let v: Array4<f32> = rand_array(&mut r, (next as usize, bs, hkv, e));
    let q: Array3<f32> = rand_array(&mut r, (4, 4, e));
    let pages = wgpu_attention::Pages::new(&k, &v, wgpu_attention::PagedLayout::TokenMajor);
    let call = PagedAttention::new(&q, &q_lens, pages, &table, &lens)
        .causal(Causal::BottomRight)
        .softcap(0.9)
        .rope(PAGED_ROPE);
    assert_eq!(call.shared_prefixes().unwrap().len(), 1);
    let want = call.reference().unwrap();
    for path in [Path::Fused, Path::Decode] {
        let got = call
            .clone()
            .path(path)
            .run(ctx)
            .await
            .unwrap_or_else(|e| panic!("shared prefix {path:?}: {e}"));
        assert_paged(&got, &want, &format!("shared prefix [{path:?}]"));
    }
}

/// 8-bit K/V caches in the browser: int8 K with fp8 V (and the reverse) contiguous on the fused
/// and decode paths, paged token-major int8 through `Sdpa::paged`, and a `KvCache` that
/// quantises as it appends; each against the reference over the values the codes stand for.
/// The scales bind two more storage buffers: WebGPU adapters offer 10 per stage where the
/// hardware allows (SwiftShader's here), 8 by default, where the calls are a typed error.
#[wasm_bindgen_test]
async fn eight_bit_caches() {
    use wgpu_attention::quant;
    let ctx = ctx().await;
    let limit = ctx.limits().max_storage_buffers_per_shader_stage;
    log(&format!("storage buffers per stage: {limit}"));
    assert!(
        limit >= 10,
        "the browser's adapter offers {limit} storage buffers per stage; 8-bit caches bind 10"
    );
    let case = Case::random((2, 4, 2, 3, 45, 32, 16), 140).with_causal(Causal::BottomRight);
    let (b, hkv, s, e) = case.k.dim();
    let ev = case.v.dim().3;
    let (kc, ks) = quant::quantize_int8(case.k.as_slice().unwrap(), e);
    let vs = vec![0.01f32, 0.02];
    let vc = quant::quantize_fp8_heads(case.v.as_slice().unwrap(), ev, &[b, hkv, s], 1, &vs);
    let mut deq = case.clone();
    deq.k = Array4::from_shape_vec((b, hkv, s, e), quant::dequantize_int8(&kc, &ks, e)).unwrap();
    deq.v = Array4::from_shape_vec(
        (b, hkv, s, ev),
        quant::dequantize_fp8_heads(&vc, ev, &[b, hkv, s], 1, &vs),
    )
    .unwrap();
    let want = deq.reference();
    for path in [Path::Fused, Path::Decode] {
        let k = Tensor::from_slice(&kc, &[b, hkv, s, e]).with_scales(Tensor::from_slice(&ks, &[b, hkv, s]));
        let v = Tensor::from_slice(&vc, &[b, hkv, s, ev]).with_scales(Tensor::from_slice(&vs, &[hkv]));
        let got = Sdpa::new(&case.q, k, v)
            .options(deq.options())
            .path(path)
            .return_lse()
            .run(&ctx)
            .await
            .unwrap_or_else(|e| panic!("8-bit {path:?}: {e}"));
        deq.assert_output(
            &got,
            &want,
            path,
            Tolerance::for_storage(Storage::F32),
            &format!("int8 k, fp8 v [{path:?}]"),
        );
    }
    eight_bit_kv_cache(&ctx).await;
}

/// A `KvCache` with int8 K and fp8 V: 5 tokens appended (quantised on the GPU), then the
/// attention of 5 queries over them against the reference over the host rule's values.
async fn eight_bit_kv_cache(ctx: &Context) {
    use wgpu_attention::quant;
    let mut cache = wgpu_attention::KvCache::new(
        ctx,
        wgpu_attention::KvCacheConfig {
            layers: 1,
            kv_heads: 2,
            head_dim: 16,
            head_dim_v: 16,
            block_size: 4,
            num_blocks: 8,
            storage: Storage::Int8,
            v_storage: Some(Storage::Fp8),
            rope: None,
        },
    )
    .unwrap();
    cache.set_scales(ctx, 0, None, Some(&[0.01, 0.005])).unwrap();
    let seq = cache.add_sequence();
    let step = cache.reserve(&[(seq, 5)]).unwrap();
    let mut r = rng(141);
    let k: Array3<f32> = rand_array(&mut r, (5, 2, 16));
    let v: Array3<f32> = rand_array(&mut r, (5, 2, 16));
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    cache
        .append(ctx, &mut enc, &step, 0, &Tensor::from(&k), &Tensor::from(&v))
        .unwrap();
    ctx.queue().submit([enc.finish()]);
    let q: Array4<f32> = rand_array(&mut r, (1, 4, 5, 16));
    let got = cache
        .attention(&step, 0, Tensor::from(&q))
        .unwrap()
        .run(ctx)
        .await
        .unwrap();
    // The reference over the host's rule (no rounding ties in these random values).
    let (kc, ks) = quant::quantize_int8(k.as_slice().unwrap(), 16);
    let kd = quant::dequantize_int8(&kc, &ks, 16);
    let vs = [0.01f32, 0.005];
    let vc = quant::quantize_fp8_heads(v.as_slice().unwrap(), 16, &[5, 2], 1, &vs);
    let vd = quant::dequantize_fp8_heads(&vc, 16, &[5, 2], 1, &vs);
    let to4 = |x: Vec<f32>| {
        Array3::from_shape_vec((5, 2, 16), x)
            .unwrap()
            .permuted_axes([1, 0, 2])
            .insert_axis(ndarray::Axis(0))
            .as_standard_layout()
            .to_owned()
    };
    let opts = wgpu_attention::Options {
        causal: Causal::BottomRight,
        ..Default::default()
    };
    let want = reference::sdpa(q.view(), to4(kd).view(), to4(vd).view(), &opts).unwrap();
    let r = compare(
        got.output.iter().copied(),
        want.out.iter().copied(),
        Tolerance::for_storage(Storage::F32),
    );
    assert!(r.passed(), "KvCache int8/fp8: {r}");
}
