//! The backward kernels (FlashAttention-2): `shaders/bwd_prep.wgsl` (the row statistics
//! logsumexp and `D = rowsum(dO ∘ O)`), `bwd_dkv.wgsl` (dK and dV, key-major), `bwd_dq.wgsl`
//! (dQ, query-major), `bwd_dbias.wgsl` (the bias gradient in the bias's own shape) and, for the
//! unfused path, `bwd_ds.wgsl` (P, dS and their transposes over a chunk of materialised
//! scores). Every kernel binds at most 8 storage buffers: the key lengths ride in the
//! statistics buffer, and dK and dV share one f32 output.

use super::access::{array, row_base, row_loader, row_storer, Access, Dim};
use super::consts::Prelude;
use super::{common, dispatch, grid_1d, mask_flags, params_of, Binding, KernelSpec, Masks, TensorViews};
use crate::device::context::Context;
use crate::error::Result;
use crate::forms::{BackwardForm, Caps};
use crate::problem::Problem;
use crate::storage::{Formats, Storage};
use crate::view::Views;

/// The backward's shared snippet (`shaders/common/backward.wgsl`).
const BACKWARD: &str = include_str!("../../shaders/common/backward.wgsl");
/// What its matrix-unit kernels share (`shaders/common/coop_backward.wgsl`).
const COOP_BACKWARD: &str = include_str!("../../shaders/common/coop_backward.wgsl");

/// The shared snippets of the gradient kernels that recompute attention (the masks, the head
/// mapping and query tiles, the backward's helpers).
const GRAD_COMMON: &[&str] = &[common::SOFTMAX, common::MASKS, common::HEADS, BACKWARD];

/// [`GRAD_COMMON`] and the matrix units' staging.
const COOP_GRAD_COMMON: &[&str] = &[
    common::SOFTMAX,
    common::MASKS,
    common::HEADS,
    BACKWARD,
    COOP_BACKWARD,
];

/// mask, bias, q, k, v, dout, stats (read), one output (read_write), params.
const GRAD_BINDINGS: &[Binding] = &[
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::ReadWrite,
    Binding::Params,
];

pub(crate) const PREP: KernelSpec = KernelSpec {
    name: "bwd_prep",
    source: include_str!("../../shaders/bwd_prep.wgsl"),
    common: &[],
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::Params,
    ],
    params: params_of::<Params>,
    trusted: true,
};

pub(crate) const DQ: KernelSpec = KernelSpec {
    name: "bwd_dq",
    source: include_str!("../../shaders/bwd_dq.wgsl"),
    common: GRAD_COMMON,
    bindings: GRAD_BINDINGS,
    params: params_of::<Params>,
    trusted: true,
};

pub(crate) const DKV: KernelSpec = KernelSpec {
    name: "bwd_dkv",
    source: include_str!("../../shaders/bwd_dkv.wgsl"),
    common: GRAD_COMMON,
    bindings: GRAD_BINDINGS,
    params: params_of::<Params>,
    trusted: true,
};

pub(crate) const DBIAS: KernelSpec = KernelSpec {
    name: "bwd_dbias",
    source: include_str!("../../shaders/bwd_dbias.wgsl"),
    common: GRAD_COMMON,
    bindings: GRAD_BINDINGS,
    params: params_of::<Params>,
    trusted: false,
};

/// The captures' gradients, per workgroup slice (`shaders/bwd_dcap.wgsl`).
pub(crate) const DCAP: KernelSpec = KernelSpec {
    name: "bwd_dcap",
    source: include_str!("../../shaders/bwd_dcap.wgsl"),
    common: GRAD_COMMON,
    bindings: GRAD_BINDINGS,
    params: params_of::<Params>,
    trusted: false,
};

