//! The multi-head attention layer's gradients on the GPU (`MhaForward::backward`) against the
//! f64 reference (`reference::mha_backward`, itself checked by finite differences in the
//! crate and against PyTorch autograd below), by FlashAttention's rule (at most twice the
//! plain f32 implementation's error, plus 1e-5·max|ref| + 1e-6): self- and cross-attention,
//! kdim/vdim != d_model, GQA/MQA, no biases, every mask kind with fully masked rows, both
//! attention paths, given query/value heads (broadcast or per batch), half formats, GPU
//! buffer inputs, and typed errors.

mod common;

use std::path::Path as FsPath;

use common::*;
use ndarray::Array3;
use ndarray_npy::read_npy;
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::reference::{self, MhaInputs};
use wgpu_attention::{
    Causal, Context, Error, MhaConfig, MhaGrads, MhaWeights, MultiHeadAttention, NeedWeights, Options, Path,
    Storage, Tensor,
};

/// Every gradient of `g`, named, flattened to f64 (`None` where absent).
fn named<F: Copy + Into<f64>>(g: &MhaGrads<F>) -> Vec<(&'static str, Option<Vec<f64>>)> {
    fn flat<F: Copy + Into<f64>, D: ndarray::Dimension>(a: &ndarray::Array<F, D>) -> Vec<f64> {
        a.iter().map(|&x| x.into()).collect()
    }
    vec![
        ("output", Some(flat(&g.output))),
        ("query", Some(flat(&g.query))),
        ("key", g.key.as_ref().map(flat)),
        ("value", g.value.as_ref().map(flat)),
        ("query_heads", g.query_heads.as_ref().map(flat)),
        ("key_heads", g.key_heads.as_ref().map(flat)),
        ("value_heads", g.value_heads.as_ref().map(flat)),
        ("w_q", Some(flat(&g.w_q))),
        ("w_k", Some(flat(&g.w_k))),
        ("w_v", Some(flat(&g.w_v))),
        ("w_o", Some(flat(&g.w_o))),
        ("b_q", g.b_q.as_ref().map(flat)),
        ("b_k", g.b_k.as_ref().map(flat)),
        ("b_v", g.b_v.as_ref().map(flat)),
        ("b_o", g.b_o.as_ref().map(flat)),
        ("dsink", g.dsink.as_ref().map(flat)),
        (
            "dcaptures",
            g.dcaptures.as_ref().map(|d| d.iter().flat_map(flat).collect()),
        ),
    ]
}

/// Every gradient of `got` against the f64 reference `want`: by FlashAttention's rule with
/// the plain f32 `plain` in f32; in a half format, four times the format's rounding of the
/// layer's largest gradient (the layer rounds its projections, heads and head gradients to
/// the format, and a bias gradient, a sum of rounded head gradients, may be near 0).
fn assert_grads(got: &MhaGrads<f32>, want: &MhaGrads<f64>, plain: &MhaGrads<f32>, st: Storage, label: &str) {
    let largest = named(want)
        .into_iter()
        .skip(1)
        .flat_map(|(_, v)| v.unwrap_or_default())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    let mut compared = 0;
    for (((name, got), (_, want)), (_, plain)) in named(got).into_iter().zip(named(want)).zip(named(plain)) {
        let (got, want, plain) = match (got, want, plain) {
            (Some(g), Some(w), Some(p)) => (g, w, p),
            (None, None, None) => continue,
            (g, w, _) => panic!(
                "{label}: {name} present on the GPU: {}, in the reference: {}",
                g.is_some(),
                w.is_some()
            ),
        };
        assert_eq!(got.len(), want.len(), "{label}: {name} length");
        let report = gradient_report(&got, &want, &plain, st, 4.0 * largest);
        assert!(report.passed(), "{label}: {name}: {report}");
        compared += 1;
    }
    // At least the output, the query input and the four projection weights.
    assert!(compared >= 6, "{label}: {compared} gradients compared");
}

