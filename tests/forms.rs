//! The form matrix: every case whose result depends on the kernel's form, checked in one
//! process against every form of the fused, decode, backward and matmul kernels this device
//! can run ([`Caps::fused_forms`], [`Caps::decode_forms`], [`Caps::backward_forms`],
//! [`Caps::matmul_forms`]), with one reference per case. The other
//! test files run the default forms (the plan's choice); this file pins each form through
//! [`Context::with_forms`].
//!
//! Cases: shapes with tails on every tile edge (L != S, E != Ev, GQA/MQA) with no mask and with
//! every mask kind combined (bottom-right causal, a boolean mask with fully masked rows, a bias,
//! key lengths); head dims at the limit of 256; a problem large enough for the fastest CPU
//! form, with a zero key length; decode shapes; mask and bias broadcasts, `-inf` biases and
//! ±1e4 logits; batch × heads over 65,535; the PyTorch goldens; one multi-head attention layer;
//! the backward on shapes with tails, with and without every mask kind; the unfused paths and
//! the public matmul; pinned forms the device cannot run.
//! Each case skips its default form, which the rest of the suite checks.
//!
//! [`Caps::fused_forms`]: wgpu_attention::Caps::fused_forms
//! [`Caps::decode_forms`]: wgpu_attention::Caps::decode_forms
//! [`Caps::backward_forms`]: wgpu_attention::Caps::backward_forms
//! [`Caps::matmul_forms`]: wgpu_attention::Caps::matmul_forms

mod common;

use common::{ctx, goldens, Case, SHAPES, TOL};
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::{
    BackwardForm, Causal, Context, DecodeForm, Error, Form, FusedForm, MatmulForm, Options, Path, Storage,
    Tuning,
};

/// Every mask kind at once: bottom-right causal, a boolean mask with fully masked rows, a
/// bias and key lengths.
fn all_masks(c: Case, seed: u64) -> Case {
    c.with_causal(Causal::BottomRight)
        .with_random_mask(seed)
        .with_random_bias(seed + 1)
        .with_kv_lens()
}

/// A context per fused form this device offers, each pinned (the device, queue and pipeline
/// cache are shared), except `case`'s default form: the plan's own choice, which the rest of
/// the suite (`tests/sdpa.rs`, `tests/golden.rs`, `tests/mha.rs`) checks on the same kinds of
/// case.
fn fused_contexts(ctx: &Context, case: &Case) -> Vec<(FusedForm, Context)> {
    let default = case.sdpa().path(Path::Fused).plan(ctx).map(|p| p.form()).ok();
    every_fused_context(ctx)
        .into_iter()
        .filter(|(f, _)| default != Some(Form::Fused(*f)))
        .filter(|(f, c)| takes(*f, c, case))
        .collect()
}

/// Whether pinned form `f` takes `case`: every scalar form does; the matrix units' forms
/// refuse bf16 inputs and half outputs they would store by atomics (tests/coop.rs checks the
/// refusals; `Path::Auto` routes around them).
fn takes(f: FusedForm, c: &Context, case: &Case) -> bool {
    !f.is_coop() || case.sdpa().path(Path::Fused).plan(c).is_ok()
}

/// A context per fused form this device offers, the default one included.
fn every_fused_context(ctx: &Context) -> Vec<(FusedForm, Context)> {
    ctx.caps()
        .fused_forms()
        .into_iter()
        .map(|f| (f, ctx.with_forms(f)))
        .collect()
}

/// [`fused_contexts`] for the decode kernel.
fn decode_contexts(ctx: &Context, case: &Case) -> Vec<(DecodeForm, Context)> {
    let default = case.sdpa().path(Path::Decode).plan(ctx).map(|p| p.form()).ok();
    ctx.caps()
        .decode_forms()
        .into_iter()
        .filter(|f| default != Some(Form::Decode(*f)))
        .map(|f| (f, ctx.with_forms(f)))
        .collect()
}

/// The tolerance of a fused form on f32 inputs: the matrix units' forms take them rounded to
/// f16 (their pinned opt-in), so theirs is f16's, twice (the tests' rule for rounded
/// intermediates); the others f32's.
fn form_tol(form: FusedForm) -> Tolerance {
    if form.is_coop() {
        common::twice_storage_tolerance(wgpu_attention::Storage::F16)
    } else {
        TOL
    }
}

