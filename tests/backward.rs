//! The SDPA backward on the GPU against the f64 reference (`reference::sdpa_backward`), by
//! FlashAttention's rule (`check::flash_rule`: at most twice the plain f32 implementation's
//! error, plus 1e-5·max|ref| + 1e-6), over the grid of shapes (tails, L != S, E != Ev,
//! GQA/MQA) × every mask kind × both paths, broadcast biases, key lengths with 0, large
//! logits, B×H past the dispatch limit, half formats, saved O/logsumexp, NaN, bad input.

mod common;

use common::*;
use ndarray::{Array3, Array4};
use wgpu_attention::check::{compare, flash_rule};
use wgpu_attention::{reference, Causal, Context, Error, Path, Sdpa, Storage, Tensor};

const PATHS: [Path; 2] = [Path::Fused, Path::Unfused];

fn dout_for(case: &Case, seed: u64) -> Array4<f32> {
    let (b, h, l, _) = case.dims();
    let ev = case.v.dim().3;
    rand_array(&mut rng(seed), (b, h, l, ev)).mapv(|x| case.storage.round(x))
}

/// Run the backward of `case` on `path` and check every gradient against the reference.
fn check(ctx: &Context, case: &Case, path: Path, label: &str) {
    let dout = dout_for(case, 99);
    let dout_t = Tensor::from(&dout).with_storage(case.storage);
    let g = case
        .sdpa()
        .backward(dout_t)
        .path(path)
        .run_blocking(ctx)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    assert_grads(case, &g, &dout, &format!("{label} {path:?}"));
}

/// The grid: every shape × every mask kind (fully masked rows included), each (shape, kind)
/// on one path, so that every path runs every shape and every kind. A mask, a bias or both
/// each compile the kernels again (causal modes and key lengths are parameters): the kinds
/// without either (none, both causal modes, key lengths) take turns over the paths, so that
/// each path runs each shape's plain kernels; the two with both (every mask kind combined,
/// top-left causal with a mask and a bias) run on one path per shape, in turn over the shapes,
/// so that each path runs the masked kernels on half the shapes (odd head dims, tails and GQA
/// among them on both); the boolean mask alone and the bias alone run on one shape (odd head
/// dims, tails on both lengths) on the unfused path, whose kernels take them as parameters
/// (the fused kernels compile each for 12 s there: a mask alone runs fused in
/// `saved_forward_matches_one_call`, a bias alone in the random problems). The same cases on
/// both paths, as before, compiled every masked kernel twice (111 s of a cold run, 14 s warm).
#[test]
fn grid_matches_reference_by_flash_rule() {
    let Some(ctx) = ctx() else { return };
    for (si, &shape) in SHAPES.iter().enumerate() {
        for (ki, (name, kind)) in mask_and_window_kinds().into_iter().enumerate() {
            let alone = name == "bias" || name == "bool_mask";
            if alone && shape != (1, 2, 2, 70, 130, 33, 65) {
                continue;
            }
            // The window kinds on every other shape (tests/forms.rs runs them in every
            // backward form): CI time.
            if name.starts_with("window") && (si + ki) % 2 == 1 {
                continue;
            }
            let case = kind(Case::random(shape, 100 + si as u64));
            let both = case.mask.is_some() && case.bias.is_some();
            let path = match (alone, both) {
                (true, _) => Path::Unfused,
                (false, true) => PATHS[si % 2],
                (false, false) => PATHS[(si + ki) % 2],
            };
            check(ctx, &case, path, &format!("{shape:?} {name}"));
        }
    }
}

/// The built-in score modifiers by FlashAttention's rule: a softcap (dQ and dK through its
/// derivative, d(bias) not), ALiBi with key lengths, both with a window, a mask and a bias;
/// each kind on both paths across two shapes (tails, L != S, GQA).
#[test]
fn modifiers_by_flash_rule() {
    let Some(ctx) = ctx() else { return };
    for (si, shape) in [(1, 2, 2, 70, 130, 33, 65), (2, 4, 2, 17, 23, 16, 8)]
        .into_iter()
        .enumerate()
    {
        for (ki, (name, kind)) in modifier_kinds().into_iter().enumerate() {
            let case = kind(Case::random(shape, 700 + si as u64));
            check(ctx, &case, PATHS[(si + ki + 1) % 2], &format!("{shape:?} {name}"));
        }
    }
}

