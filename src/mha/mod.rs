//! Multi-head attention with learned projections: the layer models call.
//!
//! `Y = concat_h(SDPA(X_q W_Qh^T + b_Qh, X_k W_Kh^T + b_Kh, X_v W_Vh^T + b_Vh)) W_O^T + b_O`,
//! PyTorch's `nn.MultiheadAttention(batch_first=True)` in inference (no dropout), plus
//! grouped-query heads (`num_kv_heads < num_heads`; 1 is multi-query).
//!
//! Everything runs on the GPU in one submission: the three input projections with the crate's
//! tiled matmul kernel (bias added in its epilogue), a strided copy that splits `[B, L, H, d]`
//! into heads `[B, H, L, d]`, [`Sdpa`] (fused, decode or unfused path, every mask), the merge
//! back to `[B, L, H·d]` and the output projection. Only the result (and the weights, when
//! asked for) is read back.
//!
//! ```no_run
//! use ndarray::Array3;
//! use wgpu_attention::{Causal, Context, MhaConfig, MhaWeights, MultiHeadAttention};
//! let ctx = Context::new_blocking()?;
//! let weights = MhaWeights::xavier_uniform(MhaConfig::new(512, 8), 0)?;
//! let mha = MultiHeadAttention::new(&ctx, &weights)?;
//! let x = Array3::<f32>::zeros((2, 128, 512));
//! let y = mha.forward(&x).causal(Causal::TopLeft).run_blocking(&ctx)?;
//! assert_eq!(y.output.shape(), &[2, 128, 512]);
//! # Ok::<(), wgpu_attention::Error>(())
//! ```

mod backward;
mod config;
mod forward;
mod grads;
pub(crate) mod weights;

pub use backward::{MhaBackward, MhaGpuGrads, MhaGradsInto};
pub use config::MhaConfig;
pub use forward::MhaForward;
pub use grads::MhaGrads;
pub use weights::MhaWeights;

use ndarray::{Array1, Array2, Array3, Array4};

use crate::device::buffers::fits;
use crate::device::context::Context;
use crate::error::Result;
use crate::tensor::Tensor;

/// Which attention weights [`MhaForward::run`] returns.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NeedWeights {
    /// None (the fused or decode path can run).
    #[default]
    No,
    /// Per head, `[B, H, L, S]`.
    PerHead,
    /// Averaged over heads, `[B, L, S]` (PyTorch's `average_attn_weights=True`).
    Averaged,
}

/// The result of [`MhaForward::run`].
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// `[B, L, d_model]`.
    pub output: Array3<f32>,
    /// `[B, H, L, S]` with [`NeedWeights::PerHead`].
    pub weights: Option<Array4<f32>>,
    /// `[B, L, S]` with [`NeedWeights::Averaged`].
    pub avg_weights: Option<Array3<f32>>,
    /// Wall-clock time of each stage, with [`MhaForward::profile`].
    pub timings: Option<MhaTimings>,
}

/// The layer's results left on the GPU by [`MhaForward::record`].
#[derive(Debug, Clone)]
pub struct MhaGpuOutput {
    /// The buffer holding the output `[B, L, d_model]` in the layer's format (the
    /// [`output_into`](MhaForward::output_into) buffer, when given).
    pub output: wgpu::Buffer,
    /// Byte offset of the output in [`MhaGpuOutput::output`].
    pub output_offset: u64,
    /// Attention weights per head `[B, H, L, S]` (f32), when asked for.
    pub weights: Option<wgpu::Buffer>,
}

/// Stage times of one profiled forward pass (each stage submitted and waited for on its own).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MhaTimings {
    /// Input uploads, Q/K/V projections and the head split.
    pub projections: std::time::Duration,
    /// Scaled dot-product attention.
    pub attention: std::time::Duration,
    /// Head merge, output projection and readback.
    pub output: std::time::Duration,
}

/// A multi-head attention layer whose parameters live on the GPU.
#[derive(Debug)]
pub struct MultiHeadAttention {
    config: MhaConfig,
    w_q: wgpu::Buffer,
    w_k: wgpu::Buffer,
    w_v: wgpu::Buffer,
    w_o: wgpu::Buffer,
    b_q: Option<wgpu::Buffer>,
    b_k: Option<wgpu::Buffer>,
    b_v: Option<wgpu::Buffer>,
    b_o: Option<wgpu::Buffer>,
    storage: crate::storage::Storage,
}

impl MultiHeadAttention {
    /// Validate `weights` and upload them.
    pub fn new(ctx: &Context, weights: &MhaWeights) -> Result<Self> {
        weights.validate()?;
        let max = ctx.max_binding();
        for (name, w) in [
            ("w_q", &weights.w_q),
            ("w_k", &weights.w_k),
            ("w_v", &weights.w_v),
            ("w_o", &weights.w_o),
        ] {
            fits(
                name,
                weights.storage.bytes(w.len()),
                max,
                "max_storage_buffer_binding_size",
            )?;
        }
        let storage = weights.storage;
        let upload = |label: &str, data: &[f32]| {
            crate::device::buffers::storage_init(ctx, label, &storage.encode(data))
        };
        let mat = |label: &str, w: &Array2<f32>| {
            upload(
                label,
                &w.as_standard_layout().to_owned().into_raw_vec_and_offset().0,
            )
        };
        let vec = |label: &str, b: &Option<Array1<f32>>| b.as_ref().map(|b| upload(label, &b.to_vec()));
        Ok(MultiHeadAttention {
            config: weights.config,
            w_q: mat("w_q", &weights.w_q),
            w_k: mat("w_k", &weights.w_k),
            w_v: mat("w_v", &weights.w_v),
            w_o: mat("w_o", &weights.w_o),
            b_q: vec("b_q", &weights.b_q),
            b_k: vec("b_k", &weights.b_k),
            b_v: vec("b_v", &weights.b_v),
            b_o: vec("b_o", &weights.b_o),
            storage,
        })
    }

    /// The device format of the parameters, activations and output.
    pub fn storage(&self) -> crate::storage::Storage {
        self.storage
    }

    /// The layer's shape.
    pub fn config(&self) -> &MhaConfig {
        &self.config
    }

    /// A forward pass over `query` `[B, L, d_model]` (host array/slice or GPU buffer). Without
    /// [`key_value`](MhaForward::key_value) it is self-attention (keys and values from `query`).
    pub fn forward<'a>(&'a self, query: impl Into<Tensor<'a>>) -> MhaForward<'a> {
        MhaForward::new(self, query.into())
    }
}