/// The captures' gradients, the slices summed in order (`shaders/bwd_dcap_sum.wgsl`).
pub(crate) const DCAP_SUM: KernelSpec = KernelSpec {
    name: "bwd_dcap_sum",
    source: include_str!("../../shaders/bwd_dcap_sum.wgsl"),
    common: &[],
    bindings: &[Binding::Read, Binding::ReadWrite, Binding::Params],
    params: params_of::<Params>,
    trusted: false,
};

// bwd_dcap.wgsl's record arrays hold 64 invocations' calls.
const _: () = assert!(crate::user_mod::MAX_DCAPTURE_CALLS * 64 == 512);

/// d(sink logits): one workgroup per query head (`shaders/bwd_dsink.wgsl`).
pub(crate) const DSINK: KernelSpec = KernelSpec {
    name: "bwd_dsink",
    source: include_str!("../../shaders/bwd_dsink.wgsl"),
    common: &[common::SOFTMAX],
    bindings: &[Binding::Read, Binding::ReadWrite, Binding::Params],
    params: params_of::<Params>,
    trusted: false,
};

pub(crate) const DS: KernelSpec = KernelSpec {
    name: "bwd_ds",
    source: include_str!("../../shaders/bwd_ds.wgsl"),
    common: GRAD_COMMON,
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::ReadWrite,
        Binding::ReadWrite,
        Binding::Read,
        Binding::Params,
    ],
    params: params_of::<Params>,
    trusted: false,
};

/// dQ on the matrix units (`shaders/bwd_dq_coop.wgsl`).
pub(crate) const DQ_COOP: KernelSpec = KernelSpec {
    name: "bwd_dq_coop",
    source: include_str!("../../shaders/bwd_dq_coop.wgsl"),
    common: COOP_GRAD_COMMON,
    bindings: GRAD_BINDINGS,
    params: params_of::<Params>,
    trusted: true,
};

/// dK and dV on the matrix units (`shaders/bwd_dkv_coop.wgsl`).
pub(crate) const DKV_COOP: KernelSpec = KernelSpec {
    name: "bwd_dkv_coop",
    source: include_str!("../../shaders/bwd_dkv_coop.wgsl"),
    common: COOP_GRAD_COMMON,
    bindings: GRAD_BINDINGS,
    params: params_of::<Params>,
    trusted: true,
};

