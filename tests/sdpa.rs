//! End-to-end SDPA on the GPU against the CPU reference: a grid of shapes (tails, L != S,
//! E != Ev, GQA/MQA) times every mask kind and combination, on every path.

mod common;

use common::{ctx, mask_and_window_kinds, modifier_kinds, user_kinds, Case, SHAPES, TOL};
use ndarray::{Array, Array4, IxDyn};
use wgpu_attention::check::compare;
use wgpu_attention::{Causal, Path, Sdpa};

#[test]
fn grid_of_shapes_and_masks_matches_reference() {
    let Some(ctx) = ctx() else { return };
    for (pi, path) in Path::ALL.into_iter().enumerate() {
        for (si, &shape) in SHAPES.iter().enumerate() {
            for (name, apply) in mask_and_window_kinds() {
                // The window kinds on half the (path, shape) pairs, each path over tails, L != S
                // and GQA among them (tests/forms.rs runs them in every form, tests/storage.rs
                // and tests/backward.rs on their grids): CI time.
                if name.starts_with("window") && (pi + si) % 2 == 1 {
                    continue;
                }
                let case = apply(Case::random(shape, si as u64));
                case.check(ctx, path, TOL, &format!("{path:?} {shape:?} {name}"));
            }
        }
    }
}

/// The built-in score modifiers (softcap, ALiBi; alone and with the window, masks and bias)
/// on every path: tails, L != S, E != Ev, and a decode shape with GQA (3 query rows, 700 keys).
#[test]
fn modifiers_on_every_path() {
    let Some(ctx) = ctx() else { return };
    let shapes = [(1, 2, 2, 70, 130, 33, 65), (2, 4, 2, 3, 700, 16, 24)];
    for (si, shape) in shapes.into_iter().enumerate() {
        for (name, apply) in modifier_kinds() {
            let case = apply(Case::random(shape, 600 + si as u64));
            case.check_all_paths(ctx, TOL, &format!("{shape:?} {name}"));
        }
    }
}

/// Long packed documents (whole query and key tiles in one document, where the fused kernels
/// skip the per-logit document test), causal, on every path.
#[test]
fn long_documents_fill_whole_tiles() {
    let Some(ctx) = ctx() else { return };
    for (si, shape) in [(2, 2, 2, 300, 300, 16, 16), (2, 2, 1, 5, 333, 8, 12)]
        .into_iter()
        .enumerate()
    {
        let case = Case::random(shape, 620 + si as u64)
            .with_long_docs()
            .with_causal(Causal::BottomRight);
        case.check_all_paths(ctx, TOL, &format!("{shape:?} long documents"));
    }
}

/// User WGSL functions on every path (fused, decode, unfused): a captured relative-position
/// bias in a `score_mod`, a prefix-LM and dilated `mask_mod` (rows fully masked), with the
/// built-in masks, on a shape with tails and GQA and a decode shape; the same source on a new
/// sequence length reuses its checked code.
#[test]
fn user_functions_on_every_path() {
    let Some(ctx) = ctx() else { return };
    let shapes = [(1, 2, 2, 70, 130, 33, 65), (2, 4, 2, 3, 700, 16, 24)];
    for (si, shape) in shapes.into_iter().enumerate() {
        for (name, apply) in user_kinds() {
            let case = apply(Case::random(shape, 610 + si as u64));
            case.check_all_paths(ctx, TOL, &format!("{shape:?} {name}"));
        }
    }
}

/// The fused forward's mask_mod block map (built once per source, captures and shape, then
/// cached): a band `mask_mod` whose width per head is a captured tensor (bounds off the map's
/// 16-blocks and the kernels' tiles; empty, full and partial blocks; rows fully masked), L != S,
/// in the default fused form and the GPU forms (larger key tiles than one block); each call
/// twice (the second reads the cached map), then new widths (a new map).
#[test]
fn mask_mod_block_map_by_form() {
    let Some(ctx) = ctx() else { return };
    let mut forms = vec![("default".to_string(), ctx.clone())];
    for f in [
        wgpu_attention::FusedForm::Gpu,
        wgpu_attention::FusedForm::GpuTiles,
    ] {
        if ctx.caps().fused_forms().contains(&f) {
            forms.push((format!("{f:?}"), ctx.with_forms(f)));
        }
    }
    for widths in [[37.0f32, 90.0], [61.0, 20.0]] {
        let case = Case::random((1, 2, 2, 150, 300, 16, 16), 640).with_band_mask_mod(widths);
        let want = case.reference();
        for (name, fctx) in &forms {
            for run in 0..2 {
                let label = format!("widths {widths:?} form {name} run {run}");
                case.check_against(&want, fctx, Path::Fused, TOL, &label);
            }
        }
    }
}

