//! The reference SDPA, stage by stage: [`scores`], [`masked_softmax`], [`weighted_sum`], chained
//! by [`sdpa`].

use ndarray::{Array3, Array4, ArrayView4, Axis, Ix4};

use crate::error::Result;
use crate::options::Options;

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

/// A 4-D array's elements widened to f64, row-major (one pass, so that the loops below index
/// plain slices: fast even in a caller's unoptimised build, where ndarray's indexing is not).
fn dense_f64<T: Copy + Into<f64>>(a: ArrayView4<T>) -> Vec<f64> {
    a.iter().map(|&x| x.into()).collect()
}

/// Stage 1: `scale · Q Kᵀ` as `[B, Hq, L, S]`; query head `h` reads key head `h / (Hq / Hkv)`.
pub fn scores<T: Copy + Into<f64>>(q: ArrayView4<T>, k: ArrayView4<T>, scale: f64) -> Array4<f64> {
    let (b, hq, l, e) = q.dim();
    let (_, hkv, s, _) = k.dim();
    let out = scores_f64(&dense_f64(q), &dense_f64(k), [b, hq, hkv, l, s, e], scale);
    Array4::from_shape_vec((b, hq, l, s), out).expect("scores length")
}

/// [`scores`] on dense row-major f64 data (compiled once, in this crate).
fn scores_f64(q: &[f64], k: &[f64], [b, hq, hkv, l, s, e]: [usize; 6], scale: f64) -> Vec<f64> {
    let group = hq / hkv;
    let mut out = vec![0.0f64; b * hq * l * s];
    for bi in 0..b {
        for h in 0..hq {
            let kh = (bi * hkv + h / group) * s * e;
            for i in 0..l {
                let qrow = &q[((bi * hq + h) * l + i) * e..][..e];
                let orow = &mut out[((bi * hq + h) * l + i) * s..][..s];
                for (j, o) in orow.iter_mut().enumerate() {
                    let krow = &k[kh + j * e..][..e];
                    let mut acc = 0.0f64;
                    for d in 0..e {
                        acc += qrow[d] * krow[d];
                    }
                    *o = scale * acc;
                }
            }
        }
    }
    out
}

/// `a` (a mask or bias of rank 1 to 4, validated) broadcast to the scores' `dims`.
pub(super) fn broadcast4<T, S: ndarray::Data<Elem = T>>(
    a: &ndarray::ArrayBase<S, ndarray::IxDyn>,
    dims: [usize; 4],
) -> ArrayView4<'_, T> {
    a.broadcast(dims)
        .expect("validated broadcast")
        .into_dimensionality::<Ix4>()
        .expect("four dims")
}

