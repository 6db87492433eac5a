//! The reference attention variants (f64), stage by stage, for [`crate::Variant`]:
//! [`general_scores`], [`additive_scores`], [`landmarks`], [`nystrom_pinv`] and
//! [`seq_project`], chained by [`variant`] with [`super::masked_softmax`] and
//! [`super::weighted_sum`].

use ndarray::{s, Array2, Array4, ArrayView2, ArrayView4, Axis};

use super::sdpa::{masked_softmax, scores, weighted_sum};
use crate::error::Result;
use crate::options::Options;
use crate::variants::VariantParams;

/// Reference results in f64.
#[derive(Debug, Clone)]
pub struct VariantOutput {
    /// `[B, Hq, L, Ev]`.
    pub out: Array4<f64>,
    /// The attention weights `[B, Hq, L, S]` (general, additive, lowrank-v).
    pub weights: Option<Array4<f64>>,
}

fn to_f64<T: Copy + Into<f64>>(x: ArrayView4<T>) -> Array4<f64> {
    x.mapv(|v| v.into())
}

/// Luong's general score `scale · qᵢᵀ W kⱼ` `[B, Hq, L, S]`.
pub fn general_scores<T: Copy + Into<f64>>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    w: ArrayView2<f32>,
    scale: f64,
) -> Array4<f64> {
    let w = w.mapv(f64::from);
    let mut qw = to_f64(q);
    for mut row in qw.lanes_mut(Axis(3)) {
        let r = row.to_owned().dot(&w);
        row.assign(&r);
    }
    scores(qw.view(), to_f64(k).view(), scale)
}

/// Bahdanau's additive score `scale · Σₐ uₐ tanh((W_q qᵢ)ₐ + (W_k kⱼ)ₐ + bₐ)` `[B, Hq, L, S]`.
pub fn additive_scores<T: Copy + Into<f64>>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    [w_q, w_k]: [ArrayView2<f32>; 2],
    u: &[f32],
    b: Option<&[f32]>,
    scale: f64,
) -> Array4<f64> {
    let project = |x: ArrayView4<T>, w: ArrayView2<f32>, bias: Option<&[f32]>| {
        let (bb, h, n, _) = x.dim();
        let a = w.nrows();
        let mut out = Array4::<f64>::zeros((bb, h, n, a));
        for (mut o, xi) in out.lanes_mut(Axis(3)).into_iter().zip(x.lanes(Axis(3))) {
            for t in 0..a {
                let mut acc = bias.map_or(0.0, |b| b[t] as f64);
                for (d, &xv) in xi.iter().enumerate() {
                    acc += w[[t, d]] as f64 * xv.into();
                }
                o[t] = acc;
            }
        }
        out
    };
    let qa = project(q, w_q, b);
    let ka = project(k, w_k, None);
    let (bb, hq, l, a) = qa.dim();
    let (_, hkv, s, _) = ka.dim();
    let group = hq / hkv;
    let mut out = Array4::<f64>::zeros((bb, hq, l, s));
    for bi in 0..bb {
        for h in 0..hq {
            for i in 0..l {
                for j in 0..s {
                    let mut acc = 0.0;
                    for t in 0..a {
                        acc += u[t] as f64 * (qa[[bi, h, i, t]] + ka[[bi, h / group, j, t]]).tanh();
                    }
                    out[[bi, h, i, j]] = scale * acc;
                }
            }
        }
    }
    out
}

/// `P · X` along the sequence for every (batch, head): P `[rows, n]`, x `[B, H, n, d]`.
pub fn seq_project<T: Copy + Into<f64>>(p: ArrayView2<f64>, x: ArrayView4<T>) -> Array4<f64> {
    let (b, h, _, d) = x.dim();
    let mut out = Array4::<f64>::zeros((b, h, p.nrows(), d));
    for bi in 0..b {
        for hi in 0..h {
            let xs = x.slice(s![bi, hi, .., ..]).mapv(|v| v.into());
            out.slice_mut(s![bi, hi, .., ..]).assign(&p.dot(&xs));
        }
    }
    out
}

/// Nyström's `m` landmarks of x `[B, H, n, d]`: segment means (row t averages rows
/// `⌊t·n/m⌋ .. ⌊(t+1)·n/m⌋ − 1`).
pub fn landmarks<T: Copy + Into<f64>>(x: ArrayView4<T>, m: usize) -> Array4<f64> {
    seq_project(crate::variants::segment_means_f64(m, x.dim().2).view(), x)
}