wgsl_struct! {
    /// The backward kernels' params (`p` in `bwd_*.wgsl`); each kernel reads the fields it needs.
    pub(crate) struct Params {
        m: Masks,
        x: TensorViews,
        batch: u32,
        l: u32,
        s: u32,
        e: u32,
        ev: u32,
        heads: u32,
        group: u32,
        /// Query tiles (dQ) or key tiles (dK, dV) per head.
        tiles: u32,
        /// Workgroups (dQ, dK/dV) or invocations (prep, dbias, ds).
        total: u32,
        scale: f32,
        /// Score rows `B·Hq·L` (the statistics' stride).
        rows: u32,
        /// Element offset of the key lengths in the statistics.
        lens_off: u32,
        /// Element offset of dV in the dK/dV output.
        dv_off: u32,
        /// The bias's broadcast shape (dbias).
        db_b: u32,
        db_h: u32,
        db_l: u32,
        db_s: u32,
        /// The unfused chunk (ds): first batch-head, first row, rows, group width.
        z0: u32,
        i0: u32,
        lc: u32,
        gw: u32,
        /// The captures' elements, all of them (dcap).
        cap_len: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

impl Params {
    /// The sizes of `p`, dV at element `dv_off` of the f32 dK/dV buffer (tiles, totals and
    /// chunks set by [`Params::over`], [`Params::tiled`], [`Params::chunk`]).
    pub(crate) fn new(p: &Problem, mask_strides: Option<[u32; 3]>, dv_off: usize) -> Params {
        let rows = (p.batch_heads() * p.seq_q) as u32;
        let [db_b, db_h, db_l, db_s] = p.bias.map_or([1; 4], |b| b.shape);
        Params {
            m: Masks::new(p, mask_strides),
            x: TensorViews::new(p),
            batch: p.batch as u32,
            l: p.seq_q as u32,
            s: p.seq_kv as u32,
            e: p.head_dim as u32,
            ev: p.head_dim_v as u32,
            heads: p.q_heads as u32,
            group: p.group() as u32,
            scale: p.scale,
            rows,
            lens_off: 2 * rows,
            db_b: db_b as u32,
            db_h: db_h as u32,
            db_l: db_l as u32,
            db_s: db_s as u32,
            gw: 1,
            cap_len: p.capture_len() as u32,
            dv_off: dv_off as u32,
            ..Default::default()
        }
    }

    /// These params reading the mask_mod block map from word `word` of binding 0.
    pub(crate) fn with_mod_map(self, word: usize, heads: usize) -> Params {
        Params {
            m: self.m.with_mod_map(word, heads),
            ..self
        }
    }

    /// These params over `total` invocations (one per row or element).
    pub(crate) fn over(self, total: usize) -> Params {
        Params {
            total: total as u32,
            ..self
        }
    }

    /// The fused kernels': `total` workgroups over `tiles` tiles per head.
    pub(crate) fn tiled(self, tiles: usize, total: usize) -> Params {
        Params {
            tiles: tiles as u32,
            total: total as u32,
            ..self
        }
    }

    /// One chunk of the unfused backward's scores (`bwd_ds`): rows `i0 .. i0 + lc` of heads
    /// from `z0`, transposed by groups of `gw` heads, `total` scores.
    pub(crate) fn chunk(self, [z0, i0, lc, gw]: [usize; 4], total: usize) -> Params {
        Params {
            total: total as u32,
            z0: z0 as u32,
            i0: i0 as u32,
            lc: lc as u32,
            gw: gw as u32,
            ..self
        }
    }
}

/// The fused backward's specialisation for a problem on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Config {
    pub form: BackwardForm,
    pub e4: u32,
    pub ev4: u32,
    /// Invocations per workgroup.
    pub wg: u32,
    /// Query rows per invocation (dQ).
    pub rq: u32,
    /// Keys per invocation (dK, dV).
    pub rk: u32,
    /// Keys per tile staged by the dQ kernel.
    pub bk: u32,
    /// Query rows per tile staged by the dK/dV kernel.
    pub bq: u32,
    pub unroll: bool,
    /// Also the loops over the head dims ([`unroll_dims`](super::unroll_dims)).
    pub unroll_e: bool,
    /// The dQ kernel's K/V tile and the dK/dV kernel's query tile live in registers, one row
    /// per invocation, shared by subgroup shuffles (`bk == bq == wg`, the workgroup is one
    /// subgroup); else they are staged in workgroup memory.
    pub sg: bool,
    pub vec4: bool,
    /// The inputs read through views.
    pub views: Views,
    /// E is odd (half dQ stores are then element by element, by atomics).
    pub e_odd: bool,
    pub formats: Formats,
    pub has_mask: bool,
    pub has_bias: bool,
    pub mods: super::Mods,
    /// The matrix units' tiles ([`BackwardForm::Coop`]).
    pub coop: Option<CoopLayout>,
    /// The device's tuning knobs (what the preludes read of them).
    pub tuning: crate::forms::Tuning,
}

/// The matrix units' backward: its tile, the head dims padded to it, and the blocks of each
/// kernel (multiples of the tile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CoopLayout {
    pub tile: u32,
    pub ep: u32,
    pub evp: u32,
    /// dK/dV: keys per workgroup, query rows per streamed tile.
    pub dkv: [u32; 2],
    /// dQ: query rows per workgroup, keys per streamed tile.
    pub dq: [u32; 2],
}

impl CoopLayout {
    /// The dK/dV kernel's workgroup memory with `bk` keys and query tiles of `bq` rows: K, V
    /// (f16) and their f32 accumulators, Q and dO (f16), S and dP (f32), P and dS (f16), the
    /// rows' statistics.
    fn dkv_bytes(&self, [bk, bq]: [u32; 2]) -> u32 {
        let (e, ev) = (self.ep, self.evp);
        bk * (e + ev) * 6 + bq * (e + ev) * 2 + bq * bk * 12 + bq * 12
    }

