//! wgpu-attention's kernels on [burn](https://burn.dev)'s wgpu tensors.
//!
//! - **One device, both ways.** [`device_on`] makes burn's wgpu runtime on a
//!   [`Context`]'s device and queue (made by [`new_context`]: burn
//!   compiles for every feature of the adapter); [`new_device`] lets burn make the device and
//!   adopts it as a context. Either way burn and the kernels share one device and one queue.
//! - **No copies.** [`Attention::forward`] reads burn's buffers in place (each tensor's buffer,
//!   byte offset and strides, after burn's fusion has run what produces them and its pending
//!   work is submitted) and writes the output into a tensor burn allocated.
//! - **The crate's options.** Masks (burn's convention: `true` = masked), an additive bias,
//!   causal masks aligned either way, the LLM modifiers, user WGSL functions, key lengths and
//!   grouped-query heads (k and v with fewer heads than q).
//! - **Gradients through burn's autodiff.** On an autodiff device, `loss.backward()` gives
//!   dq, dk, dv and d(bias) from the crate's fused backward, registered as one node of burn's
//!   graph (burn's own autodiff attention is the unfused composition).
//!
//! [`attention`] has burn's `burn::tensor::module::attention` signature, for a swap of one
//! call. burn's float formats f32, f16 and bf16 map to the crate's storage formats; any other
//! format, a tensor of another burn runtime (CUDA, ROCm, the CPU) and a device made without
//! this crate are typed errors ([`Error`]).
//!
//! **Queue order.** Everything burn has queued for the inputs is submitted before the kernels
//! are, on the same queue; work burn queues later (reading the output, freeing and reusing the
//! inputs' memory) is submitted after. No host wait is needed either way.
#![deny(missing_docs)]

mod attention;
mod cube;
mod device;
mod error;

pub use attention::{attention, Attention};
pub use device::{burn_features, context_of, device_on, new_context, new_device};
pub use error::{Error, Result};
pub use wgpu_attention;
pub use wgpu_attention::{Causal, Context, Path, UserMod};