/// Check `case` on the fused path in each of `forms` (pinned contexts), against one reference.
fn check_pinned_forms(case: &Case, forms: Vec<(FusedForm, Context)>, label: &str) {
    let want = case.reference();
    for (form, fctx) in forms.into_iter().filter(|(f, c)| takes(*f, c, case)) {
        let plan = case.sdpa().path(Path::Fused).plan(&fctx).unwrap();
        assert_eq!(plan.form(), Form::Fused(form), "{label}: the pinned form runs");
        case.check_against(
            &want,
            &fctx,
            Path::Fused,
            form_tol(form),
            &format!("{label} [{}]", form.name()),
        );
    }
}

#[test]
fn the_forms_this_device_offers() {
    let Some(ctx) = ctx() else { return };
    let caps = ctx.caps();
    let fused = caps.fused_forms();
    assert!(fused.contains(&FusedForm::Gpu) && fused.len() >= 3, "{fused:?}");
    eprintln!(
        "fused forms: {:?}; decode forms: {:?}",
        fused.iter().map(|f| f.name()).collect::<Vec<_>>(),
        caps.decode_forms().iter().map(|f| f.name()).collect::<Vec<_>>()
    );
}

/// Every grid shape (tails on every tile edge, L != S, E != Ev, GQA, MQA) in every fused form,
/// half of the (shape, form) pairs without a mask and the other half with every mask kind at
/// once, alternating: each form runs every shape and both the plain and the masked kernel
/// (each pair compiles its own specialisation: covering the pairs once, not twice, halves
/// what these two tests compile). Two tests, so that the halves run in parallel.
fn check_shapes_with_tails(masked: bool) {
    let Some(ctx) = ctx() else { return };
    for (si, &shape) in SHAPES.iter().enumerate() {
        let case = if masked {
            all_masks(Case::random(shape, 100 + si as u64), 9)
        } else {
            Case::random(shape, si as u64)
        };
        let forms: Vec<(FusedForm, Context)> =
            every_other(fused_contexts(ctx, &case), si + usize::from(masked)).collect();
        let label = if masked { "all masks" } else { "no mask" };
        check_pinned_forms(&case, forms, &format!("{shape:?} {label}"));
    }
}

#[test]
fn shapes_with_tails_in_every_fused_form() {
    check_shapes_with_tails(false);
}

#[test]
fn shapes_with_tails_and_every_mask_kind_in_every_fused_form() {
    check_shapes_with_tails(true);
}

/// Head dims at the limit in every fused form: the largest (vec4 I/O) and the largest odd
/// ones (scalar I/O); tests/sdpa.rs runs more in the default forms. Two tests, so that they
/// compile in parallel.
///
/// Each form with one query row per invocation (`loop:1`, `tiled:1`, `subgroup:1`; the GPU
/// forms as they are): the head dims size the register arrays and the tiles, the rows only
/// multiply the unrolled code, and at E = 256 each multi-row unrolled kernel took 20-40 s to
/// compile on lavapipe (these two tests: 500 s of a cold CI run). The multi-row forms run in
/// this file's other tests.
fn check_head_dims(e: usize, ev: usize, seed: u64) {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((1, 2, 1, 9, 21, e, ev), seed)
        .with_causal(Causal::BottomRight)
        .with_random_mask(41)
        .with_random_bias(42);
    let default = case.sdpa().path(Path::Fused).plan(ctx).map(|p| p.form()).ok();
    let mut forms: Vec<FusedForm> = Vec::new();
    for f in ctx.caps().fused_forms() {
        let one_row = match f {
            FusedForm::Loop { .. } => FusedForm::Loop { rows: 1 },
            FusedForm::Tiled { .. } => FusedForm::Tiled { rows: 1 },
            FusedForm::Subgroup { .. } => FusedForm::Subgroup { rows: 1 },
            other => other,
        };
        if !forms.contains(&one_row) && default != Some(Form::Fused(one_row)) {
            forms.push(one_row);
        }
    }
    assert!(forms.len() >= 2, "{forms:?}");
    let contexts = forms.into_iter().map(|f| (f, ctx.with_forms(f))).collect();
    check_pinned_forms(&case, contexts, &format!("E {e}, Ev {ev}"));
}

