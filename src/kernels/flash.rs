//! `shaders/flash.wgsl`: the fused FlashAttention-style kernel. One workgroup per tile of query
//! rows of one head; K/V tiles streamed through workgroup memory (or, on CPU adapters with a
//! fixed subgroup size, held one key per invocation and shared by subgroup shuffles); online
//! softmax; every mask inside; whole key tiles skipped past the causal limit and the key length;
//! GQA by indexing the shared K/V head. Memory is linear in L and S: the score matrix is never
//! written. [`Config`] picks the form and tile sizes for the device.

use super::consts::Prelude;
use super::{common, dispatch, grid_1d, params_of, KernelSpec, Masks, TensorViews};
use crate::device::context::Context;
use crate::error::Result;
use crate::forms::{Caps, FusedForm};
use crate::problem::Problem;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "flash",
    source: include_str!("../../shaders/flash.wgsl"),
    common: &[common::SOFTMAX, common::MASKS, common::HEADS],
    bindings: super::ATTENTION_BINDINGS,
    params: params_of::<Params>,
    trusted: true,
};

/// The register-tiled GPU form (`shaders/flash_tiles.wgsl`).
pub(crate) const TILES_SPEC: KernelSpec = KernelSpec {
    name: "flash_tiles",
    source: include_str!("../../shaders/flash_tiles.wgsl"),
    common: SPEC.common,
    bindings: SPEC.bindings,
    params: SPEC.params,
    trusted: true,
};

/// The matrix-unit form (`shaders/flash_coop.wgsl`).
pub(crate) const COOP_SPEC: KernelSpec = KernelSpec {
    name: "flash_coop",
    source: include_str!("../../shaders/flash_coop.wgsl"),
    common: SPEC.common,
    bindings: SPEC.bindings,
    params: SPEC.params,
    trusted: false,
};

/// K/V tile access (declaration, staging, reads): staged in workgroup memory, or in registers
/// shared by subgroup shuffles. Shared with the backward's dQ kernel.
pub(crate) const KV_SHARED: &str = include_str!("../../shaders/flash_kv_shared.wgsl");
pub(crate) const KV_SUBGROUP: &str = include_str!("../../shaders/flash_kv_subgroup.wgsl");

/// The logit's terms as the fused kernels sum them: `score4(q, k, d4)`, the four products of
/// vec4 block `d4`, and `score_fma(acc, q, k, d4)`, the logit so far plus those terms (the
/// register-tiled form's scalar logits). Scores other than the dot product are user
/// `score_mod`s applied to the logit (`shaders/common/masks.wgsl`).
const SCORE: &str = "fn score4(q: vec4<f32>, k: vec4<f32>, d4: u32) -> vec4<f32> {\n    return q * k;\n}\n\
fn score_fma(acc: f32, q: vec4<f32>, k: vec4<f32>, d4: u32) -> f32 {\n    \
return dot_fma(acc, q, k);\n}\n";

/// Workgroup memory the kernel may use: WebGPU's default 16 KiB, or less if the device has less.
const WG_MEMORY: u32 = 16 * 1024;

/// Workgroup memory the GPU forms (forward and backward) use where the device allows it (the
/// crate requests the adapter's limits; WebGPU's default is 16 KiB): a K/V tile of 64 keys at
/// E = 64, 2-3% faster than 32 keys on an H100 (`scripts/gpu_sweep.sh`).
pub(crate) const GPU_WG_MEMORY: u32 = 32 * 1024;

/// Workgroup memory the register-tiled GPU form uses where the device allows it.
const TILES_WG_MEMORY: u32 = 48 * 1024;

/// Whether the register-tiled form reduces its rows' max and sum by subgroup shuffles where
/// the subgroup size allows (knob `tiles_sg`). Measured on an H200 (GPU time, three
/// interleaved rounds, `docs/gpu/nvidia-h200-sg-rows.txt`): c_h8_s4096_causal 0.930 -> 0.857 ms
/// (f32), 0.897 -> 0.822 ms (f16); a_h8_s1024 1.07x, gpt2_h12_t1024_causal 1.08x.
const TILES_SG_ROWS: bool = true;

/// The register-tiled form's reductions over a row's NX adjacent lanes (`SG_ROWS`): butterflies,
/// so every lane gets the same bits (max is exact; the same pairs are added in every lane).
const TILES_SG_ROW_FNS: &str = "fn row_max_sg(x: f32) -> f32 {
    var y = x;
    for (var o = 1u; o < NX; o *= 2u) {
        y = max(y, subgroupShuffleXor(y, o));
    }
    return y;
}
fn row_sum_sg(x: f32) -> f32 {
    var y = x;
    for (var o = 1u; o < NX; o *= 2u) {
        y += subgroupShuffleXor(y, o);
    }
    return y;
}
";

