//! The CPU reference: plain ndarray, f64 accumulation, the same semantics as the GPU paths.
//!
//! Written for obviousness, not speed, and split by stage so that each GPU kernel is checked
//! against its own stage: [`scores`] (`scale · Q Kᵀ`), [`masked_softmax`] (masks, bias, causal,
//! key lengths; fully masked rows give zeros), [`weighted_sum`] (`P V`). [`sdpa`] chains them.
//! Users may call it to verify their own GPU results.

use ndarray::{Array1, Array2, Array3, Array4, ArrayView3, ArrayView4, Axis, Ix4};

use crate::error::Result;
use crate::options::Options;
use crate::problem::Causal;

/// All reference outputs, in f64.
#[derive(Debug, Clone)]
pub struct Output {
    /// `[B, Hq, L, Ev]`.
    pub out: Array4<f64>,
    /// Softmax weights `[B, Hq, L, S]` (zeros on fully masked rows).
    pub weights: Array4<f64>,
    /// Natural-log logsumexp of each row's masked logits `[B, Hq, L]`; `-inf` on fully masked rows.
    pub lse: Array3<f64>,
}

/// Stage 1: `scale · Q Kᵀ` as `[B, Hq, L, S]`; query head `h` reads key head `h / (Hq / Hkv)`.
pub fn scores<T: Copy + Into<f64>>(q: ArrayView4<T>, k: ArrayView4<T>, scale: f64) -> Array4<f64> {
    let (b, hq, l, e) = q.dim();
    let (_, hkv, s, _) = k.dim();
    let group = hq / hkv;
    let mut out = Array4::<f64>::zeros((b, hq, l, s));
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..l {
                for j in 0..s {
                    let mut acc = 0.0f64;
                    for d in 0..e {
                        acc += q[[bi, h, i, d]].into() * k[[bi, h / group, j, d]].into();
                    }
                    out[[bi, h, i, j]] = scale * acc;
                }
            }
        }
    }
    out
}

/// Whether query `i` may attend key `j` of batch `b`, head `h` (mask, causal, key lengths).
fn allowed(
    causal: Causal,
    kv_lens: Option<&[usize]>,
    mask: Option<&ndarray::ArrayView4<bool>>,
    idx: [usize; 4],
    l: usize,
    s: usize,
) -> bool {
    let [b, _h, i, j] = idx;
    if let Some(d) = causal.offset(l, s) {
        if j as i64 > i as i64 + d {
            return false;
        }
    }
    if let Some(lens) = kv_lens {
        if j >= lens[b] {
            return false;
        }
    }
    if let Some(m) = mask {
        if !m[idx] {
            return false;
        }
    }
    true
}

