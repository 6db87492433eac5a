//! The test cases both suites run: the native one (`tests/*.rs`, through `common/mod.rs`) and
//! the browser one (`web/tests/browser.rs`, which includes this file by path). Nothing here
//! blocks or touches the file system: each suite runs the cases its own way (blocking or
//! async) and finds the golden files its own way (files or bytes embedded in the wasm).
#![allow(dead_code)]

use ndarray::{Array, Array4, ArrayD, IxDyn};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wgpu_attention::check::{compare, Report, Tolerance, F32_TOLERANCE};
use wgpu_attention::reference;
use wgpu_attention::reference::MhaInputs;
use wgpu_attention::{
    Causal, DocIds, MhaConfig, MhaForward, MhaOutput, MhaWeights, MultiHeadAttention, NeedWeights, Options,
    Output, Path, Sdpa, Storage, Tensor, UserMod,
};

/// Uniform values in [-1, 1).
pub fn rand_array<Sh: ndarray::ShapeBuilder>(rng: &mut StdRng, shape: Sh) -> Array<f32, Sh::Dim> {
    Array::from_shape_simple_fn(shape, || rng.random_range(-1.0f32..1.0))
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Shapes `(B, Hq, Hkv, L, S, E, Ev)`.
pub type Shape = (usize, usize, usize, usize, usize, usize, usize);

/// One attention case: inputs and options.
#[derive(Clone)]
pub struct Case {
    pub q: Array4<f32>,
    pub k: Array4<f32>,
    pub v: Array4<f32>,
    pub mask: Option<ArrayD<bool>>,
    pub bias: Option<ArrayD<f32>>,
    pub kv_lens: Option<Vec<usize>>,
    pub causal: Causal,
    /// A sliding window `(left, right)` and its sink tokens.
    pub window: Option<(i64, i64)>,
    pub sink_tokens: usize,
    /// A logit softcap and ALiBi slopes (one per query head).
    pub softcap: Option<f32>,
    pub alibi: Option<Vec<f32>>,
    /// Sink logits (one per query head).
    pub sink_logits: Option<Vec<f32>>,
    /// Document ids of packed sequences.
    pub doc_ids: Option<DocIds>,
    /// User WGSL functions (with their closures for the reference).
    pub user_mod: Option<UserMod<'static>>,
    /// f64, as PyTorch's goldens give it; the GPU uses its f32 rounding.
    pub scale: Option<f64>,
    /// The device format of q, k, v, the bias and the output; the f32 arrays hold values
    /// already rounded to it (see [`Case::with_storage`]).
    pub storage: Storage,
}

impl Case {
    pub fn random(shape: Shape, seed: u64) -> Case {
        let (b, hq, hkv, l, s, e, ev) = shape;
        let mut r = rng(seed);
        Case {
            q: rand_array(&mut r, (b, hq, l, e)),
            k: rand_array(&mut r, (b, hkv, s, e)),
            v: rand_array(&mut r, (b, hkv, s, ev)),
            mask: None,
            bias: None,
            kv_lens: None,
            causal: Causal::None,
            window: None,
            sink_tokens: 0,
            softcap: None,
            alibi: None,
            sink_logits: None,
            doc_ids: None,
            user_mod: None,
            scale: None,
            storage: Storage::F32,
        }
    }

    /// The case in format `s`: q, k, v and the bias rounded to it (so the reference sees the
    /// values the device holds), and the GPU call declaring it for every tensor.
    pub fn with_storage(mut self, s: Storage) -> Case {
        self.q.mapv_inplace(|x| s.round(x));
        self.k.mapv_inplace(|x| s.round(x));
        self.v.mapv_inplace(|x| s.round(x));
        if let Some(b) = &mut self.bias {
            b.mapv_inplace(|x| s.round(x));
        }
        self.storage = s;
        self
    }

    pub fn dims(&self) -> (usize, usize, usize, usize) {
        let (b, h, l, _) = self.q.dim();
        (b, h, l, self.k.dim().2)
    }

    /// A `[B, 1, L, S]` mask, about 30% false, with rows 0 and L/2 fully masked.
    pub fn with_random_mask(mut self, seed: u64) -> Case {
        let (b, _, l, s) = self.dims();
        let mut r = rng(seed);
        let mut m = Array::from_shape_simple_fn(IxDyn(&[b, 1, l, s]), || r.random_range(0.0..1.0) > 0.3);
        for bi in 0..b {
            for j in 0..s {
                m[[bi, 0, 0, j]] = false;
                m[[bi, 0, l / 2, j]] = false;
            }
        }
        self.mask = Some(m);
        self
    }

    /// A `[1, H, L, S]` bias of magnitude ~2.
    pub fn with_random_bias(mut self, seed: u64) -> Case {
        let (_, h, l, s) = self.dims();
        let mut r = rng(seed);
        self.bias = Some(Array::from_shape_simple_fn(IxDyn(&[1, h, l, s]), || {
            r.random_range(-2.0..2.0)
        }));
        self
    }

    /// Key lengths `S, S - 3, 1, ...` cycling over the batch.
    pub fn with_kv_lens(mut self) -> Case {
        let (b, _, _, s) = self.dims();
        self.kv_lens = Some(
            (0..b)
                .map(|i| [s, s.saturating_sub(3).max(1), 1][i % 3])
                .collect(),
        );
        self
    }

    /// 2.5e8 FLOPs, enough for CPU adapters' fastest fused forms (several rows per
    /// invocation), with every mask kind: bottom-right causal, a mask with rows 0 and L/2 fully
    /// masked, a bias, and key lengths 700 and 0; tails on both sequence lengths.
    pub fn large() -> Case {
        let mut case = Case::random((2, 2, 1, 720, 737, 64, 64), 77)
            .with_random_mask(78)
            .with_random_bias(79)
            .with_causal(Causal::BottomRight);
        case.kv_lens = Some(vec![700, 0]);
        assert!(case.sdpa().problem().unwrap().flops() >= 2.5e8);
        case
    }

    pub fn with_causal(mut self, c: Causal) -> Case {
        self.causal = c;
        self
    }

    /// A sliding window `(left, right)` with `sinks` sink tokens.
    pub fn with_window(mut self, left: i64, right: i64, sinks: usize) -> Case {
        self.window = Some((left, right));
        self.sink_tokens = sinks;
        self
    }

    /// A logit softcap `c`.
    pub fn with_softcap(mut self, c: f32) -> Case {
        self.softcap = Some(c);
        self
    }

    /// ALiBi slopes large enough to matter at the tests' lengths (0.05 + 0.3 / (h + 1)).
    pub fn with_alibi(mut self) -> Case {
        let hq = self.q.shape()[1];
        self.alibi = Some((0..hq).map(|h| 0.05 + 0.3 / (h + 1) as f32).collect());
        self
    }

    /// Sink logits around the tests' logits (so that they matter): 0.5 - 0.4 h.
    pub fn with_sink_logits(mut self) -> Case {
        let hq = self.q.shape()[1];
        self.sink_logits = Some((0..hq).map(|h| 0.5 - 0.4 * h as f32).collect());
        self
    }

    /// Packed sequences: about five documents of random lengths over the keys, in order, and
    /// the queries' documents those of the keys at the same relative position (both sorted,
    /// so that key tiles of other documents are skipped), different in each batch.
    pub fn with_packed_docs(mut self, seed: u64) -> Case {
        let (b, _, l, s) = self.dims();
        let mut r = rng(seed);
        let (mut q, mut k) = (Vec::new(), Vec::new());
        for _ in 0..b {
            let mut doc = 0;
            let row: Vec<i32> = (0..s)
                .map(|_| {
                    if r.random_range(0.0..1.0) < 5.0 / s as f64 {
                        doc += 1;
                    }
                    doc
                })
                .collect();
            q.extend((0..l).map(|i| row[i * s / l]));
            k.extend(row);
        }
        self.doc_ids = Some(DocIds { q, k });
        self
    }

    /// Long packed documents: batch b's keys in documents of 100 + 50 b tokens (the last one
    /// shorter), its queries those of the keys at the same relative position; whole query and
    /// key tiles then lie in one document (the kernels' full tiles skip the per-logit test).
    pub fn with_long_docs(mut self) -> Case {
        let (b, _, l, s) = self.dims();
        let (mut q, mut k) = (Vec::new(), Vec::new());
        for bi in 0..b {
            let row: Vec<i32> = (0..s).map(|t| (t / (100 + 50 * bi)) as i32).collect();
            q.extend((0..l).map(|i| row[i * s / l]));
            k.extend(row);
        }
        self.doc_ids = Some(DocIds { q, k });
        self
    }

    /// Unordered document ids: queries' in 0..4, keys' in 0..3 (a query of document 3 sees no
    /// key: a fully masked row).
    pub fn with_random_docs(mut self, seed: u64) -> Case {
        let (b, _, l, s) = self.dims();
        let mut r = rng(seed);
        let q = (0..b * l).map(|_| r.random_range(0..4)).collect();
        let k = (0..b * s).map(|_| r.random_range(0..3)).collect();
        self.doc_ids = Some(DocIds { q, k });
        self
    }

    /// A user `score_mod` capping each logit at 3 (`3 tanh(s / 3)`), scaling it by a captured
    /// per-head factor and adding a learned relative-position bias (T5-style buckets, a
    /// captured `[Hq, 2R + 1]` table), with its derivatives in `s` (`score_mod_ds`) and in the
    /// captures (`score_mod_dcapture`, for the backward) and its closure for the reference.
    pub fn with_relbias_score_mod(mut self, seed: u64) -> Case {
        const R: i64 = 6;
        let (_, hq, _, _) = self.dims();
        let mut r = rng(seed);
        let table: Vec<f32> = (0..hq * (2 * R as usize + 1))
            .map(|_| r.random_range(-1.5f32..1.5))
            .collect();
        let table: &'static [f32] = Box::leak(table.into_boxed_slice());
        let scales: Vec<f32> = (0..hq).map(|h| 1.0 + 0.25 * h as f32).collect();
        let scales: &'static [f32] = Box::leak(scales.into_boxed_slice());
        let src = format!(
            "const R: i32 = {R};
             // The bucket of key j for query i: their distance, clamped to [-R, R].
             fn bucket(i: u32, j: u32) -> u32 {{
                 return u32(clamp(i32(j) - i32(i), -R, R) + R);
             }}
             fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {{
                 return 3.0 * tanh(s / 3.0) * head_scale(h) + rel(h * u32(2 * R + 1) + bucket(i, j));
             }}
             fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {{
                 let t = tanh(s / 3.0);
                 return (1.0 - t * t) * head_scale(h);
             }}
             fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) {{
                 d_rel(h * u32(2 * R + 1) + bucket(i, j), g);
                 if (g != 0.0) {{
                     d_head_scale(h, g * 3.0 * tanh(s / 3.0));
                 }}
             }}"
        );
        self.user_mod = Some(
            UserMod::wgsl(&src)
                .capture("rel", table)
                .capture("head_scale", scales)
                .cpu_score(move |s, [_, h, i, j], c| {
                    let bucket = (j as i64 - i as i64).clamp(-R, R) + R;
                    3.0 * (s / 3.0).tanh() * c.get("head_scale", h)
                        + c.get("rel", h * (2 * R as usize + 1) + bucket as usize)
                }),
        );
        self
    }

    /// A user `mask_mod`: a band of keys `i + S - L - width[h] <= j <= i + S - L + 3` (the width
    /// per head a captured tensor, so that the bounds fall off the block map's 16-blocks and the
    /// kernels' tiles: empty, full and partial blocks), rows `i % 50 == 7` fully masked.
    pub fn with_band_mask_mod(mut self, widths: [f32; 2]) -> Case {
        let (_, hq, l, s) = self.dims();
        let off = s as i64 - l as i64;
        let w: &'static [f32] = Box::leak(
            (0..hq)
                .map(|h| widths[h % 2])
                .collect::<Vec<_>>()
                .into_boxed_slice(),
        );
        let src = format!(
            "fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool {{
                 let d = i32(j) - i32(i) - {off};
                 return d <= 3 && f32(d) >= -width(h) && i % 50u != 7u;
             }}"
        );
        self.user_mod = Some(
            UserMod::wgsl(&src)
                .capture("width", w)
                .cpu_mask(move |[_, h, i, j]| {
                    let d = j as i64 - i as i64 - off;
                    d <= 3 && d as f32 >= -w[h] && i % 50 != 7
                }),
        );
        self
    }

    /// A user `mask_mod`: a prefix-LM mask (the first 5 keys seen by every query, causal
    /// bottom-right beyond) and-ed with a dilation (every other key past the prefix, by
    /// distance), and rows `i % 7 == 3` fully masked.
    pub fn with_prefix_dilated_mask_mod(mut self) -> Case {
        let (_, _, l, s) = self.dims();
        let off = s as i64 - l as i64;
        let src = format!(
            "const OFF: i32 = {off};
             fn prefix_lm(i: u32, j: u32) -> bool {{ return j < 5u || i32(j) <= i32(i) + OFF; }}
             fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool {{
                 let dilated = j < 5u || abs(i32(j) - i32(i) - OFF) % 2 == 0;
                 return prefix_lm(i, j) && dilated && i % 7u != 3u;
             }}"
        );
        self.user_mod = Some(UserMod::wgsl(&src).cpu_mask(move |[_, _, i, j]| {
            let (i, j) = (i as i64, j as i64);
            let prefix_lm = j < 5 || j <= i + off;
            let dilated = j < 5 || (j - i - off).abs() % 2 == 0;
            prefix_lm && dilated && i % 7 != 3
        }));
        self
    }

    /// The case's options, shared by the GPU call and the reference.
    pub fn options(&self) -> Options<'_> {
        let mut o = Options {
            causal: self.causal,
            scale: self.scale,
            kv_lens: self.kv_lens.clone(),
            window: self.window,
            sink_tokens: self.sink_tokens,
            softcap: self.softcap,
            alibi: self.alibi.clone(),
            sink_logits: self.sink_logits.clone(),
            doc_ids: self.doc_ids.clone(),
            user_mod: self.user_mod.clone(),
            ..Options::default()
        };
        o.mask = self.mask.as_ref().map(|m| m.into());
        o.bias = self
            .bias
            .as_ref()
            .map(|b| Tensor::from(b).with_storage(self.storage));
        o
    }

    pub fn sdpa(&self) -> Sdpa<'_> {
        let t = |a| Tensor::from(a).with_storage(self.storage);
        Sdpa::new(t(&self.q), t(&self.k), t(&self.v)).options(self.options())
    }

    pub fn reference(&self) -> reference::Output {
        reference::sdpa(self.q.view(), self.k.view(), self.v.view(), &self.options()).unwrap()
    }

    /// The call the checks run on `path`: the logsumexp always, and the weights where the path
    /// returns them (the unfused path).
    pub fn checked_sdpa(&self, path: Path) -> Sdpa<'_> {
        let run = self.sdpa().path(path).return_lse();
        if path == Path::Unfused {
            run.return_weights()
        } else {
            run
        }
    }

    /// Compare the output and logsumexp of [`Case::checked_sdpa`]'s run on `path` (and the
    /// weights where the path returns them) with `want` at `tol`. Panics with a report on
    /// mismatch.
    pub fn assert_output(
        &self,
        got: &Output,
        want: &reference::Output,
        path: Path,
        tol: Tolerance,
        label: &str,
    ) {
        assert_report(
            compare(got.output.iter().copied(), want.out.iter().copied(), tol),
            &format!("{label} output"),
        );
        assert_report(
            compare(
                got.lse.as_ref().unwrap().iter().copied(),
                want.lse.iter().copied(),
                tol,
            ),
            &format!("{label} lse"),
        );
        if path == Path::Unfused {
            assert_report(
                compare(
                    got.weights.as_ref().unwrap().iter().copied(),
                    want.weights.iter().copied(),
                    tol,
                ),
                &format!("{label} weights"),
            );
        }
    }
}