/// Their stand-ins without subgroups (never called: `SG_ROWS` is false).
const TILES_ROW_FN_STUBS: &str =
    "fn row_max_sg(x: f32) -> f32 { return x; }\nfn row_sum_sg(x: f32) -> f32 { return x; }\n";

wgsl_struct! {
    /// The fused kernel's params (`p` in `flash.wgsl`).
    pub(crate) struct Params {
        m: Masks,
        x: TensorViews,
        l: u32,
        s: u32,
        e: u32,
        ev: u32,
        heads: u32,
        group: u32,
        q_tiles: u32,
        total: u32,
        scale: f32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

/// The specialisation: the form, head dims in vec4s (rounded up) and keys per tile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Config {
    pub form: FusedForm,
    pub e4: u32,
    pub ev4: u32,
    pub bk: u32,
    /// Invocations per workgroup.
    pub wg: u32,
    /// Query rows per invocation.
    pub rq: u32,
    /// Keys per unrolled step of the inner loop (divides `bk`).
    pub kg: u32,
    /// The storage formats of q, k, v, bias and out.
    pub formats: crate::storage::Formats,
    /// vec4 rows (E and Ev multiples of 4), else scalar rows.
    pub vec4: bool,
    /// Ev is odd (half outputs are then stored element by element, with atomics).
    pub ev_odd: bool,
    /// The tensors read (written) through views.
    pub views: crate::view::Views,
    /// An fp8 paged cache's kv heads and rows per head in a block ([`super::access::fp8_rows`]).
    pub fp8_rows: Option<(usize, usize)>,
    /// Unroll the loops marked in the shader.
    pub unroll: bool,
    /// Also the loops over the head dims ([`unroll_dims`](super::unroll_dims)).
    pub unroll_e: bool,
    /// The K/V tile is held one key per invocation and read by subgroup shuffles (`bk == wg`,
    /// the workgroup is one subgroup).
    pub sg_kv: bool,
    /// A boolean mask is bound (else its code is compiled out).
    pub has_mask: bool,
    /// An additive bias is bound (else its code is compiled out).
    pub has_bias: bool,
    /// The built-in modifiers (a window, softcap, ALiBi) that apply.
    pub mods: super::Mods,
    /// The form was pinned ([`crate::Context::with_forms`]): run exactly it, no tiering.
    pub pinned: bool,
    /// The register-tiled GPU form's query rows per workgroup (0 for the other forms).
    pub bm: u32,
    /// The register-tiled GPU form reduces each row's max and sum by subgroup shuffles.
    pub sg_rows: bool,
    /// The device's tuning knobs (what the preludes read of them).
    pub tuning: crate::forms::Tuning,
}

/// The coop form's tiles: query rows and keys per workgroup and the padded head dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CoopLayout {
    bq: u32,
    bk: u32,
    ep: u32,
    evp: u32,
}

impl CoopLayout {
    /// Workgroup memory: Q, the K/V tile, the logits, the weights, the output and the
    /// small variables.
    fn bytes(&self) -> u32 {
        let kvw = self.ep.max(self.evp);
        self.bq * self.ep * 2
            + self.bk * kvw * 2
            + self.bq * self.bk * 6
            + self.bq * self.evp * 4
            + self.bq * 4
            + 64
    }
}

/// On CPU adapters without a fixed subgroup size, problems below this many FLOPs use the
/// kernel with loops; larger ones the unrolled kernel. With subgroups, problems below it take
/// one query row per invocation (quickest to compile), larger ones several rows per invocation
/// (the fastest form; see [`Config::for_now`]).
pub(crate) const CPU_UNROLL_MIN_FLOPS: f64 = 2.5e8;

/// Whether `p` is large enough for a CPU adapter's slow-to-compile, fast-to-run kernels (at
/// least [`CPU_UNROLL_MIN_FLOPS`]): the forward's unrolled and several-row forms, the
/// backward's several rows (keys) per invocation.
pub(crate) fn cpu_large(p: &Problem) -> bool {
    p.flops() >= CPU_UNROLL_MIN_FLOPS
}

/// The head dims the fused kernels (forward and backward) hold in registers: up to 256.
pub(crate) fn check_head_dims(p: &Problem) -> std::result::Result<(), String> {
    if p.head_dim > 256 || p.head_dim_v > 256 {
        return Err(format!(
            "head dims E = {}, Ev = {} exceed 256",
            p.head_dim, p.head_dim_v
        ));
    }
    Ok(())
}

/// The fused kernel's form for `p` on a device with `caps` when none is pinned: the matrix
/// units for f16 q, k and v where they are the device's default ([`Caps::coop_by_default`])
/// and the form takes the problem.
pub(crate) fn default_form(p: &Problem, caps: &Caps) -> FusedForm {
    let f16 = [p.storage.q, p.storage.k, p.storage.v] == [crate::storage::Storage::F16; 3];
    if f16 && caps.coop_by_default() {
        if let Some(t) = caps.coop.largest() {
            if Config::coop(p, caps, Some(t), false).is_ok() {
                return FusedForm::Coop { tile: Some(t) };
            }
        }
    }
    scalar_form(p, caps)
}

