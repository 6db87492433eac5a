//! `shaders/matmul.wgsl`: the batched, tiled, register-blocked matrix product used for the
//! scores (`scale · Q Kᵀ`, `TRANS_B`) and the value weighting (`P V`), and by benchmarks as the
//! crate's plain matmul. 64×64 output tile per workgroup, 4×4 per invocation, K in steps of 16.

use super::{dispatch, params_of, Binding, KernelSpec};
use crate::context::Context;
use crate::error::Result;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "matmul",
    source: include_str!("../../shaders/matmul.wgsl"),
    common: &[],
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::Params,
    ],
    params: params_of::<Params>,
};

/// Output tile edge (rows and columns) per workgroup.
pub(crate) const TILE: u32 = 64;

wgsl_struct! {
    /// The matmul kernel's params (`p` in `matmul.wgsl`): sizes, strides (elements) and
    /// batch offsets of A, B and C, and the factor `alpha`.
    pub(crate) struct Params {
        m: u32,
        n: u32,
        k: u32,
        heads: u32,
        group: u32,
        a_z0: u32,
        b_z0: u32,
        c_z0: u32,
        a_batch: u32,
        a_row: u32,
        a_off: u32,
        b_batch: u32,
        b_row: u32,
        c_batch: u32,
        c_row: u32,
        c_off: u32,
        alpha: f32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

impl Params {
    /// `C[z] = alpha · A[z] op(B[z])` for row-major, contiguous `[M, K]` slices of A,
    /// `[N, K]` (`trans_b`) or `[K, N]` slices of B and `[M, N]` slices of C, one B per z
    /// (heads = group = 1), no offsets. Callers override the strides and offsets that differ.
    pub(crate) fn dense(m: u32, n: u32, k: u32, trans_b: bool, alpha: f32) -> Params {
        Params {
            m,
            n,
            k,
            heads: 1,
            group: 1,
            a_batch: m * k,
            a_row: k,
            b_batch: n * k,
            b_row: if trans_b { k } else { n },
            c_batch: m * n,
            c_row: n,
            alpha,
            ..Default::default()
        }
    }
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