/// Head dims at the fused kernel's limit of 256, on every path (the fused kernel must serve
/// them, not fall back), with every mask kind combined: vec4 I/O at the limit, scalar I/O just
/// under it, and each limit beside the smallest dim (each pair compiles every kernel again).
#[test]
fn head_dims_up_to_256_on_every_path() {
    let Some(ctx) = ctx() else { return };
    for (i, (e, ev)) in [(256, 256), (256, 3), (255, 129), (1, 256)]
        .into_iter()
        .enumerate()
    {
        let case = Case::random((1, 2, 1, 9, 21, e, ev), 40 + i as u64)
            .with_causal(Causal::BottomRight)
            .with_random_mask(41)
            .with_random_bias(42);
        assert_eq!(
            case.sdpa().resolved_path(ctx).unwrap(),
            Path::Fused,
            "E {e}, Ev {ev}"
        );
        case.check_all_paths(ctx, TOL, &format!("E {e}, Ev {ev}"));
    }
}

#[test]
fn fully_masked_row_is_zero() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 2, 2, 9, 11, 8, 8), 1).with_random_mask(3);
    for path in Path::ALL {
        let out = case.sdpa().path(path).return_lse().run_blocking(ctx).unwrap();
        for b in 0..2 {
            for h in 0..2 {
                for i in [0, 4] {
                    assert!(out
                        .output
                        .slice(ndarray::s![b, h, i, ..])
                        .iter()
                        .all(|&x| x == 0.0));
                    assert_eq!(out.lse.as_ref().unwrap()[[b, h, i]], f32::NEG_INFINITY);
                }
            }
        }
        assert!(out.output.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn causal_bottom_right_l_gt_s_masks_leading_rows() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((1, 2, 2, 20, 6, 8, 8), 2).with_causal(Causal::BottomRight);
    let out = case.sdpa().return_weights().run_blocking(ctx).unwrap();
    let w = out.weights.unwrap();
    for i in 0..14 {
        assert!(
            w.slice(ndarray::s![.., .., i, ..]).iter().all(|&x| x == 0.0),
            "row {i}"
        );
    }
    case.check_all_paths(ctx, TOL, "bottom-right L > S");
}

#[test]
fn zero_kv_len_gives_zero_rows() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((2, 2, 2, 5, 7, 4, 4), 3);
    case.kv_lens = Some(vec![0, 7]);
    let out = case.sdpa().run_blocking(ctx).unwrap();
    assert!(out
        .output
        .slice(ndarray::s![0, .., .., ..])
        .iter()
        .all(|&x| x == 0.0));
    case.check_all_paths(ctx, TOL, "kv_len 0");
}

#[test]
fn mask_broadcast_shapes() {
    let Some(ctx) = ctx() else { return };
    for (name, case) in common::broadcast_cases() {
        case.check_all_paths(ctx, TOL, &name);
    }
}

#[test]
fn minus_infinity_bias_masks_and_full_row_is_zero() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((1, 1, 1, 4, 5, 4, 4), 6);
    let mut bias = Array::zeros(IxDyn(&[4, 5]));
    bias[[0, 1]] = f32::NEG_INFINITY;
    for j in 0..5 {
        bias[[2, j]] = f32::NEG_INFINITY;
    }
    case.bias = Some(bias);
    case.check_all_paths(ctx, TOL, "-inf bias");
    let out = case.sdpa().run_blocking(ctx).unwrap();
    assert!(out
        .output
        .slice(ndarray::s![0, 0, 2, ..])
        .iter()
        .all(|&x| x == 0.0));
}