#[test]
fn head_dims_256_in_every_fused_form() {
    check_head_dims(256, 256, 40);
}

#[test]
fn head_dims_255_129_in_every_fused_form() {
    check_head_dims(255, 129, 41);
}

/// 2.5e8 FLOPs: large enough for the fastest CPU forms (several rows per invocation), with
/// every mask kind, fully masked rows and a zero key length.
#[test]
fn large_problem_in_every_fused_form() {
    let Some(ctx) = ctx() else { return };
    let case = Case::large();
    let want = case.reference();
    let mut forms = fused_contexts(ctx, &case);
    // The fastest CPU form of the default plan too (4 rows per invocation on lavapipe).
    if let Form::Fused(f) = case.sdpa().path(Path::Fused).plan(ctx).unwrap().form() {
        if !forms.iter().any(|(g, _)| *g == f) {
            forms.push((f, ctx.with_forms(f)));
        }
    }
    for (form, fctx) in forms {
        case.check_against(
            &want,
            &fctx,
            Path::Fused,
            form_tol(form),
            &format!("large [{}]", form.name()),
        );
    }
}

#[test]
fn decode_shapes_in_every_decode_form() {
    let Some(ctx) = ctx() else { return };
    let cases = [
        ("plain", Case::random((2, 4, 2, 3, 1500, 16, 24), 15)),
        (
            "all masks",
            all_masks(Case::random((2, 4, 2, 3, 1500, 16, 24), 16), 17),
        ),
        (
            "E 37 Ev 5",
            all_masks(Case::random((1, 2, 1, 2, 700, 37, 5), 18), 19),
        ),
        (
            "L=1 top-left",
            Case::random((1, 8, 1, 1, 777, 64, 64), 20).with_causal(Causal::TopLeft),
        ),
        // Half formats with E a multiple of 8 (16-byte K loads), and the largest head dims.
        (
            "f16 E 128",
            all_masks(Case::random((1, 4, 2, 2, 900, 128, 128), 21), 22).with_storage(Storage::F16),
        ),
        (
            "bf16 E 256 Ev 200",
            Case::random((1, 2, 1, 3, 600, 256, 200), 23)
                .with_kv_lens()
                .with_storage(Storage::Bf16),
        ),
    ];
    for (name, case) in cases {
        let tol = Tolerance::for_storage(case.storage);
        let want = case.reference();
        for (form, dctx) in decode_contexts(ctx, &case) {
            let plan = case.sdpa().plan(&dctx).unwrap();
            assert_eq!(plan.form(), Form::Decode(form), "{name}");
            case.check_against(
                &want,
                &dctx,
                Path::Decode,
                tol,
                &format!("decode {name} [{}]", form.name()),
            );
        }
    }
}

/// Every other item of `items`: those at even positions when `parity` is even, else those at
/// odd positions (cases take turns over the forms, so each pair runs once, not twice).
fn every_other<T>(items: Vec<T>, parity: usize) -> impl Iterator<Item = T> {
    items
        .into_iter()
        .enumerate()
        .filter(move |(j, _)| (parity + j).is_multiple_of(2))
        .map(|(_, x)| x)
}

/// PyTorch's goldens in every form: each golden in every other form (alternating with its
/// index; tests/golden.rs runs each in the default forms), so that every form runs about half
/// of them, every storage format, mask kind and head-dim class among them: the forms' own code
/// is their loops and I/O, the semantics are shared (masks.wgsl, softmax.wgsl), and each
/// (golden, form) pair compiles its own specialisation (all pairs: 249 s of a cold run).
#[test]
fn pytorch_goldens_in_every_form() {
    let Some(ctx) = ctx() else { return };
    for (gi, g) in goldens().into_iter().enumerate() {
        for (form, fctx) in every_other(fused_contexts(ctx, &g.case), gi) {
            let got = g
                .case
                .sdpa()
                .path(Path::Fused)
                .return_lse()
                .run_blocking(&fctx)
                .unwrap_or_else(|e| panic!("{} [{}]: {e}", g.name, form.name()));
            // The matrix units' forms take f32 inputs rounded to f16 (their pinned opt-in).
            let tol = match form.is_coop() && g.case.storage == wgpu_attention::Storage::F32 {
                true => form_tol(form),
                false => g.tolerance(),
            };
            g.assert_matches(&got, Path::Fused, tol, &format!("fused [{}]", form.name()));
        }
        for (form, dctx) in every_other(decode_contexts(ctx, &g.case), gi) {
            let got = g
                .case
                .sdpa()
                .path(Path::Decode)
                .return_lse()
                .run_blocking(&dctx)
                .unwrap();
            g.assert_matches(
                &got,
                Path::Decode,
                g.tolerance(),
                &format!("decode [{}]", form.name()),
            );
        }
    }
}

