//! `shaders/matmul.wgsl`: the batched, tiled, register-blocked matrix product used for the
//! scores (`scale · Q Kᵀ`, `TRANS_B`) and the value weighting (`P V`), and by benchmarks as the
//! crate's plain matmul. 64×64 output tile per workgroup, 4×4 per invocation, K in steps of 16.

use super::{dispatch, Binding, KernelSpec};
use crate::context::Context;
use crate::error::Result;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "matmul",
    source: include_str!("../../shaders/matmul.wgsl"),
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::Uniform,
    ],
};

/// Output tile edge (rows and columns) per workgroup.
pub(crate) const TILE: u32 = 64;

/// Mirrors `Params` in `matmul.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Params {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub heads: u32,
    pub group: u32,
    pub a_z0: u32,
    pub b_z0: u32,
    pub c_z0: u32,
    pub a_batch: u32,
    pub a_row: u32,
    pub a_off: u32,
    pub b_batch: u32,
    pub b_row: u32,
    pub c_batch: u32,
    pub c_row: u32,
    pub c_off: u32,
    pub alpha: f32,
    pub _pad: [u32; 3],
}

/// Operands of one batched product; `batch` slices go on the grid's z axis.
pub(crate) struct Matmul<'a> {
    pub a: wgpu::BufferBinding<'a>,
    pub b: wgpu::BufferBinding<'a>,
    pub bias: Option<wgpu::BufferBinding<'a>>,
    pub c: wgpu::BufferBinding<'a>,
    pub params: Params,
    pub batch: u32,
    pub trans_b: bool,
}

impl Matmul<'_> {
    /// Record the dispatch. `dummy` is bound where there is no bias.
    pub(crate) fn record(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        dummy: &wgpu::Buffer,
    ) -> Result<()> {
        let p = &self.params;
        let grid = [p.n.div_ceil(TILE), p.m.div_ceil(TILE), self.batch];
        let bias = self.bias.clone().unwrap_or(dummy.as_entire_buffer_binding());
        let constants = [
            ("TRANS_B", self.trans_b as u32 as f64),
            ("HAS_BIAS", self.bias.is_some() as u32 as f64),
        ];
        dispatch(
            ctx,
            encoder,
            &SPEC,
            "",
            &constants,
            &[self.a.clone(), self.b.clone(), bias, self.c.clone()],
            bytemuck::bytes_of(p),
            grid,
        )
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn params_size_matches_wgsl() {
        // 20 four-byte fields in the WGSL struct.
        assert_eq!(std::mem::size_of::<super::Params>(), 80);
    }
}
