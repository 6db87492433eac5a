//! `shaders/softmax.wgsl`: scaled masked softmax, one workgroup per score row, in place, with
//! every mask kind applied inside and the row logsumexp written out.

use super::{common, dispatch, grid_1d, mask_consts, params_of, Binding, KernelSpec, Masks};
use crate::device::context::Context;
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

/// A chunk of score rows: rows `i0 .. i0 + rows` of heads `z0 .. z0 + heads` (over every
/// batch's heads), `[heads, rows, S]` in the scores buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk {
    pub(crate) z0: usize,
    pub(crate) heads: usize,
    pub(crate) i0: usize,
    pub(crate) rows: usize,
}

/// Record the softmax over the chunk's score rows of `p` with the kernels' `masks`, in place.
/// `buffers`: mask, bias, kv_lens, scores, lse.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    (p, masks): (&Problem, Masks),
    buffers: [wgpu::BufferBinding<'_>; 5],
    c: Chunk,
) -> Result<()> {
    let params = Params {
        m: masks,
        rows: c.rows as u32,
        total: (c.heads * c.rows) as u32,
        s: p.seq_kv as u32,
        l: p.seq_q as u32,
        z0: c.z0 as u32,
        i0: c.i0 as u32,
        heads: p.q_heads as u32,
        ..Default::default()
    };
    let grid = grid_1d(params.total, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        &SPEC,
        &mask_consts(
            p.mask.is_some(),
            p.bias.is_some(),
            crate::kernels::Mods::of(p, &ctx.tuning()),
            p.storage.bias,
        ),
        &[],
        &buffers,
        bytemuck::bytes_of(&params),
        grid,
        crate::kernels::Checks::of(p),
    )
}