pub fn assert_report(r: Report, label: &str) {
    assert!(r.passed(), "{label}: {r}");
}

pub const TOL: Tolerance = F32_TOLERANCE;

/// Compare a `PagedAttention` result's output and logsumexp with the reference's.
pub fn assert_paged(
    got: &wgpu_attention::PagedOutput,
    want: &wgpu_attention::PagedOutput,
    tol: Tolerance,
    label: &str,
) {
    let f64s = |a: &[f32]| a.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let r = wgpu_attention::check::compare(
        got.output.iter().copied(),
        f64s(want.output.as_slice().unwrap()),
        tol,
    );
    assert_report(r, &format!("{label} output"));
    let r = wgpu_attention::check::compare(got.lse.iter().copied(), f64s(want.lse.as_slice().unwrap()), tol);
    assert_report(r, &format!("{label} lse"));
}

/// Twice the tolerance of storage format `s`: for results rounded to the format twice (the
/// multi-head attention layer's intermediates, merged parts).
pub fn twice_storage_tolerance(s: Storage) -> Tolerance {
    let t = Tolerance::for_storage(s);
    Tolerance {
        atol: 2.0 * t.atol,
        rtol: 2.0 * t.rtol,
    }
}

/// A mask and a bias of every broadcast shape (every rank, every broadcast dimension) over one
/// `[2, 3, 6, 10]` problem, labelled by shape.
pub fn broadcast_cases() -> Vec<(String, Case)> {
    let base = Case::random((2, 3, 3, 6, 10, 8, 8), 4);
    let mut r = rng(5);
    [
        vec![10],
        vec![6, 10],
        vec![1, 6, 10],
        vec![3, 6, 10],
        vec![2, 1, 1, 10],
        vec![2, 3, 6, 1],
        vec![1, 3, 1, 10],
    ]
    .into_iter()
    .map(|shape| {
        let mask = Array::from_shape_simple_fn(IxDyn(&shape), || r.random_range(0.0..1.0) > 0.4);
        let bias = Array::from_shape_simple_fn(IxDyn(&shape), || r.random_range(-1.0f32..1.0));
        let case = Case {
            mask: Some(mask),
            bias: Some(bias),
            q: base.q.clone(),
            k: base.k.clone(),
            v: base.v.clone(),
            kv_lens: None,
            causal: Causal::None,
            window: None,
            sink_tokens: 0,
            softcap: None,
            alibi: None,
            sink_logits: None,
            doc_ids: None,
            user_mod: None,
            scale: None,
            storage: Storage::F32,
        };
        (format!("mask/bias {shape:?}"), case)
    })
    .collect()
}