/// The upstream gradient of a case, in its format.
fn dout_for(case: &MhaCase, seed: u64) -> Array3<f32> {
    let g = &case.grid;
    rand_array(&mut rng(seed), (g.b, g.l, g.config.d_model)).mapv(|x| case.storage.round(x))
}

/// Run the layer's backward on `path` and check every gradient against the reference.
fn check_case(ctx: &Context, case: &MhaCase, path: Path) {
    let label = format!("{} {path:?}", case.label());
    let dout = dout_for(case, 77);
    let layer = MultiHeadAttention::new(ctx, &case.w).unwrap();
    let got = case
        .forward(&layer)
        .path(path)
        .backward(Tensor::from(&dout).with_storage(case.storage))
        .run_blocking(ctx)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let (inputs, opts) = (case.inputs(), case.options());
    let want = reference::mha_backward(&case.w, &inputs, &opts, dout.view()).unwrap();
    let plain = reference::mha_backward_f32(&case.w, &inputs, &opts, dout.view()).unwrap();
    assert_grads(&got, &want, &plain, case.storage, &label);
}

/// Sink logits and a user score_mod with a captured relative-position bias through the layer's
/// backward: d(sink logits) and d(rel) with every other gradient, by FlashAttention's rule.
#[test]
fn sink_logits_and_capture_gradients() {
    let Some(ctx) = ctx() else { return };
    let case = MhaCase::random(
        grid(MhaConfig::new(48, 6).kv_heads(2), (2, 13, 13), false),
        910,
        Storage::F32,
    );
    let sinks: Vec<f32> = (0..6).map(|h| 0.3 * h as f32 - 0.5).collect();
    let table: Vec<f32> = (0..6 * 9).map(|t| ((t * 7) % 11) as f32 * 0.1 - 0.5).collect();
    let bucket = "clamp(i32(j) - i32(i), -4, 4) + 4";
    let src = format!(
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {{ return s + rel(h * 9u + u32({bucket})); }}\n\
         fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {{ return 1.0; }}\n\
         fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) {{ d_rel(h * 9u + u32({bucket}), g); }}"
    );
    let m = wgpu_attention::UserMod::wgsl(&src)
        .capture("rel", &table)
        .cpu_score(|s, [_, h, i, j], c| {
            s + c.get("rel", h * 9 + ((j as i64 - i as i64).clamp(-4, 4) + 4) as usize)
        });
    let opts = wgpu_attention::Options {
        sink_logits: Some(sinks.clone()),
        user_mod: Some(m.clone()),
        ..case.options()
    };
    let dout = dout_for(&case, 78);
    let layer = MultiHeadAttention::new(ctx, &case.w).unwrap();
    let got = case
        .forward(&layer)
        .sink_logits(&sinks)
        .user_mod(m)
        .backward(&dout)
        .run_blocking(ctx)
        .unwrap();
    assert!(got.dsink.is_some() && got.dcaptures.is_some());
    let want = reference::mha_backward(&case.w, &case.inputs(), &opts, dout.view()).unwrap();
    let plain = reference::mha_backward_f32(&case.w, &case.inputs(), &opts, dout.view()).unwrap();
    assert_grads(&got, &want, &plain, Storage::F32, "sinks and captures");
}

fn grid(config: MhaConfig, (b, l, s): (usize, usize, usize), cross: bool) -> MhaGrid {
    MhaGrid {
        config,
        b,
        l,
        s: if cross { s } else { l },
        cross,
        causal: Causal::None,
        mask: false,
        bias: false,
        lens: false,
        weights: NeedWeights::No,
    }
}

