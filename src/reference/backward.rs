//! The reference SDPA backward, stage by stage, in any float type: f64 for checking
//! ([`sdpa_backward`]) and f32 for the accuracy rule's plain f32 implementation
//! ([`sdpa_backward_f32`]).
//!
//! With `S = scale · Q Kᵀ + bias` (masked entries excluded), `P = softmax(S)`, `O = P V` and
//! the upstream gradient `dO`:
//!
//! 1. [`recompute`]: `P` and the row logsumexp, as the forward computes them;
//! 2. `dV = Pᵀ dO` (summed over the query heads of each group);
//! 3. `dP = dO Vᵀ`, `D = rowsum(dO ∘ O)`, [`softmax_backward`]: `dS = P ∘ (dP − D)`;
//! 4. `dQ = scale · dS K`, `dK = scale · dSᵀ Q` (summed over the group);
//! 5. `d(bias) = dS` summed over the bias's broadcast dimensions.
//!
//! Masked entries have `P = 0`, so their `dS` is 0; a fully masked row has zero gradients.

use ndarray::{Array3, Array4, ArrayD, ArrayView4, IxDyn};
use num_traits::Float;

use crate::error::Result;
use crate::options::Options;

use super::sdpa::{allowed, broadcast4, modified, softcap_grad};

/// Gradients of `sum(dO ∘ O)` with respect to every input, in the float type `F`.
#[derive(Debug, Clone)]
pub struct Gradients<F> {
    /// `[B, Hq, L, E]`.
    pub dq: Array4<F>,
    /// `[B, Hkv, S, E]`, summed over the query heads of each group.
    pub dk: Array4<F>,
    /// `[B, Hkv, S, Ev]`, summed over the query heads of each group.
    pub dv: Array4<F>,
    /// In the bias's own shape, summed over its broadcast dimensions; when a bias is given.
    pub dbias: Option<ArrayD<F>>,
    /// d(sink logits) `[Hq]`: `-sum_rows exp(sink[h] - lse) D`; when sink logits are given.
    pub dsink: Option<ndarray::Array1<F>>,
    /// The captures' gradients, flat, in the order they were given: the sum over the logits of
    /// dS times the score closure's derivative in each element it read (a central difference
    /// in f64); when a user score_mod is given.
    pub dcaptures: Option<Vec<ndarray::Array1<F>>>,
    /// The forward output `[B, Hq, L, Ev]` computed on the way.
    pub out: Array4<F>,
    /// The forward logsumexp `[B, Hq, L]` (`-inf` on fully masked rows).
    pub lse: Array3<F>,
}

fn cast<F: Float, T: Copy + Into<f64>>(x: T) -> F {
    F::from(x.into()).expect("float conversion")
}

/// A 4-D array's elements in `F`, row-major: the loops below index plain slices, which stay
/// fast in a caller's unoptimised build (ndarray's indexing does not).
fn dense<F: Float, T: Copy + Into<f64>>(a: ArrayView4<T>) -> Vec<F> {
    a.iter().map(|&x| cast(x)).collect()
}