    /// The dQ kernel's with `bq` query rows and key tiles of `bk`: Q, dO (f16) and the f32
    /// dQ accumulator, K and V (f16), S and dP (f32), dS (f16), the rows' statistics.
    fn dq_bytes(&self, [bq, bk]: [u32; 2]) -> u32 {
        let (e, ev) = (self.ep, self.evp);
        bq * (e + ev) * 2 + bq * e * 4 + bk * (e + ev) * 2 + bq * bk * 10 + bq * 12 + 8
    }
}

/// The form the plan picks: on GPUs [`BackwardForm::Gpu`]; on CPU adapters several rows (keys)
/// per invocation in registers, unrolled, with a fixed subgroup the other operand by shuffles
/// (measured on lavapipe, a_h8_s1024: 1 row 1242 ms, 4 rows 408 ms, 4 rows with shuffles
/// 202 ms; the forward 52 ms). Problems under the forward's threshold (`flash::cpu_large`) take
/// one row, as the forward does: LLVM compiles the several-row kernels for seconds, more than
/// such a problem runs (the cold CI's backward grid: 409 s, mostly compiling).
fn default_form(p: &Problem, caps: &Caps) -> BackwardForm {
    let f = p.storage;
    if [f.q, f.k, f.v, f.out] == [Storage::F16; 4] && caps.coop_by_default() {
        if let Some(t) = caps.coop.largest() {
            if Config::coop(p, caps, Some(t)).is_ok() {
                return BackwardForm::Coop { tile: Some(t) };
            }
        }
    }
    if !caps.cpu {
        return BackwardForm::Gpu;
    }
    let (e4, ev4) = (p.head_dim.div_ceil(4) as u32, p.head_dim_v.div_ceil(4) as u32);
    let rows = if super::flash::cpu_large(p) {
        (64 / e4.max(ev4)).clamp(1, 4)
    } else {
        1
    };
    match caps.fused_subgroup() {
        Some(_) => BackwardForm::Subgroup { rows },
        None => BackwardForm::Tiled { rows },
    }
}

/// The dK/dV kernel's access to row `ii` of its query tile: by subgroup shuffle from the
/// invocation holding it, or from workgroup memory.
const Q_SUBGROUP: &str = "\
fn q_at(ii: u32, d4: u32) -> vec4<f32> { return subgroupShuffle(q_reg[d4], ii); }
fn do_at(ii: u32, d4: u32) -> vec4<f32> { return subgroupShuffle(do_reg[d4], ii); }
fn stat_at(ii: u32) -> vec3<f32> { return subgroupShuffle(stat_reg, ii); }
";
const Q_SHARED: &str = "\
fn q_at(ii: u32, d4: u32) -> vec4<f32> { return q_tile[ii * E4 + d4]; }
fn do_at(ii: u32, d4: u32) -> vec4<f32> { return do_tile[ii * EV4 + d4]; }
fn stat_at(ii: u32) -> vec3<f32> { return vec3<f32>(lse_tile[ii], dsum_tile[ii], bitcast<f32>(end_tile[ii])); }
";

/// Workgroup memory the kernels may use (WebGPU's default).
const WG_MEMORY: u32 = 16 * 1024;