/// Long packed documents (whole tiles in one document: the dQ kernel's full tiles), causal,
/// on both paths.
#[test]
fn long_documents_by_flash_rule() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 2, 2, 300, 300, 16, 16), 705)
        .with_long_docs()
        .with_causal(Causal::BottomRight);
    for path in PATHS {
        check(ctx, &case, path, "long documents");
    }
}

/// User functions on both paths: a `score_mod` with its derivatives `score_mod_ds` and
/// `score_mod_dcapture` (a captured relative-position bias and a captured per-head scale,
/// with causal, key lengths and sink logits: the captures' gradients too, in f32 and bf16;
/// the reference differentiates its closure numerically, in s and in the captures) and a `mask_mod` (prefix-LM and dilated,
/// rows fully masked) with packed documents and a bias; d(bias) through the score_mod's
/// derivative. A `score_mod` without `score_mod_ds` is refused with a typed error before any
/// GPU work.
#[test]
fn user_functions_by_flash_rule() {
    let Some(ctx) = ctx() else { return };
    for (ki, (name, kind)) in user_kinds().into_iter().enumerate() {
        for (si, shape) in [(1, 2, 2, 70, 130, 33, 65), (2, 4, 2, 17, 23, 16, 8)]
            .into_iter()
            .enumerate()
        {
            let case = kind(Case::random(shape, 720 + si as u64));
            check(ctx, &case, PATHS[(si + ki) % 2], &format!("{shape:?} {name}"));
        }
    }
    let (_, score_kind) = user_kinds()[0];
    let case = score_kind(Case::random((1, 2, 2, 19, 27, 8, 8), 731))
        .with_random_bias(732)
        .with_softcap(1.5);
    for path in PATHS {
        check(ctx, &case, path, "score_mod with a bias and a softcap");
    }
    // A band mask_mod on the fused path: the dQ kernel reads the forward's block map.
    let case = Case::random((1, 2, 2, 150, 300, 16, 16), 735).with_band_mask_mod([37.0, 90.0]);
    check(ctx, &case, Path::Fused, "band mask_mod");
    // The captures' gradients from half inputs (the capture kernel reads them in bf16).
    let case = score_kind(Case::random((1, 3, 1, 21, 40, 12, 7), 733)).with_storage(Storage::Bf16);
    check(ctx, &case, Path::Fused, "score_mod in bf16");
    // The same bits every run (no atomics: per-workgroup partials summed in order).
    let case = score_kind(Case::random((1, 2, 2, 70, 130, 33, 65), 734));
    let dout = dout_for(&case, 5);
    let bits = || {
        let g = case.sdpa().backward(&dout).run_blocking(ctx).unwrap();
        let d = g.dcaptures.expect("the captures' gradients");
        d.iter()
            .flat_map(|a| a.iter().map(|x| x.to_bits()))
            .collect::<Vec<u32>>()
    };
    let first = bits();
    assert!(
        first.iter().any(|&b| b != 0),
        "the captures' gradients are all zero"
    );
    assert_eq!(first, bits(), "the captures' gradients differ between runs");
    let table = [0.5f32; 2];
    let m = wgpu_attention::UserMod::wgsl(
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s + t(h); }",
    )
    .capture("t", &table);
    let case = Case::random((1, 2, 2, 9, 13, 8, 8), 730);
    let dout = Array4::<f32>::zeros((1, 2, 9, 8));
    let r = case.sdpa().user_mod(m).backward(&dout).run_blocking(ctx);
    assert!(
        matches!(&r, Err(wgpu_attention::Error::InvalidModifier { modifier, .. }) if *modifier == "score_mod"),
        "{:?}",
        r.err()
    );
}

/// Biases (and masks) of every broadcast shape: d(bias) summed over the broadcast dims.
#[test]
fn broadcast_bias_gradients_are_summed() {
    let Some(ctx) = ctx() else { return };
    for (label, case) in broadcast_cases() {
        for path in PATHS {
            check(ctx, &case, path, &label);
        }
    }
}