/// Stage 1: the softmax weights `P` `[B, Hq, L, S]` and the row logsumexp, recomputed in `F`
/// from q, k and the options (the same masking rules as [`super::masked_softmax`]).
pub fn recompute<F: Float, T: Copy + Into<f64>>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    opts: &Options,
    scale: F,
) -> Result<(Array4<F>, Array3<F>)> {
    let (b, hq, l, e) = q.dim();
    let (_, hkv, s, _) = k.dim();
    let group = hq / hkv;
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
    let mask = opts.mask_view()?;
    let bias = opts.bias_view()?;
    let mask = mask.as_ref().map(|m| broadcast4(m, [b, hq, l, s]));
    let bias = bias.as_ref().map(|m| broadcast4(m, [b, hq, l, s]));
    let (qd, kd) = (dense::<F, _>(q), dense::<F, _>(k));
    let mut p = Array4::<F>::zeros((b, hq, l, s));
    let mut lse = Array3::<F>::from_elem((b, hq, l), F::neg_infinity());
    let mut logits = vec![F::zero(); s];
    let mut ok = vec![false; s];
    for bi in 0..b {
        for h in 0..hq {
            let kh = &kd[(bi * (hq / group) + h / group) * s * e..][..s * e];
            for i in 0..l {
                let qrow = &qd[((bi * hq + h) * l + i) * e..][..e];
                let mut max = F::neg_infinity();
                for j in 0..s {
                    let krow = &kh[j * e..][..e];
                    let mut acc = F::zero();
                    for d in 0..e {
                        acc = acc + qrow[d] * krow[d];
                    }
                    let raw = scale * acc;
                    let x = if opts.softcap.is_some() || opts.alibi.is_some() {
                        cast::<F, f64>(modified(
                            opts,
                            raw.to_f64().unwrap_or(f64::NAN),
                            [bi, h, i, j],
                            l,
                            s,
                        ))
                    } else {
                        raw
                    } + bias.as_ref().map_or(F::zero(), |x| cast(x[[bi, h, i, j]]));
                    let x = match user_score {
                        Some(f) => cast::<F, f64>(f(x.to_f64().unwrap_or(f64::NAN), [bi, h, i, j], &caps)),
                        None => x,
                    };
                    ok[j] = allowed(opts, mask.as_ref(), [bi, h, i, j], l, s) && x != F::neg_infinity();
                    logits[j] = x;
                    if ok[j] {
                        max = if x.is_nan() || max.is_nan() {
                            F::nan()
                        } else {
                            max.max(x)
                        };
                    }
                }
                let sink = opts.sink_logits.as_ref().map(|sk| cast::<F, f32>(sk[h]));
                if let Some(sk) = sink {
                    max = if max.is_nan() { max } else { max.max(sk) };
                }
                if max == F::neg_infinity() {
                    continue;
                }
                let mut sum = sink.map_or(F::zero(), |sk| (sk - max).exp());
                for j in 0..s {
                    if ok[j] {
                        sum = sum + (logits[j] - max).exp();
                    }
                }
                for j in 0..s {
                    if ok[j] {
                        p[[bi, h, i, j]] = (logits[j] - max).exp() / sum;
                    }
                }
                lse[[bi, h, i]] = max + sum.ln();
            }
        }
    }
    Ok((p, lse))
}

/// Stage 3: `dS = P ∘ (dP − D)` with `D = rowsum(P ∘ dP)` (which equals `rowsum(dO ∘ O)`).
pub fn softmax_backward<F: Float>(p: &Array4<F>, dp: &Array4<F>, d: &Array3<F>) -> Array4<F> {
    let mut ds = p.clone();
    for ((idx, x), &dpx) in ds.indexed_iter_mut().zip(dp.iter()) {
        let (b, h, i, _) = idx;
        *x = *x * (dpx - d[[b, h, i]]);
    }
    ds
}