/// Self- and cross-attention, kdim/vdim != d_model, GQA, MQA, no biases, head dims that are
/// not multiples of 4, lengths that are not multiples of the tiles, L != S; every mask kind
/// (a boolean mask with a fully masked row, causal top-left and bottom-right, an additive
/// bias, key lengths with a 0); both attention paths.
#[test]
fn grid_matches_reference() {
    let Some(ctx) = ctx() else { return };
    let configs = [
        (MhaConfig::new(32, 4), false),
        (MhaConfig::new(48, 6).kv_heads(2), true),     // GQA, d_k = 8
        (MhaConfig::new(40, 4).kv_heads(1), false),    // MQA, d_k = 10
        (MhaConfig::new(36, 3).kv_dims(20, 28), true), // cross widths != d_model
        (MhaConfig::new(24, 2).bias(false), true),     // no biases
    ];
    let mut seed = 300;
    for (config, cross) in configs {
        for (causal, mask, bias, lens) in [
            (Causal::None, false, false, false),
            (Causal::TopLeft, false, false, true),
            (Causal::BottomRight, true, false, false),
            (Causal::None, true, true, true),
        ] {
            seed += 1;
            let g = MhaGrid {
                causal,
                mask,
                bias,
                lens,
                ..grid(config, (3, 37, 45), cross)
            };
            let case = MhaCase::random(g, seed, Storage::F32);
            for path in [Path::Fused, Path::Unfused] {
                check_case(ctx, &case, path);
            }
        }
    }
}

/// A larger self-attention case: rows past the matmul's 64-row tile and several tiles of keys.
#[test]
fn larger_case_matches_reference() {
    let Some(ctx) = ctx() else { return };
    let g = MhaGrid {
        causal: Causal::TopLeft,
        mask: true,
        ..grid(MhaConfig::new(64, 4).kv_heads(2), (2, 130, 130), false)
    };
    check_case(ctx, &MhaCase::random(g, 9, Storage::F32), Path::Auto);
}

/// f16 and bf16 layers: the gradients of the layer run in the format.
#[test]
fn half_formats_match_reference() {
    let Some(ctx) = ctx() else { return };
    for st in [Storage::F16, Storage::Bf16] {
        for (config, cross) in [
            (MhaConfig::new(32, 4), false),
            (MhaConfig::new(36, 3).kv_heads(1).kv_dims(20, 27), true), // odd vdim
        ] {
            let g = MhaGrid {
                causal: Causal::BottomRight,
                mask: true,
                lens: true,
                ..grid(config, (2, 19, 23), cross)
            };
            check_case(ctx, &MhaCase::random(g, 40, st), Path::Auto);
        }
    }
}

