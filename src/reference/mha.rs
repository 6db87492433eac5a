//! The reference multi-head attention layer.

use ndarray::{Array1, Array2, Array3, Array4, ArrayView3, ArrayView4, Axis};
use num_traits::Float;

use crate::error::{Error, Result};
use crate::mha::MhaGrads;
use crate::options::Options;

use super::backward::sdpa_backward_in;
use super::sdpa::sdpa;

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
    /// Given key heads `[B or 1, G, S, d_k]` instead of the projected key.
    pub key_heads: Option<ArrayView4<'a, f32>>,
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
            key_heads: None,
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
            key_heads: None,
            value_heads: None,
        }
    }
}

/// Reference multi-head attention outputs, in f64.
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// `[B, L, d_model]`.
    pub out: Array3<f64>,
    /// Per-head weights `[B, H, L, S]`; [`mean_over_heads`](super::mean_over_heads) gives PyTorch's averaged weights.
    pub weights: Array4<f64>,
}

fn cast<F: Float, T: Copy + Into<f64>>(x: T) -> F {
    F::from(x.into()).expect("float conversion")
}

/// `x Wᵀ + b` over the last axis, in `F`.
fn linear<F: Float, T: Copy + Into<f64>>(
    x: ArrayView3<T>,
    w: &Array2<f32>,
    b: Option<&Array1<f32>>,
) -> Array3<F> {
    let (bn, t, din) = x.dim();
    let n = w.nrows();
    let mut out = Array3::<F>::zeros((bn, t, n));
    for bi in 0..bn {
        for ti in 0..t {
            for o in 0..n {
                let mut acc: F = b.map_or(F::zero(), |b| cast(b[o]));
                for k in 0..din {
                    acc = acc + cast::<F, _>(x[[bi, ti, k]]) * cast(w[[o, k]]);
                }
                out[[bi, ti, o]] = acc;
            }
        }
    }
    out
}

/// The gradients of [`linear`] for the upstream gradient `dy` `[B, T, n]`: `dx = dy W`,
/// `dW = dyᵀ x` and `db = Σ dy` (over batch and tokens).
fn linear_backward<F: Float, T: Copy + Into<f64>>(
    x: ArrayView3<T>,
    w: &Array2<f32>,
    dy: &Array3<F>,
) -> (Array3<F>, Array2<F>, Array1<F>) {
    let (bn, t, din) = x.dim();
    let n = w.nrows();
    let mut dx = Array3::<F>::zeros((bn, t, din));
    let mut dw = Array2::<F>::zeros((n, din));
    let mut db = Array1::<F>::zeros(n);
    for bi in 0..bn {
        for ti in 0..t {
            for o in 0..n {
                let g = dy[[bi, ti, o]];
                db[o] = db[o] + g;
                for k in 0..din {
                    dx[[bi, ti, k]] = dx[[bi, ti, k]] + g * cast(w[[o, k]]);
                    dw[[o, k]] = dw[[o, k]] + g * cast::<F, _>(x[[bi, ti, k]]);
                }
            }
        }
    }
    (dx, dw, db)
}

/// `[B, heads, T, d]` to `[B, T, heads·d]`.
fn merge_heads<F: Clone>(x: Array4<F>) -> Array3<F> {
    let (b, h, t, d) = x.dim();
    x.permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .to_owned()
        .into_shape_with_order((b, t, h * d))
        .expect("merge heads")
}

/// `[B, T, heads·d]` to `[B, heads, T, d]`.
fn split_heads<F: Clone>(x: Array3<F>, heads: usize) -> Array4<F> {
    let (b, t, n) = x.dim();
    x.into_shape_with_order((b, t, heads, n / heads))
        .expect("divisible")
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .to_owned()
}

/// `[B or 1, heads, T, d]` given heads, broadcast to batch `b`, in `F`.
fn given_heads<F: Float>(x: ArrayView4<f32>, b: usize) -> Array4<F> {
    let (_, h, t, d) = x.dim();
    x.broadcast((b, h, t, d)).expect("batch 1 or B").mapv(cast)
}