/// [`default_form`] among the scalar forms.
fn scalar_form(p: &Problem, caps: &Caps) -> FusedForm {
    let (e4, ev4) = (p.head_dim.div_ceil(4) as u32, p.head_dim_v.div_ceil(4) as u32);
    let large = cpu_large(p);
    let sg = caps.fused_subgroup().filter(|_| caps.cpu);
    match (caps.cpu, sg, large) {
        (false, _, _) => gpu_form(p, caps),
        // Measured on lavapipe at E = 64 (a_h8_s1024): 4 rows x 4 keys per step 85 ms but
        // 5 s to compile, 1 row 1.2 s and 1.6x the time. Small problems (small_h4_s128):
        // 1 row 0.9 s to compile and 2.6 ms, 2 rows 1.5 s and 1.9 ms; the loop form 2.3 s
        // and 15 ms. Later (loops over the head dims unrolled, rows' bases computed once),
        // at head dims up to 64, 8 rows: a_h8_s1024 120-129 ms against 184-185 ms with 4,
        // b_h8_s1024_causal 68-70 against 92-103, e_b4_h12_s256_padmask 49-51 against 67-87
        // (compiled in the background in 1.4 s against 0.65 s).
        (true, Some(_), true) => FusedForm::Subgroup {
            rows: if e4.max(ev4) <= 16 {
                8
            } else {
                (64 / e4.max(ev4)).clamp(1, 8)
            },
        },
        (true, Some(_), false) => FusedForm::Subgroup { rows: 1 },
        // About 256 vec4s of q (and of accumulator) per invocation (measured on lavapipe at
        // E = 64: 8 rows 315 ms, 16 rows 203 ms; keys per step matter little), while the
        // one-row form serves the first calls. Without background compilation (the web) about
        // 64 vec4s, which compile in a second or two (see `Caps::background_compile`).
        (true, None, true) if caps.background_compile => FusedForm::Tiled {
            rows: (256 / e4.max(ev4)).clamp(1, 16),
        },
        (true, None, true) => FusedForm::Tiled {
            rows: (64 / e4.max(ev4)).clamp(1, 4),
        },
        (true, None, false) => FusedForm::Loop { rows: 2 },
    }
}

/// The fused form a GPU gets: the register-tiled form where its full-size tiles (64 query rows
/// x 32 keys) fit the workgroup memory (48 KiB: E up to about 64), else one row per invocation.
/// Measured on an H100 (`scripts/gpu_sweep.sh tiles`, GPU time, f32): the tiled form 13.4
/// TFLOP/s at c_h8_s4096_causal against 11.4, 13.4 against 8.5 at a_h8_s1024, 8.8 against 6.3
/// at gpt2_h12_t1024_causal; smaller tiles 2x slower. But with f32 K/V over more than 8192 keys
/// it lost (long_h1_s32768_causal 7.2 against 11.9; in f16 16.6 against 12.0), so those keep
/// the one-row form.
fn gpu_form(p: &Problem, caps: &Caps) -> FusedForm {
    let tiles_fit = Config::tiles(p, caps, false).is_ok_and(|c| c.bm >= 64);
    let long_f32 = p.seq_kv > 8192 && !(p.storage.k.is_half() && p.storage.v.is_half());
    if tiles_fit && !long_f32 {
        FusedForm::GpuTiles
    } else {
        FusedForm::Gpu
    }
}

/// How a form of the fused kernel lays out its work ([`Config::new`]).
struct FormLayout {
    wg: u32,
    rq: u32,
    kg: u32,
    unroll: bool,
    sg_kv: bool,
}

