//! Multi-head attention: PyTorch `nn.MultiheadAttention` goldens (reference to 1e-10, GPU to
//! the crate tolerance), the GPU layer against the f64 reference on a grid (self/cross,
//! kdim/vdim != d_model, GQA/MQA, every mask, key lengths, weights per head and averaged,
//! lengths that are not multiples of the tiles), constant query/value heads, and typed errors.

mod common;

use std::path::Path as FsPath;

use common::{
    assert_mha_output, assert_report, ctx, mha_fixture_mask, rand_array, rng, twice_storage_tolerance,
    MhaCase, MhaGrid, TOL,
};
use ndarray::{Array2, Array3, Array4};
use ndarray_npy::read_npy;
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::reference::{self, MhaInputs};
use wgpu_attention::Options;
use wgpu_attention::{
    half, Causal, Error, MhaConfig, MhaWeights, MultiHeadAttention, NeedWeights, Path, Storage, Tensor,
};

const GOLDEN_TOL: Tolerance = Tolerance {
    atol: 1e-10,
    rtol: 1e-9,
};

#[test]
fn pytorch_goldens_reference_and_gpu() {
    let root = FsPath::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mha");
    let mut names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    names.sort();
    assert_eq!(names.len(), 6, "fixture cases");
    for dir in names {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let heads = meta["num_heads"].as_u64().unwrap() as usize;
        let w = MhaWeights::from_safetensors_file(dir.join("weights.safetensors"), heads).unwrap();
        assert_eq!(w.config.d_model, meta["embed_dim"].as_u64().unwrap() as usize);
        assert_eq!(w.config.kdim, meta["kdim"].as_u64().unwrap() as usize);
        assert_eq!(w.config.vdim, meta["vdim"].as_u64().unwrap() as usize);
        assert_eq!(w.b_q.is_some(), meta["bias"].as_bool().unwrap());
        let q: Array3<f32> = read_npy(dir.join("query.npy")).unwrap();
        let k: Array3<f32> = read_npy(dir.join("key.npy")).unwrap();
        let v: Array3<f32> = read_npy(dir.join("value.npy")).unwrap();
        let out: Array3<f64> = read_npy(dir.join("out.npy")).unwrap();
        let avg: Array3<f64> = read_npy(dir.join("attn_weights_avg.npy")).unwrap();
        let per_head: Array4<f64> = read_npy(dir.join("attn_weights_per_head.npy")).unwrap();
        // PyTorch's boolean masks mean true = masked out; ours true = may attend.
        let mask = mha_fixture_mask(&dir);
        let spec = Options {
            mask: mask.as_ref().map(|m| m.into()),
            ..Default::default()
        };
        let r = reference::mha(&w, &MhaInputs::cross(q.view(), k.view(), v.view()), &spec).unwrap();
        assert_report(
            compare(r.out.iter().copied(), out.iter().copied(), GOLDEN_TOL),
            &format!("{name} reference out"),
        );
        assert_report(
            compare(
                reference::mean_over_heads(&r.weights).iter().copied(),
                avg.iter().copied(),
                GOLDEN_TOL,
            ),
            &format!("{name} reference avg weights"),
        );

        let Some(ctx) = ctx() else { continue };
        let layer = MultiHeadAttention::new(ctx, &w).unwrap();
        for path in [Path::Auto, Path::Unfused, Path::Fused] {
            let mut f = layer.forward(&q).key_value(&k, &v).path(path);
            if let Some(m) = &mask {
                f = f.mask(m);
            }
            let o = f.run_blocking(ctx).unwrap();
            assert_report(
                compare(o.output.iter().copied(), out.iter().copied(), TOL),
                &format!("{name} gpu {path:?}"),
            );
        }
        let mut f = layer
            .forward(&q)
            .key_value(&k, &v)
            .need_weights(NeedWeights::Averaged);
        if let Some(m) = &mask {
            f = f.mask(m);
        }
        let o = f.run_blocking(ctx).unwrap();
        assert_report(
            compare(o.avg_weights.unwrap().iter().copied(), avg.iter().copied(), TOL),
            &format!("{name} gpu avg weights"),
        );
        let mut f = layer
            .forward(&q)
            .key_value(&k, &v)
            .need_weights(NeedWeights::PerHead);
        if let Some(m) = &mask {
            f = f.mask(m);
        }
        let o = f.run_blocking(ctx).unwrap();
        assert_report(
            compare(o.weights.unwrap().iter().copied(), per_head.iter().copied(), TOL),
            &format!("{name} gpu per-head weights"),
        );
        assert_report(
            compare(o.output.iter().copied(), out.iter().copied(), TOL),
            &format!("{name} gpu out (weights)"),
        );
    }
}

