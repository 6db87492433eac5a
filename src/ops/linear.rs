//! A linear layer's forward, `y = x Wᵀ + b` (PyTorch's `nn.Linear`): the multi-head layer's
//! projections and the additive variant's.

use super::matmul::Matmul;
use super::Mats;
use crate::device::context::Context;
use crate::error::Result;
use crate::storage::Storage;

/// The weights of one linear layer: W `[out, in]` (PyTorch's layout) and b `[out]`, in one
/// storage format.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Weights<'a> {
    pub(crate) w: &'a wgpu::Buffer,
    pub(crate) b: Option<&'a wgpu::Buffer>,
    pub(crate) storage: Storage,
}

/// Record `y = x Wᵀ + b` for x `[rows, in]` (format `x.1`) into y `[rows, out]` (the weights'
/// format), the bias added in the product's epilogue. `[rows, out, in]` = `dims`.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    (x, x_storage): (wgpu::BufferBinding<'_>, Storage),
    weights: Weights<'_>,
    y: wgpu::BufferBinding<'_>,
    [rows, out, inp]: [usize; 3],
) -> Result<()> {
    let st = weights.storage;
    let product = Matmul::new(
        Mats::dense(x, x_storage, rows, inp),
        Mats::shared(weights.w.as_entire_buffer_binding(), st, out, inp),
        Mats::dense(y, st, rows, out),
    )
    .trans_b(true);
    match weights.b {
        Some(b) => product.bias(b.as_entire_buffer_binding(), st),
        None => product,
    }
    .record(ctx, encoder)
}