/// One multi-head attention layer (GQA, cross-attention, every mask kind) in every fused form.
#[test]
fn multi_head_attention_in_every_fused_form() {
    use ndarray::{Array, IxDyn};
    use wgpu_attention::reference::{self, MhaInputs};
    use wgpu_attention::{MhaConfig, MhaWeights, MultiHeadAttention};
    let Some(ctx) = ctx() else { return };
    let config = MhaConfig::new(24, 4).kv_heads(2).kv_dims(10, 14);
    let w = MhaWeights::xavier_uniform(config, 3).unwrap();
    let mut r = common::rng(4);
    let x = common::rand_array(&mut r, (2, 13, 24));
    let k = common::rand_array(&mut r, (2, 19, 10));
    let v = common::rand_array(&mut r, (2, 19, 14));
    let mask = Array::from_shape_simple_fn(IxDyn(&[13, 19]), || {
        rand::Rng::random_range(&mut r, 0.0..1.0) > 0.3
    });
    let lens = [19, 11];
    let spec = Options {
        causal: Causal::BottomRight,
        mask: Some((&mask).into()),
        kv_lens: Some(lens.to_vec()),
        ..Default::default()
    };
    let want = reference::mha(&w, &MhaInputs::cross(x.view(), k.view(), v.view()), &spec).unwrap();
    for (form, fctx) in every_fused_context(ctx) {
        let layer = MultiHeadAttention::new(&fctx, &w).unwrap();
        let got = layer
            .forward(&x)
            .key_value(&k, &v)
            .causal(Causal::BottomRight)
            .mask(&mask)
            .kv_lens(&lens)
            .path(Path::Fused)
            .run_blocking(&fctx)
            .unwrap();
        common::assert_report(
            compare(
                got.output.iter().copied(),
                want.out.iter().copied(),
                form_tol(form),
            ),
            &format!("mha [{}]", form.name()),
        );
    }
}

/// Mask and bias broadcast shapes (every rank and broadcast dimension), a `-inf` bias that
/// masks a key and a whole row, and logits near ±1e4: the mask indexing and the sentinels in
/// every fused and decode form.
#[test]
fn broadcasts_infinite_bias_and_large_logits_in_every_form() {
    use ndarray::{Array, Array4, IxDyn};
    let Some(ctx) = ctx() else { return };
    let mut r = common::rng(5);
    let mut cases = common::broadcast_cases();
    let mut inf = Case::random((2, 3, 3, 6, 10, 8, 8), 6);
    let mut bias = Array::zeros(IxDyn(&[6, 10]));
    bias[[0, 1]] = f32::NEG_INFINITY;
    for j in 0..10 {
        bias[[2, j]] = f32::NEG_INFINITY;
    }
    inf.bias = Some(bias);
    cases.push(("-inf bias".into(), inf));
    let mut int = |shape: (usize, usize, usize, usize)| {
        Array4::from_shape_simple_fn(shape, || rand::Rng::random_range(&mut r, -3i32..=3) as f32)
    };
    for offset in [1.0e4f32, -1.0e4] {
        let case = Case {
            q: int((2, 3, 6, 8)),
            k: int((2, 3, 10, 8)),
            v: int((2, 3, 10, 8)),
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
        cases.push((format!("logits around {offset}"), case));
    }
    for (name, case) in &cases {
        let want = case.reference();
        for (form, fctx) in fused_contexts(ctx, case) {
            case.check_against(
                &want,
                &fctx,
                Path::Fused,
                form_tol(form),
                &format!("{name} [{}]", form.name()),
            );
        }
        for (form, dctx) in decode_contexts(ctx, case) {
            case.check_against(
                &want,
                &dctx,
                Path::Decode,
                TOL,
                &format!("{name} [{}]", form.name()),
            );
        }
    }
}

/// A forms context (as [`fused_contexts`] uses) is a pinned copy of `ctx`; this one is a new
/// device on the same adapter whose `max_compute_workgroups_per_dimension` is `limit`, so
/// that dispatch grids fold over x and y (and leave a tail) at a few hundred workgroups.
fn context_with_grid_limit(limit: u32) -> Context {
    pollster::block_on(async {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        if let Some(backends) = wgpu::Backends::from_env() {
            desc.backends = backends;
        }
        let instance = wgpu::Instance::new(desc);
        let adapter = instance
            .request_adapter(&Default::default())
            .await
            .expect("the adapter the suite runs on");
        let limits = wgpu::Limits {
            max_compute_workgroups_per_dimension: limit,
            ..adapter.limits()
        };
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("grid limit"),
                required_features: adapter.features() & Context::wanted_features(),
                required_limits: limits,
                ..Default::default()
            })
            .await
            .expect("a device with a lower grid limit");
        let ctx = Context::from_parts(&adapter, device, queue);
        assert_eq!(ctx.limits().max_compute_workgroups_per_dimension, limit);
        ctx
    })
}

