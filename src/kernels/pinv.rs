//! `shaders/pinv_init.wgsl` and `shaders/eye_minus.wgsl`: the two small kernels of the
//! Nyström pseudo-inverse iteration (its products run on the crate's matmul): the scaled
//! transpose that starts it, and `Y = c·I − X`.

use super::{dispatch, grid_1d, params_of, Binding, KernelSpec};
use crate::device::context::Context;
use crate::error::Result;

pub(crate) const INIT: KernelSpec = KernelSpec {
    name: "pinv_init",
    source: include_str!("../../shaders/pinv_init.wgsl"),
    common: &[],
    bindings: &[Binding::Read, Binding::ReadWrite, Binding::Params],
    params: params_of::<InitParams>,
    trusted: false,
};

pub(crate) const EYE_MINUS: KernelSpec = KernelSpec {
    name: "eye_minus",
    source: include_str!("../../shaders/eye_minus.wgsl"),
    common: &[],
    bindings: &[Binding::Read, Binding::ReadWrite, Binding::Params],
    params: params_of::<EyeParams>,
    trusted: false,
};

wgsl_struct! {
    /// `pinv_init.wgsl`'s params: the matrix side and the number of matrices.
    pub(crate) struct InitParams {
        m: u32,
        batch: u32,
        _pad0: u32,
        _pad1: u32,
    }
}

wgsl_struct! {
    /// `eye_minus.wgsl`'s params: the matrix side, the element count and the diagonal's c.
    pub(crate) struct EyeParams {
        m: u32,
        total: u32,
        c: f32,
        _pad0: u32,
    }
}

/// Record `z[i] = a[i]ᵀ / (max column sum · max row sum of |a[i]|)` for `batch` f32 `m × m`
/// matrices.
pub(crate) fn record_init(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    a: wgpu::BufferBinding<'_>,
    z: wgpu::BufferBinding<'_>,
    m: usize,
    batch: usize,
) -> Result<()> {
    let params = InitParams {
        m: m as u32,
        batch: batch as u32,
        ..Default::default()
    };
    let grid = grid_1d(batch as u32, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        &INIT,
        &Default::default(),
        &[],
        &[a, z],
        bytemuck::bytes_of(&params),
        grid,
        super::Checks::Kernel,
    )
}

/// Record `y[i] = c·I − x[i]` for `batch` f32 `m × m` matrices.
pub(crate) fn record_eye_minus(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    [x, y]: [wgpu::BufferBinding<'_>; 2],
    m: usize,
    batch: usize,
    c: f32,
) -> Result<()> {
    let total = (batch * m * m) as u32;
    let params = EyeParams {
        m: m as u32,
        total,
        c,
        ..Default::default()
    };
    let grid = grid_1d(
        total.div_ceil(256),
        ctx.limits().max_compute_workgroups_per_dimension,
    );
    dispatch(
        ctx,
        encoder,
        &EYE_MINUS,
        &Default::default(),
        &[],
        &[x, y],
        bytemuck::bytes_of(&params),
        grid,
        super::Checks::Kernel,
    )
}