/// Given query heads (a constant broadcast over the batch, or per batch element) and value
/// heads: their gradients (summed over a broadcast batch), zero gradients for the unused
/// projections, and the query input's gradient through the key (and value) projections.
#[test]
fn given_heads_gradients() {
    let Some(ctx) = ctx() else { return };
    let c = MhaConfig::new(32, 4).kv_heads(2);
    let w = MhaCase::random(grid(c, (3, 5, 19), true), 21, Storage::F32).w;
    let layer = MultiHeadAttention::new(ctx, &w).unwrap();
    let mut r = rng(22);
    let (b, l, s, d) = (3, 5, 19, c.head_dim());
    let x: Array3<f32> = rand_array(&mut r, (b, s, 32));
    let xk: Array3<f32> = rand_array(&mut r, (b, s, 32));
    let dout: Array3<f32> = rand_array(&mut r, (b, l, 32));
    for (qb, vb, kb, cross) in [
        (1, 1, 0, false),
        (b, 0, 0, false),
        (1, b, 0, true),
        (b, 0, 1, true),
    ] {
        let label =
            format!("query heads batch {qb}, key heads batch {kb}, value heads batch {vb}, cross {cross}");
        let qh: ndarray::Array4<f32> = rand_array(&mut r, (qb, 4, l, d));
        let vh: Option<ndarray::Array4<f32>> = (vb > 0).then(|| rand_array(&mut r, (vb, 2, s, d)));
        let kh: Option<ndarray::Array4<f32>> = (kb > 0).then(|| rand_array(&mut r, (kb, 2, s, d)));
        let mut inputs = if cross {
            MhaInputs::cross(x.view(), xk.view(), xk.view())
        } else {
            MhaInputs::self_attention(x.view())
        };
        inputs.query_heads = Some(qh.view());
        inputs.value_heads = vh.as_ref().map(|v| v.view());
        inputs.key_heads = kh.as_ref().map(|k| k.view());
        let opts = Options {
            causal: Causal::BottomRight,
            ..Default::default()
        };
        let want = reference::mha_backward(&w, &inputs, &opts, dout.view()).unwrap();
        let plain = reference::mha_backward_f32(&w, &inputs, &opts, dout.view()).unwrap();
        let mut f = layer.forward(&x).query_heads(&qh).causal(Causal::BottomRight);
        if cross {
            f = f.key_value(&xk, &xk);
        }
        if let Some(v) = &vh {
            f = f.value_heads(v);
        }
        if let Some(k) = &kh {
            f = f.key_heads(k);
        }
        let got = f.backward(&dout).run_blocking(ctx).unwrap();
        if kb > 0 {
            assert_eq!(got.key_heads.as_ref().unwrap().dim().0, kb, "{label}");
            assert!(got.w_k.iter().all(|&x| x == 0.0), "{label}: unused W_K");
            assert!(
                got.key.as_ref().unwrap().iter().all(|&x| x == 0.0),
                "{label}: unused key"
            );
        }
        assert_eq!(got.query_heads.as_ref().unwrap().dim().0, qb, "{label}");
        assert!(got.w_q.iter().all(|&x| x == 0.0), "{label}: unused W_Q");
        if vb > 0 {
            assert!(got.w_v.iter().all(|&x| x == 0.0), "{label}: unused W_V");
        }
        if cross {
            assert!(got.query.iter().all(|&x| x == 0.0), "{label}: unused query");
        } else {
            assert!(got.query.iter().any(|&x| x != 0.0), "{label}: query through K/V");
        }
        assert_grads(&got, &want, &plain, Storage::F32, &label);
    }
}

/// Inputs and the upstream gradient as GPU buffers (the caller's), and the same gradients
/// as from host arrays.
#[test]
fn gpu_buffer_inputs() {
    let Some(ctx) = ctx() else { return };
    use wgpu_attention::wgpu::util::DeviceExt;
    let c = MhaConfig::new(16, 2);
    let case = MhaCase::random(grid(c, (2, 9, 9), false), 31, Storage::F32);
    let layer = MultiHeadAttention::new(ctx, &case.w).unwrap();
    let dout = dout_for(&case, 5);
    let upload = |a: &[f32]| {
        ctx.device()
            .create_buffer_init(&wgpu_attention::wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytemuck::cast_slice(a),
                usage: wgpu_attention::wgpu::BufferUsages::STORAGE,
            })
    };
    let (xb, db) = (
        upload(case.x.as_slice().unwrap()),
        upload(dout.as_slice().unwrap()),
    );
    let host = layer.forward(&case.x).backward(&dout).run_blocking(ctx).unwrap();
    let gpu = layer
        .forward(Tensor::from_buffer(
            &xb,
            wgpu_attention::Storage::F32,
            &[2, 9, 16],
        ))
        .backward(Tensor::from_buffer(
            &db,
            wgpu_attention::Storage::F32,
            &[2, 9, 16],
        ))
        .run_blocking(ctx)
        .unwrap();
    assert_eq!(host, gpu);
    // Recorded into our encoder, the gradients left on the GPU: the same values.
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let g = layer
        .forward(Tensor::from_buffer(&xb, Storage::F32, &[2, 9, 16]))
        .backward(Tensor::from_buffer(&db, Storage::F32, &[2, 9, 16]))
        .record(ctx, &mut enc)
        .unwrap();
    ctx.queue().submit([enc.finish()]);
    let read = |b: &wgpu_attention::wgpu::Buffer, n: usize| {
        pollster::block_on(ctx.read_f32(b, 0, (n * 4) as u64)).unwrap()
    };
    assert_eq!(read(&g.query, 2 * 9 * 16), host.query.as_slice().unwrap());
    assert_eq!(read(&g.w[0], 16 * 16), host.w_q.as_slice().unwrap());
    assert_eq!(read(&g.w[3], 16 * 16), host.w_o.as_slice().unwrap());
    let y = pollster::block_on(ctx.read_f32(&g.output, g.output_offset, (2 * 9 * 16 * 4) as u64)).unwrap();
    assert_eq!(y, host.output.as_slice().unwrap());
    assert!(g.heads.iter().all(Option::is_none));
}

