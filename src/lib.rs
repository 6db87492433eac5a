#![doc = include_str!("../docs/crate.md")]
#![deny(missing_docs)]

// The Rust code blocks of the README and of the docs/ topics, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod doctest_readme {}
#[cfg(doctest)]
#[doc = include_str!("../docs/storage.md")]
mod doctest_storage {}
#[cfg(doctest)]
#[doc = include_str!("../docs/backward.md")]
mod doctest_backward {}
#[cfg(doctest)]
#[doc = include_str!("../docs/variants.md")]
mod doctest_variants {}
#[cfg(doctest)]
#[doc = include_str!("../docs/ring.md")]
mod doctest_ring {}
#[cfg(doctest)]
#[doc = include_str!("../docs/mha.md")]
mod doctest_mha {}

pub mod check;
mod device;
mod error;
mod forms;
mod kernels;
mod ops;
#[macro_use]
mod options;
#[cfg(any(feature = "heatmap", feature = "plot"))]
mod pictures;
#[cfg(feature = "heatmap")]
pub use pictures::heatmap;
#[cfg(all(feature = "plot", not(target_arch = "wasm32")))]
pub use pictures::plot;
mod mha;
mod paged;
pub mod problem;
pub mod quant;
pub mod reference;
#[cfg(not(target_arch = "wasm32"))]
pub mod ring;
mod rope;
mod sdpa;
#[cfg(feature = "shapes")]
pub mod shapes;
mod storage;
mod tensor;
mod user_mod;
mod variants;
mod view;

pub use device::cache::{CacheLimits, CacheStats};
pub use device::context::Context;
pub use device::faults::Fault;
pub use device::timer::GpuTimed;
pub use error::{Error, Result};
pub use forms::{BackwardForm, Caps, CoopTiles, DecodeForm, Forms, FusedForm, MatmulForm, Tuning};
/// Re-exported: the half-precision host types ([`half::f16`], [`half::bf16`]).
pub use half;
pub use mha::{
    MhaBackward, MhaConfig, MhaForward, MhaGpuGrads, MhaGpuOutput, MhaGrads, MhaGradsInto, MhaOutput,
    MhaTimings, MhaWeights, MultiHeadAttention, NeedWeights,
};
#[cfg(not(target_arch = "wasm32"))]
pub use ops::matmul::matmul_blocking;
pub use ops::matmul::{matmul, record_matmul};
pub use options::Options;
pub use paged::{
    GpuPagedOutput, PagedAttention, PagedLayout, PagedOutput, Pages, SharedPrefix, MIN_SHARED_KEYS,
};
pub use paged::{KvCache, KvCacheConfig, SeqId, Step};
pub use problem::{alibi_slopes, Causal, DocIds, Problem, Window};
#[cfg(not(target_arch = "wasm32"))]
pub use ring::{DeviceReport, Layout, Ring, RingGrads, RingOutput, RingPlan, RingReport};
pub use rope::{Rope, RopeStyle};
pub use sdpa::backward::{Backward, GpuGrads, Grads};
pub use sdpa::merge::merge;
#[cfg(not(target_arch = "wasm32"))]
pub use sdpa::merge::merge_blocking;
pub use sdpa::plan::{Form, Plan, Tiles};
pub use sdpa::{GpuOutput, Output, Path, Sdpa};
pub use storage::{Element, Formats, Storage};
pub use tensor::{Mask, Tensor};
pub use user_mod::{Captures, CpuMask, CpuScore, UserMod, MAX_DCAPTURE_CALLS};
pub use variants::{GpuVariantOutput, Variant, VariantKind, VariantOutput, VariantParams};
pub use view::TensorLayout;
/// Re-exported so callers use the same wgpu version.
pub use wgpu;