/// One grid case.
type Grid = MhaGrid;

fn run_grid_case(ctx: &wgpu_attention::Context, g: &Grid, seed: u64) {
    run_grid_case_as(ctx, g, seed, Storage::F32, TOL)
}

/// A grid case with the layer in `st` (weights, activations, output) and its inputs rounded
/// to `st`, against the f64 reference on the rounded weights and inputs at `tol`.
fn run_grid_case_as(ctx: &wgpu_attention::Context, g: &Grid, seed: u64, st: Storage, tol: Tolerance) {
    let case = MhaCase::random(*g, seed, st);
    let r = reference::mha(&case.w, &case.inputs(), &case.options()).unwrap();
    let layer = MultiHeadAttention::new(ctx, &case.w).unwrap();
    let label = case.label();
    let o = case.forward(&layer).run_blocking(ctx).unwrap();
    assert_mha_output(&o, &r, g.weights, tol, &label);
    if st != Storage::F32 {
        assert!(
            o.output.iter().all(|&x| st.round(x) == x),
            "{label}: output not in {st}"
        );
    }
}

/// The layer in f16 and bf16: weights, projections, heads, attention and output held in the
/// format (accumulation f32), against the f64 reference on the rounded weights and inputs.
/// The layer rounds its intermediates (projections, attention output) to the format too, so
/// the tolerance is twice the single-call one.
#[test]
fn half_storage_layer_matches_reference() {
    let Some(ctx) = ctx() else { return };
    for st in [Storage::F16, Storage::Bf16] {
        let tol = twice_storage_tolerance(st);
        for (i, (config, cross, b, l, s)) in [
            (MhaConfig::new(32, 4), false, 2, 37, 37),
            (MhaConfig::new(48, 6).kv_heads(2), true, 2, 5, 131),
            (MhaConfig::new(40, 4).kv_heads(1), false, 1, 19, 19), // d_k = 10
            (MhaConfig::new(36, 3).kv_dims(20, 27), true, 3, 9, 11), // odd vdim
        ]
        .into_iter()
        .enumerate()
        {
            for (causal, mask, bias, lens, weights) in [
                (Causal::None, false, false, false, NeedWeights::No),
                (Causal::BottomRight, true, true, true, NeedWeights::PerHead),
            ] {
                let g = Grid {
                    config,
                    b,
                    l,
                    s,
                    cross,
                    causal,
                    mask,
                    bias,
                    lens,
                    weights,
                };
                run_grid_case_as(ctx, &g, 500 + i as u64, st, tol);
            }
        }
    }
}