/// Gradients into the caller's buffers (`grads_into`): overwritten, then accumulated onto what
/// the buffers hold; every misuse a typed error before any GPU work.
#[test]
fn gradients_into_caller_buffers() {
    let Some(ctx) = ctx() else { return };
    use wgpu_attention::wgpu;
    use wgpu_attention::MhaGradsInto;
    let c = MhaConfig::new(16, 2);
    let case = MhaCase::random(grid(c, (2, 9, 7), true), 33, Storage::F32);
    let layer = MultiHeadAttention::new(ctx, &case.w).unwrap();
    let dout = dout_for(&case, 6);
    let call = || case.forward(&layer).backward(&dout);
    let want = call().run_blocking(ctx).unwrap();
    let filled = |n: usize, x: f32| filled(ctx, n, x);
    let (dq, dk, dwq, dwo, dbv) = (
        filled(2 * 9 * 16, 1.0),
        filled(2 * 7 * 16, 1.0),
        filled(16 * 16, 1.0),
        filled(16 * 16 + 5, 1.0),
        filled(16, 1.0),
    );
    let into = MhaGradsInto {
        query: Some(&dq),
        key: Some(&dk),
        w: [Some(&dwq), None, None, Some(&dwo)],
        b: [None, None, Some(&dbv), None],
        ..Default::default()
    };
    let read = |b: &wgpu::Buffer, n: usize| pollster::block_on(ctx.read_f32(b, 0, (n * 4) as u64)).unwrap();
    let got = call().grads_into(into).run_blocking(ctx).unwrap();
    assert_eq!(got, want, "the same gradients, through the caller's buffers");
    assert_eq!(read(&dq, 2 * 9 * 16), want.query.as_slice().unwrap());
    assert_eq!(
        read(&dk, 2 * 7 * 16),
        want.key.as_ref().unwrap().as_slice().unwrap()
    );
    assert_eq!(read(&dwq, 16 * 16), want.w_q.as_slice().unwrap());
    assert_eq!(read(&dbv, 16), want.b_v.as_ref().unwrap().as_slice().unwrap());
    // Accumulated: a second call adds the same gradients (the buffers now hold them once).
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    call()
        .grads_into(MhaGradsInto {
            accumulate: true,
            ..into
        })
        .record(ctx, &mut enc)
        .unwrap();
    ctx.queue().submit([enc.finish()]);
    let twice = |v: &[f32]| v.iter().map(|x| 2.0 * x).collect::<Vec<f32>>();
    let tol = Tolerance {
        atol: 1e-6,
        rtol: 1e-6,
    };
    for (label, buf, one) in [
        ("query", &dq, want.query.as_slice().unwrap()),
        ("key", &dk, want.key.as_ref().unwrap().as_slice().unwrap()),
        ("w_q", &dwq, want.w_q.as_slice().unwrap()),
        ("w_o", &dwo, want.w_o.as_slice().unwrap()),
        ("b_v", &dbv, want.b_v.as_ref().unwrap().as_slice().unwrap()),
    ] {
        let got = read(buf, one.len());
        assert_report(
            compare(got.iter().copied(), twice(one).iter().map(|&x| x as f64), tol),
            &format!("{label} accumulated"),
        );
    }
}

/// A storage buffer of `n` values `x` that copies go from and to.
fn filled(ctx: &Context, n: usize, x: f32) -> wgpu_attention::wgpu::Buffer {
    use wgpu_attention::wgpu::{self, util::DeviceExt};
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    ctx.device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: bytemuck::cast_slice(&vec![x; n]),
            usage,
        })
}