/// Whether query `i` may attend key `j` of batch `b`, head `h` (document ids, window, causal,
/// key lengths, mask).
pub(super) fn allowed(
    opts: &Options,
    mask: Option<&ndarray::ArrayView4<bool>>,
    idx: [usize; 4],
    l: usize,
    s: usize,
) -> bool {
    let (causal, kv_lens) = (opts.causal, opts.kv_lens.as_deref());
    let [b, _h, i, j] = idx;
    if let Some(d) = &opts.doc_ids {
        if d.q[b * l + i] != d.k[b * s + j] {
            return false;
        }
    }
    if let Some(f) = opts.user_mod.as_ref().and_then(|m| m.mask_closure()) {
        if !f(idx) {
            return false;
        }
    }
    if let Some((left, right)) = opts.window {
        let w = crate::problem::Window {
            left,
            right,
            sink_tokens: opts.sink_tokens,
        };
        if !w.allows(i, j, l, kv_lens.map_or(s, |lens| lens[b])) {
            return false;
        }
    }
    if let Some(d) = causal.offset_for(l, s, kv_lens.map(|lens| lens[b])) {
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

/// The softcap and ALiBi of the scaled logit `x` of `idx` = (b, h, i, j), for `l` queries and
/// `s` keys: `C tanh(x / C) - slope[h] |i + S_b - L - j|` (each only when set; `S_b` the batch's
/// key length with key lengths). The bias is added after the softcap, like ALiBi.
pub(super) fn modified(opts: &Options, x: f64, idx: [usize; 4], l: usize, s: usize) -> f64 {
    let [b, h, i, j] = idx;
    let mut y = x;
    if let Some(c) = opts.softcap {
        let c = f64::from(c);
        y = c * (y / c).tanh();
    }
    if let Some(slopes) = &opts.alibi {
        let sb = opts.kv_lens.as_ref().map_or(s, |lens| lens[b]);
        y -= f64::from(slopes[h]) * (i as f64 + sb as f64 - l as f64 - j as f64).abs();
    }
    y
}

/// `d modified(x) / dx`: `1 - tanh(x / C)^2` with a softcap, else 1.
pub(super) fn softcap_grad(opts: &Options, x: f64) -> f64 {
    opts.softcap
        .map_or(1.0, |c| 1.0 - (x / f64::from(c)).tanh().powi(2))
}

/// Stage 2: apply the softcap, add the bias and ALiBi, apply every mask, softmax each row with the max subtracted.
/// Returns the weights and each row's logsumexp. A row with no allowed key (or whose allowed
/// logits are all `-inf`) gives all-zero weights and logsumexp `-inf`. The options' scale is
/// not used (the scores are already scaled); a bias must be host data.
pub fn masked_softmax(scores: &Array4<f64>, opts: &Options) -> Result<(Array4<f64>, Array3<f64>)> {
    let (b, h, l, s) = scores.dim();
    if let Some(d) = &opts.doc_ids {
        if d.q.len() != b * l || d.k.len() != b * s {
            return Err(crate::error::Error::InvalidModifier {
                modifier: "doc_ids",
                reason: format!(
                    "{} query and {} key document ids for scores [{b}, {h}, {l}, {s}]: give B·L and B·S",
                    d.q.len(),
                    d.k.len()
                ),
            });
        }
    }
    let (mask_view, bias_view) = (opts.mask_view()?, opts.bias_view()?);
    // User functions: their closures (an error when the source has one and no closure).
    let caps = opts
        .user_mod
        .as_ref()
        .map_or(crate::user_mod::Captures::new(&[]), |m| m.cpu_captures())
        .at_positions(opts.kv_lens.clone().unwrap_or_else(|| vec![s; b]), l);
    let user_score = match &opts.user_mod {
        Some(m) => {
            m.cpu_mask_fn()?;
            m.cpu_score_fn()?
        }
        None => None,
    };
    let mask = mask_view.as_ref().map(|m| broadcast4(m, [b, h, l, s]));
    let bias = bias_view.as_ref().map(|m| broadcast4(m, [b, h, l, s]));
    let mut weights = Array4::<f64>::zeros((b, h, l, s));
    let mut lse = Array3::<f64>::from_elem((b, h, l), f64::NEG_INFINITY);
    let mut logits = vec![0f64; s];
    let mut ok = vec![false; s];
    let dense = scores.as_standard_layout();
    let dense = dense.as_slice().expect("standard layout");
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..l {
                let mut max = f64::NEG_INFINITY;
                let row = &dense[((bi * h + hi) * l + i) * s..][..s];
                for j in 0..s {
                    ok[j] = allowed(opts, mask.as_ref(), [bi, hi, i, j], l, s);
                    logits[j] = modified(opts, row[j], [bi, hi, i, j], l, s)
                        + bias.as_ref().map_or(0.0, |x| x[[bi, hi, i, j]] as f64);
                    if let Some(f) = user_score {
                        logits[j] = f(logits[j], [bi, hi, i, j], &caps);
                    }
                    if ok[j] {
                        // NaN propagates: f64::max ignores NaN, so check explicitly.
                        if logits[j].is_nan() || max.is_nan() {
                            max = f64::NAN;
                        } else {
                            max = max.max(logits[j]);
                        }
                    }
                }
                // A sink logit joins the denominator with no value: a row with no allowed key
                // is 0 with logsumexp the sink.
                let sink = opts.sink_logits.as_ref().map(|sk| f64::from(sk[hi]));
                if let Some(sk) = sink {
                    max = if max.is_nan() { max } else { max.max(sk) };
                }
                if max == f64::NEG_INFINITY {
                    continue; // fully masked row: zeros, lse = -inf
                }
                let mut sum = sink.map_or(0.0, |sk| (sk - max).exp());
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
    let pw = p.as_standard_layout();
    let pw = pw.as_slice().expect("standard layout");
    let out = weighted_sum_f64(pw, &dense_f64(v), [b, hq, hkv, l, s, ev]);
    Array4::from_shape_vec((b, hq, l, ev), out).expect("output length")
}

/// [`weighted_sum`] on dense row-major f64 data (compiled once, in this crate).
fn weighted_sum_f64(p: &[f64], v: &[f64], [b, hq, hkv, l, s, ev]: [usize; 6]) -> Vec<f64> {
    let group = hq / hkv;
    let mut out = vec![0.0f64; b * hq * l * ev];
    for bi in 0..b {
        for h in 0..hq {
            let vh = (bi * hkv + h / group) * s * ev;
            for i in 0..l {
                let prow = &p[((bi * hq + h) * l + i) * s..][..s];
                let orow = &mut out[((bi * hq + h) * l + i) * ev..][..ev];
                for (j, &w) in prow.iter().enumerate() {
                    if w == 0.0 {
                        continue;
                    }
                    let vrow = &v[vh + j * ev..][..ev];
                    for d in 0..ev {
                        orow[d] += w * vrow[d];
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

#[cfg(test)]
mod modifier_tests {
    use super::*;

    /// One query, two keys, written out by hand: softcap, then the bias and ALiBi (aligned
    /// bottom-right to the batch's key length), then the softmax.
    #[test]
    fn softcap_and_alibi_by_hand() {
        let q = ndarray::Array4::from_shape_vec((1, 1, 1, 1), vec![1.0f64]).unwrap();
        let k = ndarray::Array4::from_shape_vec((1, 1, 3, 1), vec![2.0, -1.0, 7.0]).unwrap();
        let v = ndarray::Array4::from_shape_vec((1, 1, 3, 1), vec![10.0, 20.0, 30.0]).unwrap();
        let bias = [0.25f32, -0.5, 0.0];
        let opts = Options {
            scale: Some(1.0),
            softcap: Some(1.5),
            alibi: Some(vec![0.375]),
            kv_lens: Some(vec![2]),
            bias: Some(crate::tensor::Tensor::from_slice(&bias, &[1, 1, 1, 3])),
            ..Default::default()
        };
        let got = sdpa(q.view(), k.view(), v.view(), &opts).unwrap().out[[0, 0, 0, 0]];
        // Query 0 of L = 1 sits at key S_b - 1 = 1 (key length 2): distances 1, 0; key 2 is
        // past the key length.
        let x0 = 1.5 * (2.0f64 / 1.5).tanh() + 0.25 - 0.375;
        let x1 = 1.5 * (-1.0f64 / 1.5).tanh() - 0.5;
        let want = (10.0 * x0.exp() + 20.0 * x1.exp()) / (x0.exp() + x1.exp());
        assert!((got - want).abs() < 1e-12, "{got} against {want}");
        // A sink logit joins the denominator with no value; a row with no allowed key is 0
        // with logsumexp the sink.
        let sinks = Options {
            sink_logits: Some(vec![0.5]),
            ..opts.clone()
        };
        let got = sdpa(q.view(), k.view(), v.view(), &sinks).unwrap();
        let den = x0.exp() + x1.exp() + 0.5f64.exp();
        let want = (10.0 * x0.exp() + 20.0 * x1.exp()) / den;
        assert!(
            (got.out[[0, 0, 0, 0]] - want).abs() < 1e-12,
            "{} against {want}",
            got.out[[0, 0, 0, 0]]
        );
        assert!((got.lse[[0, 0, 0]] - den.ln()).abs() < 1e-12);
        let empty = Options {
            kv_lens: Some(vec![0]),
            ..sinks
        };
        let got = sdpa(q.view(), k.view(), v.view(), &empty).unwrap();
        assert_eq!((got.out[[0, 0, 0, 0]], got.lse[[0, 0, 0]]), (0.0, 0.5));
    }
}