/// `without_dbias`: no d(bias), and the same dQ, dK, dV bits as with it (the bias still
/// shapes the scores), on both paths.
#[test]
fn without_dbias_skips_only_the_bias_gradient() {
    let Some(ctx) = ctx() else { return };
    let r = |shape: (usize, usize, usize, usize), seed| rand_array(&mut rng(seed), shape);
    let (q, k, v) = (r((2, 3, 21, 16), 1), r((2, 3, 35, 16), 2), r((2, 3, 35, 8), 3));
    let (bias, dout) = (r((1, 3, 21, 35), 4), r((2, 3, 21, 8), 5));
    for path in PATHS {
        let call = || {
            Sdpa::new(&q, &k, &v)
                .bias(&bias)
                .causal(Causal::BottomRight)
                .backward(&dout)
                .path(path)
        };
        let with = call().run_blocking(ctx).unwrap();
        let without = call().without_dbias().run_blocking(ctx).unwrap();
        assert!(with.dbias.is_some() && without.dbias.is_none(), "{path:?}");
        assert_eq!(with.dq, without.dq, "{path:?}: dq");
        assert_eq!(with.dk, without.dk, "{path:?}: dk");
        assert_eq!(with.dv, without.dv, "{path:?}: dv");
    }
}

/// Key lengths including 0 (a batch with no key: zero gradients), large logits, a -inf bias
/// entry, and every mask at once with GQA and tails.
#[test]
fn edge_cases_match_reference() {
    let Some(ctx) = ctx() else { return };
    let mut zero_len = Case::random((3, 4, 2, 9, 21, 12, 7), 5).with_causal(wgpu_attention::Causal::TopLeft);
    zero_len.kv_lens = Some(vec![21, 0, 4]);
    let mut large = Case::random((1, 2, 1, 33, 40, 16, 16), 6);
    large.q.mapv_inplace(|x| 30.0 * x);
    let mut neg_inf = Case::random((1, 2, 2, 5, 9, 4, 4), 7).with_random_bias(8);
    if let Some(b) = &mut neg_inf.bias {
        b[[0, 0, 1, 3]] = f32::NEG_INFINITY;
        for j in 0..9 {
            b[[0, 1, 2, j]] = f32::NEG_INFINITY;
        }
    }
    for (label, case) in [
        ("kv_lens with 0", zero_len),
        ("large logits", large),
        ("-inf bias", neg_inf),
    ] {
        for path in PATHS {
            check(ctx, &case, path, label);
        }
    }
}

/// More batch-heads than one dispatch dimension holds (65,535 on most devices).
#[test]
fn batch_heads_past_the_dispatch_limit() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((70_000, 1, 1, 1, 2, 1, 1), 9);
    for path in PATHS {
        check(ctx, &case, path, "B*H 70000");
    }
}

/// A large problem with every mask: 2.6e8 FLOPs (causal), past the CPU adapters' threshold
/// for several rows (keys) per invocation (`CPU_UNROLL_MIN_FLOPS`, 2.5e8; smaller problems
/// take one), GQA, tails on both sequence lengths, a key length short of S.
#[test]
fn large_case_matches_reference() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((1, 8, 2, 450, 560, 64, 64), 77)
        .with_random_mask(78)
        .with_random_bias(79)
        .with_causal(wgpu_attention::Causal::BottomRight);
    case.kv_lens = Some(vec![553]);
    check(ctx, &case, Path::Fused, "large");
    check(ctx, &case, Path::Unfused, "large");
    // On CPU adapters the large case's fastest form compiles in the background: it must be
    // done before the process exits (a compilation cut off by exit can crash the driver).
    ctx.wait_idle().unwrap();
}

/// f16 and bf16 inputs (rounded), gradients in the inputs' formats: both formats with odd head
/// dims (scalar I/O) and every mask kind; f16 with vec4 I/O and every mask kind; bf16 with vec4
/// q/k, scalar v and no mask. Each (format, shape) compiles its own kernels on both paths.
#[test]
fn half_formats_match_reference() {
    let Some(ctx) = ctx() else { return };
    for (s, shape, kind) in [
        (Storage::F16, (1, 2, 1, 9, 13, 5, 3), 6),
        (Storage::Bf16, (1, 2, 1, 9, 13, 5, 3), 6),
        (Storage::F16, (2, 4, 2, 17, 23, 16, 16), 6),
        (Storage::Bf16, (1, 2, 2, 8, 8, 8, 6), 0),
    ] {
        let (name, f) = mask_kinds()[kind];
        let case = f(Case::random(shape, 11)).with_storage(s);
        for path in PATHS {
            check(ctx, &case, path, &format!("{s:?} {shape:?} {name}"));
        }
    }
}