/// Stage 2: add the bias, apply every mask, softmax each row with the max subtracted.
/// Returns the weights and each row's logsumexp. A row with no allowed key (or whose allowed
/// logits are all `-inf`) gives all-zero weights and logsumexp `-inf`. The options' scale is
/// not used (the scores are already scaled); a bias must be host data.
pub fn masked_softmax(scores: &Array4<f64>, opts: &Options) -> Result<(Array4<f64>, Array3<f64>)> {
    let (b, h, l, s) = scores.dim();
    let (mask_view, bias_view) = (opts.mask_view()?, opts.bias_view()?);
    let kv_lens = opts.kv_lens.as_deref();
    let mask = mask_view.as_ref().map(|m| {
        m.broadcast((b, h, l, s))
            .expect("mask broadcasts")
            .into_dimensionality::<Ix4>()
            .unwrap()
    });
    let bias = bias_view.as_ref().map(|m| {
        m.broadcast((b, h, l, s))
            .expect("bias broadcasts")
            .into_dimensionality::<Ix4>()
            .unwrap()
    });
    let mut weights = Array4::<f64>::zeros((b, h, l, s));
    let mut lse = Array3::<f64>::from_elem((b, h, l), f64::NEG_INFINITY);
    let mut logits = vec![0f64; s];
    let mut ok = vec![false; s];
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..l {
                let mut max = f64::NEG_INFINITY;
                for j in 0..s {
                    ok[j] = allowed(opts.causal, kv_lens, mask.as_ref(), [bi, hi, i, j], l, s);
                    logits[j] =
                        scores[[bi, hi, i, j]] + bias.as_ref().map_or(0.0, |x| x[[bi, hi, i, j]] as f64);
                    if ok[j] {
                        // NaN propagates: f64::max ignores NaN, so check explicitly.
                        if logits[j].is_nan() || max.is_nan() {
                            max = f64::NAN;
                        } else {
                            max = max.max(logits[j]);
                        }
                    }
                }
                if max == f64::NEG_INFINITY {
                    continue; // fully masked row: zeros, lse = -inf
                }
                let mut sum = 0.0;
                for j in 0..s {
                    if ok[j] {
                        sum += (logits[j] - max).exp();
                    }
                }
                for j in 0..s {
                    if ok[j] {
                        weights[[bi, hi, i, j]] = (logits[j] - max).exp() / sum;
                    }
                }
                lse[[bi, hi, i]] = max + sum.ln();
            }
        }
    }
    Ok((weights, lse))
}

/// Stage 3: `P V` as `[B, Hq, L, Ev]`; query head `h` reads value head `h / (Hq / Hkv)`.
pub fn weighted_sum<T: Copy + Into<f64>>(p: &Array4<f64>, v: ArrayView4<T>) -> Array4<f64> {
    let (b, hq, l, s) = p.dim();
    let (_, hkv, _, ev) = v.dim();
    let group = hq / hkv;
    let mut out = Array4::<f64>::zeros((b, hq, l, ev));
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..l {
                for j in 0..s {
                    let w = p[[bi, h, i, j]];
                    if w == 0.0 {
                        continue;
                    }
                    for d in 0..ev {
                        out[[bi, h, i, d]] += w * v[[bi, h / group, j, d]].into();
                    }
                }
            }
        }
    }
    out
}

/// The whole of `softmax(scale · Q Kᵀ + bias, masked) V`, validated like the GPU entry points
/// (the same [`Options`]; the mask and bias must be host data). The scale is used in f64.
pub fn sdpa<T: Copy + Into<f64>>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &Options,
) -> Result<Output> {
    let p = opts.problem(q.shape(), k.shape(), v.shape())?;
    let scale = opts.scale.unwrap_or(1.0 / (p.head_dim as f64).sqrt());
    let s = scores(q, k, scale);
    let (weights, lse) = masked_softmax(&s, opts)?;
    let out = weighted_sum(&weights, v);
    Ok(Output { out, weights, lse })
}

/// Average over the head axis: `[B, H, L, S]` to `[B, L, S]`.
pub fn mean_over_heads(w: &Array4<f64>) -> Array3<f64> {
    w.mean_axis(Axis(1)).expect("at least one head")
}

/// Inputs of the reference [`mha`]; mirrors [`crate::MhaForward`].
#[derive(Debug, Clone)]
pub struct MhaInputs<'a> {
    /// `[B, L, d_model]`.
    pub query: ArrayView3<'a, f32>,
    /// `[B, S, kdim]`; `None`: self-attention (keys from `query`).
    pub key: Option<ArrayView3<'a, f32>>,
    /// `[B, S, vdim]`; `None`: self-attention (values from `query`).
    pub value: Option<ArrayView3<'a, f32>>,
    /// Given query heads `[B or 1, H, L, d_k]` instead of the projected query.
    pub query_heads: Option<ArrayView4<'a, f32>>,
    /// Given value heads `[B or 1, G, S, d_k]` instead of the projected value.
    pub value_heads: Option<ArrayView4<'a, f32>>,
}