/// Multi-head attention, the plain way: f64 projections, [`scores`](super::scores),
/// [`masked_softmax`](super::masked_softmax), [`weighted_sum`](super::weighted_sum), head merge, output projection. Validated like the GPU layer (the same
/// typed errors for bad shapes).
pub fn mha(w: &crate::mha::MhaWeights, inputs: &MhaInputs, opts: &Options) -> Result<MhaOutput> {
    w.validate()?;
    let c = &w.config;
    let (h, g, d) = (c.num_heads, c.num_kv_heads, c.head_dim());
    let b = inputs.query.dim().0;
    let q: Array4<f64> = match &inputs.query_heads {
        Some(qh) => given_heads(*qh, b),
        None => split_heads(linear(inputs.query, &w.w_q, w.b_q.as_ref()), h),
    };
    let key = inputs.key.unwrap_or(inputs.query);
    let k: Array4<f64> = match &inputs.key_heads {
        Some(kh) => given_heads(*kh, b),
        None => split_heads(linear(key, &w.w_k, w.b_k.as_ref()), g),
    };
    let v: Array4<f64> = match &inputs.value_heads {
        Some(vh) => given_heads(*vh, b),
        None => split_heads(
            linear(inputs.value.unwrap_or(inputs.query), &w.w_v, w.b_v.as_ref()),
            g,
        ),
    };
    let mut opts = opts.clone();
    opts.scale = opts.scale.or(Some(1.0 / (d as f64).sqrt()));
    let o = sdpa(q.view(), k.view(), v.view(), &opts)?;
    let out = linear(merge_heads(o.out).view(), &w.w_o, w.b_o.as_ref());
    Ok(MhaOutput {
        out,
        weights: o.weights,
    })
}