/// Logits near ±1e4 computed exactly in f32 (small integers): the max subtraction must keep
/// every value finite, and the result must match the reference at the usual tolerance.
#[test]
fn large_magnitude_logits_stay_finite() {
    let Some(ctx) = ctx() else { return };
    let mut r = common::rng(7);
    let mut int = |shape: (usize, usize, usize, usize)| {
        Array4::from_shape_simple_fn(shape, || rand::Rng::random_range(&mut r, -3i32..=3) as f32)
    };
    let (q, k, v) = (int((1, 2, 9, 16)), int((1, 2, 13, 16)), int((1, 2, 13, 8)));
    for offset in [1.0e4f32, -1.0e4] {
        let case = Case {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
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
        case.check_all_paths(ctx, TOL, &format!("logits around {offset}"));
    }
    // Scaled up inputs: logits are multiples of 64 up to ~9e3 without any bias.
    let case = Case {
        q: q.mapv(|x| 64.0 * x),
        k: k.clone(),
        v: v.clone(),
        mask: None,
        bias: None,
        kv_lens: None,
        causal: Causal::TopLeft,
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
    case.check_all_paths(ctx, TOL, "logits up to 9e3");
}

#[test]
fn batch_times_heads_over_65535() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 33_000, 33_000, 2, 3, 4, 3), 8).with_causal(Causal::BottomRight);
    case.check_all_paths(ctx, TOL, "B*H = 66000");
}

#[test]
fn chunked_scores_match_unchunked() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 3, 1, 50, 45, 8, 12), 9)
        .with_random_mask(1)
        .with_causal(Causal::TopLeft);
    let want = case.reference();
    // 4 KiB of scores: 22 rows of one head at a time. 20 KiB: two whole heads at a time.
    for budget in [4096u64, 20_000, 180] {
        let got = case
            .sdpa()
            .path(Path::Unfused)
            .max_scores_bytes(budget)
            .return_weights()
            .return_lse()
            .run_blocking(ctx)
            .unwrap();
        common::assert_report(
            compare(got.output.iter().copied(), want.out.iter().copied(), TOL),
            &format!("budget {budget} out"),
        );
        common::assert_report(
            compare(
                got.weights.unwrap().iter().copied(),
                want.weights.iter().copied(),
                TOL,
            ),
            &format!("budget {budget} weights"),
        );
    }
}

#[test]
fn scale_one_is_unscaled_dot_product() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((1, 2, 2, 7, 9, 5, 3), 10);
    case.scale = Some(1.0);
    case.check_all_paths(ctx, TOL, "scale 1");
    case.scale = Some(0.0);
    case.check_all_paths(ctx, TOL, "scale 0 (uniform weights)");
}

#[test]
fn nan_input_propagates_without_crash() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((1, 1, 1, 3, 4, 2, 2), 11);
    case.q[[0, 0, 1, 0]] = f32::NAN;
    let out = case.sdpa().run_blocking(ctx).unwrap();
    assert!(out
        .output
        .slice(ndarray::s![0, 0, 1, ..])
        .iter()
        .all(|x| x.is_nan()));
    assert!(out
        .output
        .slice(ndarray::s![0, 0, 0, ..])
        .iter()
        .all(|x| x.is_finite()));
    assert!(out
        .output
        .slice(ndarray::s![0, 0, 2, ..])
        .iter()
        .all(|x| x.is_finite()));
}

/// A NaN logit makes its row NaN on every path with a mask and a bias too, as in PyTorch: the
/// masks test NaN by its bit pattern (WGSL lets compilers assume no NaNs, and lavapipe folded
/// the comparison, so the fused and decode paths' NaN row came out 0, silently).
#[test]
fn nan_row_under_mask_and_bias_is_nan_on_every_path() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((1, 2, 2, 5, 7, 4, 4), 11).with_random_mask(12);
    case.q[[0, 1, 1, 0]] = f32::NAN;
    let mut bias = ndarray::Array::zeros(IxDyn(&[5, 7]));
    bias[[1, 3]] = f32::NEG_INFINITY;
    case.bias = Some(bias);
    for path in [Path::Fused, Path::Decode, Path::Unfused] {
        case.check(
            ctx,
            path,
            TOL,
            &format!("NaN row with mask and -inf bias, {path:?}"),
        );
    }
    let mut plain = Case::random((1, 2, 2, 5, 7, 4, 4), 13).with_random_bias(14);
    plain.k[[0, 0, 2, 1]] = f32::NAN;
    for path in [Path::Fused, Path::Decode, Path::Unfused] {
        plain.check(ctx, path, TOL, &format!("NaN key under a bias, {path:?}"));
    }
    // NaN in keys and values past the key length (a KV cache's unwritten capacity) must not
    // reach any row: every output finite and as the reference's. The fused and decode paths
    // (the paths a decode loop takes); the unfused path still multiplies those V rows by their
    // zero weights (0 * NaN), left for now.
    let mut padded = Case::random((1, 2, 2, 5, 7, 4, 4), 15).with_random_bias(16);
    padded.kv_lens = Some(vec![5]);
    padded.k[[0, 0, 6, 0]] = f32::NAN;
    padded.k[[0, 1, 5, 2]] = f32::NAN;
    padded.v[[0, 1, 6, 1]] = f32::NAN;
    for path in [Path::Fused, Path::Decode] {
        padded.check(ctx, path, TOL, &format!("NaN past the key length, {path:?}"));
    }
    for path in [Path::Fused, Path::Decode] {
        let out = padded.sdpa().path(path).run_blocking(ctx).unwrap();
        assert!(
            out.output.iter().all(|x| x.is_finite()),
            "{path:?}: NaN past the key length leaked"
        );
    }
}

