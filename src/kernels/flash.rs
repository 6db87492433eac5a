//! `shaders/flash.wgsl`: the fused FlashAttention-style kernel. One workgroup per tile of query
//! rows of one head; K/V tiles streamed through workgroup memory (or, on CPU adapters with a
//! fixed subgroup size, held one key per invocation and shared by subgroup shuffles); online
//! softmax; every mask inside; whole key tiles skipped past the causal limit and the key length;
//! GQA by indexing the shared K/V head. Memory is linear in L and S: the score matrix is never
//! written. [`Config`] picks the form and tile sizes for the device.

use super::{dispatch, grid_1d, KernelSpec};
use crate::context::Context;
use crate::error::Result;
use crate::problem::Problem;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "flash",
    source: include_str!("../../shaders/flash.wgsl"),
    bindings: super::ATTENTION_BINDINGS,
};

/// The bindings and loads of q, k, v and out, by element type.
pub(crate) const IO_VEC4: &str = include_str!("../../shaders/flash_io_vec4.wgsl");
pub(crate) const IO_SCALAR: &str = include_str!("../../shaders/flash_io_scalar.wgsl");
/// K/V tile access: staged in workgroup memory, or in registers shared by subgroup shuffles.
const KV_SHARED: &str = include_str!("../../shaders/flash_kv_shared.wgsl");
const KV_SUBGROUP: &str = include_str!("../../shaders/flash_kv_subgroup.wgsl");

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
    /// Keys per unrolled step of the inner loop (divides `bk`).
    pub kg: u32,
    /// E and Ev are multiples of 4: q, k, v and out are bound as `array<vec4<f32>>`.
    pub vec4_io: bool,
    /// Unroll the loops marked in the shader.
    pub unroll: bool,
    /// The K/V tile is held one key per invocation and read by subgroup shuffles (`bk == wg`,
    /// the workgroup is one subgroup).
    pub sg_kv: bool,
    /// A boolean mask is bound (else its code is compiled out).
    pub has_mask: bool,
    /// An additive bias is bound (else its code is compiled out).
    pub has_bias: bool,
    /// Set by the `WGPU_ATTENTION_FLASH` override: run exactly this form.
    pub pinned: bool,
}

/// On CPU adapters without a fixed subgroup size, problems below this many FLOPs use the
/// kernel with loops; larger ones the unrolled kernel. With subgroups, problems below it take
/// one query row per invocation (quickest to compile), larger ones several rows per invocation
/// (the fastest form; see [`Config::for_now`]).
pub(crate) const CPU_UNROLL_MIN_FLOPS: f64 = 2.5e8;

impl Config {
    /// `None` when the head dims do not fit (E or Ev beyond 256) or the device is too small.
    /// `cpu`: the adapter is a CPU (lavapipe/llvmpipe, WARP), where each memory access costs far
    /// more than arithmetic, so each invocation takes several rows, and where unrolled code
    /// compiles for seconds (once per machine: Mesa caches it on disk).
    /// `subgroup`: the device's subgroup size when it is fixed and subgroup operations are
    /// enabled; on CPU adapters with a subgroup of 4 to 16 the K/V tile then lives in
    /// registers and is shared by shuffles instead of workgroup memory.
    pub(crate) fn new(
        p: &Problem,
        limits: &wgpu::Limits,
        cpu: bool,
        subgroup: Option<u32>,
    ) -> Option<Config> {
        if p.head_dim > 256 || p.head_dim_v > 256 {
            return None;
        }
        let (e4, ev4) = (p.head_dim.div_ceil(4) as u32, p.head_dim_v.div_ceil(4) as u32);
        let large = p.flops() >= CPU_UNROLL_MIN_FLOPS;
        let sg = subgroup.filter(|s| cpu && (4..=16).contains(s));
        let unroll = !cpu || large || sg.is_some();
        // On CPUs: about 256 vec4s of q (and of accumulator) per invocation (measured on
        // lavapipe at E = 64: 8 rows 315 ms, 16 rows 203 ms; keys per step matter little).
        let cpu_rows = (256 / e4.max(ev4)).clamp(1, 16);
        #[cfg_attr(target_arch = "wasm32", allow(unused_mut))]
        let (mut wg, mut rq, mut kg): (u32, u32, u32) = match (cpu, unroll, sg) {
            (false, _, _) => (64, 1, 4),
            // Measured on lavapipe at E = 64 (a_h8_s1024): 4 rows x 4 keys per step 85 ms but
            // 5 s to compile, 1 row 1.2 s and 1.6x the time. Small problems (small_h4_s128):
            // 1 row 0.9 s to compile and 2.6 ms, 2 rows 1.5 s and 1.9 ms; the loop form 2.3 s
            // and 15 ms.
            (true, _, Some(s)) => (s, if large { (64 / e4.max(ev4)).clamp(1, 8) } else { 1 }, 4),
            (true, true, None) => (8, cpu_rows, 2),
            (true, false, _) => (8, 2, 4),
        };
        #[cfg_attr(target_arch = "wasm32", allow(unused_mut))]
        let mut unroll = unroll;
        #[cfg_attr(target_arch = "wasm32", allow(unused_mut))]
        let mut sg_kv = sg.is_some();
        #[cfg_attr(target_arch = "wasm32", allow(unused_mut))]
        let mut pinned = false;
        // Tuning override for experiments: WGPU_ATTENTION_FLASH=<invocations>,<rows per
        // invocation>,<keys per step>,<unroll 0|1>[,<subgroup K/V 0|1>].
        #[cfg(not(target_arch = "wasm32"))]
        if let Ok(v) = std::env::var("WGPU_ATTENTION_FLASH") {
            let v: Vec<u32> = v.split(',').filter_map(|x| x.parse().ok()).collect();
            if let [a, b, c, d, ..] = v[..] {
                (wg, rq, kg, unroll) = (a, b, c, d != 0);
                sg_kv = v.get(4).is_some_and(|&e| e != 0) && subgroup == Some(a) && unroll;
                pinned = true;
            }
        }
        if wg == 0
            || rq == 0
            || !kg.is_power_of_two()
            || kg > 64
            || limits.max_compute_invocations_per_workgroup < wg
            || limits.max_compute_workgroup_size_x < wg
        {
            return None;
        }
        let vec4_io = p.head_dim.is_multiple_of(4) && p.head_dim_v.is_multiple_of(4);
        let budget = WG_MEMORY
            .min(limits.max_compute_workgroup_storage_size)
            .saturating_sub(16);
        let tiles: &[u32] = if sg_kv { &[wg] } else { &[64, 32, 16, 8, 4] };
        tiles
            .iter()
            .copied()
            .find(|&bk| staged_rows(sg_kv, bk) * (e4 + ev4) * 16 <= budget)
            .map(|bk| Config {
                e4,
                ev4,
                bk,
                wg,
                rq,
                kg: kg.min(bk),
                vec4_io,
                unroll,
                has_mask: p.mask.is_some(),
                has_bias: p.bias.is_some(),
                sg_kv,
                pinned,
            })
    }