/// Gradient buffers the call cannot write (too small, given twice, not storage, without the
/// copy usages it needs, a key gradient in self-attention): typed errors before any GPU work.
#[test]
fn gradient_buffer_misuse_is_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    use wgpu_attention::wgpu;
    use wgpu_attention::MhaGradsInto;
    let c = MhaConfig::new(16, 2);
    let case = MhaCase::random(grid(c, (2, 9, 7), true), 33, Storage::F32);
    let layer = MultiHeadAttention::new(ctx, &case.w).unwrap();
    let dout = dout_for(&case, 6);
    let call = || case.forward(&layer).backward(&dout);
    let filled = |n: usize, x: f32| filled(ctx, n, x);
    let (dk, dwq) = (filled(2 * 7 * 16, 1.0), filled(16 * 16, 1.0));
    let small = filled(10, 0.0);
    let buffer = |size: u64, usage| {
        ctx.device().create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage,
            mapped_at_creation: false,
        })
    };
    let no_copy = buffer(4 * 16 * 16, wgpu::BufferUsages::STORAGE);
    let no_dst = buffer(4 * 16, wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC);
    let uniform = buffer(
        4 * 16 * 16,
        wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_SRC,
    );
    let cases = [
        (
            "too small",
            MhaGradsInto {
                w: [Some(&small), None, None, None],
                ..Default::default()
            },
            "w_q gradient",
        ),
        (
            "twice the same buffer",
            MhaGradsInto {
                w: [Some(&dwq), Some(&dwq), None, None],
                ..Default::default()
            },
            "w_k gradient",
        ),
        (
            "not storage",
            MhaGradsInto {
                w: [None, None, Some(&uniform), None],
                ..Default::default()
            },
            "w_v gradient",
        ),
        (
            "no COPY_DST without accumulate",
            MhaGradsInto {
                b: [None, None, None, Some(&no_dst)],
                ..Default::default()
            },
            "b_o gradient",
        ),
        (
            "no COPY_SRC for run",
            MhaGradsInto {
                w: [None, None, None, Some(&no_copy)],
                ..Default::default()
            },
            "w_o gradient",
        ),
    ];
    for (label, into, tensor) in cases {
        match call().grads_into(into).run_blocking(ctx) {
            Err(Error::BadBuffer { tensor: t, .. }) if t == tensor => {}
            other => panic!("{label}: {other:?}"),
        }
    }
    // Self-attention has no key input gradient.
    let self_case = MhaCase::random(grid(c, (2, 9, 9), false), 34, Storage::F32);
    let self_layer = MultiHeadAttention::new(ctx, &self_case.w).unwrap();
    let err = self_case
        .forward(&self_layer)
        .backward(&dout_for(&self_case, 7))
        .grads_into(MhaGradsInto {
            key: Some(&dk),
            ..Default::default()
        })
        .run_blocking(ctx)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BadBuffer {
                tensor: "key gradient",
                ..
            }
        ),
        "{err}"
    );
}

/// A wrong-shaped upstream gradient, a decode path and bad inputs are typed errors.
#[test]
fn bad_input_is_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let w = MhaWeights::xavier_uniform(MhaConfig::new(16, 2), 1).unwrap();
    let layer = MultiHeadAttention::new(ctx, &w).unwrap();
    let x = Array3::<f32>::zeros((2, 5, 16));
    let bad = Array3::<f32>::zeros((2, 4, 16));
    let err = layer.forward(&x).backward(&bad).run_blocking(ctx).unwrap_err();
    assert!(
        matches!(err, Error::ShapeMismatch { tensor: "dout", .. }),
        "{err}"
    );
    let err = layer
        .forward(&x)
        .path(Path::Decode)
        .backward(&x)
        .run_blocking(ctx)
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    let err = layer
        .forward(&Array3::<f32>::zeros((2, 5, 15)))
        .backward(&x)
        .run_blocking(ctx)
        .unwrap_err();
    assert!(
        matches!(err, Error::ShapeMismatch { tensor: "query", .. }),
        "{err}"
    );
}