/// Shapes `(B, Hq, Hkv, L, S, E, Ev)` of the grid: no dimension a multiple of the 64-wide
/// tiles except where noted; L != S, E != Ev, GQA and MQA.
pub const SHAPES: &[Shape] = &[
    (1, 1, 1, 1, 1, 1, 1),
    (2, 3, 3, 17, 17, 16, 16),
    (1, 2, 2, 70, 130, 33, 65),
    (2, 4, 2, 65, 63, 64, 64),
    (1, 4, 1, 5, 129, 8, 20),
    (1, 2, 2, 130, 7, 128, 5),
];

/// A mask kind of the grid: its name and how it changes a case.
pub type MaskKind = (&'static str, fn(Case) -> Case);

/// Every mask kind one at a time, and combined.
pub fn mask_kinds() -> Vec<MaskKind> {
    vec![
        ("none", |c| c),
        ("causal_top_left", |c| c.with_causal(Causal::TopLeft)),
        ("causal_bottom_right", |c| c.with_causal(Causal::BottomRight)),
        ("bool_mask", |c| c.with_random_mask(7)),
        ("bias", |c| c.with_random_bias(8)),
        ("kv_lens", |c| c.with_kv_lens()),
        ("all_combined", |c| {
            c.with_causal(Causal::BottomRight)
                .with_random_mask(9)
                .with_random_bias(10)
                .with_kv_lens()
        }),
        ("top_left_mask_bias", |c| {
            c.with_causal(Causal::TopLeft)
                .with_random_mask(11)
                .with_random_bias(12)
        }),
    ]
}

/// The sliding-window kinds (the ring and the approximate variants refuse windows, so they
/// are apart from [`mask_kinds`]): both sides bounded with sink tokens; and a one-sided
/// window (Mistral's) with bottom-right causal, a boolean mask and key lengths, where rows
/// whose window falls past their batch's keys (L > S) are fully masked.
pub fn window_kinds() -> Vec<MaskKind> {
    vec![
        ("window_both_sides_sinks", |c| c.with_window(5, 3, 2)),
        ("window_left_causal_mask_lens", |c| {
            c.with_window(9, -1, 0)
                .with_causal(Causal::BottomRight)
                .with_random_mask(13)
                .with_kv_lens()
        }),
    ]
}

/// The built-in score modifiers (the ring and the approximate variants refuse them): a
/// softcap alone (the fused kernels pass logits through `masked_logit` for it alone); ALiBi
/// and sink logits with packed documents (key tiles skipped), bottom-right causal and key
/// lengths (its distance aligned to each batch's length); and all three with unordered
/// document ids (rows of a document no key has: fully masked), a window, sink tokens, a
/// boolean mask and a bias (softcap before the bias; rows the window leaves empty give 0 with
/// the sink).
/// The softcap of 0.8 bends the tests' logits (|s| up to about 2) well into tanh's curve.
pub fn modifier_kinds() -> Vec<MaskKind> {
    vec![
        ("softcap", |c| c.with_softcap(0.8)),
        ("alibi_sinks_packed_docs_causal_lens", |c| {
            c.with_alibi()
                .with_sink_logits()
                .with_packed_docs(16)
                .with_causal(Causal::BottomRight)
                .with_kv_lens()
        }),
        ("softcap_alibi_sinks_docs_window_mask_bias", |c| {
            c.with_softcap(0.8)
                .with_alibi()
                .with_sink_logits()
                .with_random_docs(17)
                .with_window(5, 3, 2)
                .with_random_mask(14)
                .with_random_bias(15)
        }),
    ]
}

/// User WGSL functions: a relative-position bias table captured by a `score_mod` (with
/// causal, key lengths and sink logits), and a `mask_mod` (prefix-LM and dilated, some rows
/// fully masked) with packed documents and a bias.
pub fn user_kinds() -> Vec<MaskKind> {
    vec![
        ("relbias_score_mod_causal_lens_sinks", |c| {
            c.with_relbias_score_mod(18)
                .with_causal(Causal::BottomRight)
                .with_kv_lens()
                .with_sink_logits()
        }),
        ("prefix_dilated_mask_mod_docs_bias", |c| {
            c.with_prefix_dilated_mask_mod()
                .with_packed_docs(19)
                .with_random_bias(20)
        }),
    ]
}

/// [`mask_kinds`] and [`window_kinds`].
pub fn mask_and_window_kinds() -> Vec<MaskKind> {
    mask_kinds().into_iter().chain(window_kinds()).collect()
}

/// A PyTorch float64 golden (`tests/fixtures/sdpa/<name>`, written by `scripts/make_goldens.py`):
/// the case and PyTorch's outputs.
pub struct Golden {
    pub name: String,
    pub case: Case,
    pub pytorch: reference::Output,
    /// PyTorch autograd of `sum(dout * O)`, where the golden has them (the f32 ones).
    pub grads: Option<GoldenGrads>,
}

/// A golden's upstream gradient and PyTorch's autograd gradients: float64 (the truth) and
/// float32 (the plain f32 implementation of FlashAttention's accuracy rule), as `[dq, dk, dv]`
/// and the bias's.
pub struct GoldenGrads {
    pub dout: Array4<f32>,
    pub f64: [Array4<f64>; 3],
    pub f32: [Array4<f32>; 3],
    pub dbias: Option<(ArrayD<f64>, ArrayD<f32>)>,
}

impl Golden {
    /// The tolerance of the golden's storage format (the crate's f32 tolerance for f32).
    pub fn tolerance(&self) -> Tolerance {
        Tolerance::for_storage(self.case.storage)
    }

    /// [`Case::assert_output`] against PyTorch's outputs.
    pub fn assert_matches(&self, got: &Output, path: Path, tol: Tolerance, label: &str) {
        let label = format!("{} {label}", self.name);
        self.case.assert_output(got, &self.pytorch, path, tol, &label);
    }
}

/// Compare a multi-head attention layer's GPU output (and the weights `weights` asked for) with
/// the reference's at `tol`.
pub fn assert_mha_output(
    got: &MhaOutput,
    want: &reference::MhaOutput,
    weights: NeedWeights,
    tol: Tolerance,
    label: &str,
) {
    assert_report(
        compare(got.output.iter().copied(), want.out.iter().copied(), tol),
        label,
    );
    match weights {
        NeedWeights::PerHead => assert_report(
            compare(
                got.weights.as_ref().unwrap().iter().copied(),
                want.weights.iter().copied(),
                tol,
            ),
            &format!("{label} weights"),
        ),
        NeedWeights::Averaged => assert_report(
            compare(
                got.avg_weights.as_ref().unwrap().iter().copied(),
                reference::mean_over_heads(&want.weights).iter().copied(),
                tol,
            ),
            &format!("{label} avg weights"),
        ),
        NeedWeights::No => assert!(got.weights.is_none() && got.avg_weights.is_none(), "{label}"),
        other => panic!("{label}: no check for {other:?}"),
    }
}

/// The SDPA golden named `name`, its files read by `file` (`"q.npy"` to its bytes; `None` for an
/// optional file that is not there).
/// The inputs and options of a golden directory (SDPA's or a variant's) and its `meta.json`.
pub fn golden_case(name: &str, file: &impl Fn(&str) -> Option<Vec<u8>>) -> (Case, serde_json::Value) {
    let need = |f: &str| file(f).unwrap_or_else(|| panic!("golden {name}: {f} missing"));
    let meta: serde_json::Value = serde_json::from_slice(&need("meta.json")).unwrap();
    let causal = match meta["causal"].as_str().unwrap() {
        "none" => Causal::None,
        "top_left" => Causal::TopLeft,
        "bottom_right" => Causal::BottomRight,
        other => panic!("unknown causal {other}"),
    };
    let case = Case {
        q: npy(need("q.npy")),
        k: npy(need("k.npy")),
        v: npy(need("v.npy")),
        mask: file("mask.npy").map(npy),
        bias: file("bias.npy").map(npy),
        kv_lens: file("kv_lens.npy").map(|b| {
            let a: ndarray::Array1<i64> = npy(b);
            a.iter().map(|&x| x as usize).collect()
        }),
        causal,
        window: None,
        sink_tokens: 0,
        softcap: None,
        alibi: None,
        sink_logits: None,
        doc_ids: None,
        user_mod: None,
        scale: meta["scale"].as_f64(),
        // Half goldens hold inputs already rounded to the format (by PyTorch's
        // `.half()` / `.bfloat16()`) and outputs computed in f64 from them.
        storage: meta["storage"]
            .as_str()
            .map_or(Storage::F32, |s| s.parse().unwrap()),
    };
    (case, meta)
}

/// An `.npy` file's array.
pub fn npy<T: ndarray_npy::ReadNpyExt>(bytes: Vec<u8>) -> T {
    T::read_npy(&bytes[..]).unwrap()
}

pub fn golden(name: &str, file: impl Fn(&str) -> Option<Vec<u8>>) -> Golden {
    let need = |f: &str| file(f).unwrap_or_else(|| panic!("golden {name}: {f} missing"));
    let (case, _) = golden_case(name, &file);
    Golden {
        name: name.to_string(),
        case,
        pytorch: reference::Output {
            out: npy(need("out.npy")),
            weights: npy(need("weights.npy")),
            lse: npy(need("lse.npy")),
        },
        grads: file("dout.npy").map(|d| GoldenGrads {
            dout: npy(d),
            f64: ["dq.npy", "dk.npy", "dv.npy"].map(|f| npy(need(f))),
            f32: ["dq_f32.npy", "dk_f32.npy", "dv_f32.npy"].map(|f| npy(need(f))),
            dbias: file("dbias.npy").map(|b| (npy(b), npy(need("dbias_f32.npy")))),
        }),
    }
}

/// A property test's case: `(B, Hkv · group, Hkv, L, S, E, Ev)` from `seed`, causal mode
/// `causal` (0 none, 1 top-left, 2 bottom-right), with a random mask, bias and key lengths
/// where asked.
#[allow(clippy::too_many_arguments)]
pub fn random_problem(
    (b, hkv, group, l, s, e, ev): Shape,
    causal: u8,
    mask: bool,
    bias: bool,
    lens: bool,
    seed: u64,
) -> Case {
    let mut case = Case::random((b, hkv * group, hkv, l, s, e, ev), seed)
        .with_causal([Causal::None, Causal::TopLeft, Causal::BottomRight][causal as usize]);
    if mask {
        case = case.with_random_mask(seed ^ 1);
    }
    if bias {
        case = case.with_random_bias(seed ^ 2);
    }
    if lens {
        case = case.with_kv_lens();
    }
    case
}

/// One multi-head attention grid case: the layer's config, batch, query and key lengths, and
/// the options.
#[derive(Debug, Clone, Copy)]
pub struct MhaGrid {
    pub config: MhaConfig,
    pub b: usize,
    pub l: usize,
    pub s: usize,
    pub cross: bool,
    pub causal: Causal,
    /// A boolean mask `[B, 1, L, S]` with a fully masked query row.
    pub mask: bool,
    /// An additive bias `[1, H, L, S]`.
    pub bias: bool,
    /// Key lengths with a 0 (batch 1) and a partial one (batch 0).
    pub lens: bool,
    pub weights: NeedWeights,
}

/// A grid case's data: weights (non-zero biases) and inputs rounded to `storage`, masks.
pub struct MhaCase {
    pub grid: MhaGrid,
    pub storage: Storage,
    pub w: MhaWeights,
    pub x: ndarray::Array3<f32>,
    pub k: ndarray::Array3<f32>,
    pub v: ndarray::Array3<f32>,
    pub mask: Option<ArrayD<bool>>,
    pub bias: Option<ArrayD<f32>>,
    pub lens: Option<Vec<usize>>,
}

impl MhaCase {
    pub fn random(g: MhaGrid, seed: u64, st: Storage) -> MhaCase {
        let c = g.config;
        let mut w = MhaWeights::xavier_uniform(c, seed).unwrap();
        // Non-zero biases so that they are exercised.
        let mut r = rng(seed + 1);
        if c.bias {
            w.b_q = Some(rand_array(&mut r, c.d_model));
            w.b_k = Some(rand_array(&mut r, c.num_kv_heads * c.head_dim()));
            w.b_v = Some(rand_array(&mut r, c.num_kv_heads * c.head_dim()));
            w.b_o = Some(rand_array(&mut r, c.d_model));
        }
        let w = w.with_storage(st);
        let round = |x: f32| st.round(x);
        let x = rand_array(&mut r, (g.b, g.l, c.d_model)).mapv(round);
        let k = rand_array(&mut r, (g.b, g.s, c.kdim)).mapv(round);
        let v = rand_array(&mut r, (g.b, g.s, c.vdim)).mapv(round);
        let mask = g.mask.then(|| {
            let mut m = ArrayD::from_shape_fn(IxDyn(&[g.b, 1, g.l, g.s]), |i| {
                (i[2] * 7 + i[3] * 3 + i[0]) % 5 != 0
            });
            // A fully masked query row.
            m.slice_mut(ndarray::s![0, 0, g.l / 2, ..]).fill(false);
            m
        });
        let bias = g
            .bias
            .then(|| rand_array(&mut r, IxDyn(&[1, c.num_heads, g.l, g.s])).mapv(round));
        let lens = g.lens.then(|| {
            (0..g.b)
                .map(|i| match i {
                    0 => g.s / 2 + 1,
                    1 => 0,
                    _ => g.s,
                })
                .collect()
        });
        MhaCase {
            grid: g,
            storage: st,
            w,
            x,
            k,
            v,
            mask,
            bias,
            lens,
        }
    }

    pub fn inputs(&self) -> MhaInputs<'_> {
        if self.grid.cross {
            MhaInputs::cross(self.x.view(), self.k.view(), self.v.view())
        } else {
            MhaInputs::self_attention(self.x.view())
        }
    }

    pub fn options(&self) -> Options<'_> {
        Options {
            causal: self.grid.causal,
            mask: self.mask.as_ref().map(|m| m.into()),
            bias: self
                .bias
                .as_ref()
                .map(|b| Tensor::from(b).with_storage(self.storage)),
            kv_lens: self.lens.clone(),
            ..Default::default()
        }
    }

    /// The layer's forward on this case's inputs (in the case's format) and options.
    pub fn forward<'a>(&'a self, layer: &'a MultiHeadAttention) -> MhaForward<'a> {
        let t = |a| Tensor::from(a).with_storage(self.storage);
        let mut f = layer
            .forward(t(&self.x))
            .options(self.options())
            .need_weights(self.grid.weights);
        if self.grid.cross {
            f = f.key_value(t(&self.k), t(&self.v));
        }
        f
    }

    pub fn label(&self) -> String {
        let g = &self.grid;
        format!(
            "{} config {:?} b{} l{} s{} cross {} {:?} mask {} bias {} lens {} {:?}",
            self.storage, g.config, g.b, g.l, g.s, g.cross, g.causal, g.mask, g.bias, g.lens, g.weights
        )
    }
}