impl Config {
    /// The configuration of the pinned form (`caps.forms.backward`) or the default one
    /// ([`BackwardForm`] describes each), or why the fused backward cannot run `p` there.
    pub(crate) fn new(p: &Problem, caps: &Caps) -> std::result::Result<Config, String> {
        super::flash::check_head_dims(p)?;
        let (e4, ev4) = (p.head_dim.div_ceil(4) as u32, p.head_dim_v.div_ceil(4) as u32);
        let form = caps.forms.backward.unwrap_or_else(|| default_form(p, caps));
        if let BackwardForm::Coop { tile } = form {
            return Config::coop(p, caps, tile);
        }
        let (wg, rows, unroll, sg) = match form {
            BackwardForm::Gpu => (
                caps.tuning.bwd_wg.unwrap_or(64),
                caps.tuning.bwd_rows.unwrap_or(1),
                // Measured on an H100 (scripts/gpu_sweep.sh, c_h8_s4096_causal): unrolled 13.6 ms,
                // loops as written 42 ms (their register arrays go to local memory); 2 rows per
                // invocation spill (5.3 ms against 1.7 ms at a_h8_s1024).
                caps.tuning.bwd_unroll.is_none_or(|u| u != 0),
                None,
            ),
            BackwardForm::Subgroup { rows } => {
                let s = caps.fused_subgroup_for(&form.name())?;
                (s, rows, true, Some(s))
            }
            BackwardForm::Tiled { rows } => (8, rows, true, None),
            BackwardForm::Coop { .. } => unreachable!("configured by Config::coop"),
        };
        if !(1..=8).contains(&rows) || caps.max_invocations < wg || caps.max_workgroup_size_x < wg {
            return Err(format!(
                "the {} form needs {wg} invocations per workgroup and 1 to 8 rows",
                form.name()
            ));
        }
        let wg_memory = match form {
            BackwardForm::Gpu => caps.tuning.wg_memory.unwrap_or(super::flash::GPU_WG_MEMORY),
            _ => WG_MEMORY,
        };
        let budget = wg_memory.min(caps.workgroup_storage).saturating_sub(16);
        let tiles: &[u32] = if wg_memory > WG_MEMORY {
            &[128, 64, 32, 16, 8, 4]
        } else {
            &[64, 32, 16, 8, 4]
        };
        let fit = |per_row: u32| tiles.iter().copied().find(|&t| t * per_row <= budget);
        let (bk, bq) = match sg {
            Some(s) => (s, s),
            None => (
                fit((e4 + ev4) * 16).ok_or("its K/V tile does not fit workgroup memory")?,
                fit((e4 + ev4) * 16 + 12).ok_or("its Q/dO tile does not fit workgroup memory")?,
            ),
        };
        Ok(Config {
            form,
            e4,
            ev4,
            wg,
            rq: rows,
            rk: rows,
            bk,
            bq,
            unroll,
            unroll_e: super::unroll_dims(p, caps),
            sg: sg.is_some(),
            vec4: p.vec4_rows(),
            views: p.views,
            e_odd: p.head_dim % 2 == 1,
            formats: p.storage,
            has_mask: p.mask.is_some(),
            has_bias: p.bias.is_some(),
            mods: super::Mods::of(p, &caps.tuning),
            tuning: caps.tuning,
            coop: None,
        })
    }