/// The backward of `softmax(scale · Q Kᵀ + bias, masks) V` in the float type `F`, for the
/// upstream gradient `dout` `[B, Hq, L, Ev]` (the gradients of `sum(dout ∘ O)`).
pub fn sdpa_backward_in<F: Float, T: Copy + Into<f64>, U: Copy + Into<f64>>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    dout: ArrayView4<U>,
    opts: &Options,
) -> Result<Gradients<F>> {
    let pr = opts.problem(q.shape(), k.shape(), v.shape())?;
    if dout.shape() != pr.out_shape() {
        return Err(crate::error::Error::ShapeMismatch {
            tensor: "dout",
            expected: pr.out_shape().to_vec(),
            actual: dout.shape().to_vec(),
        });
    }
    let scale: F = F::from(opts.scale.unwrap_or(1.0 / (pr.head_dim as f64).sqrt())).unwrap();
    let (b, hq, l, e) = q.dim();
    let (_, hkv, s, ev) = v.dim();
    let (p, lse) = recompute(q, k, opts, scale)?;
    let (qd, kd) = (dense::<F, _>(q), dense::<F, _>(k));
    let (vd, dod) = (dense::<F, _>(v), dense::<F, _>(dout));
    let dims = Dims { b, hq, hkv, l, s };
    // Stage 2: O = P V, dV = Pᵀ dO, dP = dO Vᵀ.
    let (out, dv, dp) = values_stage(dims, &p, &vd, &dod, ev);
    // Stage 3: D = rowsum(dO ∘ O), dS = P ∘ (dP − D).
    let dsum = dod
        .chunks(ev.max(1))
        .zip(out.chunks(ev.max(1)))
        .take(b * hq * l)
        .map(|(g, o)| g.iter().zip(o).fold(F::zero(), |acc, (&g, &o)| acc + g * o))
        .collect::<Vec<F>>();
    let shape4 = |d4: usize| [b, hq, l, d4];
    let out = Array4::from_shape_vec(shape4(ev), out).expect("out length");
    let dp = Array4::from_shape_vec(shape4(s), dp).expect("dp length");
    let dsum = Array3::from_shape_vec((b, hq, l), dsum).expect("D length");
    let mut ds = softmax_backward(&p, &dp, &dsum);
    let raw_at = |bi: usize, h: usize, i: usize, j: usize| {
        let qrow = &qd[((bi * hq + h) * l + i) * e..][..e];
        let krow = &kd[((bi * hkv + h / (hq / hkv)) * s + j) * e..][..e];
        let raw = qrow.iter().zip(krow).fold(F::zero(), |a, (&q, &k)| a + q * k) * scale;
        raw.to_f64().unwrap_or(f64::NAN)
    };
    // Through a user score_mod (dQ, dK and d(bias): it acts after the bias).
    let dcaptures = through_score_mod(&mut ds, opts, &raw_at)?;
    // Through the softcap (dQ and dK only: the bias is added after it).
    let ds_qk = opts.softcap.map(|_| {
        let mut d = ds.clone();
        for ((bi, h, i, j), x) in d.indexed_iter_mut() {
            *x = *x * cast(softcap_grad(opts, raw_at(bi, h, i, j)));
        }
        d
    });
    // Stage 4: dQ = scale · dS K, dK = scale · dSᵀ Q.
    let (dq, dk) = qk_stage(
        dims,
        ds_qk.as_ref().unwrap_or(&ds).as_slice().expect("standard layout"),
        (&qd, &kd),
        e,
        scale,
    );
    let dv = Array4::from_shape_vec([b, hkv, s, ev], dv).expect("dv length");
    let dq = Array4::from_shape_vec([b, hq, l, e], dq).expect("dq length");
    let dk = Array4::from_shape_vec([b, hkv, s, e], dk).expect("dk length");
    // Stage 5: d(bias) = dS summed over the bias's broadcast dimensions.
    let dbias = pr.bias.map(|bc| {
        let [sb, sh, sl, ss] = bc.shape;
        let mut acc = Array4::<F>::zeros((sb, sh, sl, ss));
        for ((bi, h, i, j), &x) in ds.indexed_iter() {
            let idx = [bi.min(sb - 1), h.min(sh - 1), i.min(sl - 1), j.min(ss - 1)];
            acc[idx] = acc[idx] + x;
        }
        let shape = opts.bias.as_ref().expect("bias given").shape.clone();
        acc.into_shape_with_order(IxDyn(&shape)).expect("same length")
    });
    // d(sink logits): -sum over the head's rows of the sink's weight exp(sink - lse) times D.
    let dsink = opts.sink_logits.as_ref().map(|sk| {
        ndarray::Array1::from_shape_fn(hq, |h| {
            let s = cast::<F, f32>(sk[h]);
            let mut acc = F::zero();
            for bi in 0..b {
                for i in 0..l {
                    acc = acc + (s - lse[[bi, h, i]]).exp() * dsum[[bi, h, i]];
                }
            }
            -acc
        })
    });
    Ok(Gradients {
        dq,
        dk,
        dv,
        dbias,
        dsink,
        dcaptures,
        out,
        lse,
    })
}

/// The sizes the backward's stages loop over: batches, query and kv heads, query and key rows.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    l: usize,
    s: usize,
}

impl Dims {
    /// Every query row `r = (b Hq + h) L + i` (of a `[B, Hq, L, width]` array, starting at
    /// element `r · width`) with the row of its kv head's first key, `(b Hkv + h / G) S`.
    fn rows(self) -> impl Iterator<Item = (usize, usize)> {
        let g = self.hq / self.hkv;
        (0..self.b).flat_map(move |bi| {
            (0..self.hq).flat_map(move |h| {
                (0..self.l).map(move |i| ((bi * self.hq + h) * self.l + i, (bi * self.hkv + h / g) * self.s))
            })
        })
    }
}