impl Config {
    /// The configuration of the pinned form (`caps.forms.fused`) or the default one, or why
    /// the fused kernel cannot run `p` on this device.
    pub(crate) fn new(p: &Problem, caps: &Caps) -> std::result::Result<Config, String> {
        check_head_dims(p)?;
        let pinned = caps.forms.fused;
        let form = pinned.unwrap_or_else(|| default_form(p, caps));
        if form == FusedForm::GpuTiles {
            return Config::tiles(p, caps, pinned.is_some());
        }
        if let FusedForm::Coop { tile } = form {
            return Config::coop(p, caps, tile, pinned.is_some());
        }
        // Invocations per workgroup, query rows per invocation, keys per step; whether the
        // key loop is unrolled and K/V are shared by subgroup shuffles.
        let layout = |wg, rq, kg, [unroll, sg_kv]: [bool; 2]| FormLayout {
            wg,
            rq,
            kg,
            unroll,
            sg_kv,
        };
        let FormLayout {
            wg,
            rq,
            kg,
            unroll,
            sg_kv,
        } = match form {
            // Measured on an H100 (scripts/gpu_sweep.sh): 128 invocations 10% faster than 64
            // at c_h8_s4096_causal and a_h8_s1024; 2 or 4 rows per invocation spill registers
            // (3x slower); 8 keys per step no better than 4.
            FusedForm::Gpu => layout(
                caps.tuning.fused_wg.unwrap_or(128),
                caps.tuning.fused_rq.unwrap_or(1),
                caps.tuning.fused_kg.unwrap_or(4),
                [true, false],
            ),
            FusedForm::Subgroup { rows } => {
                let s = caps.fused_subgroup_for(&form.name())?;
                layout(s, rows, 4, [true, true])
            }
            FusedForm::Tiled { rows } => layout(8, rows, 2, [true, false]),
            FusedForm::Loop { rows } => layout(8, rows, 4, [false, false]),
            FusedForm::GpuTiles | FusedForm::Coop { .. } => {
                unreachable!("configured by Config::tiles and Config::coop")
            }
        };
        if !(1..=16).contains(&rq) || caps.max_invocations < wg || caps.max_workgroup_size_x < wg {
            return Err(format!(
                "the {} form needs {wg} invocations per workgroup and 1 to 16 rows",
                form.name()
            ));
        }
        let (e4, ev4) = (p.head_dim.div_ceil(4) as u32, p.head_dim_v.div_ceil(4) as u32);
        let wg_memory = match form {
            FusedForm::Gpu => caps.tuning.wg_memory.unwrap_or(GPU_WG_MEMORY),
            _ => WG_MEMORY,
        };
        let budget = wg_memory.min(caps.workgroup_storage).saturating_sub(16);
        let tiles: &[u32] = match (sg_kv, wg_memory > WG_MEMORY) {
            (true, _) => &[wg],
            (false, true) => &[128, 64, 32, 16, 8, 4],
            (false, false) => &[64, 32, 16, 8, 4],
        };
        let bk = tiles
            .iter()
            .copied()
            .find(|&bk| staged_rows(sg_kv, bk) * (e4 + ev4) * 16 <= budget)
            .ok_or_else(|| {
                format!(
                    "its K/V tile for E = {}, Ev = {} does not fit {budget} bytes of workgroup memory",
                    p.head_dim, p.head_dim_v
                )
            })?;
        Ok(Config {
            form,
            e4,
            ev4,
            bk,
            wg,
            rq,
            kg: kg.min(bk),
            formats: p.storage,
            vec4: p.vec4_rows(),
            views: p.views,
            fp8_rows: super::access::fp8_rows(p),
            ev_odd: p.head_dim_v % 2 == 1,
            unroll,
            unroll_e: super::unroll_dims(p, caps),
            sg_kv,
            has_mask: p.mask.is_some(),
            has_bias: p.bias.is_some(),
            mods: super::Mods::of(p, &caps.tuning),
            tuning: caps.tuning,
            pinned: pinned.is_some(),
            bm: 0,
            sg_rows: false,
        })
    }

    /// The coop form's configuration: the largest tiles (BQ query rows, BK keys, multiples
    /// of the tile) whose blocks fit the workgroup memory, or why it cannot take `p`: no
    /// listed tile, bf16 inputs (f16 has not their range), a half output of odd Ev (stored by
    /// atomics, which naga's SPIR-V under the Vulkan memory model lacks a capability for), a
    /// head dim too large for the workgroup memory.
    fn coop(
        p: &Problem,
        caps: &Caps,
        tile: Option<u32>,
        pinned: bool,
    ) -> std::result::Result<Config, String> {
        let t = caps.coop_tile(tile)?;
        let s = p.storage;
        crate::forms::coop_takes("coop form", &[s.q, s.k, s.v])?;
        let ev_odd = p.head_dim_v % 2 == 1;
        if super::access::out_is_atomic(s.out, p.vec4_rows(), ev_odd, &p.views) {
            return Err("the coop form cannot store a half-format output element by element (odd Ev, or a view whose pairs are not whole words)".into());
        }
        let (e4, ev4) = (p.head_dim.div_ceil(4) as u32, p.head_dim_v.div_ceil(4) as u32);
        let (ep, evp) = ((4 * e4).next_multiple_of(t), (4 * ev4).next_multiple_of(t));
        let wg = caps.coop_workgroup();
        let budget = caps.workgroup_storage;
        let layout = [(4, 4), (4, 2), (2, 4), (2, 2), (1, 2), (1, 1)]
            .into_iter()
            .map(|(q, k)| CoopLayout {
                bq: q * t,
                bk: k * t,
                ep,
                evp,
            })
            // The mask_mod votes (one word per invocation) beside the blocks.
            .find(|l| l.bq <= wg && l.bytes() + 4 * wg <= budget)
            .ok_or_else(|| {
                format!(
                    "the coop form's tiles for E = {}, Ev = {} do not fit {budget} bytes of workgroup memory",
                    p.head_dim, p.head_dim_v
                )
            })?;
        Ok(Config {
            form: FusedForm::Coop { tile: Some(t) },
            e4,
            ev4,
            bk: layout.bk,
            wg,
            rq: 1,
            kg: t,
            formats: p.storage,
            vec4: p.vec4_rows(),
            views: p.views,
            fp8_rows: super::access::fp8_rows(p),
            ev_odd,
            unroll: false,
            unroll_e: false,
            sg_kv: false,
            has_mask: p.mask.is_some(),
            has_bias: p.bias.is_some(),
            mods: super::Mods::of(p, &caps.tuning),
            tuning: caps.tuning,
            pinned,
            bm: layout.bq,
            sg_rows: false,
        })
    }