/// A state dict saved in F16 or BF16 stays in that format on the device (no widening): the
/// layer's storage is the file's, and it computes what the f32 layer computes on the same
/// values within the format's tolerance. Mixed F16/BF16 tensors are a typed error.
#[test]
fn half_safetensors_keep_their_format() {
    use safetensors::tensor::{serialize, TensorView};
    use safetensors::Dtype;
    let Some(ctx) = ctx() else { return };
    let w = MhaWeights::xavier_uniform(MhaConfig::new(16, 2), 3).unwrap();
    let encode = |a: &[f32], dt: Dtype| -> Vec<u8> {
        match dt {
            Dtype::F16 => a
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            _ => a
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        }
    };
    let file = |dts: [Dtype; 3]| -> Vec<u8> {
        let inp =
            ndarray::concatenate(ndarray::Axis(0), &[w.w_q.view(), w.w_k.view(), w.w_v.view()]).unwrap();
        let bias: Vec<f32> = [w.b_q.as_ref(), w.b_k.as_ref(), w.b_v.as_ref()]
            .into_iter()
            .flat_map(|b| b.unwrap().to_vec())
            .collect();
        let data = [
            (
                "in_proj_weight",
                encode(&inp.iter().copied().collect::<Vec<_>>(), dts[0]),
                vec![48, 16],
                dts[0],
            ),
            ("in_proj_bias", encode(&bias, dts[1]), vec![48], dts[1]),
            (
                "out_proj.weight",
                encode(&w.w_o.iter().copied().collect::<Vec<_>>(), dts[2]),
                vec![16, 16],
                dts[2],
            ),
        ];
        let views: Vec<(String, TensorView)> = data
            .iter()
            .map(|(k, d, s, dt)| (k.to_string(), TensorView::new(*dt, s.clone(), d).unwrap()))
            .collect();
        serialize(views, None).unwrap()
    };
    let x: Array3<f32> = rand_array(&mut rng(4), (2, 7, 16));
    for (dt, st) in [(Dtype::F16, Storage::F16), (Dtype::BF16, Storage::Bf16)] {
        let loaded = MhaWeights::from_safetensors(&file([dt; 3]), 2).unwrap();
        assert_eq!(loaded.storage, st);
        let layer = MultiHeadAttention::new(ctx, &loaded).unwrap();
        assert_eq!(layer.storage(), st);
        let xr = x.mapv(|v| st.round(v));
        let got = layer.forward(&xr).run_blocking(ctx).unwrap();
        assert!(
            got.output.iter().all(|&v| st.round(v) == v),
            "{st}: output not in the format"
        );
        let want = reference::mha(
            &loaded,
            &MhaInputs::self_attention(xr.view()),
            &Options::default(),
        )
        .unwrap();
        let tol = twice_storage_tolerance(st);
        assert_report(
            compare(got.output.iter().copied(), want.out.iter().copied(), tol),
            &format!("{st} layer"),
        );
    }
    let err = MhaWeights::from_safetensors(&file([Dtype::F16, Dtype::F16, Dtype::BF16]), 2).unwrap_err();
    assert!(matches!(err, Error::StorageMismatch { .. }), "{err}");
}

#[test]
fn grid_matches_reference() {
    let Some(ctx) = ctx() else { return };
    let configs = [
        MhaConfig::new(32, 4),
        MhaConfig::new(48, 6).kv_heads(2),     // GQA, d_k = 8
        MhaConfig::new(40, 4).kv_heads(1),     // MQA, d_k = 10 (not a multiple of 4)
        MhaConfig::new(36, 3).kv_dims(20, 28), // cross widths != d_model, d_k = 12
        MhaConfig::new(24, 2).bias(false),     // no biases
    ];
    let mut seed = 100;
    for (ci, config) in configs.into_iter().enumerate() {
        let cross = config.kdim != config.d_model || ci % 2 == 1;
        for (b, l, s) in [(3, 67, 45), (2, 5, 131)] {
            let (l, s) = if cross { (l, s) } else { (l, l) };
            for (causal, mask, bias, lens, weights) in [
                (Causal::None, false, false, false, NeedWeights::No),
                (Causal::TopLeft, false, false, true, NeedWeights::Averaged),
                (Causal::BottomRight, true, false, false, NeedWeights::No),
                (Causal::None, true, true, true, NeedWeights::PerHead),
            ] {
                seed += 1;
                run_grid_case(
                    ctx,
                    &Grid {
                        config,
                        b,
                        l,
                        s,
                        cross,
                        causal,
                        mask,
                        bias,
                        lens,
                        weights,
                    },
                    seed,
                );
            }
        }
    }
}