    /// The matrix units' configuration: the largest blocks (multiples of the tile) of each
    /// kernel that fit the workgroup memory, or why it cannot take `p`: no listed tile, bf16
    /// inputs or upstream gradient (f16 has not their range), a half dQ stored element by
    /// element (odd E: by atomics, which naga's SPIR-V under the Vulkan memory model lacks a
    /// capability for), head dims too large for the workgroup memory.
    fn coop(p: &Problem, caps: &Caps, tile: Option<u32>) -> std::result::Result<Config, String> {
        let t = caps.coop_tile(tile)?;
        let s = p.storage;
        crate::forms::coop_takes("coop backward", &[s.q, s.k, s.v, s.out])?;
        let vec4 = p.vec4_rows();
        if s.q.is_half() && !vec4 && p.head_dim % 2 == 1 {
            return Err(
                "the coop backward cannot store a half-format dQ of odd E (element by element)".into(),
            );
        }
        let (e4, ev4) = (p.head_dim.div_ceil(4) as u32, p.head_dim_v.div_ceil(4) as u32);
        let mut layout = CoopLayout {
            tile: t,
            ep: (4 * e4).next_multiple_of(t),
            evp: (4 * ev4).next_multiple_of(t),
            dkv: [t, t],
            dq: [t, t],
        };
        let wg = caps.coop_workgroup();
        // The mask_mod votes (one word per invocation) beside the blocks.
        let budget = caps.workgroup_storage.saturating_sub(4 * wg + 64);
        let blocks = [(4, 4), (4, 2), (2, 4), (2, 2), (2, 1), (1, 2), (1, 1)].map(|(a, b)| [a * t, b * t]);
        let too_big = || {
            format!(
                "the coop backward's tiles for E = {}, Ev = {} do not fit {} bytes of workgroup memory",
                p.head_dim, p.head_dim_v, caps.workgroup_storage
            )
        };
        layout.dkv = blocks
            .into_iter()
            .find(|&b| layout.dkv_bytes(b) <= budget)
            .ok_or_else(too_big)?;
        layout.dq = blocks
            .into_iter()
            .find(|&b| layout.dq_bytes(b) <= budget)
            .ok_or_else(too_big)?;
        Ok(Config {
            form: BackwardForm::Coop { tile: Some(t) },
            e4,
            ev4,
            wg,
            rq: 1,
            rk: 1,
            bk: layout.dq[1],
            bq: layout.dkv[1],
            unroll: false,
            unroll_e: false,
            sg: false,
            vec4,
            views: p.views,
            e_odd: p.head_dim % 2 == 1,
            formats: p.storage,
            has_mask: p.mask.is_some(),
            has_bias: p.bias.is_some(),
            mods: super::Mods::of(p, &caps.tuning),
            tuning: caps.tuning,
            coop: Some(layout),
        })
    }

    /// Keys per workgroup of the dK/dV kernel.
    pub(crate) fn key_tile(&self) -> u32 {
        self.coop.map_or(self.wg * self.rk, |c| c.dkv[0])
    }

    /// Query rows per workgroup of the dQ kernel.
    pub(crate) fn query_tile(&self) -> u32 {
        self.coop.map_or(self.wg * self.rq, |c| c.dq[0])
    }

