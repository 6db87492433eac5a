//! The fused backward's recorder: `bwd_dkv` (key-major: dK and dV of each key tile) and
//! `bwd_dq` (query-major), each recomputing the probabilities from the statistics.

use crate::device::context::Context;
use crate::error::Result;
use crate::kernels::backward as kb;
use crate::problem::Problem;

use super::io::Io;
use super::plan::fused_grids;

/// Record dK and dV (f32, into `dkv`, dV at `params.dv_off`) and dQ (q's format, into `dq`).
pub(super) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    (p, cfg): (&Problem, &kb::Config),
    io: &Io<'_>,
    params: &kb::Params,
    [dkv, dq]: [&wgpu::Buffer; 2],
) -> Result<()> {
    let [(k_tiles, dkv_total), (q_tiles, dq_total)] = fused_grids(p, cfg);
    let mut kernel =
        |spec, prelude: crate::kernels::consts::Prelude, out: &wgpu::Buffer, [tiles, total]: [usize; 2]| {
            kb::record(
                ctx,
                encoder,
                spec,
                &prelude,
                &io.with_out(out.as_entire_buffer_binding()),
                &params.tiled(tiles, total),
                total as u32,
                crate::kernels::Checks::of(p),
            )
        };
    kernel(cfg.dkv_spec(), cfg.dkv_prelude(), dkv, [k_tiles, dkv_total])?;
    kernel(cfg.dq_spec(), cfg.dq_prelude(), dq, [q_tiles, dq_total])
}