/// PyTorch `nn.MultiheadAttention` autograd goldens (float64): the reference to 1e-9, and the
/// GPU (both attention paths) by FlashAttention's rule; the gradients also named by their
/// state-dict keys as PyTorch does.
#[test]
fn pytorch_autograd_goldens() {
    let root = FsPath::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mha");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("grads.safetensors").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 5, "{} golden cases with gradients", dirs.len());
    let ctx = ctx();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let heads = meta["num_heads"].as_u64().unwrap() as usize;
        let self_attn = meta["self_attn"].as_bool().unwrap_or(false);
        let w = MhaWeights::from_safetensors_file(dir.join("weights.safetensors"), heads).unwrap();
        let q: Array3<f32> = read_npy(dir.join("query.npy")).unwrap();
        let k: Array3<f32> = read_npy(dir.join("key.npy")).unwrap();
        let v: Array3<f32> = read_npy(dir.join("value.npy")).unwrap();
        let dout: Array3<f32> = read_npy(dir.join("dout.npy")).unwrap();
        let mask = mha_fixture_mask(&dir);
        let opts = Options {
            mask: mask.as_ref().map(|m| m.into()),
            ..Default::default()
        };
        let inputs = if self_attn {
            MhaInputs::self_attention(q.view())
        } else {
            MhaInputs::cross(q.view(), k.view(), v.view())
        };
        let bytes = std::fs::read(dir.join("grads.safetensors")).unwrap();
        let torch = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tensor = |key: &str| -> Vec<f64> {
            let t = torch.tensor(key).unwrap_or_else(|e| panic!("{name}: {key}: {e}"));
            assert_eq!(t.dtype(), safetensors::Dtype::F64, "{name}: {key}");
            t.data()
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let keys: Vec<String> = torch.names().into_iter().map(String::from).collect();
        let packed = keys.iter().any(|k| k == "in_proj_weight");
        let r64 = reference::mha_backward(&w, &inputs, &opts, dout.view()).unwrap();
        let golden_tol = Tolerance {
            atol: 1e-10,
            rtol: 1e-9,
        };
        // Inputs: query (the total in self-attention), key and value in cross-attention.
        let mut want_inputs = vec![("query", r64.query.iter().copied().collect::<Vec<_>>())];
        if !self_attn {
            want_inputs.push(("key", r64.key.as_ref().unwrap().iter().copied().collect()));
            want_inputs.push(("value", r64.value.as_ref().unwrap().iter().copied().collect()));
        }
        let state = r64.state_dict(packed, "");
        let mut names: Vec<String> = want_inputs.iter().map(|(k, _)| k.to_string()).collect();
        names.extend(state.iter().map(|(k, _)| k.clone()));
        let mut sorted_keys = keys.clone();
        sorted_keys.sort();
        names.sort();
        assert_eq!(names, sorted_keys, "{name}: gradient names");
        for (key, want) in want_inputs
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .chain(state.into_iter().map(|(k, a)| (k, a.iter().copied().collect())))
        {
            assert_report(
                compare(want.iter().copied(), tensor(&key), golden_tol),
                &format!("{name} reference {key}"),
            );
        }
        let Some(ctx) = ctx else { continue };
        let plain = reference::mha_backward_f32(&w, &inputs, &opts, dout.view()).unwrap();
        let layer = MultiHeadAttention::new(ctx, &w).unwrap();
        for path in [Path::Fused, Path::Unfused] {
            let mut f = layer.forward(&q).path(path);
            if !self_attn {
                f = f.key_value(&k, &v);
            }
            if let Some(m) = &mask {
                f = f.mask(m);
            }
            let got = f.backward(&dout).run_blocking(ctx).unwrap();
            assert_grads(&got, &r64, &plain, Storage::F32, &format!("{name} gpu {path:?}"));
        }
    }
}