/// A NaN logit makes its row NaN, but keys the boolean mask (or a -inf bias) removes keep
/// weight 0 in that row, as in the reference (the unfused path returns the weights).
#[test]
fn nan_row_keeps_masked_weights_zero() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((1, 2, 2, 5, 7, 4, 4), 11).with_random_mask(12);
    case.q[[0, 1, 1, 0]] = f32::NAN;
    let mut bias = ndarray::Array::zeros(IxDyn(&[5, 7]));
    bias[[1, 3]] = f32::NEG_INFINITY;
    case.bias = Some(bias);
    case.check(ctx, Path::Unfused, TOL, "NaN row with mask and -inf bias");
    let w = case
        .sdpa()
        .path(Path::Unfused)
        .return_weights()
        .run_blocking(ctx)
        .unwrap()
        .weights
        .unwrap();
    assert_eq!(
        w[[0, 1, 1, 3]],
        0.0,
        "a key removed by a -inf bias weighs 0 in a NaN row"
    );
    assert!(w.slice(ndarray::s![0, 1, 1, ..]).iter().any(|x| x.is_nan()));
}

#[test]
fn caller_buffers_in_and_out() {
    let Some(ctx) = ctx() else { return };
    use wgpu::util::DeviceExt;
    let case = Case::random((1, 2, 2, 10, 12, 8, 6), 12).with_causal(Causal::TopLeft);
    let dev = ctx.device();
    let up = |a: &Array4<f32>| {
        dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: bytemuck::cast_slice(a.as_slice().unwrap()),
            usage: wgpu::BufferUsages::STORAGE,
        })
    };
    let (qb, kb, vb) = (up(&case.q), up(&case.k), up(&case.v));
    let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
    let out_buf = dev.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: align + 2 * 10 * 6 * 4,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let got = Sdpa::new(
        wgpu_attention::Tensor::from_buffer(&qb, wgpu_attention::Storage::F32, &[1, 2, 10, 8]),
        wgpu_attention::Tensor::from_buffer(&kb, wgpu_attention::Storage::F32, &[1, 2, 12, 8]),
        wgpu_attention::Tensor::from_buffer(&vb, wgpu_attention::Storage::F32, &[1, 2, 12, 6]),
    )
    .causal(Causal::TopLeft)
    .output_into(
        wgpu_attention::Tensor::from_buffer(&out_buf, wgpu_attention::Storage::F32, &[1, 2, 10, 6])
            .at_offset(align),
    )
    .run_blocking(ctx)
    .unwrap();
    let want = case.reference();
    common::assert_report(
        compare(got.output.iter().copied(), want.out.iter().copied(), TOL),
        "buffers",
    );

    // record into our own encoder, submit ourselves, read back
    let mut enc = dev.create_command_encoder(&Default::default());
    let gpu = case.sdpa().record(ctx, &mut enc).unwrap();
    ctx.queue().submit([enc.finish()]);
    let v = pollster::block_on(ctx.read_f32(&gpu.output, gpu.output_offset, 2 * 10 * 6 * 4)).unwrap();
    common::assert_report(
        compare(v.iter().copied(), want.out.iter().copied(), TOL),
        "record",
    );
}

#[test]
fn adopted_device_works() {
    let Some(ctx) = ctx() else { return };
    let adopted = wgpu_attention::Context::from_device(ctx.device().clone(), ctx.queue().clone());
    let case = Case::random((1, 1, 1, 3, 3, 2, 2), 13);
    case.check(&adopted, Path::Unfused, TOL, "adopted device");
}