    /// The register-tiled GPU form's configuration: the largest tiles of (BM query rows, BN
    /// keys) whose Q, K, V and weight tiles fit the workgroup memory (48 KiB where the device
    /// allows), with TM x TN logits per invocation (4 x 4; the `tiles_*` knobs of
    /// [`crate::forms::tune`] choose others).
    fn tiles(p: &Problem, caps: &Caps, pinned: bool) -> std::result::Result<Config, String> {
        let (e4, ev4) = (p.head_dim.div_ceil(4) as u32, p.head_dim_v.div_ceil(4) as u32);
        let memory = caps.tuning.wg_memory.unwrap_or(TILES_WG_MEMORY);
        let budget = memory.min(caps.workgroup_storage);
        let tm = caps.tuning.tiles_tm.filter(|&k| k == 4 || k == 8).unwrap_or(4);
        let tn = caps.tuning.tiles_tn.filter(|&k| k == 4 || k == 8).unwrap_or(4);
        let want_sg = caps.tuning.tiles_sg.map_or(TILES_SG_ROWS, |k| k == 1);
        // A row's NX invocations are adjacent lanes of one subgroup where NX divides its size.
        let sg_rows = |nx: u32| want_sg && caps.subgroup.is_some_and(|s| s % nx == 0);
        let bytes = |bm: u32, bn: u32| {
            let (nx, evt) = (bn / tn, ev4.div_ceil(bn / tn));
            let red = if sg_rows(nx) { 0 } else { 4 * bm * nx };
            // The small variables (the bounds, the mask_mod verdicts: WebGPU counts each one
            // rounded up to 16 bytes) in the last 64.
            16 * (bm * (e4 + 1) + bn * (e4 + 1) + bn * nx * evt + bm * (bn / 4 + 1)) + red + 64
        };
        let tiles = [
            (128, 32),
            (64, 64),
            (64, 32),
            (32, 64),
            (32, 32),
            (64, 16),
            (32, 16),
            (16, 16),
            (16, 8),
            (8, 8),
            (8, 4),
            (4, 4),
        ];
        let (bm, bn) = tiles
            .into_iter()
            .filter(|&(bm, bn)| {
                caps.tuning.tiles_bm.is_none_or(|k| k == bm)
                    && caps.tuning.tiles_bn.is_none_or(|k| k == bn)
                    && bm % tm == 0
                    && bn % tn == 0
            })
            .find(|&(bm, bn)| {
                bytes(bm, bn) <= budget
                    && (bm / tm) * (bn / tn) <= caps.max_invocations.min(caps.max_workgroup_size_x)
            })
            .ok_or_else(|| {
                format!(
                    "the gpu-tiles form's tiles for E = {}, Ev = {} do not fit {budget} bytes of workgroup memory",
                    p.head_dim, p.head_dim_v
                )
            })?;
        Ok(Config {
            form: FusedForm::GpuTiles,
            e4,
            ev4,
            bk: bn,
            wg: (bm / tm) * (bn / tn),
            rq: tm,
            kg: tn,
            formats: p.storage,
            vec4: p.vec4_rows(),
            views: p.views,
            fp8_rows: super::access::fp8_rows(p),
            ev_odd: p.head_dim_v % 2 == 1,
            // GPU compilers; CPU adapters (where it is pinned for tests) compile the loops as
            // written in a fraction of the time.
            unroll: !caps.cpu,
            unroll_e: super::unroll_dims(p, caps),
            sg_kv: false,
            has_mask: p.mask.is_some(),
            has_bias: p.bias.is_some(),
            mods: super::Mods::of(p, &caps.tuning),
            tuning: caps.tuning,
            pinned,
            bm,
            sg_rows: sg_rows(bn / tn),
        })
    }

