//! `shaders/softmax.wgsl`: scaled masked softmax, one workgroup per score row, in place, with
//! every mask kind applied inside and the row logsumexp written out.

use super::{dispatch, grid_1d, Binding, KernelSpec};
use crate::context::Context;
use crate::error::Result;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "softmax",
    source: include_str!("../../shaders/softmax.wgsl"),
    bindings: &[
        Binding::ReadWrite,
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::Uniform,
    ],
};

/// Mirrors `Params` in `softmax.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Params {
    pub rows: u32,
    pub total: u32,
    pub s: u32,
    pub l: u32,
    pub z0: u32,
    pub i0: u32,
    pub heads: u32,
    pub masks: super::MaskParams,
    pub _pad0: u32,
}

/// Record the softmax over `params.total` rows of `scores`.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    buffers: [wgpu::BufferBinding<'_>; 5],
    params: &Params,
) -> Result<()> {
    let grid = grid_1d(params.total, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        &SPEC,
        "",
        &[],
        &buffers,
        bytemuck::bytes_of(params),
        grid,
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn params_size_matches_wgsl() {
        assert_eq!(std::mem::size_of::<super::Params>(), 80);
    }
}
