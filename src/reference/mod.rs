//! The CPU reference: plain ndarray, f64 accumulation, the same semantics as the GPU paths.
//!
//! Written for obviousness, not speed, and split by stage so that each GPU kernel is checked
//! against its own stage: [`scores`] (`scale · Q Kᵀ`), [`masked_softmax`] (masks, bias, causal,
//! key lengths; fully masked rows give zeros), [`weighted_sum`] (`P V`). [`sdpa()`] chains them.
//! Users may call it to verify their own GPU results. One file per family: `sdpa.rs` (the
//! stages and their chain), `backward.rs` (its gradients, [`sdpa_backward`]), `mha.rs` (the layer), `paged.rs` (paged KV caches, [`sdpa_paged`]), `variants.rs` (the attention variants, [`variant`]).

mod backward;
mod mha;
mod paged;
mod sdpa;
mod variants;

pub use backward::{
    recompute, sdpa_backward, sdpa_backward_f32, sdpa_backward_in, softmax_backward, Gradients,
};

pub use mha::{mha, mha_backward, mha_backward_f32, mha_backward_in, MhaInputs, MhaOutput};
pub use paged::{gather_paged, sdpa_paged};
pub use sdpa::{masked_softmax, mean_over_heads, scores, sdpa, weighted_sum, Output};
pub use variants::{
    additive_scores, general_scores, landmarks, nystrom_pinv, seq_project, variant, VariantOutput,
};