/// Batch × heads over 65,535: the grid folds over x and y in every form.
///
/// At the device's own limit (66,000 heads) in every form but the default (tests/sdpa.rs runs
/// that on every path) and, on CPU adapters, the GPU-shaped forms, whose large workgroups
/// take about a millisecond each on lavapipe (150 s for this case). Every form, the default
/// and the GPU-shaped ones included, then runs the same fold on a device whose limit is 61
/// (300 heads: grids of 61 x 5 with a tail), and the unfused path with it.
#[test]
fn batch_times_heads_over_65535_in_every_form() {
    let Some(ctx) = ctx() else { return };
    let slow_here = |gpu_shaped: bool| ctx.is_cpu() && gpu_shaped;
    let case = Case::random((2, 33_000, 33_000, 2, 3, 4, 3), 8).with_causal(Causal::BottomRight);
    let want = case.reference();
    for (form, fctx) in fused_contexts(ctx, &case) {
        if slow_here(matches!(form, FusedForm::Gpu | FusedForm::GpuTiles)) {
            continue;
        }
        case.check_against(
            &want,
            &fctx,
            Path::Fused,
            form_tol(form),
            &format!("B*H = 66000 [{}]", form.name()),
        );
    }
    for (form, dctx) in decode_contexts(ctx, &case) {
        if slow_here(matches!(form, DecodeForm::Gpu | DecodeForm::GpuTiles)) {
            continue;
        }
        case.check_against(
            &want,
            &dctx,
            Path::Decode,
            TOL,
            &format!("B*H = 66000 [{}]", form.name()),
        );
    }

    let limit = 61;
    let small = context_with_grid_limit(limit);
    let case = Case::random((2, 150, 50, 2, 3, 4, 3), 18).with_causal(Causal::BottomRight);
    let want = case.reference();
    for (form, fctx) in every_fused_context(&small) {
        case.check_against(
            &want,
            &fctx,
            Path::Fused,
            form_tol(form),
            &format!("B*H = 300, grid limit {limit} [{}]", form.name()),
        );
    }
    for form in small.caps().decode_forms() {
        case.check_against(
            &want,
            &small.with_forms(form),
            Path::Decode,
            TOL,
            &format!("B*H = 300, grid limit {limit} [{}]", form.name()),
        );
    }
    case.check_against(
        &want,
        &small,
        Path::Unfused,
        TOL,
        &format!("B*H = 300, grid limit {limit} [unfused]"),
    );
}

/// An upstream gradient for `case`, rounded to its format.
fn dout_for(case: &Case, seed: u64) -> ndarray::Array4<f32> {
    let (b, h, l, _) = case.dims();
    let ev = case.v.dim().3;
    common::rand_array(&mut common::rng(seed), (b, h, l, ev)).mapv(|x| case.storage.round(x))
}

