//! The attention options every entry point shares: causal alignment, scale, boolean mask,
//! additive bias and key lengths. [`Sdpa`](crate::Sdpa) and
//! [`MhaForward`](crate::MhaForward) hold one [`Options`] and get the same setters from one
//! macro; the validation into a [`Problem`] is written once here.

use ndarray::{ArrayViewD, IxDyn};

use crate::error::{Error, Result};
use crate::problem::{Causal, Problem};
use crate::tensor::{check_len, Mask, Tensor};

/// Attention options (PyTorch `scaled_dot_product_attention` semantics; `docs/semantics.md`).
#[derive(Debug, Clone, Default)]
pub struct Options<'a> {
    /// Causal masking and its alignment.
    pub causal: Causal,
    /// The softmax scale; `None` is `1/sqrt(E)`. Kept in f64 for the reference (and for
    /// PyTorch goldens); the kernels use its f32 rounding.
    pub scale: Option<f64>,
    /// Boolean mask, **true = may attend**, broadcastable to `[B, Hq, L, S]`.
    pub mask: Option<Mask<'a>>,
    /// Additive bias, broadcastable to `[B, Hq, L, S]`; a `-inf` entry masks that key.
    pub bias: Option<Tensor<'a>>,
    /// Per-batch key lengths: batch `b` attends keys `j < kv_lens[b]` only.
    pub kv_lens: Option<Vec<usize>>,
    /// A sliding window `(left, right)`, FlashAttention's `window_size` (see
    /// [`Window`](crate::Window)).
    pub window: Option<(i64, i64)>,
    /// Keys `j < sink_tokens` exempt from the window (needs a window).
    pub sink_tokens: usize,
    /// The logit softcap `C`: `s = C tanh(s / C)` (see [`Problem::with_softcap`]).
    pub softcap: Option<f32>,
    /// ALiBi slopes, one per query head (see [`Problem::with_alibi`]).
    pub alibi: Option<Vec<f32>>,
    /// Sink logits, one per query head (see [`Problem::with_sink_logits`]).
    pub sink_logits: Option<Vec<f32>>,
    /// Document ids of packed sequences (see [`Problem::with_doc_ids`]).
    pub doc_ids: Option<crate::problem::DocIds>,
    /// User WGSL `score_mod` / `mask_mod` with their captures (see [`UserMod`](crate::UserMod)).
    pub user_mod: Option<crate::user_mod::UserMod<'a>>,
}

impl<'a> Options<'a> {
    /// The problem of q, k, v shapes with these options, validated (no GPU work).
    pub fn problem(&self, q: &[usize], k: &[usize], v: &[usize]) -> Result<Problem> {
        let mut p = Problem::new(q, k, v)?
            .with_scale(self.scale)?
            .with_causal(self.causal)
            .with_window(self.window, self.sink_tokens)?
            .with_softcap(self.softcap)?
            .with_alibi(self.alibi.as_deref())?
            .with_sink_logits(self.sink_logits.as_deref())?
            .with_doc_ids(self.doc_ids.as_ref().map(|d| (&d.q[..], &d.k[..])))?
            .with_user_mod(self.user_mod.as_ref())?;
        if let Some(m) = &self.mask {
            p = p.with_mask(&m.shape)?;
            check_len("mask", &m.shape, m.data.len())?;
        }
        if let Some(b) = &self.bias {
            p = p.with_bias(&b.shape)?;
        }
        if let Some(l) = &self.kv_lens {
            p = p.with_kv_lens(l)?;
        }
        Ok(p)
    }

    /// The mask as an array view (for the CPU reference), its length checked.
    pub(crate) fn mask_view(&self) -> Result<Option<ArrayViewD<'_, bool>>> {
        self.mask
            .as_ref()
            .map(|m| {
                check_len("mask", &m.shape, m.data.len())?;
                Ok(ArrayViewD::from_shape(IxDyn(&m.shape), &m.data).expect("length checked"))
            })
            .transpose()
    }

    /// The bias as an array view (for the CPU reference): host data only.
    pub(crate) fn bias_view(&self) -> Result<Option<ndarray::CowArray<'_, f32, IxDyn>>> {
        self.bias
            .as_ref()
            .map(|b| match b.host_f32() {
                Some(d) => {
                    check_len("bias", &b.shape, d.len())?;
                    Ok(match d {
                        std::borrow::Cow::Borrowed(d) => ArrayViewD::from_shape(IxDyn(&b.shape), d)
                            .expect("length checked")
                            .into(),
                        std::borrow::Cow::Owned(d) => ndarray::ArrayD::from_shape_vec(IxDyn(&b.shape), d)
                            .expect("length checked")
                            .into(),
                    })
                }
                None => Err(Error::BadBuffer {
                    tensor: "bias",
                    reason: "the CPU reference reads host data, not a GPU buffer".into(),
                }),
            })
            .transpose()
    }
}