/// Non-contiguous inputs (a `[B, L, H, E]` array viewed as `[B, H, L, E]`) are copied into
/// row-major order, not misread.
#[test]
fn non_standard_layout_views_are_copied() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 3, 3, 5, 6, 4, 4), 14);
    let blhe = case
        .q
        .view()
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned();
    let q_view = blhe.view().permuted_axes([0, 2, 1, 3]);
    assert!(!q_view.is_standard_layout());
    let mask = ndarray::Array::from_elem(IxDyn(&[6, 5]), true);
    for path in Path::ALL {
        let got = Sdpa::new(q_view, &case.k, &case.v)
            .mask(mask.t())
            .path(path)
            .run_blocking(ctx)
            .unwrap();
        let want = case.reference();
        common::assert_report(
            compare(got.output.iter().copied(), want.out.iter().copied(), TOL),
            "permuted q",
        );
    }
}

/// KV-cache decoding shapes: one to a few query rows over a long key sequence, split across
/// many workgroups; every mask kind.
#[test]
fn decode_shapes_match_reference_on_every_path() {
    let Some(ctx) = ctx() else { return };
    let base = Case::random((2, 4, 2, 3, 1500, 16, 24), 15);
    assert_eq!(base.sdpa().resolved_path(ctx).unwrap(), Path::Decode);
    base.check_all_paths(ctx, TOL, "decode plain");
    let case = Case::random((2, 4, 2, 3, 1500, 16, 24), 16)
        .with_causal(Causal::BottomRight)
        .with_random_mask(17)
        .with_random_bias(18)
        .with_kv_lens();
    case.check_all_paths(ctx, TOL, "decode all masks");
    let one = Case::random((1, 8, 1, 1, 777, 64, 64), 19).with_causal(Causal::TopLeft);
    one.check_all_paths(ctx, TOL, "decode L=1 top-left (one key)");
}

/// Two halves of the keys, attended separately and merged by the logsumexp rule, equal the
/// whole; an empty half contributes nothing.
#[test]
fn merge_of_disjoint_key_halves_is_the_whole() {
    let Some(ctx) = ctx() else { return };
    use ndarray::s;
    let case = Case::random((1, 2, 2, 7, 30, 8, 5), 20);
    let want = case.reference();
    let (k1, k2) = (
        case.k.slice(s![.., .., ..13, ..]).to_owned(),
        case.k.slice(s![.., .., 13.., ..]).to_owned(),
    );
    let (v1, v2) = (
        case.v.slice(s![.., .., ..13, ..]).to_owned(),
        case.v.slice(s![.., .., 13.., ..]).to_owned(),
    );
    let a = Sdpa::new(&case.q, &k1, &v1)
        .return_lse()
        .run_blocking(ctx)
        .unwrap();
    let b = Sdpa::new(&case.q, &k2, &v2)
        .return_lse()
        .run_blocking(ctx)
        .unwrap();
    let (o, lse) = wgpu_attention::merge_blocking(
        ctx,
        &a.output,
        a.lse.as_ref().unwrap(),
        &b.output,
        b.lse.as_ref().unwrap(),
    )
    .unwrap();
    common::assert_report(
        compare(o.iter().copied(), want.out.iter().copied(), TOL),
        "merged output",
    );
    common::assert_report(
        compare(lse.iter().copied(), want.lse.iter().copied(), TOL),
        "merged lse",
    );
    // A part with no allowed key (lse = -inf) leaves the other part unchanged.
    let empty_o = Array4::<f32>::zeros(a.output.dim());
    let empty_lse = ndarray::Array3::from_elem(a.lse.as_ref().unwrap().dim(), f32::NEG_INFINITY);
    let (o, lse) =
        wgpu_attention::merge_blocking(ctx, &a.output, a.lse.as_ref().unwrap(), &empty_o, &empty_lse)
            .unwrap();
    common::assert_report(
        compare(o.iter().copied(), a.output.iter().copied(), TOL),
        "merge with empty",
    );
    common::assert_report(
        compare(lse.iter().copied(), a.lse.as_ref().unwrap().iter().copied(), TOL),
        "lse with empty",
    );
    let (o, lse) = wgpu_attention::merge_blocking(ctx, &empty_o, &empty_lse, &empty_o, &empty_lse).unwrap();
    assert!(o.iter().all(|&x| x == 0.0) && lse.iter().all(|&x| x == f32::NEG_INFINITY));
    // Shapes are checked.
    let bad = ndarray::Array3::<f32>::zeros((1, 2, 6));
    assert!(wgpu_attention::merge_blocking(ctx, &a.output, &bad, &b.output, &bad).is_err());
}