/// The backward of `case` on `path` in `fctx`'s pinned forms, which must be the ones that run
/// (`want`), checked against the reference by FlashAttention's rule.
fn check_backward(fctx: &Context, case: &Case, path: Path, want: Form, label: &str) {
    let dout = dout_for(case, 99);
    let dout_t = wgpu_attention::Tensor::from(&dout).with_storage(case.storage);
    let b = case.sdpa().backward(dout_t).path(path);
    assert_eq!(b.form(fctx).unwrap(), want, "{label}: the pinned form runs");
    let g = b.run_blocking(fctx).unwrap_or_else(|e| panic!("{label}: {e}"));
    // The matrix units' form takes f32 inputs rounded to f16 (its pinned opt-in): f16's rule.
    let rule = match want {
        Form::Backward(f) if f.is_coop() => wgpu_attention::Storage::F16,
        _ => case.storage,
    };
    common::assert_grads_at(case, &g, &dout, rule, label);
}

/// The fused backward in every form this device offers but each case's default (tests/backward.rs
/// runs the default on every shape and mask kind): three shapes with tails (small odd head
/// dims and L != S; vec4 I/O at E = 64 with GQA; MQA with E != Ev), each form meeting each
/// shape once, without a mask and with every mask kind at once in turn. Each pair compiles its
/// own kernels, and the unrolled multi-row forms compile for seconds per vec4 of the head dims
/// (at E = 33, Ev = 65 with every mask: 14-17 s each on lavapipe), so the odd dims are small.
#[test]
fn backward_in_every_backward_form() {
    let Some(ctx) = ctx() else { return };
    let forms = ctx.caps().backward_forms();
    assert!(
        forms.contains(&BackwardForm::Gpu) && forms.len() >= 2,
        "{forms:?}"
    );
    for (si, shape) in [
        (1, 2, 2, 19, 37, 7, 5),
        (2, 4, 2, 65, 63, 64, 64),
        (1, 4, 1, 5, 129, 8, 20),
    ]
    .into_iter()
    .enumerate()
    {
        let plain = Case::random(shape, 300 + si as u64);
        let dout = dout_for(&plain, 1);
        let default = plain.sdpa().backward(&dout).path(Path::Fused).form(ctx).ok();
        for (fi, form) in forms.iter().copied().enumerate() {
            if default == Some(Form::Backward(form)) {
                continue;
            }
            let masked = (si + fi) % 2 == 1;
            let case = Case::random(shape, 300 + si as u64);
            let case = if masked { all_masks(case, 7) } else { case };
            let label = format!(
                "{shape:?} {} [{}]",
                if masked { "all masks" } else { "no mask" },
                form.name()
            );
            check_backward(
                &ctx.with_forms(form),
                &case,
                Path::Fused,
                Form::Backward(form),
                &label,
            );
        }
    }
}

/// The matmul in every form this device offers but its default (the stage test in
/// `src/kernels/stage_tests.rs` runs every form on every storage format): the unfused forward
/// with every mask kind and the unfused backward, each on a shape with tails, and the public
/// `matmul` with a transposed B.
#[test]
fn unfused_paths_in_every_matmul_form() {
    let Some(ctx) = ctx() else { return };
    let forms = ctx.caps().matmul_forms();
    assert!(
        forms.contains(&MatmulForm::Tiled) && forms.contains(&MatmulForm::GpuTiles),
        "{forms:?}"
    );
    let fwd = all_masks(Case::random((1, 4, 2, 70, 130, 33, 65), 41), 43);
    let bwd = Case::random((2, 4, 2, 65, 63, 64, 64), 42);
    let default = fwd.sdpa().path(Path::Unfused).plan(ctx).unwrap().form();
    let want = fwd.reference();
    let (m, n, k) = (67, 45, 19);
    let a = common::rand_array(&mut common::rng(5), (1, m, k));
    let b = common::rand_array(&mut common::rng(6), (1, n, k));
    let product = ndarray::Array2::from_shape_fn((m, n), |(i, j)| {
        (0..k)
            .map(|x| a[[0, i, x]] as f64 * b[[0, j, x]] as f64)
            .sum::<f64>()
    });
    for form in forms {
        if default == Form::Unfused(form) {
            continue;
        }
        let fctx = ctx.with_forms(form);
        let label = format!("[{}]", form.name());
        let plan = fwd.sdpa().path(Path::Unfused).plan(&fctx).unwrap();
        assert_eq!(plan.form(), Form::Unfused(form), "{label}: the pinned form runs");
        // The matrix units' form takes f32 operands rounded to f16 (its pinned opt-in).
        let tol = if form.is_coop() {
            common::twice_storage_tolerance(wgpu_attention::Storage::F16)
        } else {
            TOL
        };
        fwd.check_against(
            &want,
            &fctx,
            Path::Unfused,
            tol,
            &format!("forward, all masks {label}"),
        );
        if !form.is_coop() {
            check_backward(
                &fctx,
                &bwd,
                Path::Unfused,
                Form::Unfused(form),
                &format!("backward {label}"),
            );
        }
        let c = wgpu_attention::matmul_blocking(&fctx, &a, &b, true, 1.0).unwrap();
        let r = compare(c.iter().copied(), product.iter().copied(), tol);
        assert!(r.passed(), "matmul {label}: {r}");
    }
}