/// The setters of [`Options`] for a builder with an `options: Options<'a>` field.
macro_rules! option_setters {
    () => {
        /// Causal masking with the given alignment (see [`Causal`](crate::Causal)).
        pub fn causal(mut self, causal: $crate::problem::Causal) -> Self {
            self.options.causal = causal;
            self
        }

        /// The softmax scale (default `1/sqrt(E)`; `1.0` gives the unscaled dot product): an
        /// f32 or an f64 (kept in f64 for the reference, as [`Options::scale`](crate::Options);
        /// the kernels use its f32 rounding).
        pub fn scale(mut self, scale: impl Into<f64>) -> Self {
            self.options.scale = Some(scale.into());
            self
        }

        /// A boolean mask, **true = may attend**, broadcastable to `[B, Hq, L, S]` (PyTorch's
        /// `nn.MultiheadAttention` uses the opposite convention: negate its masks).
        pub fn mask(mut self, mask: impl Into<$crate::tensor::Mask<'a>>) -> Self {
            self.options.mask = Some(mask.into());
            self
        }

        /// An additive bias added to the scaled scores, broadcastable to `[B, Hq, L, S]`
        /// (PyTorch's float `attn_mask`). A `-inf` entry masks that key.
        pub fn bias(mut self, bias: impl Into<$crate::tensor::Tensor<'a>>) -> Self {
            self.options.bias = Some(bias.into());
            self
        }

        /// Per-batch key lengths (padding): batch `b` attends keys `j < kv_lens[b]` only.
        pub fn kv_lens(mut self, lens: &[usize]) -> Self {
            self.options.kv_lens = Some(lens.to_vec());
            self
        }

        /// A sliding window, FlashAttention's `window_size = (left, right)`: query `i` sees keys
        /// `i + S - L - left <= j <= i + S - L + right`, `-1` unbounded on that side (with key
        /// lengths, `S` is the batch's). Combines with every other mask (`(-1, 0)` alone is
        /// bottom-right causal). Sides below `-1` are an error. See [`Window`](crate::Window).
        pub fn window(mut self, left: i64, right: i64) -> Self {
            self.options.window = Some((left, right));
            self
        }

        /// The first `n` keys seen by every query whatever the window (StreamingLLM's
        /// attention sinks); needs [`window`](Self::window).
        pub fn sink_tokens(mut self, n: usize) -> Self {
            self.options.sink_tokens = n;
            self
        }

        /// The logit softcap `C`: each scaled logit `s` becomes `C tanh(s / C)` before the
        /// bias and ALiBi are added (Gemma 2, Grok); `C` finite and > 0.
        pub fn softcap(mut self, c: f32) -> Self {
            self.options.softcap = Some(c);
            self
        }

        /// ALiBi with one slope per query head: the logit of query `i`, key `j` in head `h`
        /// gets `- slopes[h] |i + S - L - j|` (bottom-right aligned; with key lengths `S` is
        /// the batch's). See [`alibi_slopes`](crate::alibi_slopes) for the paper's slopes.
        pub fn alibi(mut self, slopes: &[f32]) -> Self {
            self.options.alibi = Some(slopes.to_vec());
            self
        }

        /// Sink logits, one per query head (gpt-oss's attention sinks): each row's softmax gets
        /// `exp(sink[h])` added to its denominator, with no value, so its weights sum to less
        /// than 1 and a row with no allowed key is 0. The backward gives their gradient
        /// (`Grads::dsink`).
        pub fn sink_logits(mut self, sinks: &[f32]) -> Self {
            self.options.sink_logits = Some(sinks.to_vec());
            self
        }

        /// Document ids of packed sequences (FlexAttention's document mask): `q_docs` gives
        /// the document of each query (`[B, L]` row-major), `k_docs` of each key (`[B, S]`);
        /// query `i` of batch `b` sees key `j` only if `q_docs[b·L + i] == k_docs[b·S + j]`.
        /// Combines with every other mask (causal within each document: add `causal`). Key
        /// tiles holding none of a query tile's documents are skipped.
        pub fn doc_ids(mut self, q_docs: &[i32], k_docs: &[i32]) -> Self {
            self.options.doc_ids = Some($crate::problem::DocIds {
                q: q_docs.to_vec(),
                k: k_docs.to_vec(),
            });
            self
        }

        /// User WGSL functions: `score_mod` (applied to each logit after the softcap, the bias
        /// and ALiBi) and/or `mask_mod` (and-ed with every other mask), with their captured
        /// tensors. Checked by naga before any GPU work. See [`UserMod`]($crate::UserMod).
        pub fn user_mod(mut self, m: $crate::user_mod::UserMod<'a>) -> Self {
            self.options.user_mod = Some(m);
            self
        }

        /// Every option at once, replacing those set before.
        pub fn options(mut self, options: $crate::options::Options<'a>) -> Self {
            self.options = options;
            self
        }
    };
}