/// Stage 2: O = P V, dV = Pᵀ dO and dP = dO Vᵀ, for the probabilities `p`, dense V and dO
/// (`ev` columns). Returns (O, dV, dP), dense.
/// `ds` times the derivative of the user's score closure (if any) at the logit it was given (after
/// the softcap, the bias and ALiBi), by a central difference in f64; masked entries (dS = 0)
/// are left alone. `raw_at(b, h, i, j)` is the scaled dot product. Returns the captures'
/// gradients: per logit, dS times the closure's derivative in each capture element it read
/// (a central difference in f64), summed in `F` in the logits' order.
fn through_score_mod<F: Float>(
    ds: &mut Array4<F>,
    opts: &Options,
    raw_at: &dyn Fn(usize, usize, usize, usize) -> f64,
) -> Result<Option<Vec<ndarray::Array1<F>>>> {
    let Some((m, f)) = opts
        .user_mod
        .as_ref()
        .map(|m| m.cpu_score_fn().map(|f| f.map(|f| (m, f))))
        .transpose()?
        .flatten()
    else {
        return Ok(None);
    };
    let (b, _, l, s) = ds.dim();
    let caps = m
        .cpu_captures()
        .at_positions(opts.kv_lens.clone().unwrap_or_else(|| vec![s; b]), l);
    let mut dcap: Vec<Vec<F>> = caps.lens().map(|(_, n)| vec![F::zero(); n]).collect();
    let (b, hq, l, s) = ds.dim();
    let bias4 = opts.bias_view()?;
    let bias4 = bias4.as_ref().map(|m| broadcast4(m, [b, hq, l, s]));
    for ((bi, h, i, j), x) in ds.indexed_iter_mut() {
        if *x == F::zero() {
            continue;
        }
        let idx = [bi, h, i, j];
        let y = modified(opts, raw_at(bi, h, i, j), idx, l, s)
            + bias4.as_ref().map_or(0.0, |m| f64::from(m[idx]));
        let rec = caps.recording();
        f(y, idx, &rec);
        for at in rec.read() {
            let d = 1e-6 * caps.value(at).abs().max(1.0);
            let dy = (f(y, idx, &caps.bumped(at, d)) - f(y, idx, &caps.bumped(at, -d))) / (2.0 * d);
            dcap[at.0][at.1] = dcap[at.0][at.1] + *x * cast(dy);
        }
        let d = 1e-6 * y.abs().max(1.0);
        let g = (f(y + d, idx, &caps) - f(y - d, idx, &caps)) / (2.0 * d);
        *x = *x * cast(g);
    }
    Ok(Some(dcap.into_iter().map(ndarray::Array1::from).collect()))
}

fn values_stage<F: Float>(
    d: Dims,
    p: &Array4<F>,
    v: &[F],
    dout: &[F],
    ev: usize,
) -> (Vec<F>, Vec<F>, Vec<F>) {
    let pd = p.as_slice().expect("standard layout");
    let s = d.s;
    let mut out = vec![F::zero(); d.b * d.hq * d.l * ev];
    let mut dv = vec![F::zero(); d.b * d.hkv * s * ev];
    let mut dp = vec![F::zero(); d.b * d.hq * d.l * s];
    for (r, k0) in d.rows() {
        let dorow = &dout[r * ev..][..ev];
        let orow = &mut out[r * ev..][..ev];
        for j in 0..s {
            let pij = pd[r * s + j];
            let vrow = &v[(k0 + j) * ev..][..ev];
            let dvrow = &mut dv[(k0 + j) * ev..][..ev];
            let mut acc = F::zero();
            for c in 0..ev {
                orow[c] = orow[c] + pij * vrow[c];
                dvrow[c] = dvrow[c] + pij * dorow[c];
                acc = acc + dorow[c] * vrow[c];
            }
            dp[r * s + j] = acc;
        }
    }
    (out, dv, dp)
}