/// The fused path's device memory is q, k, v, output and logsumexp only (linear in L and S);
/// the unfused path adds a score chunk capped by the binding limit.
#[test]
fn fused_memory_is_linear_in_sequence_length() {
    let Some(ctx) = ctx() else { return };
    let n = 32768;
    let data = vec![0f32; n * 64];
    let t = || wgpu_attention::Tensor::from_slice(&data, &[1, 1, n, 64]);
    let sdpa = Sdpa::new(t(), t(), t()).causal(Causal::TopLeft);
    let linear = 4 * (n as u64 * 64 * 4) + n as u64 * 4;
    assert_eq!(sdpa.clone().path(Path::Fused).device_memory(ctx).unwrap(), linear);
    let unfused = sdpa.clone().path(Path::Unfused).device_memory(ctx).unwrap();
    let max_binding = ctx.limits().max_storage_buffer_binding_size;
    assert!(unfused > linear && unfused <= linear + max_binding, "{unfused}");
    // The scores alone would be 4 GiB: the unfused path chunks them.
    assert!((n as u64 * n as u64 * 4) > max_binding);
}

/// The public matmul (the kernel behind the unfused path) against a plain f64 product:
/// tails on every tile edge, transposed and plain B, shared B.
#[test]
fn matmul_matches_plain_product() {
    let Some(ctx) = ctx() else { return };
    let mut r = common::rng(21);
    for (batch, m, n, k, trans_b, shared) in [
        (2, 70, 65, 33, true, false),
        (3, 5, 130, 17, false, true),
        (1, 1, 1, 1, true, false),
    ] {
        let a = common::rand_array(&mut r, (batch, m, k));
        let bshape = if trans_b {
            (if shared { 1 } else { batch }, n, k)
        } else {
            (if shared { 1 } else { batch }, k, n)
        };
        let b = common::rand_array(&mut r, bshape);
        let got = wgpu_attention::matmul_blocking(ctx, &a, &b, trans_b, 0.5).unwrap();
        let mut want = ndarray::Array3::<f64>::zeros((batch, m, n));
        for z in 0..batch {
            let bz = if shared { 0 } else { z };
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0;
                    for kk in 0..k {
                        let bv = if trans_b { b[[bz, j, kk]] } else { b[[bz, kk, j]] };
                        acc += a[[z, i, kk]] as f64 * bv as f64;
                    }
                    want[[z, i, j]] = 0.5 * acc;
                }
            }
        }
        common::assert_report(compare(got.iter().copied(), want.iter().copied(), TOL), "matmul");
    }
    let a = ndarray::Array3::<f32>::zeros((2, 3, 4));
    let b = ndarray::Array3::<f32>::zeros((2, 5, 3));
    assert!(matches!(
        wgpu_attention::matmul_blocking(ctx, &a, &b, true, 1.0),
        Err(wgpu_attention::Error::ShapeMismatch { tensor: "b", .. })
    ));
}