    /// The configuration to run now. On CPU adapters the fastest form (several query rows per
    /// invocation) takes seconds to compile the first time: lavapipe compiles at the first
    /// dispatch, about 5 s at E = 64 on a machine without a warm Mesa cache. Until it is ready,
    /// calls are served by the same kernel with one row per invocation (about 1.2 s to compile,
    /// 1.6x the run time; each row's arithmetic is the same, so are the results) while the fast
    /// form is compiled in the background ([`super::warm`]); later calls get it.
    pub(crate) fn for_now(self, ctx: &Context) -> Config {
        if self.rq == 1
            || self.pinned
            || !self.unroll
            || self.form == FusedForm::GpuTiles
            || self.form.is_coop()
        {
            return self;
        }
        if super::warm(ctx, self.spec(), self.prelude(), self.mods.checks()) {
            self
        } else {
            Config {
                rq: 1,
                form: self.form.with_rows(1),
                ..self
            }
        }
    }

    /// Whether the logits are scalars summed by FMAs (`score_fma`), not vec4 partials: the GPU
    /// forms' arithmetic ([`super::scalar_logits`]).
    fn scalar_logits(&self) -> bool {
        super::scalar_logits(
            matches!(self.form, FusedForm::Gpu | FusedForm::GpuTiles),
            &self.tuning,
        )
    }

    /// Query rows per workgroup.
    pub(crate) fn rows(&self) -> u32 {
        if self.form == FusedForm::GpuTiles || self.form.is_coop() {
            return self.bm;
        }
        self.wg * self.rq
    }

    /// The kernel spec of this configuration: its form's.
    pub(crate) fn spec(&self) -> &'static KernelSpec {
        match self.form {
            FusedForm::GpuTiles => &TILES_SPEC,
            FusedForm::Coop { .. } => &COOP_SPEC,
            _ => &SPEC,
        }
    }

    /// The kernel's constants, I/O and score snippets.
    pub(crate) fn prelude(&self) -> Prelude {
        let io = super::access::attention_io(
            &self.formats,
            self.formats.out,
            self.vec4,
            self.ev_odd,
            false,
            &self.views,
            (4 * self.e4 as usize, 4 * self.ev4 as usize),
            self.fp8_rows,
        );
        let masks = super::mask_consts(self.has_mask, self.has_bias, self.mods.clone(), self.formats.bias);
        let (e4, ev4) = (self.e4, self.ev4);
        let form = match self.form {
            FusedForm::Coop { tile: Some(t) } => {
                let (ep, evp) = ((4 * e4).next_multiple_of(t), (4 * ev4).next_multiple_of(t));
                super::matmul::coop_prelude(t, self.wg)
                    .consts(&CoopConsts {
                        E4: e4,
                        EV4: ev4,
                        BQ: self.bm,
                        BK: self.bk,
                        EP: ep,
                        EVP: evp,
                        SCALAR_LOGITS: false,
                        UNROLL: false,
                        UNROLL_E: false,
                    })
                    .consts(&KvwConsts { KVW: ep.max(evp) })
            }
            FusedForm::GpuTiles => self.tiles_prelude(),
            _ => Prelude::new()
                .consts(&SharedConsts {
                    E4: e4,
                    EV4: ev4,
                    BK: self.bk,
                    WG: self.wg,
                    RQ: self.rq,
                    KG: self.kg,
                    NG: self.bk / self.kg,
                    UNROLL: self.unroll,
                    UNROLL_E: self.unroll_e,
                    SG_KV: self.sg_kv,
                    SCALAR_LOGITS: self.scalar_logits(),
                })
                // Naga takes the subgroup built-ins without `enable subgroups;` (which it rejects).
                .code(if self.sg_kv { KV_SUBGROUP } else { KV_SHARED }),
        };
        form.then(masks).then(io).code(SCORE)
    }

    /// The GPU-tiled form's constants and row reductions.
    fn tiles_prelude(&self) -> Prelude {
        let (tm, tn) = (self.rq, self.kg);
        let nx = self.bk / tn;
        let evt = self.ev4.div_ceil(nx);
        let ny = self.bm / tm;
        Prelude::new()
            .consts(&TilesConsts {
                E4: self.e4,
                EV4: self.ev4,
                BM: self.bm,
                BN: self.bk,
                TM: tm,
                TN: tn,
                TMN: tm * tn,
                NX: nx,
                NY: ny,
                EVT: evt,
                TM_EVT: tm * evt,
                NPK: (self.bk * self.e4).div_ceil(nx * ny),
                NPV: (self.bk * nx * evt).div_ceil(nx * ny),
                SCALAR_LOGITS: self.scalar_logits(),
                // The next K/V tile's loads issued before this tile's arithmetic: off unless the
                // knob asks (slower on an H200).
                PREFETCH: self.tuning.tiles_prefetch == Some(1),
                SG_ROWS: self.sg_rows,
                RED_LEN: if self.sg_rows { 1 } else { self.bm * nx },
                UNROLL: self.unroll,
                UNROLL_E: self.unroll_e,
            })
            .code(if self.sg_rows {
                TILES_SG_ROW_FNS
            } else {
                TILES_ROW_FN_STUBS
            })
    }
}