/// Nyströmformer's iterative pseudo-inverse of each `[m, m]` matrix of `a` `[B, H, m, m]`:
/// `Z₀ = Aᵀ / (max column sum · max row sum of |A|)`, then `iters` times
/// `Z ← ¼ Z (13I − AZ (15I − AZ (7I − AZ)))`.
pub fn nystrom_pinv(a: &Array4<f64>, iters: usize) -> Array4<f64> {
    let (b, h, m, _) = a.dim();
    let eye = Array2::<f64>::eye(m);
    let mut out = Array4::<f64>::zeros((b, h, m, m));
    for bi in 0..b {
        for hi in 0..h {
            let a = a.slice(s![bi, hi, .., ..]);
            let abs = a.mapv(f64::abs);
            let col = abs.sum_axis(Axis(0)).fold(0.0f64, |x, &y| x.max(y));
            let row = abs.sum_axis(Axis(1)).fold(0.0f64, |x, &y| x.max(y));
            let mut z = a.t().to_owned() / (col * row);
            for _ in 0..iters {
                let az = a.dot(&z);
                let t = &eye * 7.0 - &az;
                let t = &eye * 15.0 - az.dot(&t);
                let t = &eye * 13.0 - az.dot(&t);
                z = z.dot(&t) * 0.25;
            }
            out.slice_mut(s![bi, hi, .., ..]).assign(&z);
        }
    }
    out
}

/// `[B, H, m, m] · [B, H, m, d]` per (batch, head).
fn batched_dot(x: &Array4<f64>, y: &Array4<f64>) -> Array4<f64> {
    let (b, h, m, _) = x.dim();
    let d = y.dim().3;
    let mut out = Array4::<f64>::zeros((b, h, m, d));
    for bi in 0..b {
        for hi in 0..h {
            let r = x.slice(s![bi, hi, .., ..]).dot(&y.slice(s![bi, hi, .., ..]));
            out.slice_mut(s![bi, hi, .., ..]).assign(&r);
        }
    }
    out
}

/// `x` `[B, Hkv, n, d]` repeated to `hq` heads (query head h reads kv head h / (hq / Hkv)).
fn expand_heads(x: Array4<f64>, hq: usize) -> Array4<f64> {
    let (b, hkv, n, d) = x.dim();
    let g = hq / hkv;
    Array4::from_shape_fn((b, hq, n, d), |(bi, h, i, j)| x[[bi, h / g, i, j]])
}

/// The whole variant `params.kind()`, validated like [`crate::Variant`] (the same errors),
/// masks from `opts` where the kind takes them; for lowrank-v `v` holds U. `pinv_iters`:
/// Nyström's iterations (6 is the paper's).
pub fn variant<T: Copy + Into<f64>>(
    params: &VariantParams,
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    opts: &Options,
    weights: bool,
    pinv_iters: usize,
) -> Result<VariantOutput> {
    let d = params.check(q.shape(), k.shape(), v.shape(), opts, weights, pinv_iters)?;
    let scale = d.scale;
    let softmax_v = |sc: Array4<f64>, v: ArrayView4<T>| -> Result<(Array4<f64>, Array4<f64>)> {
        let (w, _lse) = masked_softmax(&sc, opts)?;
        Ok((weighted_sum(&w, v), w))
    };
    let plain = Options::default();
    let (out, w) = match params {
        VariantParams::General { w } => {
            let (o, p) = softmax_v(general_scores(q, k, w.view(), scale), v)?;
            (o, Some(p))
        }
        VariantParams::Additive { w_q, w_k, u, b } => {
            let u = u.to_vec();
            let b = b.as_ref().map(|b| b.to_vec());
            let sc = additive_scores(q, k, [w_q.view(), w_k.view()], &u, b.as_deref(), scale);
            let (o, p) = softmax_v(sc, v)?;
            (o, Some(p))
        }
        VariantParams::LowRankV { a } => {
            let (pu, p) = softmax_v(scores(q, k, scale), v)?;
            let a = a.mapv(f64::from);
            let (b, h, l, r) = pu.dim();
            let flat = pu
                .into_shape_with_order((b * h * l, r))
                .expect("contiguous")
                .dot(&a);
            let out = flat
                .into_shape_with_order((b, h, l, a.ncols()))
                .expect("contiguous");
            (out, Some(p))
        }
        VariantParams::Linformer { e, f } => {
            let kp = seq_project(e.mapv(f64::from).view(), k);
            let vp = seq_project(f.mapv(f64::from).view(), v);
            let (w, _) = masked_softmax(&scores(to_f64(q).view(), kp.view(), scale), &plain)?;
            (weighted_sum(&w, vp.view()), None)
        }
        VariantParams::Nystrom { landmarks: m } => {
            let qt = landmarks(q, *m);
            let kt = expand_heads(landmarks(k, *m), d.hq);
            let soft = |x: ArrayView4<f64>, y: ArrayView4<f64>| {
                masked_softmax(&scores(x, y, scale), &plain).map(|r| r.0)
            };
            let f = soft(to_f64(q).view(), kt.view())?;
            let a = soft(qt.view(), kt.view())?;
            let bv = weighted_sum(&soft(qt.view(), to_f64(k).view())?, v);
            let z = nystrom_pinv(&a, pinv_iters);
            let out = weighted_sum(&f, batched_dot(&z, &bv).view());
            (out, None)
        }
    };
    Ok(VariantOutput {
        out,
        weights: if weights { w } else { None },
    })
}
