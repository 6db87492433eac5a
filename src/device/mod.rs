//! The device floor: everything between wgpu and the kernels, knowing nothing of attention.
//!
//! - `context.rs`: the [`Context`](context::Context): device and queue (own or adopted),
//!   limits, features, what the device offers the kernels ([`Caps`](crate::Caps)).
//! - `instance.rs`: the wgpu instance the crate makes (no window-system probing).
//! - `buffers.rs`: element sizes, size checks, uploads, outputs, readback.
//! - `pipelines.rs`: the pipeline cache a context owns (given finished WGSL, it knows no
//!   kernel); `cache.rs`: the parameter buffers and bind groups a repeated call reuses.
//! - `faults.rs`: device faults (lost, out of memory, validation) as typed errors.
//! - `timer.rs`: GPU time of recorded work (timestamp queries).
//! - `subgroup_probe.rs`: the per-context check of the subgroup operations.

pub(crate) mod buffers;
pub(crate) mod cache;
pub(crate) mod context;
pub(crate) mod faults;
pub(crate) mod instance;
pub(crate) mod pipelines;
#[cfg(not(target_arch = "wasm32"))]
pub(crate) mod subgroup_probe;
pub(crate) mod timer;