    /// The dQ kernel of this form.
    pub(crate) fn dq_spec(&self) -> &'static KernelSpec {
        match self.coop {
            Some(_) => &DQ_COOP,
            None => &DQ,
        }
    }

    /// The dK/dV kernel of this form.
    pub(crate) fn dkv_spec(&self) -> &'static KernelSpec {
        match self.coop {
            Some(_) => &DKV_COOP,
            None => &DKV,
        }
    }

    /// The matrix units' constants (`[rows, keys]` blocks) and the q, k, v, dout loaders.
    fn coop_prelude(&self, c: &CoopLayout, [bq, bk]: [u32; 2]) -> Prelude {
        super::matmul::coop_prelude(c.tile, self.wg)
            .consts(&super::flash::CoopConsts {
                E4: self.e4,
                EV4: self.ev4,
                BQ: bq,
                BK: bk,
                EP: c.ep,
                EVP: c.evp,
                UNROLL: false,
                UNROLL_E: false,
                SCALAR_LOGITS: false,
            })
            .then(self.io())
    }

    /// q, k, v, dout with the masks, as this configuration reads them.
    fn io(&self) -> Prelude {
        grad_io(
            &self.formats,
            (self.has_mask, self.has_bias, self.mods.clone()),
            self.vec4,
            &self.views,
        )
    }

    /// The constants and the q, k, v, dout loaders of the dQ and dK/dV kernels.
    fn common_prelude(&self) -> Prelude {
        Prelude::new()
            .consts(&CommonConsts {
                E4: self.e4,
                EV4: self.ev4,
                WG: self.wg,
                UNROLL: self.unroll,
                UNROLL_E: self.unroll_e,
                SCALAR_LOGITS: super::scalar_logits(self.form == BackwardForm::Gpu, &self.tuning),
            })
            .then(self.io())
    }

    /// The dQ kernel's prelude; dq is stored in q's format.
    pub(crate) fn dq_prelude(&self) -> Prelude {
        let fq = self.formats.q;
        let odd = fq.is_half() && !self.vec4 && self.e_odd;
        let access = if odd { Access::Atomic } else { Access::Write };
        let dq = array("dq", 7, fq, self.vec4, access)
            + &row_base("dq", Dim::E, self.vec4, None, "")
            + &row_storer("dq", "dq", Dim::E, self.vec4, fq.is_half() && !odd);
        if let Some(c) = &self.coop {
            return self.coop_prelude(c, c.dq).code(&dq);
        }
        let kv = if self.sg {
            super::flash::KV_SUBGROUP
        } else {
            super::flash::KV_SHARED
        };
        self.common_prelude()
            .consts(&DqConsts {
                BK: self.bk,
                RQ: self.rq,
                SG_KV: self.sg,
            })
            .code(kv)
            .code(&dq)
    }

    /// The dK/dV kernel's prelude; both go to one f32 buffer, dV at `p.dv_off`.
    pub(crate) fn dkv_prelude(&self) -> Prelude {
        let out = array("dkv", 7, Storage::F32, self.vec4, Access::Write)
            + &row_base("dk", Dim::E, self.vec4, None, "")
            + &row_storer("dk", "dkv", Dim::E, self.vec4, false)
            + &row_base("dv", Dim::EV, self.vec4, None, "p.dv_off + ")
            + &row_storer("dv", "dkv", Dim::EV, self.vec4, false);
        if let Some(c) = &self.coop {
            let [bk, bq] = c.dkv;
            return self.coop_prelude(c, [bq, bk]).code(&out);
        }
        self.common_prelude()
            .consts(&DkvConsts {
                BQ: self.bq,
                QT: if self.sg { 1 } else { self.bq },
                RK: self.rk,
                SG_Q: self.sg,
            })
            .code(if self.sg { Q_SUBGROUP } else { Q_SHARED })
            .code(&out)
    }
}

wgsl_consts! {
    /// What the fused backward's dQ and dK/dV kernels share: head dims in vec4s, `WG`
    /// invocations, whether loops are unrolled and how logits are summed.
    pub(crate) struct CommonConsts {
        E4: u32,
        EV4: u32,
        WG: u32,
        UNROLL: bool,
        UNROLL_E: bool,
        SCALAR_LOGITS: bool,
    }
}

wgsl_consts! {
    /// The dQ kernel (`shaders/bwd_dq.wgsl`): `BK` keys per tile, `RQ` rows per invocation,
    /// keys shared through the subgroup (`SG_KV`) or workgroup memory.
    pub(crate) struct DqConsts {
        BK: u32,
        RQ: u32,
        SG_KV: bool,
    }
}

wgsl_consts! {
    /// The dK/dV kernel (`shaders/bwd_dkv.wgsl`): `BQ` queries per tile (`QT` staged), `RK`
    /// keys per invocation, queries shared through the subgroup (`SG_Q`) or workgroup memory.
    pub(crate) struct DkvConsts {
        BQ: u32,
        QT: u32,
        RK: u32,
        SG_Q: bool,
    }
}

wgsl_consts! {
    /// The capture-gradient kernel's bound on a user function's capture calls.
    pub(crate) struct DcapConsts {
        CALLS: u32,
    }
}

