//! `shaders/flash.wgsl`: the fused FlashAttention-style kernel. One workgroup per 64-query tile
//! of one head; K/V tiles streamed through workgroup memory; online softmax; every mask inside;
//! whole key tiles skipped past the causal limit and the key length; GQA by indexing the shared
//! K/V head. Memory is linear in L and S: the score matrix is never written.

use super::{dispatch, grid_1d, KernelSpec};
use crate::context::Context;
use crate::error::Result;
use crate::problem::Problem;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "flash",
    source: include_str!("../../shaders/flash.wgsl"),
    bindings: super::ATTENTION_BINDINGS,
};

/// Workgroup memory the kernel may use: WebGPU's default 16 KiB, or less if the device has less.
const WG_MEMORY: u32 = 16 * 1024;

/// Mirrors `Params` in `flash.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Params {
    pub l: u32,
    pub s: u32,
    pub e: u32,
    pub ev: u32,
    pub heads: u32,
    pub group: u32,
    pub q_tiles: u32,
    pub total: u32,
    pub scale: f32,
    pub masks: super::MaskParams,
    pub _pad: [u32; 3],
}

/// The specialisation: head dims in vec4s (rounded up) and keys per tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Config {
    pub e4: u32,
    pub ev4: u32,
    pub bk: u32,
    /// Invocations per workgroup.
    pub wg: u32,
    /// Query rows per invocation.
    pub rq: u32,
}

/// Head dims in vec4s, bucketed (1, 2, 3, 4, then multiples of 4) to bound the number of
/// pipeline variants.
fn vec4s(d: usize) -> u32 {
    let n = d.div_ceil(4) as u32;
    if n <= 4 {
        n
    } else {
        n.div_ceil(4) * 4
    }
}

impl Config {
    /// `None` when the head dims do not fit (E or Ev beyond 256) or the device is too small.
    /// `cpu`: the adapter is a CPU (lavapipe/llvmpipe, WARP), where each memory access costs far
    /// more than arithmetic, so each invocation takes several rows.
    pub(crate) fn new(p: &Problem, limits: &wgpu::Limits, cpu: bool) -> Option<Config> {
        if p.head_dim > 256 || p.head_dim_v > 256 {
            return None;
        }
        let (mut wg, mut rq) = if cpu { (8, 8) } else { (64, 1) };
        // Tuning override for experiments: WGPU_ATTENTION_FLASH=<invocations>,<rows per invocation>.
        #[cfg(not(target_arch = "wasm32"))]
        if let Ok(v) = std::env::var("WGPU_ATTENTION_FLASH") {
            let v: Vec<u32> = v.split(',').filter_map(|x| x.parse().ok()).collect();
            if let [a, b] = v[..] {
                (wg, rq) = (a, b);
            }
        }
        if wg == 0
            || rq == 0
            || limits.max_compute_invocations_per_workgroup < wg
            || limits.max_compute_workgroup_size_x < wg
        {
            return None;
        }
        let (e4, ev4) = (vec4s(p.head_dim), vec4s(p.head_dim_v));
        let budget = WG_MEMORY
            .min(limits.max_compute_workgroup_storage_size)
            .saturating_sub(16);
        [64u32, 32, 16, 8, 4]
            .into_iter()
            .find(|bk| bk * (e4 + ev4) * 16 <= budget)
            .map(|bk| Config { e4, ev4, bk, wg, rq })
    }

    /// Query rows per workgroup.
    pub(crate) fn rows(&self) -> u32 {
        self.wg * self.rq
    }

    fn prelude(&self) -> String {
        format!(
            "const E4: u32 = {}u;\nconst EV4: u32 = {}u;\nconst BK: u32 = {}u;\nconst WG: u32 = {}u;\nconst RQ: u32 = {}u;\n",
            self.e4, self.ev4, self.bk, self.wg, self.rq
        )
    }
}

/// Record the fused kernel. `buffers`: q, k, v, mask, bias, kv_lens, out, lse.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    cfg: &Config,
    buffers: [wgpu::BufferBinding<'_>; 8],
    params: &Params,
) -> Result<()> {
    let grid = grid_1d(params.total, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        &SPEC,
        &cfg.prelude(),
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
    fn params_size_matches_wgsl() {
        assert_eq!(std::mem::size_of::<Params>(), 96);
    }

    #[test]
    fn config_fits_16k_up_to_256() {
        let limits = wgpu::Limits::default();
        for (e, ev) in [(1, 1), (64, 64), (72, 5), (128, 128), (256, 256), (256, 3)] {
            let p = Problem::new(&[1, 1, 1, e], &[1, 1, 1, e], &[1, 1, 1, ev]).unwrap();
            let c = Config::new(&p, &limits, false).unwrap();
            assert!(c.bk * (c.e4 + c.ev4) * 16 + 16 <= 16384, "{e} {ev} {c:?}");
            assert!(c.e4 * 4 >= e as u32 && c.ev4 * 4 >= ev as u32);
        }
        let p = Problem::new(&[1, 1, 1, 257], &[1, 1, 1, 257], &[1, 1, 1, 4]).unwrap();
        assert!(Config::new(&p, &limits, false).is_none());
    }
}