wgsl_consts! {
    /// The shared and subgroup forms of the fused forward (`shaders/flash.wgsl`): head dims in
    /// vec4s, `BK` keys per tile, `WG` invocations, `RQ` rows each, keys in `KG` groups of `NG`.
    pub(crate) struct SharedConsts {
        E4: u32,
        EV4: u32,
        BK: u32,
        WG: u32,
        RQ: u32,
        KG: u32,
        NG: u32,
        UNROLL: bool,
        UNROLL_E: bool,
        SG_KV: bool,
        SCALAR_LOGITS: bool,
    }
}

wgsl_consts! {
    /// The GPU-tiled form (`shaders/flash_tiles.wgsl`): `BM` x `BN` tiles of `TM` x `TN`
    /// register blocks over `NX` x `NY` invocations, `EVT` output vec4s each, `NPK`/`NPV` loads
    /// of K/V per invocation, the row reductions' length.
    pub(crate) struct TilesConsts {
        E4: u32,
        EV4: u32,
        BM: u32,
        BN: u32,
        TM: u32,
        TN: u32,
        TMN: u32,
        NX: u32,
        NY: u32,
        EVT: u32,
        TM_EVT: u32,
        NPK: u32,
        NPV: u32,
        SCALAR_LOGITS: bool,
        PREFETCH: bool,
        SG_ROWS: bool,
        RED_LEN: u32,
        UNROLL: bool,
        UNROLL_E: bool,
    }
}

wgsl_consts! {
    /// The matrix units' attention kernels, forward and backward (`shaders/flash_coop.wgsl`,
    /// `bwd_dq_coop.wgsl`, `bwd_dkv_coop.wgsl`): `BQ` queries and `BK` keys per block, head dims
    /// padded to the tile (`EP`, `EVP`); logits from the matrix units, loops as written.
    pub(crate) struct CoopConsts {
        E4: u32,
        EV4: u32,
        BQ: u32,
        BK: u32,
        EP: u32,
        EVP: u32,
        SCALAR_LOGITS: bool,
        UNROLL: bool,
        UNROLL_E: bool,
    }
}

wgsl_consts! {
    /// The forward's staged K/V rows' width on the matrix units (`shaders/flash_coop.wgsl`).
    pub(crate) struct KvwConsts {
        KVW: u32,
    }
}

/// Rows of K (and of V) the workgroup stages in workgroup memory: the whole tile of `bk`
/// keys, or, with subgroup sharing, none.
fn staged_rows(sg_kv: bool, bk: u32) -> u32 {
    if sg_kv {
        0
    } else {
        bk
    }
}