/// Stage 4: dQ = scale · dS K and dK = scale · dSᵀ Q for dense dS, Q and K (`e` columns).
fn qk_stage<F: Float>(d: Dims, ds: &[F], (q, k): (&[F], &[F]), e: usize, scale: F) -> (Vec<F>, Vec<F>) {
    let s = d.s;
    let mut dq = vec![F::zero(); d.b * d.hq * d.l * e];
    let mut dk = vec![F::zero(); d.b * d.hkv * s * e];
    for (r, k0) in d.rows() {
        let qrow = &q[r * e..][..e];
        let dqrow = &mut dq[r * e..][..e];
        for j in 0..s {
            let x = ds[r * s + j];
            let krow = &k[(k0 + j) * e..][..e];
            let dkrow = &mut dk[(k0 + j) * e..][..e];
            for c in 0..e {
                dqrow[c] = dqrow[c] + scale * x * krow[c];
                dkrow[c] = dkrow[c] + scale * x * qrow[c];
            }
        }
    }
    (dq, dk)
}

/// [`sdpa_backward_in`] in f64: the reference every GPU backward is checked against.
pub fn sdpa_backward<T: Copy + Into<f64>, U: Copy + Into<f64>>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    dout: ArrayView4<U>,
    opts: &Options,
) -> Result<Gradients<f64>> {
    sdpa_backward_in(q, k, v, dout, opts)
}

