//! The gradients of a multi-head attention layer, and their PyTorch state-dict names.

use ndarray::{Array1, Array2, Array3, Array4, ArrayD, Axis};

/// Gradients of a loss `sum(dY ∘ Y)` through a [`MultiHeadAttention`](crate::MultiHeadAttention)
/// layer, with respect to its inputs and every parameter, from
/// [`MhaBackward`](crate::MhaBackward) (`F = f32`, computed on the GPU) or
/// [`reference::mha_backward`](crate::reference::mha_backward) (`F = f64`).
///
/// The parameter gradients have the shapes of the [`MhaWeights`](crate::MhaWeights) fields;
/// [`state_dict`](Self::state_dict) names them as PyTorch does, so they compare with
/// `{n: p.grad for n, p in mha.named_parameters()}`. A parameter the pass did not use (the
/// query projection under given query heads, the value projection under given value heads)
/// has a zero gradient.
#[derive(Debug, Clone, PartialEq)]
pub struct MhaGrads<F> {
    /// The layer's output `Y` `[B, L, d_model]`, computed on the way.
    pub output: Array3<F>,
    /// With respect to the query input `[B, L, d_model]`. In self-attention (no key/value
    /// inputs) the total through the query, key and value projections; zero where the input
    /// is not used (given query heads in cross-attention).
    pub query: Array3<F>,
    /// With respect to the key input `[B, S, kdim]`, in cross-attention.
    pub key: Option<Array3<F>>,
    /// With respect to the value input `[B, S, vdim]`, in cross-attention (zero under given
    /// value heads).
    pub value: Option<Array3<F>>,
    /// With respect to given query heads, in their shape `[B or 1, H, L, d_k]` (summed over
    /// the batch when it is broadcast).
    pub query_heads: Option<Array4<F>>,
    /// With respect to given key heads, in their shape `[B or 1, G, S, d_k]`.
    pub key_heads: Option<Array4<F>>,
    /// With respect to given value heads, in their shape `[B or 1, G, S, d_k]`.
    pub value_heads: Option<Array4<F>>,
    /// `[H·d_k, d_model]`.
    pub w_q: Array2<F>,
    /// `[G·d_k, kdim]`.
    pub w_k: Array2<F>,
    /// `[G·d_k, vdim]`.
    pub w_v: Array2<F>,
    /// `[d_model, H·d_k]`.
    pub w_o: Array2<F>,
    /// `[H·d_k]`, when the layer has projection biases.
    pub b_q: Option<Array1<F>>,
    /// `[G·d_k]`.
    pub b_k: Option<Array1<F>>,
    /// `[G·d_k]`.
    pub b_v: Option<Array1<F>>,
    /// `[d_model]`, when the layer has an output bias.
    pub b_o: Option<Array1<F>>,
    /// d(sink logits) `[H]`, when the attention has sink logits (not a layer parameter: not
    /// in [`state_dict`](Self::state_dict)).
    pub dsink: Option<Array1<F>>,
    /// The gradients of the user functions' captures, flat, in capture order, when the source
    /// defines `score_mod_dcapture` (see [`Grads::dcaptures`](crate::Grads::dcaptures)).
    pub dcaptures: Option<Vec<Array1<F>>>,
}

impl<F: Copy> MhaGrads<F> {
    /// Every gradient (and the output) with `f` applied to each element, e.g.
    /// `g.mapv(|x| x as f32)` for the reference's f64 gradients.
    pub fn mapv<G>(&self, f: impl Fn(F) -> G + Copy) -> MhaGrads<G> {
        MhaGrads {
            output: self.output.mapv(f),
            query: self.query.mapv(f),
            key: self.key.as_ref().map(|a| a.mapv(f)),
            value: self.value.as_ref().map(|a| a.mapv(f)),
            query_heads: self.query_heads.as_ref().map(|a| a.mapv(f)),
            key_heads: self.key_heads.as_ref().map(|a| a.mapv(f)),
            value_heads: self.value_heads.as_ref().map(|a| a.mapv(f)),
            w_q: self.w_q.mapv(f),
            w_k: self.w_k.mapv(f),
            w_v: self.w_v.mapv(f),
            w_o: self.w_o.mapv(f),
            b_q: self.b_q.as_ref().map(|a| a.mapv(f)),
            b_k: self.b_k.as_ref().map(|a| a.mapv(f)),
            b_v: self.b_v.as_ref().map(|a| a.mapv(f)),
            b_o: self.b_o.as_ref().map(|a| a.mapv(f)),
            dsink: self.dsink.as_ref().map(|a| a.mapv(f)),
            dcaptures: self
                .dcaptures
                .as_ref()
                .map(|d| d.iter().map(|a| a.mapv(f)).collect()),
        }
    }

    /// The parameter gradients under the state-dict keys of `torch.nn.MultiheadAttention`,
    /// each prefixed by `prefix`: `in_proj_weight` `[3E, E]` (`packed`) or `q_proj_weight`,
    /// `k_proj_weight`, `v_proj_weight`; `in_proj_bias` (the three biases concatenated);
    /// `out_proj.weight`; `out_proj.bias`. Biases the layer does not have are left out.
    pub fn state_dict(&self, packed: bool, prefix: &str) -> Vec<(String, ArrayD<F>)> {
        let key = |k: &str| format!("{prefix}{k}");
        let mut out = Vec::new();
        if packed {
            let w = ndarray::concatenate(Axis(0), &[self.w_q.view(), self.w_k.view(), self.w_v.view()])
                .expect("packed projections share their width");
            out.push((key("in_proj_weight"), w.into_dyn()));
        } else {
            for (k, w) in [
                ("q_proj_weight", &self.w_q),
                ("k_proj_weight", &self.w_k),
                ("v_proj_weight", &self.w_v),
            ] {
                out.push((key(k), w.clone().into_dyn()));
            }
        }
        if let (Some(q), Some(k), Some(v)) = (&self.b_q, &self.b_k, &self.b_v) {
            let b = ndarray::concatenate(Axis(0), &[q.view(), k.view(), v.view()]).expect("vectors");
            out.push((key("in_proj_bias"), b.into_dyn()));
        }
        out.push((key("out_proj.weight"), self.w_o.clone().into_dyn()));
        if let Some(b) = &self.b_o {
            out.push((key("out_proj.bias"), b.clone().into_dyn()));
        }
        out
    }
}