/// A pinned form the device cannot run is refused with a typed error, before any GPU work, on
/// every path that would run it (not replaced by another path).
#[test]
fn pinned_forms_the_device_cannot_run_are_refused() {
    let Some(ctx) = ctx() else { return };
    let caps = ctx.caps();
    let case = Case::random((1, 2, 2, 9, 21, 8, 8), 3);
    let dout = dout_for(&case, 4);
    let unsupported = |r: Result<Form, Error>, what: &str| {
        assert!(matches!(r, Err(Error::Unsupported { .. })), "{what}: {r:?}");
    };
    if !caps
        .backward_forms()
        .iter()
        .any(|f| matches!(f, BackwardForm::Subgroup { .. }))
    {
        let fctx = ctx.with_forms(BackwardForm::Subgroup { rows: 1 });
        for path in [Path::Auto, Path::Fused] {
            unsupported(
                case.sdpa().backward(&dout).path(path).form(&fctx),
                "backward subgroup form",
            );
        }
    }
    if caps.subgroup != Some(8) {
        let fctx = ctx.with_forms(MatmulForm::Subgroup);
        unsupported(
            case.sdpa().path(Path::Unfused).plan(&fctx).map(|p| p.form()),
            "matmul subgroup form",
        );
    }
    let out_of_range = ctx.with_forms(BackwardForm::Tiled { rows: 9 });
    unsupported(
        case.sdpa().backward(&dout).path(Path::Fused).form(&out_of_range),
        "9 rows",
    );
}

/// The built-in score modifiers in every form: a softcap alone (the fused kernels route logits
/// through `masked_logit` for it) and softcap with ALiBi, a window, a mask and a bias, in every
/// fused form; the combined kind in every decode form; each kind in a backward form.
#[test]
fn modifiers_in_every_form() {
    let Some(ctx) = ctx() else { return };
    let kinds = common::modifier_kinds();
    let (alone, all) = (&kinds[0], &kinds[2]);
    let case = (all.1)(Case::random((1, 2, 2, 70, 130, 33, 65), 430));
    check_pinned_forms(&case, every_fused_context(ctx), all.0);
    // The softcap alone in the register-tiled form (its masked_logit gate; tests/sdpa.rs runs
    // the other forward kernel's): CI time.
    let case = (alone.1)(Case::random((1, 2, 2, 70, 130, 33, 65), 433));
    let every = every_fused_context(ctx);
    let tiles: Vec<_> = every
        .iter()
        .filter(|(f, _)| *f == FusedForm::GpuTiles)
        .cloned()
        .collect();
    check_pinned_forms(&case, if tiles.is_empty() { every } else { tiles }, alone.0);
    let case = (all.1)(Case::random((2, 4, 2, 3, 1500, 16, 24), 431));
    let want = case.reference();
    for (form, dctx) in decode_contexts(ctx, &case) {
        case.check_against(
            &want,
            &dctx,
            Path::Decode,
            TOL,
            &format!("decode {} [{}]", all.0, form.name()),
        );
    }
    for (fi, form) in ctx.caps().backward_forms().into_iter().enumerate() {
        let (name, kind) = &kinds[fi % kinds.len()];
        let case = kind(Case::random((1, 2, 2, 19, 37, 7, 5), 432));
        check_backward(
            &ctx.with_forms(form),
            &case,
            Path::Fused,
            Form::Backward(form),
            &format!("{name} [{}]", form.name()),
        );
    }
}