/// The mask flags, the bias, and q, k, v, dout (bindings 2-5) in their formats (`out`: dout's)
/// with `load_q`, `load_k`, `load_v`, `load_dout(row, c4)` and their `X_base(row)` (dense, or
/// through the `views`).
fn grad_io(f: &Formats, masks: (bool, bool, super::Mods), vec4: bool, views: &Views) -> Prelude {
    let (has_mask, has_bias, mods) = masks;
    let mut s = String::new();
    for (i, (x, fmt, dim, view, slot)) in [
        ("q", f.q, Dim::E, views.q, "q"),
        ("k", f.k, Dim::E, views.k, "k"),
        ("v", f.v, Dim::EV, views.v, "v"),
        ("dout", f.out, Dim::EV, views.dout, "g"),
    ]
    .into_iter()
    .enumerate()
    {
        s += &array(x, 2 + i as u32, fmt, vec4, Access::Read);
        s += &row_base(x, dim, vec4, view.map(|_| slot), "");
        s += &row_loader(x, dim, vec4);
        if x == "k" || x == "v" {
            s += &super::access::key_row_loaders(x, dim, vec4, false, false);
        }
    }
    mask_flags(has_mask, has_bias, mods, f.bias).code(&s).tag(format!(
        "q={} k={} v={} dout={}{}{}",
        f.q,
        f.k,
        f.v,
        f.out,
        if vec4 { " vec4" } else { "" },
        super::access::viewed(&[
            ("q", views.q),
            ("k", views.k),
            ("v", views.v),
            ("dout", views.dout)
        ]),
    ))
}

/// The dbias kernel's prelude (any head dims): scalar q, k, v, dout; dbias in the bias's format.
pub(crate) fn dbias_prelude(p: &Problem, tuning: &crate::forms::Tuning) -> Prelude {
    let f = &p.storage;
    let access = if f.bias.is_half() {
        Access::Atomic
    } else {
        Access::Write
    };
    grad_io(
        f,
        (p.mask.is_some(), true, super::Mods::of(p, tuning)),
        false,
        &p.views,
    )
    .code(&array("dbias", 7, f.bias, false, access))
}

/// The capture-gradient kernel's prelude: scalar q, k, v, dout, the calls' bound and the
/// user's `score_mod_dcapture` with its accumulators (None: the source has none).
pub(crate) fn dcap_prelude(p: &Problem, tuning: &crate::forms::Tuning) -> Option<Prelude> {
    let user = p.user_fns.as_ref()?;
    let dcap = user.code.dcapture.clone()?;
    Some(
        grad_io(
            &p.storage,
            (p.mask.is_some(), p.bias.is_some(), super::Mods::of(p, tuning)),
            false,
            &p.views,
        )
        .consts(&DcapConsts {
            CALLS: crate::user_mod::MAX_DCAPTURE_CALLS as u32,
        })
        .code(&dcap),
    )
}

/// The prep kernel's prelude: o and dout (bindings 0, 1) in their formats, with `o_base` and
/// `dout_base` (dense, or through the `views`).
pub(crate) fn prep_prelude(o: Storage, dout: Storage, views: &Views) -> Prelude {
    Prelude::from(
        array("o", 0, o, false, Access::Read)
            + &array("dout", 1, dout, false, Access::Read)
            + &row_base("o", Dim::EV, false, views.out.map(|_| "o"), "")
            + &row_base("dout", Dim::EV, false, views.dout.map(|_| "g"), ""),
    )
    .tag(format!(
        "o={o} dout={dout}{}",
        super::access::viewed(&[("o", views.out), ("dout", views.dout)])
    ))
}

/// The ds kernel's prelude.
pub(crate) fn ds_prelude(has_mask: bool, has_bias: bool, mods: super::Mods, bias: Storage) -> Prelude {
    mask_flags(has_mask, has_bias, mods, bias)
}

/// Record one dispatch of a gradient kernel over `workgroups` workgroups.
#[allow(clippy::too_many_arguments)] // each argument is a distinct part of one dispatch
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    spec: &KernelSpec,
    prelude: &Prelude,
    buffers: &[wgpu::BufferBinding<'_>],
    params: &Params,
    workgroups: u32,
    checks: super::Checks,
) -> Result<()> {
    let grid = grid_1d(workgroups, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        spec,
        prelude,
        &[],
        buffers,
        bytemuck::bytes_of(params),
        grid,
        checks,
    )
}
