//! `shaders/decode.wgsl` and `shaders/merge.wgsl`: split-K attention for few query rows and long
//! key sequences. The keys are split so that there are hundreds of workgroups even for one
//! query row; each split writes a normalised partial output and logsumexp, and the merge kernel
//! combines them by the logsumexp rule (also exposed as [`crate::merge`]).

use super::{dispatch, grid_1d, Binding, KernelSpec, MaskParams};
use crate::context::Context;
use crate::error::Result;
use crate::problem::Problem;

pub(crate) const DECODE: KernelSpec = KernelSpec {
    name: "decode",
    source: include_str!("../../shaders/decode.wgsl"),
    bindings: super::ATTENTION_BINDINGS,
};

pub(crate) const MERGE: KernelSpec = KernelSpec {
    name: "merge",
    source: include_str!("../../shaders/merge.wgsl"),
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::ReadWrite,
        Binding::Uniform,
    ],
};

/// Query rows up to which [`crate::Path::Auto`] prefers the decode path (with a long `S`).
pub(crate) const MAX_ROWS: usize = 16;
/// Key length from which [`crate::Path::Auto`] prefers the decode path.
pub(crate) const MIN_KEYS: usize = 512;
/// Workgroups the split aims for: enough to fill a GPU with dozens of compute units.
const TARGET_WORKGROUPS: usize = 512;

/// Mirrors `Params` in `decode.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Params {
    pub l: u32,
    pub s: u32,
    pub e: u32,
    pub ev: u32,
    pub heads: u32,
    pub group: u32,
    pub splits: u32,
    pub total: u32,
    pub scale: f32,
    pub masks: MaskParams,
    /// Keys per split.
    pub chunk: u32,
    pub _pad: [u32; 2],
}

/// Mirrors `Params` in `merge.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct MergeParams {
    pub rows: u32,
    pub splits: u32,
    pub ev: u32,
    pub _pad: u32,
}

/// Keys per split (a multiple of 64, at most 1024) and the number of splits.
pub(crate) fn split(p: &Problem) -> (usize, usize) {
    let rows = p.batch_heads() * p.seq_q;
    let want = TARGET_WORKGROUPS.div_ceil(rows).max(1);
    let chunk = p.seq_kv.div_ceil(want).next_multiple_of(64).clamp(64, 1024);
    (chunk, p.seq_kv.div_ceil(chunk))
}

/// Head dims (E and Ev) up to which the decode kernel, on GPUs, unrolls its loops over the
/// head dims (see `prelude`); beyond, plain loops.
const UNROLL_MAX_DIM: usize = 256;

/// The decode kernel's constants, reductions and I/O bindings (shared with the fused kernel).
/// `cpu`: one SIMD batch of 8 invocations per workgroup (lavapipe), else 64; `subgroup`: the
/// fixed subgroup size, if any: where it equals the workgroup, reductions use subgroup
/// operations instead of workgroup memory.
fn prelude(p: &Problem, cpu: bool, subgroup: Option<u32>) -> String {
    // CPU adapters run the loops as written: on lavapipe at d_decode_h32_s4096_e128 the
    // unrolled kernel took 2.6 s to compile (each per-invocation load becomes a loop over the
    // SIMD lanes) and ran in 41 ms; the looped one compiles in 1.3 s and runs in 36 ms.
    let fits = p.head_dim.max(p.head_dim_v) <= UNROLL_MAX_DIM;
    #[cfg_attr(target_arch = "wasm32", allow(unused_mut))]
    let mut unroll = !cpu && fits;
    let vec4_io = p.head_dim.is_multiple_of(4) && p.head_dim_v.is_multiple_of(4);
    let (e4, ev4) = (p.head_dim.div_ceil(4), p.head_dim_v.div_ceil(4));
    let rb = [8, 4, 2, 1].into_iter().find(|r| ev4 % r == 0).unwrap_or(1);
    #[cfg_attr(target_arch = "wasm32", allow(unused_mut))]
    let mut wg = if cpu { 8 } else { 64 };
    #[cfg_attr(target_arch = "wasm32", allow(unused_mut))]
    let mut sg = cpu && subgroup == Some(wg);
    // Test override: WGPU_ATTENTION_DECODE=<invocations, a power of two>,<subgroup 0|1>
    // [,<unroll 0|1>].
    #[cfg(not(target_arch = "wasm32"))]
    if let Ok(v) = std::env::var("WGPU_ATTENTION_DECODE") {
        let v: Vec<u32> = v.split(',').filter_map(|x| x.parse().ok()).collect();
        if let [a, b, ..] = v[..] {
            if a.is_power_of_two() && a <= 256 {
                wg = a;
                sg = b != 0 && subgroup == Some(a);
                if let Some(&u) = v.get(2) {
                    unroll = u != 0 && fits;
                }
            }
        }
    }
    let reductions = if sg { RED_SUBGROUP } else { RED_SHARED };
    format!(
        "const WG: u32 = {wg}u;\nconst E4: u32 = {e4}u;\n\
         const EV4: u32 = {ev4}u;\nconst RB: u32 = {rb}u;\nconst NRB: u32 = {}u;\n\
         const HAS_MASK: bool = {};\nconst HAS_BIAS: bool = {};\nconst UNROLL: bool = {unroll};\n{}{reductions}",
        ev4 / rb,
        p.mask.is_some(),
        p.bias.is_some(),
        if vec4_io { super::flash::IO_VEC4 } else { super::flash::IO_SCALAR },
    )
}

/// Workgroup reductions of the decode kernel: through workgroup memory, or by subgroup
/// operations.
const RED_SHARED: &str = include_str!("../../shaders/decode_red_shared.wgsl");
const RED_SUBGROUP: &str = include_str!("../../shaders/decode_red_subgroup.wgsl");

/// Record the split pass. `buffers`: q, k, v, mask, bias, kv_lens, part_out, part_lse.
pub(crate) fn record_decode(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    buffers: [wgpu::BufferBinding<'_>; 8],
    params: &Params,
) -> Result<()> {
    let grid = grid_1d(params.total, ctx.limits().max_compute_workgroups_per_dimension);
    let prelude = prelude(p, ctx.is_cpu(), ctx.fixed_subgroup_size());
    dispatch(
        ctx,
        encoder,
        &DECODE,
        &prelude,
        &[],
        &buffers,
        bytemuck::bytes_of(params),
        grid,
    )
}

/// Record the merge. `buffers`: part_out, part_lse, out, lse.
pub(crate) fn record_merge(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    buffers: [wgpu::BufferBinding<'_>; 4],
    params: &MergeParams,
) -> Result<()> {
    let grid = grid_1d(params.rows, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        &MERGE,
        "",
        &[],
        &buffers,
        bytemuck::bytes_of(params),
        grid,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_sizes_match_wgsl() {
        assert_eq!(std::mem::size_of::<Params>(), 96);
        assert_eq!(std::mem::size_of::<MergeParams>(), 16);
    }

    #[test]
    fn decode_of_one_row_makes_hundreds_of_workgroups() {
        let p = Problem::new(&[1, 32, 1, 128], &[1, 32, 4096, 128], &[1, 32, 4096, 128]).unwrap();
        let (chunk, splits) = split(&p);
        assert_eq!(chunk * splits, 4096);
        assert!(splits * 32 >= 256, "{splits}");
        let p = Problem::new(&[1, 1, 1, 8], &[1, 1, 100_000, 8], &[1, 1, 100_000, 8]).unwrap();
        let (chunk, splits) = split(&p);
        assert!(chunk <= 1024 && chunk * splits >= 100_000);
    }
}