#[test]
fn constant_query_and_value_heads_broadcast_over_batch() {
    let Some(ctx) = ctx() else { return };
    let c = MhaConfig::new(32, 4).kv_heads(2);
    let w = MhaWeights::xavier_uniform(c, 7).unwrap();
    let mut r = rng(8);
    let (b, l, s, d) = (3, 5, 19, c.head_dim());
    let x: Array3<f32> = rand_array(&mut r, (b, s, 32));
    let qh: Array4<f32> = rand_array(&mut r, (1, 4, l, d));
    let vh: Array4<f32> = rand_array(&mut r, (1, 2, s, d));
    let inputs = MhaInputs {
        query_heads: Some(qh.view()),
        value_heads: Some(vh.view()),
        ..MhaInputs::self_attention(x.view())
    };
    let reference = reference::mha(&w, &inputs, &Options::default()).unwrap();
    let layer = MultiHeadAttention::new(ctx, &w).unwrap();
    let o = layer
        .forward(&x)
        .query_heads(&qh)
        .value_heads(&vh)
        .run_blocking(ctx)
        .unwrap();
    assert_eq!(o.output.shape(), &[b, l, 32]);
    assert_report(
        compare(o.output.iter().copied(), reference.out.iter().copied(), TOL),
        "constant q/v",
    );
    // Per-batch query heads too.
    let qh3: Array4<f32> = rand_array(&mut r, (b, 4, l, d));
    let inputs = MhaInputs {
        query_heads: Some(qh3.view()),
        ..MhaInputs::self_attention(x.view())
    };
    let reference = reference::mha(&w, &inputs, &Options::default()).unwrap();
    let o = layer.forward(&x).query_heads(&qh3).run_blocking(ctx).unwrap();
    assert_report(
        compare(o.output.iter().copied(), reference.out.iter().copied(), TOL),
        "per-batch q",
    );
}

