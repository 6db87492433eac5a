//! `shaders/softmax.wgsl`: scaled masked softmax, one workgroup per score row, in place, with
//! every mask kind applied inside and the row logsumexp written out.

use super::{common, dispatch, grid_1d, mask_consts, params_of, Binding, KernelSpec, Masks};
use crate::context::Context;
use crate::error::Result;
use crate::problem::Problem;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "softmax",
    source: include_str!("../../shaders/softmax.wgsl"),
    common: &[common::SOFTMAX, common::MASKS, common::REDUCE_SHARED],
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::ReadWrite,
        Binding::Params,
    ],
    params: params_of::<Params>,
    trusted: false,
};

wgsl_struct! {
    /// The softmax kernel's params (`p` in `softmax.wgsl`).
    pub(crate) struct Params {
        m: Masks,
        rows: u32,
        total: u32,
        s: u32,
        l: u32,
        z0: u32,
        i0: u32,
        heads: u32,
        _pad0: u32,
    }
}

/// Record the softmax over `params.total` rows of `scores`. `buffers`: mask, bias, kv_lens,
/// scores, lse.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    buffers: [wgpu::BufferBinding<'_>; 5],
    params: &Params,
) -> Result<()> {
    let grid = grid_1d(params.total, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        &SPEC,
        &mask_consts(p.mask.is_some(), p.bias.is_some(), p.storage.bias),
        &[],
        &buffers,
        bytemuck::bytes_of(params),
        grid,
    )
}