impl<'a> MhaInputs<'a> {
    /// Self-attention over `x`.
    pub fn self_attention(x: ArrayView3<'a, f32>) -> Self {
        MhaInputs {
            query: x,
            key: None,
            value: None,
            query_heads: None,
            value_heads: None,
        }
    }

    /// Cross-attention: query from `query`, keys and values from `key` and `value`.
    pub fn cross(query: ArrayView3<'a, f32>, key: ArrayView3<'a, f32>, value: ArrayView3<'a, f32>) -> Self {
        MhaInputs {
            query,
            key: Some(key),
            value: Some(value),
            query_heads: None,
            value_heads: None,
        }
    }
}

/// Reference multi-head attention outputs, in f64.
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// `[B, L, d_model]`.
    pub out: Array3<f64>,
    /// Per-head weights `[B, H, L, S]`; [`mean_over_heads`] gives PyTorch's averaged weights.
    pub weights: Array4<f64>,
}

/// `x Wᵀ + b` over the last axis, f64.
fn linear<T: Copy + Into<f64>>(x: ArrayView3<T>, w: &Array2<f32>, b: Option<&Array1<f32>>) -> Array3<f64> {
    let (bn, t, din) = x.dim();
    let n = w.nrows();
    let mut out = Array3::<f64>::zeros((bn, t, n));
    for bi in 0..bn {
        for ti in 0..t {
            for o in 0..n {
                let mut acc = b.map_or(0.0, |b| b[o] as f64);
                for k in 0..din {
                    acc += x[[bi, ti, k]].into() * w[[o, k]] as f64;
                }
                out[[bi, ti, o]] = acc;
            }
        }
    }
    out
}

/// `[B, T, heads·d]` to `[B, heads, T, d]`.
fn split_heads(x: Array3<f64>, heads: usize) -> Array4<f64> {
    let (b, t, n) = x.dim();
    x.into_shape_with_order((b, t, heads, n / heads))
        .expect("divisible")
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .to_owned()
}

/// `[B or 1, heads, T, d]` given heads, broadcast to batch `b`, as f64.
fn given_heads(x: ArrayView4<f32>, b: usize) -> Array4<f64> {
    let (_, h, t, d) = x.dim();
    x.broadcast((b, h, t, d))
        .expect("batch 1 or B")
        .mapv(|v| v as f64)
}

/// Multi-head attention, the plain way: f64 projections, [`scores`], [`masked_softmax`],
/// [`weighted_sum`], head merge, output projection. Validated like the GPU layer (the same
/// typed errors for bad shapes).
pub fn mha(w: &crate::MhaWeights, inputs: &MhaInputs, opts: &Options) -> Result<MhaOutput> {
    w.validate()?;
    let c = &w.config;
    let (h, g, d) = (c.num_heads, c.num_kv_heads, c.head_dim());
    let b = inputs.query.dim().0;
    let q = match &inputs.query_heads {
        Some(qh) => given_heads(*qh, b),
        None => split_heads(linear(inputs.query, &w.w_q, w.b_q.as_ref()), h),
    };
    let key = inputs.key.unwrap_or(inputs.query);
    let k = split_heads(linear(key, &w.w_k, w.b_k.as_ref()), g);
    let v = match &inputs.value_heads {
        Some(vh) => given_heads(*vh, b),
        None => split_heads(
            linear(inputs.value.unwrap_or(inputs.query), &w.w_v, w.b_v.as_ref()),
            g,
        ),
    };
    let mut opts = opts.clone();
    opts.scale = opts.scale.or(Some(1.0 / (d as f64).sqrt()));
    let o = sdpa(q.view(), k.view(), v.view(), &opts)?;
    let (_, _, l, _) = o.out.dim();
    let merged = o
        .out
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .to_owned()
        .into_shape_with_order((b, l, h * d))
        .expect("merge heads");
    let out = linear(merged.view(), &w.w_o, w.b_o.as_ref());
    Ok(MhaOutput {
        out,
        weights: o.weights,
    })
}