/// `record_matmul`: the product recorded into the caller's encoder and written into the caller's
/// buffer, at an offset, in f16 and f32, from GPU operands (one of them shared); every mistake a
/// typed error before anything is recorded.
#[test]
fn record_matmul_into_caller_buffer() {
    use wgpu::util::DeviceExt;
    use wgpu_attention::{record_matmul, Error, Storage, Tensor};
    let Some(ctx) = ctx() else { return };
    let mut r = common::rng(22);
    let (batch, m, n, k) = (2, 37, 41, 19);
    let a = common::rand_array(&mut r, (batch, m, k));
    let b = common::rand_array(&mut r, (1, n, k));
    let want = ndarray::Array3::from_shape_fn((batch, m, n), |(z, i, j)| {
        0.25 * (0..k)
            .map(|kk| a[[z, i, kk]] as f64 * b[[0, j, kk]] as f64)
            .sum::<f64>()
    });
    let dev = ctx.device();
    let upload = |x: &[f32]| {
        dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: bytemuck::cast_slice(x),
            usage: wgpu::BufferUsages::STORAGE,
        })
    };
    let (abuf, bbuf) = (upload(a.as_slice().unwrap()), upload(b.as_slice().unwrap()));
    let ta = || Tensor::from_buffer(&abuf, Storage::F32, &[batch, m, k]);
    let tb = || Tensor::from_buffer(&bbuf, Storage::F32, &[1, n, k]);
    let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
    for storage in [Storage::F32, Storage::F16] {
        let c_bytes = storage.bytes(batch * m * n);
        let cbuf = dev.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: align + c_bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let c = Tensor::from_buffer(&cbuf, storage, &[batch, m, n]).at_offset(align);
        let mut enc = dev.create_command_encoder(&Default::default());
        record_matmul(ctx, &mut enc, ta(), tb(), c, true, 0.25).unwrap();
        ctx.queue().submit([enc.finish()]);
        let got = pollster::block_on(ctx.read_as_f32(&cbuf, align, batch * m * n, storage)).unwrap();
        let tol = wgpu_attention::check::Tolerance::for_storage(storage);
        common::assert_report(
            compare(got.iter().copied(), want.iter().copied(), tol),
            &format!("record_matmul {storage:?}"),
        );
    }
    // Mistakes, each before anything is recorded.
    let cbuf = dev.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4 * (batch * m * n) as u64,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let c = |buf, st, shape: [usize; 3]| Tensor::from_buffer(buf, st, &shape);
    let mut enc = dev.create_command_encoder(&Default::default());
    let host_c = ndarray::Array3::<f32>::zeros((batch, m, n));
    let mut mm = |c, trans_b| record_matmul(ctx, &mut enc, ta(), tb(), c, trans_b, 1.0);
    let bad = [
        (
            "c of the wrong shape",
            mm(c(&cbuf, Storage::F32, [batch, n, m]), true),
        ),
        ("host c", mm(Tensor::from(&host_c), true)),
        ("c in a's buffer", mm(c(&abuf, Storage::F16, [batch, m, n]), true)),
        ("c too small", mm(c(&bbuf, Storage::F32, [batch, m, n]), true)),
        (
            "b of the wrong shape",
            mm(c(&cbuf, Storage::F32, [batch, m, n]), false),
        ),
    ];
    for (label, res) in bad {
        match res {
            Err(Error::ShapeMismatch { .. }) | Err(Error::BadBuffer { .. }) => {}
            other => panic!("{label}: {other:?}"),
        }
    }
}

/// A problem big enough (2.5e8 FLOPs) that CPU adapters take the production unrolled fused
/// kernel (16 rows per invocation at E = 64), with every mask kind, a fully masked row, a
/// zero key length and a tail on both sequence lengths.
#[test]
fn large_problem_on_the_unrolled_fused_kernel() {
    let Some(ctx) = ctx() else { return };
    let case = Case::large();
    case.check(ctx, Path::Fused, TOL, "large unrolled");
    // On CPU adapters the first use may have been served by the one-row form while the
    // fastest form compiled in the background: check that one too.
    ctx.wait_idle().unwrap();
    case.check(ctx, Path::Fused, TOL, "large unrolled, fastest form");
}

/// Bottom-right causal with key lengths aligns each batch's last query row with that batch's
/// last key (FlashAttention's rule for varlen batches and KV caches), on every path: checked
/// against the reference, and the reference itself against each batch run alone on its keys
/// cut to its length (where bottom-right needs no key lengths). A length below L leaves the
/// leading rows fully masked; the prefill of L tokens into a cache of capacity S is the case
/// that was silently wrong (aligned to the tensor's S).
#[test]
fn bottom_right_with_kv_lens_aligns_to_each_batch() {
    let Some(ctx) = ctx() else { return };
    for (shape, lens) in [
        ((3, 4, 2, 5, 23, 8, 6), vec![23, 9, 3]),
        ((2, 2, 1, 17, 40, 16, 16), vec![17, 33]),
        // Decode: one query per batch, long keys (the split-K path's shape).
        ((2, 2, 2, 1, 600, 8, 8), vec![600, 77]),
    ] {
        let mut case = Case::random(shape, 31).with_causal(Causal::BottomRight);
        case.kv_lens = Some(lens.clone());
        let want = case.reference();
        for (b, &len) in lens.iter().enumerate() {
            let one = |a: &Array4<f32>, keys: bool| {
                let a = a.slice(ndarray::s![b..b + 1, .., .., ..]);
                if keys {
                    a.slice(ndarray::s![.., .., ..len, ..]).to_owned()
                } else {
                    a.to_owned()
                }
            };
            let alone = wgpu_attention::reference::sdpa(
                one(&case.q, false).view(),
                one(&case.k, true).view(),
                one(&case.v, true).view(),
                &wgpu_attention::Options {
                    causal: Causal::BottomRight,
                    ..Default::default()
                },
            )
            .unwrap();
            let mine = want.out.slice(ndarray::s![b..b + 1, .., .., ..]);
            common::assert_report(
                compare(mine.iter().copied(), alone.out.iter().copied(), TOL),
                &format!("reference batch {b} (len {len}) against the batch alone"),
            );
        }
        case.check_all_paths(ctx, TOL, &format!("bottom-right kv_lens {lens:?}"));
    }
}