/// Sliding windows (one-sided with bottom-right causal, a mask and key lengths, fully masked
/// rows where L > S) in every fused form, every decode form on a decode shape, and (with the
/// two-sided kind with sink tokens) every backward form:
/// each form its own specialisation of the window code (tests/sdpa.rs runs the defaults on
/// every shape).
#[test]
fn windows_in_every_form() {
    let Some(ctx) = ctx() else { return };
    let kinds = common::window_kinds();
    // The one-sided kind on L > S (rows past the keys) in every fused and decode form; the
    // two-sided kind with sink tokens is modifiers_in_every_form's combined kind there (the
    // same window code, in every fused and decode form): CI time.
    let (name, kind) = &kinds[1];
    let shape = (1, 2, 2, 130, 7, 16, 5);
    let case = kind(Case::random(shape, 401));
    check_pinned_forms(&case, every_fused_context(ctx), &format!("{shape:?} {name}"));
    for (name, kind) in &kinds[1..] {
        let case = kind(Case::random((2, 4, 2, 3, 1500, 16, 24), 410));
        let want = case.reference();
        for (form, dctx) in decode_contexts(ctx, &case) {
            case.check_against(
                &want,
                &dctx,
                Path::Decode,
                TOL,
                &format!("decode {name} [{}]", form.name()),
            );
        }
    }
    for (fi, form) in ctx.caps().backward_forms().into_iter().enumerate() {
        let (name, kind) = &kinds[fi % kinds.len()];
        let case = kind(Case::random((1, 2, 2, 19, 37, 7, 5), 420));
        check_backward(
            &ctx.with_forms(form),
            &case,
            Path::Fused,
            Form::Backward(form),
            &format!("{name} [{}]", form.name()),
        );
    }
}

/// A context's tuning knobs reach its plans and kernels, and only its own: on one device,
/// the GPU form pinned with other knobs (`Context::with_tuning`) plans other tiles and runs
/// other kernels, and both agree with the reference; the knobs of a context made by
/// `with_forms` or `with_tuning` are its parent's unless set.
#[test]
fn tuning_is_a_value_of_the_context() {
    let Some(ctx) = ctx() else { return };
    let gpu = ctx.with_forms(FusedForm::Gpu);
    assert!(
        ctx.caps().fused_forms().contains(&FusedForm::Gpu),
        "every device offers the GPU form"
    );
    let mut knobs = Tuning::default();
    knobs.set("fused_wg", 64).unwrap();
    knobs.set("fused_kg", 2).unwrap();
    knobs.set("softcap_form", 1).unwrap();
    let tuned = gpu.with_tuning(knobs);
    assert_eq!(tuned.tuning(), knobs);
    assert_eq!(tuned.caps().tuning, knobs);
    assert_eq!(gpu.tuning(), ctx.tuning(), "with_forms keeps the knobs");
    assert_eq!(tuned.with_forms(FusedForm::Gpu).tuning(), knobs);
    let case = Case::random((2, 4, 2, 37, 45, 24, 20), 31)
        .with_causal(Causal::BottomRight)
        .with_softcap(20.0);
    let want = case.reference();
    let tiles = |c: &Context| case.sdpa().path(Path::Fused).plan(c).unwrap().tiles();
    let (base, other) = (tiles(&gpu), tiles(&tuned));
    assert!(
        matches!(other, wgpu_attention::Tiles::Fused { invocations: 64, .. }),
        "{other:?}"
    );
    assert_ne!(base, other);
    for (c, label) in [
        (&gpu, "default knobs"),
        (&tuned, "fused_wg=64 fused_kg=2 softcap_form=1"),
    ] {
        case.check_against(&want, c, Path::Fused, TOL, label);
    }
}