/// The gradients of `sum(dY ∘ Y)` for the layer's output `Y` = [`mha`]`(w, inputs, opts)` and
/// the upstream gradient `dout` `[B, L, d_model]`, computed in `F` stage by stage: the forward
/// projections, `dO = split(dY W_O)`, `dW_O = dYᵀ merge(O)`, `db_O = Σ dY`, the SDPA backward
/// ([`sdpa_backward_in`]), then for each projection `dx = dP W`, `dW = dPᵀ x` and `db = Σ dP`
/// of its merged head gradient `dP`; self-attention adds the three input gradients.
pub fn mha_backward_in<F: Float + Into<f64>, U: Copy + Into<f64>>(
    w: &crate::mha::MhaWeights,
    inputs: &MhaInputs,
    opts: &Options,
    dout: ArrayView3<U>,
) -> Result<MhaGrads<F>> {
    w.validate()?;
    let c = &w.config;
    let (h, g) = (c.num_heads, c.num_kv_heads);
    let (d, e) = (c.head_dim(), c.d_model);
    let (b, lq, _) = inputs.query.dim();
    let l = inputs.query_heads.map_or(lq, |qh| qh.dim().2);
    if dout.dim() != (b, l, e) {
        return Err(Error::ShapeMismatch {
            tensor: "dout",
            expected: vec![b, l, e],
            actual: dout.shape().to_vec(),
        });
    }
    let key = inputs.key.unwrap_or(inputs.query);
    let value = inputs.value.unwrap_or(inputs.query);
    let q: Array4<F> = match &inputs.query_heads {
        Some(qh) => given_heads(*qh, b),
        None => split_heads(linear(inputs.query, &w.w_q, w.b_q.as_ref()), h),
    };
    let k: Array4<F> = match &inputs.key_heads {
        Some(kh) => given_heads(*kh, b),
        None => split_heads(linear(key, &w.w_k, w.b_k.as_ref()), g),
    };
    let v: Array4<F> = match &inputs.value_heads {
        Some(vh) => given_heads(*vh, b),
        None => split_heads(linear(value, &w.w_v, w.b_v.as_ref()), g),
    };
    let mut opts = opts.clone();
    opts.scale = opts.scale.or(Some(1.0 / (d as f64).sqrt()));
    // Output projection: dO = split(dY W_O).
    let dy: Array3<F> = dout.mapv(cast);
    let mut dmerged = Array3::<F>::zeros((b, l, h * d));
    for ((bi, ti, j), x) in dmerged.indexed_iter_mut() {
        for o in 0..e {
            *x = *x + dy[[bi, ti, o]] * cast(w.w_o[[o, j]]);
        }
    }
    let dheads = split_heads(dmerged, h);
    let gr = sdpa_backward_in::<F, F, F>(q.view(), k.view(), v.view(), dheads.view(), &opts)?;
    let merged = merge_heads(gr.out);
    let output = linear(merged.view(), &w.w_o, w.b_o.as_ref());
    let (_, w_o, b_o) = linear_backward(merged.view(), &w.w_o, &dy);
    // Each input projection's gradients (zeros where given heads replace it).
    let back = |given: bool, x: ArrayView3<f32>, w: &Array2<f32>, dheads: &Array4<F>| {
        if given {
            (
                Array3::zeros(x.dim()),
                Array2::zeros(w.dim()),
                Array1::zeros(w.nrows()),
            )
        } else {
            linear_backward(x, w, &merge_heads(dheads.clone()))
        }
    };
    let (dxq, w_q, b_q) = back(inputs.query_heads.is_some(), inputs.query, &w.w_q, &gr.dq);
    let (dxk, w_k, b_k) = back(inputs.key_heads.is_some(), key, &w.w_k, &gr.dk);
    let (dxv, w_v, b_v) = back(inputs.value_heads.is_some(), value, &w.w_v, &gr.dv);
    // Given heads: the heads' gradient, summed over a broadcast batch.
    let given = |given: Option<ArrayView4<f32>>, grad: Array4<F>| {
        given.map(|x| match x.dim().0 {
            1 if b != 1 => grad.sum_axis(Axis(0)).insert_axis(Axis(0)),
            _ => grad,
        })
    };
    let cross = inputs.key.is_some();
    let query = if cross { dxq } else { dxq + &dxk + &dxv };
    let bias = |db: Array1<F>, has: bool| has.then_some(db);
    Ok(MhaGrads {
        output,
        query,
        key: cross.then_some(dxk),
        value: inputs.value.is_some().then_some(dxv),
        query_heads: given(inputs.query_heads, gr.dq),
        key_heads: given(inputs.key_heads, gr.dk),
        value_heads: given(inputs.value_heads, gr.dv),
        w_q,
        w_k,
        w_v,
        w_o,
        b_q: bias(b_q, w.b_q.is_some()),
        b_k: bias(b_k, w.b_k.is_some()),
        b_v: bias(b_v, w.b_v.is_some()),
        b_o: bias(b_o, w.b_o.is_some()),
        dsink: gr.dsink,
        dcaptures: gr.dcaptures,
    })
}

/// [`mha_backward_in`] in f64: the reference every GPU layer gradient is checked against.
pub fn mha_backward<U: Copy + Into<f64>>(
    w: &crate::mha::MhaWeights,
    inputs: &MhaInputs,
    opts: &Options,
    dout: ArrayView3<U>,
) -> Result<MhaGrads<f64>> {
    mha_backward_in(w, inputs, opts, dout)
}