/// O and the logsumexp from the caller (a separate forward) give the same gradients as the
/// one-call form.
#[test]
fn saved_forward_matches_one_call() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 4, 2, 19, 30, 8, 12), 12).with_random_mask(13);
    let dout = dout_for(&case, 14);
    let fw = case.sdpa().return_lse().run_blocking(ctx).unwrap();
    let lse = fw.lse.unwrap();
    for path in PATHS {
        let saved = case
            .sdpa()
            .backward(&dout)
            .saved(&fw.output, &lse)
            .path(path)
            .run_blocking(ctx)
            .unwrap();
        assert!(saved.output.is_none());
        let once = case.sdpa().backward(&dout).path(path).run_blocking(ctx).unwrap();
        for (a, b) in [
            (&saved.dq, &once.dq),
            (&saved.dk, &once.dk),
            (&saved.dv, &once.dv),
        ] {
            let r = compare(a.iter().copied(), b.iter().copied(), TOL);
            assert!(r.passed(), "{path:?}: {r}");
        }
    }
}

/// NaN in q propagates to that row's dQ (and dK, dV); nothing else turns NaN on its own.
#[test]
fn nan_propagates() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((1, 1, 1, 4, 6, 4, 4), 15);
    case.q[[0, 0, 2, 1]] = f32::NAN;
    let dout = dout_for(&case, 16);
    for path in PATHS {
        let g = case.sdpa().backward(&dout).path(path).run_blocking(ctx).unwrap();
        assert!(
            g.dq.slice(ndarray::s![0, 0, 2, ..]).iter().all(|x| x.is_nan()),
            "{path:?} {:?} {:?}",
            g.dq,
            g.lse
        );
        assert!(
            g.dq.slice(ndarray::s![0, 0, 0, ..]).iter().all(|x| x.is_finite()),
            "{path:?}"
        );
        assert!(g.dk.iter().all(|x| x.is_nan()), "{path:?}");
    }
}

/// Bad input: typed errors before any GPU work.
#[test]
fn bad_input_is_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((1, 2, 2, 5, 7, 4, 4), 17);
    let dout = dout_for(&case, 18);
    let wrong = Array4::<f32>::zeros((1, 2, 5, 3));
    assert!(matches!(
        case.sdpa().backward(&wrong).run_blocking(ctx),
        Err(Error::ShapeMismatch { tensor: "dout", .. })
    ));
    let out = Array4::<f32>::zeros((1, 2, 5, 4));
    let other_lse = Array3::<f32>::zeros((1, 2, 6));
    assert!(matches!(
        case.sdpa()
            .backward(&dout)
            .saved(&out, &other_lse)
            .run_blocking(ctx),
        Err(Error::ShapeMismatch { tensor: "lse", .. })
    ));
    let lse = Array3::<f32>::zeros((1, 2, 5));
    assert!(matches!(
        case.sdpa().backward(&dout).saved(&wrong, &lse).run_blocking(ctx),
        Err(Error::ShapeMismatch { tensor: "output", .. })
    ));
    let half_lse = Tensor::from(&lse).with_storage(Storage::F16);
    assert!(matches!(
        case.sdpa()
            .backward(&dout)
            .saved(&out, half_lse)
            .run_blocking(ctx),
        Err(Error::StorageMismatch { tensor: "lse", .. })
    ));
    assert!(matches!(
        case.sdpa().backward(&dout).path(Path::Decode).run_blocking(ctx),
        Err(Error::Unsupported { path: "decode", .. })
    ));
    let wide = Case::random((1, 1, 1, 2, 3, 300, 4), 19);
    let d = dout_for(&wide, 20);
    assert!(matches!(
        wide.sdpa().backward(&d).path(Path::Fused).run_blocking(ctx),
        Err(Error::Unsupported { path: "fused", .. })
    ));
    // Auto runs it on the unfused path.
    assert_eq!(
        wide.sdpa().backward(&d).resolved_path(ctx).unwrap(),
        Path::Unfused
    );
    check(ctx, &wide, Path::Auto, "E 300 auto");
}