/// Record the fused kernel. `buffers`: mask, bias, kv_lens, q, k, v, out, lse.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    cfg: &Config,
    buffers: &[wgpu::BufferBinding<'_>],
    params: &Params,
) -> Result<()> {
    let grid = grid_1d(params.total, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        cfg.spec(),
        &cfg.prelude(),
        &[],
        buffers,
        bytemuck::bytes_of(params),
        grid,
        cfg.mods.checks(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(cpu: bool, subgroup: Option<u32>) -> Caps {
        Caps::new(&wgpu::Limits::default(), cpu, subgroup)
    }

    #[test]
    fn config_fits_16k_up_to_256() {
        for (e, ev) in [(1, 1), (64, 64), (72, 5), (128, 128), (256, 256), (256, 3)] {
            let p = Problem::new(&[1, 1, 1, e], &[1, 1, 1, e], &[1, 1, 1, ev]).unwrap();
            let c = Config::new(&p, &caps(false, None)).unwrap();
            assert!(c.bk * (c.e4 + c.ev4) * 16 + 16 <= 16384, "{e} {ev} {c:?}");
            assert!(c.e4 * 4 >= e as u32 && c.ev4 * 4 >= ev as u32);
        }
        let p = Problem::new(&[1, 1, 1, 257], &[1, 1, 1, 257], &[1, 1, 1, 4]).unwrap();
        assert!(Config::new(&p, &caps(false, None)).is_err());
    }

    /// Every head dim up to 256 has a fused configuration in every form on every kind of
    /// adapter that can run the form (the subgroup form stages no K/V tile in workgroup
    /// memory, so its budget must not count one).
    #[test]
    fn every_form_serves_head_dims_up_to_256() {
        for (e, ev) in [(1, 1), (64, 64), (255, 129), (256, 256), (256, 3)] {
            let p = Problem::new(&[1, 1, 1, e], &[1, 1, 1, e], &[1, 1, 1, ev]).unwrap();
            for (cpu, sg) in [(false, None), (true, None), (true, Some(8)), (true, Some(32))] {
                let c = caps(cpu, sg);
                assert!(
                    Config::new(&p, &c).is_ok(),
                    "E {e}, Ev {ev}, cpu {cpu}, subgroup {sg:?}"
                );
                for form in c.fused_forms() {
                    let pinned = c.with_forms(form);
                    let cfg = Config::new(&p, &pinned).unwrap();
                    assert_eq!(cfg.form, form);
                }
            }
        }
    }

    /// The default forms: GPUs one row per invocation; CPU adapters with subgroups one row
    /// for small problems and several for large ones; without subgroups the loop form for
    /// small problems and the tiled form for large ones. A subgroup form pinned on a device
    /// without a fixed subgroup size is refused.
    /// The register-tiled form reduces its rows by subgroup shuffles where a row's NX = 8
    /// invocations are whole within a subgroup (8 to 64 lanes), through workgroup memory
    /// otherwise (4 lanes, no fixed size); the shuffles free the reduction's memory.
    #[test]
    fn tiles_reduce_rows_by_subgroups_where_the_size_allows() {
        let p = Problem::new(&[1, 8, 1024, 64], &[1, 8, 1024, 64], &[1, 8, 1024, 64]).unwrap();
        let limits = wgpu::Limits {
            max_compute_workgroup_storage_size: 48 * 1024,
            ..wgpu::Limits::default()
        };
        for (sg, want) in [
            (Some(8), true),
            (Some(32), true),
            (Some(64), true),
            (Some(4), false),
            (None, false),
        ] {
            let c = Config::tiles(&p, &Caps::new(&limits, false, sg), false).unwrap();
            assert_eq!((c.bm, c.bk, c.sg_rows), (64, 32, want), "subgroup {sg:?}");
            let prelude = c.prelude();
            let declared = prelude.declared();
            assert!(declared.contains(&("SG_ROWS", want.into())));
            // Subgroup built-ins only where used: WebGPU compilers reject them otherwise.
            assert_eq!(
                prelude.text().contains("subgroupShuffleXor"),
                want,
                "subgroup {sg:?}"
            );
            let red: u32 = if want { 1 } else { 64 * 8 };
            assert!(
                declared.contains(&("RED_LEN", red.into())),
                "{}",
                prelude.label("flash_tiles")
            );
        }
    }

    #[test]
    fn default_forms_by_device_and_size() {
        let small = Problem::new(&[1, 4, 128, 64], &[1, 4, 128, 64], &[1, 4, 128, 64]).unwrap();
        let large = Problem::new(&[1, 8, 1024, 64], &[1, 8, 1024, 64], &[1, 8, 1024, 64]).unwrap();
        // GPUs: WebGPU's default 16 KiB of workgroup memory keeps the one-row form; 48 KiB
        // (Vulkan, Metal, D3D12 GPUs) the register-tiled form at E = 64, not at E = 128, nor for
        // f32 K/V past 8192 keys.
        assert_eq!(default_form(&large, &caps(false, Some(32))), FusedForm::Gpu);
        let big = Caps::new(
            &wgpu::Limits {
                max_compute_workgroup_storage_size: 48 * 1024,
                ..wgpu::Limits::default()
            },
            false,
            Some(32),
        );
        assert_eq!(default_form(&large, &big), FusedForm::GpuTiles);
        let e128 = Problem::new(&[1, 8, 1024, 128], &[1, 8, 1024, 128], &[1, 8, 1024, 128]).unwrap();
        assert_eq!(default_form(&e128, &big), FusedForm::Gpu);
        let long = Problem::new(&[1, 1, 9000, 64], &[1, 1, 9000, 64], &[1, 1, 9000, 64]).unwrap();
        assert_eq!(default_form(&long, &big), FusedForm::Gpu);
        let long16 = long
            .clone()
            .with_storage(crate::storage::Formats::all(crate::storage::Storage::F16));
        assert_eq!(default_form(&long16, &big), FusedForm::GpuTiles);
        assert_eq!(
            default_form(&small, &caps(true, Some(8))),
            FusedForm::Subgroup { rows: 1 }
        );
        assert_eq!(
            default_form(&large, &caps(true, Some(8))),
            FusedForm::Subgroup { rows: 8 }
        );
        assert_eq!(
            default_form(&small, &caps(true, None)),
            FusedForm::Loop { rows: 2 }
        );
        assert_eq!(
            default_form(&large, &caps(true, None)),
            FusedForm::Tiled { rows: 16 }
        );
        // Without background compilation (the web): a form that compiles quickly.
        let web_cpu = Caps {
            background_compile: false,
            ..caps(true, None)
        };
        assert_eq!(default_form(&large, &web_cpu), FusedForm::Tiled { rows: 4 });
        let wide = Problem::new(&[1, 8, 1024, 256], &[1, 8, 1024, 256], &[1, 8, 1024, 256]).unwrap();
        assert_eq!(default_form(&wide, &web_cpu), FusedForm::Tiled { rows: 1 });
        let pinned = caps(true, None).with_forms(FusedForm::Subgroup { rows: 2 });
        assert!(Config::new(&small, &pinned).is_err());
    }
}
