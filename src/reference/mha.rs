//! The reference multi-head attention layer.

use ndarray::{Array1, Array2, Array3, Array4, ArrayView3, ArrayView4};

use crate::error::Result;
use crate::options::Options;

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
    /// Per-head weights `[B, H, L, S]`; [`mean_over_heads`](super::mean_over_heads) gives PyTorch's averaged weights.
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

/// Multi-head attention, the plain way: f64 projections, [`scores`](super::scores),
/// [`masked_softmax`](super::masked_softmax), [`weighted_sum`](super::weighted_sum), head merge, output projection. Validated like the GPU layer (the same
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
