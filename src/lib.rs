#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod attention;
pub mod check;
mod context;
mod error;
#[cfg(feature = "heatmap")]
pub mod heatmap;
mod kernels;
mod matmul;
mod mha;
pub mod problem;
pub mod reference;
#[cfg(feature = "shapes")]
pub mod shapes;
mod tensor;

#[cfg(not(target_arch = "wasm32"))]
pub use attention::merge_blocking;
pub use attention::{merge, GpuOutput, Output, Path, Sdpa};
pub use context::Context;
pub use error::{Error, Result};
pub use matmul::matmul;
#[cfg(not(target_arch = "wasm32"))]
pub use matmul::matmul_blocking;
pub use mha::{MhaConfig, MhaForward, MhaOutput, MhaTimings, MhaWeights, MultiHeadAttention, NeedWeights};
pub use problem::{Causal, Problem};
pub use tensor::{Mask, Tensor};
/// Re-exported so callers use the same wgpu version.
pub use wgpu;