    /// The configuration to run now. On CPU adapters the fastest form (several query rows per
    /// invocation) takes seconds to compile the first time: lavapipe compiles at the first
    /// dispatch, about 5 s at E = 64 on a machine without a warm Mesa cache. Until it is ready,
    /// calls are served by the same kernel with one row per invocation (about 1.2 s to compile,
    /// 1.6x the run time; each row's arithmetic is the same, so are the results) while the fast
    /// form is compiled in the background ([`Context::warm`]); later calls get it.
    pub(crate) fn for_now(self, ctx: &Context) -> Config {
        if self.rq == 1 || self.pinned || !self.unroll {
            return self;
        }
        if ctx.warm(&SPEC, self.prelude(), std::mem::size_of::<Params>()) {
            self
        } else {
            Config { rq: 1, ..self }
        }
    }

    /// Query rows per workgroup.
    pub(crate) fn rows(&self) -> u32 {
        self.wg * self.rq
    }

    fn prelude(&self) -> String {
        let io = if self.vec4_io { IO_VEC4 } else { IO_SCALAR };
        // Naga takes the subgroup built-ins without `enable subgroups;` (which it rejects).
        let kv = if self.sg_kv { KV_SUBGROUP } else { KV_SHARED };
        format!(
            "const E4: u32 = {}u;\nconst EV4: u32 = {}u;\nconst BK: u32 = {}u;\nconst KT: u32 = {}u;\nconst WG: u32 = {}u;\n\
             const RQ: u32 = {}u;\nconst KG: u32 = {}u;\nconst NG: u32 = {}u;\nconst HAS_MASK: bool = {};\n\
             const HAS_BIAS: bool = {};\nconst UNROLL: bool = {};\nconst SG_KV: bool = {};\n{io}{kv}",
            self.e4,
            self.ev4,
            self.bk,
            staged_rows(self.sg_kv, self.bk),
            self.wg,
            self.rq,
            self.kg,
            self.bk / self.kg,
            self.has_mask,
            self.has_bias,
            self.unroll,
            self.sg_kv,
        )
    }
}

/// Rows of K (and of V) the workgroup stages in workgroup memory, `KT` in the shader: the
/// whole tile of `bk` keys, or, with subgroup sharing, none; WGSL needs a non-empty array,
/// so one row then.
fn staged_rows(sg_kv: bool, bk: u32) -> u32 {
    if sg_kv {
        1
    } else {
        bk
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
            let c = Config::new(&p, &limits, false, None).unwrap();
            assert!(c.bk * (c.e4 + c.ev4) * 16 + 16 <= 16384, "{e} {ev} {c:?}");
            assert!(c.e4 * 4 >= e as u32 && c.ev4 * 4 >= ev as u32);
        }
        let p = Problem::new(&[1, 1, 1, 257], &[1, 1, 1, 257], &[1, 1, 1, 4]).unwrap();
        assert!(Config::new(&p, &limits, false, None).is_none());
    }

    /// Every head dim up to 256 has a fused form on every kind of adapter (the subgroup form
    /// stages no K/V tile in workgroup memory, so its budget must not count one).
    #[test]
    fn every_form_serves_head_dims_up_to_256() {
        let limits = wgpu::Limits::default();
        for (e, ev) in [(1, 1), (64, 64), (255, 129), (256, 256), (256, 3)] {
            let p = Problem::new(&[1, 1, 1, e], &[1, 1, 1, e], &[1, 1, 1, ev]).unwrap();
            for (cpu, sg) in [(false, None), (true, None), (true, Some(8)), (true, Some(32))] {
                let c = Config::new(&p, &limits, cpu, sg);
                assert!(c.is_some(), "E {e}, Ev {ev}, cpu {cpu}, subgroup {sg:?}");
            }
        }
    }
}