/// A decode step as a generation loop runs it: the new token's query projected, the keys and
/// values given as cached heads (`key_heads`, `value_heads`, broadcast or per batch), the whole
/// layer recorded into the caller's encoder with its output in the caller's buffer (at an
/// offset), and the weights per head; against the reference.
#[test]
fn decode_step_with_cached_heads_recorded_into_caller_buffer() {
    let Some(ctx) = ctx() else { return };
    use wgpu_attention::wgpu;
    let c = MhaConfig::new(32, 4).kv_heads(2);
    let w = MhaWeights::xavier_uniform(c, 17).unwrap();
    let layer = MultiHeadAttention::new(ctx, &w).unwrap();
    let mut r = rng(18);
    let (b, s, d) = (2, 23, c.head_dim());
    let x: Array3<f32> = rand_array(&mut r, (b, 1, 32));
    for kb in [1, b] {
        let kh: Array4<f32> = rand_array(&mut r, (kb, 2, s, d));
        let vh: Array4<f32> = rand_array(&mut r, (b, 2, s, d));
        let inputs = MhaInputs {
            key_heads: Some(kh.view()),
            value_heads: Some(vh.view()),
            ..MhaInputs::self_attention(x.view())
        };
        let want = reference::mha(&w, &inputs, &Options::default()).unwrap();
        // run
        let o = layer
            .forward(&x)
            .key_heads(&kh)
            .value_heads(&vh)
            .run_blocking(ctx)
            .unwrap();
        assert_report(
            compare(o.output.iter().copied(), want.out.iter().copied(), TOL),
            &format!("cached heads (key batch {kb})"),
        );
        // record into our encoder, output into our buffer at an offset
        let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
        let out = ctx.device().create_buffer(&wgpu::BufferDescriptor {
            label: Some("layer output"),
            size: align + (b * 32 * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let gpu = layer
            .forward(&x)
            .key_heads(&kh)
            .value_heads(&vh)
            .return_weights()
            .output_into(Tensor::from_buffer(&out, Storage::F32, &[b, 1, 32]).at_offset(align))
            .record(ctx, &mut enc)
            .unwrap();
        ctx.queue().submit([enc.finish()]);
        assert_eq!(gpu.output_offset, align);
        let got = pollster::block_on(ctx.read_f32(&gpu.output, align, (b * 32 * 4) as u64)).unwrap();
        assert_report(
            compare(got.iter().copied(), want.out.iter().copied(), TOL),
            &format!("recorded (key batch {kb})"),
        );
        let weights = gpu.weights.expect("weights asked for");
        let wv = pollster::block_on(ctx.read_f32(&weights, 0, weights.size())).unwrap();
        assert_report(
            compare(wv.iter().copied(), want.weights.iter().copied(), TOL),
            &format!("recorded weights (key batch {kb})"),
        );
    }
    // Mistakes: an output buffer of the wrong shape or format, key heads of the wrong width.
    let out = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4096,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let kh: Array4<f32> = rand_array(&mut r, (b, 2, s, d));
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let e = layer
        .forward(&x)
        .output_into(Tensor::from_buffer(&out, Storage::F16, &[b, 1, 32]))
        .record(ctx, &mut enc)
        .unwrap_err();
    assert!(matches!(e, wgpu_attention::Error::StorageMismatch { .. }), "{e}");
    let e = layer
        .forward(&x)
        .output_into(Tensor::from_buffer(&out, Storage::F32, &[b, 2, 32]))
        .record(ctx, &mut enc)
        .unwrap_err();
    assert!(matches!(e, wgpu_attention::Error::ShapeMismatch { .. }), "{e}");
    let narrow: Array4<f32> = rand_array(&mut r, (b, 2, s, d + 1));
    let e = layer
        .forward(&x)
        .key_heads(&narrow)
        .value_heads(&kh)
        .run_blocking(ctx)
        .unwrap_err();
    assert!(
        matches!(
            e,
            wgpu_attention::Error::ShapeMismatch {
                tensor: "key_heads",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn gpu_buffer_inputs_and_profiled_run() {
    let Some(ctx) = ctx() else { return };
    let c = MhaConfig::new(64, 4);
    let w = MhaWeights::xavier_uniform(c, 9).unwrap();
    let x: Array3<f32> = rand_array(&mut rng(10), (2, 70, 64));
    let buf = wgpu_attention::wgpu::util::DeviceExt::create_buffer_init(
        ctx.device(),
        &wgpu_attention::wgpu::util::BufferInitDescriptor {
            label: None,
            contents: bytemuck::cast_slice(x.as_slice().unwrap()),
            usage: wgpu_attention::wgpu::BufferUsages::STORAGE,
        },
    );
    let layer = MultiHeadAttention::new(ctx, &w).unwrap();
    let r = reference::mha(&w, &MhaInputs::self_attention(x.view()), &Options::default()).unwrap();
    let o = layer
        .forward(Tensor::from_buffer(
            &buf,
            wgpu_attention::Storage::F32,
            &[2, 70, 64],
        ))
        .profile()
        .run_blocking(ctx)
        .unwrap();
    assert_report(
        compare(o.output.iter().copied(), r.out.iter().copied(), TOL),
        "gpu buffer input",
    );
    let t = o.timings.expect("profiled");
    assert!(t.projections.as_nanos() > 0 && t.attention.as_nanos() > 0 && t.output.as_nanos() > 0);
}

#[test]
fn bad_configs_and_inputs_are_typed_errors() {
    // Config rules (no GPU needed).
    assert!(matches!(
        MhaConfig::new(30, 4).validate(),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        MhaConfig::new(32, 4).kv_heads(3).validate(),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        MhaConfig::new(0, 1).validate(),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        MhaWeights::xavier_uniform(MhaConfig::new(32, 5), 0),
        Err(Error::InvalidConfig { .. })
    ));
    let mut w = MhaWeights::xavier_uniform(MhaConfig::new(32, 4), 0).unwrap();
    w.w_k = Array2::zeros((31, 32));
    assert!(matches!(w.validate(), Err(Error::WeightShape { ref key, .. }) if key == "w_k"));
    // Weight files.
    assert!(matches!(
        MhaWeights::from_safetensors(b"not a safetensors file", 4),
        Err(Error::WeightFile { .. })
    ));
    let dir = FsPath::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mha/self_attn");
    let bytes = std::fs::read(dir.join("weights.safetensors")).unwrap();
    assert!(matches!(
        MhaWeights::from_safetensors_prefixed(&bytes, "layer.", 4),
        Err(Error::MissingWeight { ref key }) if key == "layer.q_proj_weight"
    ));
    assert!(matches!(
        MhaWeights::from_safetensors(&bytes, 5),
        Err(Error::InvalidConfig { .. })
    ));
    let e = MhaWeights::from_safetensors_file(dir.join("no-such-file"), 4).unwrap_err();
    assert!(matches!(e, Error::WeightFile { .. }), "{e}");

    let Some(ctx) = ctx() else { return };
    let w = MhaWeights::xavier_uniform(MhaConfig::new(32, 4).kv_dims(10, 12), 1).unwrap();
    let layer = MultiHeadAttention::new(ctx, &w).unwrap();
    let x = Array3::<f32>::zeros((2, 5, 32));
    let k = Array3::<f32>::zeros((2, 7, 10));
    let v = Array3::<f32>::zeros((2, 7, 12));
    // Self-attention needs kdim = vdim = d_model.
    assert!(matches!(
        layer.forward(&x).run_blocking(ctx),
        Err(Error::ShapeMismatch { tensor: "query", .. })
    ));
    let bad_q = Array3::<f32>::zeros((2, 5, 31));
    assert!(matches!(
        layer.forward(&bad_q).key_value(&k, &v).run_blocking(ctx),
        Err(Error::ShapeMismatch { tensor: "query", .. })
    ));
    let bad_v = Array3::<f32>::zeros((2, 6, 12));
    assert!(matches!(
        layer.forward(&x).key_value(&k, &bad_v).run_blocking(ctx),
        Err(Error::ShapeMismatch { tensor: "value", .. })
    ));
    let bad_b = Array3::<f32>::zeros((3, 7, 10));
    assert!(matches!(
        layer.forward(&x).key_value(&bad_b, &v).run_blocking(ctx),
        Err(Error::ShapeMismatch { tensor: "key", .. })
    ));
    let empty = Array3::<f32>::zeros((2, 0, 32));
    assert!(matches!(
        layer.forward(&empty).key_value(&k, &v).run_blocking(ctx),
        Err(Error::ZeroSized { .. })
    ));
    assert!(matches!(
        layer
            .forward(&x)
            .key_value(&k, &v)
            .kv_lens(&[1])
            .run_blocking(ctx),
        Err(Error::KvLensCount { .. })
    ));
    assert!(matches!(
        layer
            .forward(&x)
            .key_value(&k, &v)
            .need_weights(NeedWeights::PerHead)
            .path(Path::Fused)
            .run_blocking(ctx),
        Err(Error::Unsupported { .. })
    ));
    let bad_mask = ndarray::Array2::<bool>::from_elem((5, 8), true);
    assert!(matches!(
        layer
            .forward(&x)
            .key_value(&k, &v)
            .mask(&bad_mask)
            .run_blocking(ctx),
        Err(Error::NotBroadcastable { .. })
    ));
}

/// The layer with a sliding window and sink tokens (the options reach its attention call):
/// self-attention with GQA and key lengths, and cross-attention with L != S and the weights,
/// against the reference with the same options.
#[test]
fn window_reaches_the_layer() {
    let Some(ctx) = ctx() else { return };
    for (i, (config, cross, l, s, lens, weights)) in [
        (
            MhaConfig::new(48, 6).kv_heads(2),
            false,
            37,
            37,
            true,
            NeedWeights::No,
        ),
        (
            MhaConfig::new(36, 3).kv_dims(20, 28),
            true,
            23,
            41,
            false,
            NeedWeights::PerHead,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let g = Grid {
            config,
            b: 2,
            l,
            s,
            cross,
            causal: Causal::BottomRight,
            mask: false,
            bias: false,
            lens,
            weights,
        };
        let case = MhaCase::random(g, 700 + i as u64, Storage::F32);
        let opts = wgpu_attention::Options {
            window: Some((6, 0)),
            sink_tokens: 2,
            ..case.options()
        };
        let r = reference::mha(&case.w, &case.inputs(), &opts).unwrap();
        let plain = reference::mha(&case.w, &case.inputs(), &case.options()).unwrap();
        assert!(
            r.out
                .iter()
                .zip(plain.out.iter())
                .any(|(a, b)| (a - b).abs() > 1e-3),
            "the window changes the output"
        );
        let layer = MultiHeadAttention::new(ctx, &case.w).unwrap();
        let paths: &[Path] = if weights == NeedWeights::No {
            &[Path::Fused, Path::Unfused]
        } else {
            &[Path::Auto]
        };
        for &path in paths {
            let o = case
                .forward(&layer)
                .window(6, 0)
                .sink_tokens(2)
                .path(path)
                .run_blocking(ctx)
                .unwrap();
            assert_mha_output(&o, &r, weights, TOL, &format!("{} window {path:?}", case.label()));
        }
    }
}

/// The layer with a softcap, ALiBi and sink logits (the options reach its attention call): self-attention
/// with GQA and key lengths, and cross-attention with L != S and the weights, against the
/// reference with the same options.
#[test]
fn softcap_alibi_and_sinks_reach_the_layer() {
    let Some(ctx) = ctx() else { return };
    for (i, (config, cross, l, s, lens, weights)) in [
        (
            MhaConfig::new(48, 6).kv_heads(2),
            false,
            37,
            37,
            true,
            NeedWeights::No,
        ),
        (
            MhaConfig::new(36, 3).kv_dims(20, 28),
            true,
            23,
            41,
            false,
            NeedWeights::PerHead,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let heads = config.num_heads;
        let g = Grid {
            config,
            b: 2,
            l,
            s,
            cross,
            causal: Causal::BottomRight,
            mask: false,
            bias: false,
            lens,
            weights,
        };
        let case = MhaCase::random(g, 710 + i as u64, Storage::F32);
        let slopes = wgpu_attention::alibi_slopes(heads);
        let sinks: Vec<f32> = (0..heads).map(|h| 0.3 * h as f32 - 0.5).collect();
        // Three packed documents per batch, their boundaries moving with the batch.
        let docs = |n: usize| -> Vec<i32> {
            (0..2 * n)
                .map(|t| ((t % n + t / n * 5) * 3 / (n + 5)) as i32)
                .collect()
        };
        let (qd, kd) = (docs(l), docs(s));
        let opts = wgpu_attention::Options {
            softcap: Some(0.5),
            alibi: Some(slopes.clone()),
            sink_logits: Some(sinks.clone()),
            doc_ids: Some(wgpu_attention::DocIds {
                q: qd.clone(),
                k: kd.clone(),
            }),
            ..case.options()
        };
        let r = reference::mha(&case.w, &case.inputs(), &opts).unwrap();
        let plain = reference::mha(&case.w, &case.inputs(), &case.options()).unwrap();
        assert!(
            r.out
                .iter()
                .zip(plain.out.iter())
                .any(|(a, b)| (a - b).abs() > 1e-3),
            "the modifiers change the output"
        );
        let layer = MultiHeadAttention::new(ctx, &case.w).unwrap();
        let paths: &[Path] = if weights == NeedWeights::No {
            &[Path::Fused, Path::Unfused]
        } else {
            &[Path::Auto]
        };
        for &path in paths {
            let o = case
                .forward(&layer)
                .softcap(0.5)
                .alibi(&slopes)
                .sink_logits(&sinks)
                .doc_ids(&qd, &kd)
                .path(path)
                .run_blocking(ctx)
                .unwrap();
            assert_mha_output(
                &o,
                &r,
                weights,
                TOL,
                &format!("{} softcap alibi sinks docs {path:?}", case.label()),
            );
        }
    }
}