/// A context adopted from a caller's device reads the adapter's information from the device:
/// the same caps (so the same plan, forms and params placement) as the crate's own context,
/// whichever way it is adopted.
#[test]
fn adopted_device_plans_like_the_crates_own() {
    let Some(ctx) = ctx() else { return };
    let adopted = wgpu_attention::Context::from_device(ctx.device().clone(), ctx.queue().clone());
    assert_eq!(adopted.adapter_info(), ctx.adapter_info());
    assert_eq!(adopted.is_cpu(), ctx.is_cpu());
    // The same caps, but the matrix units: their tiles are the adapter's to list, which
    // from_device does not have (from_parts does).
    let caps = adopted.caps();
    assert!(
        caps.coop.largest().is_none() && caps.coop.none_because.is_some_and(|w| w.contains("from_parts"))
    );
    let like_ours = wgpu_attention::Caps {
        coop: ctx.caps().coop,
        ..caps
    };
    assert_eq!(format!("{like_ours:?}"), format!("{:?}", ctx.caps()));
    let case = Case::random((1, 8, 2, 128, 256, 64, 64), 5);
    let prefill = case.sdpa();
    assert_eq!(
        format!("{:?}", prefill.plan(&adopted).unwrap()),
        format!("{:?}", prefill.plan(ctx).unwrap())
    );
    let decode = Case::random((1, 8, 2, 1, 700, 64, 64), 6);
    assert_eq!(
        format!("{:?}", decode.sdpa().plan(&adopted).unwrap()),
        format!("{:?}", decode.sdpa().plan(ctx).unwrap())
    );
    decode.check(&adopted, Path::Auto, TOL, "adopted device, decode");
}

/// A generation loop prepared over its key lengths compiles nothing when it crosses the
/// decode threshold (512 keys) or any other form boundary: every length's call finds its
/// pipelines cached (on a fresh context: its own, empty pipeline cache).
#[test]
fn prepared_kernels_cover_a_growing_kv_cache() {
    let Some(ctx) = ctx() else { return };
    let fresh = wgpu_attention::Context::from_device(ctx.device().clone(), ctx.queue().clone());
    assert_eq!(fresh.cached_pipelines(), 0);
    let step = |s: usize| {
        let mut case = Case::random((1, 4, 2, 1, s, 16, 16), s as u64).with_causal(Causal::BottomRight);
        case.kv_lens = Some(vec![s - 1]);
        case
    };
    let template = step(8);
    let forms = template.sdpa().prepare_blocking(&fresh, 1..=700).unwrap();
    // CPU adapters: the decode path from 512 keys and the fused one below; GPUs run one
    // query row by the decode kernel at every length.
    let least = if ctx.is_cpu() { 2 } else { 1 };
    assert!(forms >= least, "the decode path and another: {forms}");
    let prepared = fresh.cached_pipelines();
    assert!(prepared > 0);
    for s in [3, 64, 511, 512, 513, 700] {
        let case = step(s);
        case.check(&fresh, Path::Auto, TOL, &format!("S = {s}"));
        assert_eq!(fresh.cached_pipelines(), prepared, "S = {s} compiled a kernel");
    }
}

/// The strict-WebGPU lane (CI runs this file, `errors.rs` and `golden.rs` with
/// `WGPU_STRICT_WEBGPU_COMPLIANCE=1` on Vulkan): the context's device has WebGPU's features
/// only, so every kernel and limit the suite touches is validated as a browser would.
#[test]
fn strict_webgpu_lane_has_only_webgpu_features() {
    let Some(ctx) = ctx() else { return };
    if std::env::var("WGPU_STRICT_WEBGPU_COMPLIANCE").as_deref() != Ok("1") {
        return;
    }
    let extra = ctx.features() - wgpu::Features::all_webgpu_mask();
    assert!(extra.is_empty(), "features beyond WebGPU's: {extra:?}");
    assert!(ctx.caps().subgroup.is_none() || ctx.features().contains(wgpu::Features::SUBGROUP));
}