/// A case's contiguous K and V scattered into caches of `block_size` token blocks in shuffled
/// order (two spare blocks; every unwritten slot NaN), with the table (`-1` past each
/// sequence's blocks, one spare column).
pub struct Paged {
    pub k: Array4<f32>,
    pub v: Array4<f32>,
    pub table: Vec<i32>,
    pub lens: Vec<usize>,
}

pub fn page(case: &Case, lens: &[usize], block_size: usize, seed: u64) -> Paged {
    let (b, hkv, s, e) = case.k.dim();
    let ev = case.v.dim().3;
    let per_seq: Vec<usize> = lens.iter().map(|l| l.div_ceil(block_size)).collect();
    let nb = per_seq.iter().sum::<usize>() + 2;
    let max_blocks = s.div_ceil(block_size) + 1;
    let mut order: Vec<usize> = (0..nb).collect();
    rand::seq::SliceRandom::shuffle(&mut order[..], &mut rng(seed));
    let mut k = Array4::from_elem((nb, block_size, hkv, e), f32::NAN);
    let mut v = Array4::from_elem((nb, block_size, hkv, ev), f32::NAN);
    let mut table = vec![-1i32; b * max_blocks];
    let mut next = order.into_iter();
    for seq in 0..b {
        for blk in 0..per_seq[seq] {
            let phys = next.next().unwrap();
            table[seq * max_blocks + blk] = phys as i32;
            for slot in 0..block_size {
                let t = blk * block_size + slot;
                if t >= lens[seq] {
                    break;
                }
                for h in 0..hkv {
                    for d in 0..e {
                        k[[phys, slot, h, d]] = case.k[[seq, h, t, d]];
                    }
                    for d in 0..ev {
                        v[[phys, slot, h, d]] = case.v[[seq, h, t, d]];
                    }
                }
            }
        }
    }
    Paged {
        k,
        v,
        table,
        lens: lens.to_vec(),
    }
}

/// The case's lengths as sequence lengths: `S, S - 3, n, ...` cycling (each at least n).
pub fn seq_lens(case: &Case) -> Vec<usize> {
    let (b, _, n, s) = case.dims();
    (0..b)
        .map(|i| [s, s.saturating_sub(3).max(n), n][i % 3])
        .collect()
}