/// [`sdpa_backward_in`] in f32: the plain f32 implementation of FlashAttention's accuracy rule
/// (a GPU result's error against the f64 reference may be at most twice this one's).
pub fn sdpa_backward_f32<T: Copy + Into<f64>, U: Copy + Into<f64>>(
    q: ArrayView4<T>,
    k: ArrayView4<T>,
    v: ArrayView4<T>,
    dout: ArrayView4<U>,
    opts: &Options,
) -> Result<Gradients<f32>> {
    sdpa_backward_in(q, k, v, dout, opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Causal;
    use crate::tensor::{Mask, Tensor};
    use ndarray::Array;
    use rand::{Rng, SeedableRng};

    fn rand4(rng: &mut rand::rngs::StdRng, shape: (usize, usize, usize, usize)) -> Array4<f64> {
        Array::from_shape_simple_fn(shape, || rng.random_range(-1.0..1.0))
    }

    /// The loss `sum(dO ∘ O)` of the f64 forward.
    fn loss(q: &Array4<f64>, k: &Array4<f64>, v: &Array4<f64>, dout: &Array4<f64>, opts: &Options) -> f64 {
        let o = crate::reference::sdpa(q.view(), k.view(), v.view(), opts)
            .unwrap()
            .out;
        (&o * dout).sum()
    }

    /// Central finite differences of the f64 forward agree with the analytic gradients, for
    /// every input, under GQA, a causal mask, a boolean mask with a fully masked row, a
    /// broadcast bias (with a -inf entry) and key lengths, L != S and E != Ev; and with a
    /// softcap (whose derivative dQ and dK take, d(bias) not) and ALiBi besides.
    #[test]
    fn backward_matches_finite_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (b, hq, hkv, l, s, e, ev) = (2, 4, 2, 3, 5, 3, 2);
        let q = rand4(&mut rng, (b, hq, l, e));
        let k = rand4(&mut rng, (b, hkv, s, e));
        let v = rand4(&mut rng, (b, hkv, s, ev));
        let dout = rand4(&mut rng, (b, hq, l, ev));
        let mask: Vec<bool> = (0..hq * l * s).map(|i| i % 7 != 3 && i / s != 2).collect();
        let mut bias: Vec<f32> = (0..hq * s).map(|_| rng.random_range(-1.0..1.0)).collect();
        bias[4] = f32::NEG_INFINITY;
        for (causal, mods) in [
            (Causal::None, false),
            (Causal::BottomRight, false),
            (Causal::BottomRight, true),
        ] {
            let opts = Options {
                causal,
                scale: Some(0.7),
                mask: Some(Mask::from_slice(&mask, &[hq, l, s])),
                bias: Some(Tensor::from_slice(&bias, &[hq, 1, s])),
                kv_lens: Some(vec![4, 5]),
                softcap: mods.then_some(0.3),
                alibi: mods.then(|| vec![0.3, -0.2, 0.1, 0.5]),
                sink_logits: mods.then(|| vec![0.5, -1.0, 2.0, 0.0]),
                ..Default::default()
            };
            let g = sdpa_backward(q.view(), k.view(), v.view(), dout.view(), &opts).unwrap();
            let h = 1e-6;
            let check = |name: &str, x: &Array4<f64>, grad: &Array4<f64>, which: usize| {
                for idx in ndarray::indices(x.dim()) {
                    let mut xs = [q.clone(), k.clone(), v.clone()];
                    xs[which][idx] = x[idx] + h;
                    let up = loss(&xs[0], &xs[1], &xs[2], &dout, &opts);
                    xs[which][idx] = x[idx] - h;
                    let down = loss(&xs[0], &xs[1], &xs[2], &dout, &opts);
                    let fd = (up - down) / (2.0 * h);
                    assert!(
                        (fd - grad[idx]).abs() <= 1e-7 + 1e-6 * fd.abs(),
                        "{name}{idx:?} {causal:?}: fd {fd}, analytic {}",
                        grad[idx]
                    );
                }
            };
            check("dq", &q, &g.dq, 0);
            check("dk", &k, &g.dk, 1);
            check("dv", &v, &g.dv, 2);
            let db = g.dbias.unwrap();
            assert_eq!(db.shape(), &[hq, 1, s]);
            for (n, &x) in bias.iter().enumerate() {
                if x.is_infinite() {
                    continue;
                }
                // The bias is f32: step it in f32 units of about 1e-3 and compare at 1e-5.
                let step = 1.0f32 / 1024.0;
                let at = |d: f32| {
                    let mut bb = bias.clone();
                    bb[n] = x + d;
                    let o = Options {
                        bias: Some(Tensor::from_slice(&bb, &[hq, 1, s])),
                        ..opts.clone()
                    };
                    loss(&q, &k, &v, &dout, &o)
                };
                let fd = (at(step) - at(-step)) / (2.0 * step as f64);
                let an = db.as_slice().unwrap()[n];
                assert!(
                    (fd - an).abs() <= 1e-5 + 1e-4 * an.abs(),
                    "dbias[{n}]: fd {fd}, analytic {an}"
                );
            }
            if let Some(sk) = &opts.sink_logits {
                let ds = g.dsink.as_ref().unwrap();
                for h in 0..hq {
                    let at = |d: f32| {
                        let mut s2 = sk.clone();
                        s2[h] += d;
                        let o = Options {
                            sink_logits: Some(s2),
                            ..opts.clone()
                        };
                        loss(&q, &k, &v, &dout, &o)
                    };
                    let step = 1.0f32 / 1024.0;
                    let fd = (at(step) - at(-step)) / (2.0 * step as f64);
                    assert!(
                        (fd - ds[h]).abs() <= 1e-5 + 1e-4 * ds[h].abs(),
                        "dsink[{h}]: fd {fd}, analytic {}",
                        ds[h]
                    );
                }
            } else {
                assert!(g.dsink.is_none());
            }
            // The fully masked query row (head 0, row 2 by the mask) has zero gradients.
            assert!(g.dq.slice(ndarray::s![.., 0, 2, ..]).iter().all(|&x| x == 0.0));
        }
    }

    /// The f32 instantiation is close to the f64 one (it is the accuracy rule's yardstick).
    #[test]
    fn f32_instantiation_is_close() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let q = rand4(&mut rng, (1, 2, 9, 8)).mapv(|x| x as f32);
        let k = rand4(&mut rng, (1, 2, 11, 8)).mapv(|x| x as f32);
        let v = rand4(&mut rng, (1, 2, 11, 4)).mapv(|x| x as f32);
        let dout = rand4(&mut rng, (1, 2, 9, 4)).mapv(|x| x as f32);
        let opts = Options {
            causal: Causal::TopLeft,
            ..Default::default()
        };
        let a = sdpa_backward(q.view(), k.view(), v.view(), dout.view(), &opts).unwrap();
        let b = sdpa_backward_f32(q.view(), k.view(), v.view(), dout.view(), &opts).unwrap();
        for (x, y) in a.dq.iter().zip(b.dq.iter()) {
            assert!((x - *y as f64).abs() < 1e-5);
        }
        assert!(a.dq.iter().any(|&x| x.abs() > 1e-3));
    }
}