/// The kernels' specialisations the random problems draw from: head dims (E, Ev) and whether a
/// boolean mask and a bias are given. Compiling a specialisation is most of a case's time on
/// lavapipe (the same 8 cases took 79 s with new pipelines and 19 s with Mesa's shader cache
/// warm), so the random problems draw from three of the grid test's (scalar I/O with odd dims,
/// a mask and a bias; vec4 I/O with neither; E = 128 with a bias) and randomise everything that
/// is not compiled in: shapes, GQA groups, causal modes, key lengths and values. The grid test
/// and the edge cases run the other head dims and mask kinds.
const SPECIALISATIONS: [(usize, usize, bool, bool); 3] = [
    (33, 65, true, true),
    (16, 16, false, false),
    (128, 5, false, true),
];

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 8, ..Default::default() })]
    /// Random shapes, GQA groups, masks, biases, key lengths and causal modes: both paths by
    /// FlashAttention's rule. S >= 2: with one key (see `single_key`) dQ and dK are identically
    /// zero and any f32 implementation's are pure rounding noise, which the rule's absolute
    /// floor (1e-6) does not scale with.
    #[test]
    fn random_problems_match_reference(
        b in 1usize..3, hkv in 1usize..3, group in 1usize..4, l in 1usize..40, s in 2usize..40,
        spec in proptest::sample::select(&SPECIALISATIONS[..]), causal in 0u8..3,
        lens in proptest::bool::ANY, seed in proptest::num::u64::ANY,
    ) {
        let (e, ev, mask, bias) = spec;
        let Some(ctx) = thread_ctx() else { return Ok(()) };
        let case = random_problem((b, hkv, group, l, s, e, ev), causal, mask, bias, lens, seed);
        for path in PATHS {
            check(ctx, &case, path, &format!("proptest b{b} hkv{hkv} g{group} l{l} s{s} e{e} ev{ev}"));
        }
    }
}

/// One key: P = 1 on every live row, so dS = dP - D = 0 exactly and dQ, dK are identically
/// zero; in f32 they are the rounding noise of dP - D (D and dP are the same dot product summed
/// in different orders). dV = dO summed over the group by the rule; dQ and dK within a few
/// ulps of |dP|.
#[test]
fn single_key() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 6, 2, 35, 1, 1, 33), 5);
    let dout = dout_for(&case, 99);
    let opts = case.options();
    let r64 =
        reference::sdpa_backward(case.q.view(), case.k.view(), case.v.view(), dout.view(), &opts).unwrap();
    let r32 = reference::sdpa_backward_f32(case.q.view(), case.k.view(), case.v.view(), dout.view(), &opts)
        .unwrap();
    // |dP| <= Ev · max|dO| · max|V|; its f32 rounding, times scale · |q| or |k|, bounds dQ and dK.
    let max = |a: &Array4<f32>| a.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
    let noise = 8.0 * f32::EPSILON as f64 * 33.0 * max(&dout) * max(&case.v) * max(&case.q).max(max(&case.k));
    for path in PATHS {
        let g = case.sdpa().backward(&dout).path(path).run_blocking(ctx).unwrap();
        let report = flash_rule(
            g.dv.iter().copied(),
            r64.dv.iter().copied(),
            r32.dv.iter().copied(),
        );
        assert!(report.passed(), "{path:?} dv: {report}");
        for (name, got) in [("dq", &g.dq), ("dk", &g.dk)] {
            assert!(
                got.iter().all(|x| (*x as f64).abs() <= noise),
                "{path:?} {name}: past {noise}"
            );
        }
    }
}

/// Bottom-right causal with key lengths aligns each batch to its own length in the backward
/// too (the dK/dV kernel's first row per key tile reads the batch's offset), on both paths.
#[test]
fn bottom_right_with_kv_lens_aligns_to_each_batch() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((3, 4, 2, 6, 29, 8, 6), 41).with_causal(Causal::BottomRight);
    case.kv_lens = Some(vec![29, 11, 4]);
    for path in PATHS {
        check(ctx, &case, path, "bottom-right kv_lens");
    }
}

/// A relative bias by position (`q_pos`, the query's position among the keys) in the
/// backward: L != S and key lengths per batch, so that `q_pos(b, i) = kv_lens[b] - L + i`
/// differs from `i`; the gradients on both paths against the reference, which reads the
/// positions through `Captures::q_pos`.
#[test]
fn relative_bias_by_position_in_the_backward() {
    let Some(ctx) = ctx() else { return };
    let mut case = Case::random((2, 2, 1, 5, 11, 8, 8), 48).with_causal(wgpu_attention::Causal::BottomRight);
    case.kv_lens = Some(vec![11, 8]);
    case.user_mod = Some(
        wgpu_attention::UserMod::wgsl(
            "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
                 return s - 0.25 * abs(f32(j) - f32(q_pos(b, i)));
             }
             fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }",
        )
        .cpu_score(|s, [b, _, i, j], c| s - 0.25 * (j as f64 - c.q_pos(b, i) as f64).abs()),
    );
    for path in PATHS {
        check(ctx, &case, path, "relative bias by q_pos");
    }
}