/// [`mha_backward_in`] in f32: the plain f32 implementation of the accuracy rule
/// ([`crate::check::flash_rule`]).
pub fn mha_backward_f32<U: Copy + Into<f64>>(
    w: &crate::mha::MhaWeights,
    inputs: &MhaInputs,
    opts: &Options,
    dout: ArrayView3<U>,
) -> Result<MhaGrads<f32>> {
    mha_backward_in(w, inputs, opts, dout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mha::MhaConfig;
    use crate::mha::MhaWeights;
    use crate::problem::Causal;
    use crate::tensor::Mask;
    use ndarray::{Array, ArrayD, Dimension};
    use rand::{Rng, SeedableRng};

    /// Everything the loss depends on, as f32 host arrays.
    #[derive(Clone)]
    struct Point {
        w: MhaWeights,
        x: Array3<f32>,
        k: Array3<f32>,
        v: Array3<f32>,
        qh: Option<Array4<f32>>,
        kh: Option<Array4<f32>>,
        vh: Option<Array4<f32>>,
    }

    impl Point {
        fn inputs(&self, cross: bool) -> MhaInputs<'_> {
            let mut i = if cross {
                MhaInputs::cross(self.x.view(), self.k.view(), self.v.view())
            } else {
                MhaInputs::self_attention(self.x.view())
            };
            i.query_heads = self.qh.as_ref().map(|a| a.view());
            i.key_heads = self.kh.as_ref().map(|a| a.view());
            i.value_heads = self.vh.as_ref().map(|a| a.view());
            i
        }

        /// The `n`th perturbable tensor, flattened.
        fn slot(&mut self, n: usize) -> Option<&mut [f32]> {
            let w = &mut self.w;
            let s = match n {
                0 => w.w_q.as_slice_mut(),
                1 => w.w_k.as_slice_mut(),
                2 => w.w_v.as_slice_mut(),
                3 => w.w_o.as_slice_mut(),
                4 => w.b_q.as_mut()?.as_slice_mut(),
                5 => w.b_k.as_mut()?.as_slice_mut(),
                6 => w.b_v.as_mut()?.as_slice_mut(),
                7 => w.b_o.as_mut()?.as_slice_mut(),
                8 => self.x.as_slice_mut(),
                9 => self.k.as_slice_mut(),
                10 => self.v.as_slice_mut(),
                11 => self.qh.as_mut()?.as_slice_mut(),
                12 => self.vh.as_mut()?.as_slice_mut(),
                13 => self.kh.as_mut()?.as_slice_mut(),
                _ => None,
            };
            s
        }
    }

    /// The analytic gradient of slot `n`, flattened (`None` where the slot has none).
    fn analytic(g: &MhaGrads<f64>, n: usize) -> Option<Vec<f64>> {
        let v = |a: &ArrayD<f64>| a.iter().copied().collect::<Vec<_>>();
        Some(match n {
            0 => v(&g.w_q.clone().into_dyn()),
            1 => v(&g.w_k.clone().into_dyn()),
            2 => v(&g.w_v.clone().into_dyn()),
            3 => v(&g.w_o.clone().into_dyn()),
            4 => v(&g.b_q.clone()?.into_dyn()),
            5 => v(&g.b_k.clone()?.into_dyn()),
            6 => v(&g.b_v.clone()?.into_dyn()),
            7 => v(&g.b_o.clone()?.into_dyn()),
            8 => v(&g.query.clone().into_dyn()),
            9 => v(&g.key.clone()?.into_dyn()),
            10 => v(&g.value.clone()?.into_dyn()),
            11 => v(&g.query_heads.clone()?.into_dyn()),
            12 => v(&g.value_heads.clone()?.into_dyn()),
            13 => v(&g.key_heads.clone()?.into_dyn()),
            _ => return None,
        })
    }

    fn rand<D: Dimension>(
        rng: &mut rand::rngs::StdRng,
        shape: impl ndarray::ShapeBuilder<Dim = D>,
    ) -> Array<f32, D> {
        Array::from_shape_simple_fn(shape, || rng.random_range(-1.0f32..1.0))
    }

    /// Central finite differences of the f64 forward [`mha`] agree with [`mha_backward`] for
    /// every parameter and input: cross-attention with GQA, kdim/vdim != d_model, bottom-right
    /// causal, a mask with a fully masked row and key lengths; self-attention (the three uses
    /// of the input summed) with multi-query heads; given query heads (batch 1, broadcast) and
    /// value heads; given key heads (batch 1) in cross-attention.
    #[test]
    fn mha_backward_matches_finite_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (b, l, s) = (2, 3, 4);
        let mask: Vec<bool> = (0..b * l * s).map(|i| i % 5 != 2 && i / s != 1).collect();
        for case in 0..4 {
            let cross = case == 0 || case == 3;
            let config = match case {
                0 | 3 => MhaConfig::new(8, 4).kv_heads(2).kv_dims(5, 6),
                _ => MhaConfig::new(6, 2).kv_heads(1),
            };
            let s = if cross { s } else { l };
            let mut w = MhaWeights::xavier_uniform(config, case as u64).unwrap();
            let (e, kv, d) = (config.d_model, config.kv_width(), config.head_dim());
            w.b_q = Some(rand(&mut rng, e));
            w.b_k = Some(rand(&mut rng, kv));
            w.b_v = Some(rand(&mut rng, kv));
            w.b_o = Some(rand(&mut rng, e));
            let point = Point {
                w,
                x: rand(&mut rng, (b, l, e)),
                k: rand(&mut rng, (b, s, config.kdim)),
                v: rand(&mut rng, (b, s, config.vdim)),
                qh: (case == 2).then(|| rand(&mut rng, (1, config.num_heads, l, d))),
                vh: (case == 2).then(|| rand(&mut rng, (b, config.num_kv_heads, s, d))),
                // Cross-attention's keys given as heads (broadcast over the batch).
                kh: (case == 3).then(|| rand(&mut rng, (1, config.num_kv_heads, s, d))),
            };
            let dout: Array3<f64> = rand(&mut rng, (b, l, e)).mapv(f64::from);
            let opts = match case {
                0 => Options {
                    causal: Causal::BottomRight,
                    mask: Some(Mask::from_slice(&mask, &[b, 1, l, s])),
                    kv_lens: Some(vec![4, 3]),
                    ..Default::default()
                },
                1 => Options {
                    causal: Causal::TopLeft,
                    ..Default::default()
                },
                _ => Options::default(),
            };
            let loss = |p: &Point| {
                let y = mha(&p.w, &p.inputs(cross), &opts).unwrap().out;
                (&y * &dout).sum()
            };
            let g = mha_backward(&point.w, &point.inputs(cross), &opts, dout.view()).unwrap();
            let y = mha(&point.w, &point.inputs(cross), &opts).unwrap().out;
            assert!((&g.output - &y).iter().all(|x| x.abs() < 1e-12));
            let mut checked = 0;
            for n in 0..14 {
                if !cross && (n == 9 || n == 10) {
                    continue; // no key/value inputs in self-attention
                }
                let mut p = point.clone();
                let Some(len) = p.slot(n).map(|s| s.len()) else {
                    continue;
                };
                let an = analytic(&g, n).unwrap_or_else(|| panic!("case {case}: slot {n} has no gradient"));
                assert_eq!(an.len(), len, "case {case} slot {n}");
                for (i, &an_i) in an.iter().enumerate() {
                    let x = point.clone().slot(n).unwrap()[i];
                    let step = 1.0f32 / 1024.0;
                    let at = |dx: f32| {
                        let mut p = point.clone();
                        p.slot(n).unwrap()[i] = x + dx;
                        loss(&p)
                    };
                    let delta = ((x + step) as f64) - ((x - step) as f64);
                    let fd = (at(step) - at(-step)) / delta;
                    assert!(
                        (fd - an_i).abs() <= 1e-5 + 1e-4 * an_i.abs(),
                        "case {case} slot {n}[{i}]: fd {fd}, analytic {an_i}"
                    );
                    checked += 1;
                }
            }
            assert!(checked > 100, "case {case}: {checked} entries");
        }
    }
}
