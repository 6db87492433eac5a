//! `shaders/decode.wgsl`: split-K attention for few query rows and long key sequences. The
//! keys are split so that there are hundreds of workgroups even for one query row; each split
//! writes a normalised partial output and logsumexp, and the merge kernel
//! ([`super::merge`]) combines them by the logsumexp rule (also exposed as [`crate::merge`]). [`Config`] picks the
//! form ([`DecodeForm`]) and the split for the device.

use super::consts::Prelude;
use super::{common, dispatch, grid_1d, params_of, KernelSpec, Masks, TensorViews};
use crate::device::context::Context;
use crate::error::Result;
use crate::forms::{Caps, DecodeForm};
use crate::problem::Problem;

pub(crate) const DECODE: KernelSpec = KernelSpec {
    name: "decode",
    source: include_str!("../../shaders/decode.wgsl"),
    common: &[common::SOFTMAX, common::MASKS, common::HEADS],
    bindings: super::ATTENTION_BINDINGS,
    params: params_of::<Params>,
    trusted: false,
};

/// The decode kernel's GPU-tiled form (`DecodeForm::GpuTiles`): same params and bindings.
pub(crate) const DECODE_TILES: KernelSpec = KernelSpec {
    name: "decode_tiles",
    source: include_str!("../../shaders/decode_tiles.wgsl"),
    common: &[common::SOFTMAX, common::MASKS, common::HEADS],
    bindings: super::ATTENTION_BINDINGS,
    params: params_of::<Params>,
    trusted: false,
};

/// The accumulator reductions: through workgroup memory in blocks, or by subgroup operations.
const ACC_SHARED: &str = include_str!("../../shaders/decode_acc_shared.wgsl");
const ACC_SUBGROUP: &str = include_str!("../../shaders/decode_acc_subgroup.wgsl");

/// Query rows up to which [`crate::Path::Auto`] prefers the decode path (with a long `S`).
pub(crate) const MAX_ROWS: usize = 16;
/// Key length from which [`crate::Path::Auto`] prefers the decode path.
pub(crate) const MIN_KEYS: usize = 512;
/// Workgroups the split aims for: enough to fill a GPU with dozens of compute units.
const TARGET_WORKGROUPS: usize = 512;

wgsl_struct! {
    /// The decode kernel's params (`p` in `decode.wgsl`).
    pub(crate) struct Params {
        m: Masks,
        x: TensorViews,
        l: u32,
        s: u32,
        e: u32,
        ev: u32,
        heads: u32,
        group: u32,
        splits: u32,
        total: u32,
        scale: f32,
        /// Keys per split.
        chunk: u32,
        _pad0: u32,
        _pad1: u32,
    }
}

/// Workgroups the GPU-tiled form's split aims for: fewer, larger splits (H200, d_decode: 256
/// workgroups of 256 invocations 0.064 ms f32, 512 of 128 0.072 ms, 2048 0.11 ms;
/// docs/gpu/nvidia-h200.md).
const TILES_TARGET_WORKGROUPS: usize = 256;
/// The GPU-tiled form's invocations (same sweep).
const TILES_WG: u32 = 256;

/// Keys per split (a multiple of 64, at most 1024) and the number of splits, for `form`.
pub(crate) fn split(p: &Problem, form: DecodeForm, tuning: &crate::forms::Tuning) -> (usize, usize) {
    let rows = p.batch_heads() * p.seq_q;
    let default = match form {
        DecodeForm::GpuTiles => TILES_TARGET_WORKGROUPS,
        _ => TARGET_WORKGROUPS,
    };
    let target = tuning.decode_target.map_or(default, |t| t as usize);
    let want = target.div_ceil(rows).max(1);
    let chunk = p.seq_kv.div_ceil(want).next_multiple_of(64).clamp(64, 1024);
    (chunk, p.seq_kv.div_ceil(chunk))
}

/// Head dims (E and Ev) up to which the decode kernel's GPU form unrolls its loops over the
/// head dims; beyond, plain loops.
const UNROLL_MAX_DIM: usize = 256;

/// The decode kernel's form, workgroup and split for one problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Config {
    pub form: DecodeForm,
    /// Invocations per workgroup (a power of two).
    pub wg: u32,
    /// Keys per split and the number of splits.
    pub chunk: usize,
    pub splits: usize,
    unroll: bool,
    e4: usize,
    ev4: usize,
    formats: crate::storage::Formats,
    vec4: bool,
    ev_odd: bool,
    /// The tensors read through views (the output is written by the merge).
    views: crate::view::Views,
    /// An fp8 paged cache's kv heads and rows per head in a block ([`super::access::fp8_rows`]).
    fp8_rows: Option<(usize, usize)>,
    masks: bool,
    bias: bool,
    mods: super::Mods,
    /// Invocations per key in the GPU-tiled form's scores.
    kl: usize,
}

/// Invocations that score one key together in the GPU-tiled form (knob `decode_klanes`, a
/// power of two up to 16): halved until it divides the K row's 16-byte chunks and `wg`.
fn key_lanes(p: &Problem, wg: u32, tuning: &crate::forms::Tuning) -> usize {
    let e4 = p.head_dim.div_ceil(4);
    // Half formats with E a multiple of 8 read 8 elements per chunk (Config::p8); E4 / 2
    // chunks then, which KL must divide too.
    let chunks = if e4.is_multiple_of(2) { e4 / 2 } else { e4 };
    let mut kl = tuning
        .decode_klanes
        .map_or(KEY_LANES, |k| k as usize)
        .clamp(1, 16)
        .next_power_of_two();
    while kl > 1 && (!chunks.is_multiple_of(kl) || !(wg as usize).is_multiple_of(kl)) {
        kl /= 2;
    }
    kl
}

/// The GPU-tiled form's default invocations per key (H200, d_decode: 4 and 8 0.059-0.060 ms
/// f32 and 0.050-0.051 ms f16, 1 0.066 and 0.054 ms, 16 0.065 and 0.057-0.058 ms;
/// docs/gpu/nvidia-h200-decode-klanes.txt).
const KEY_LANES: usize = 4;

impl Config {
    /// The pinned form (`caps.forms.decode`) or the default one: the GPU form on GPUs; on CPU
    /// adapters one SIMD batch of 8 invocations (lavapipe), whose reductions are subgroup
    /// operations where the workgroup is one subgroup. Or why the form cannot run here.
    pub(crate) fn new(p: &Problem, caps: &Caps) -> std::result::Result<Config, String> {
        let form = caps
            .forms
            .decode
            .unwrap_or(match (caps.cpu, caps.decode_subgroup()) {
                (false, _) => DecodeForm::GpuTiles,
                (true, Some(8)) => DecodeForm::Subgroup,
                (true, _) => DecodeForm::Cpu,
            });
        // CPU adapters run the loops as written, the GPU forms too when pinned there: on
        // lavapipe at d_decode_h32_s4096_e128 the unrolled kernel took 2.6 s to compile (each
        // per-invocation load becomes a loop over the SIMD lanes) and ran in 41 ms; the looped
        // one compiles in 1.3 s and runs in 36 ms.
        let (wg, unroll) = match form {
            DecodeForm::Gpu => (
                caps.tuning.decode_wg.unwrap_or(64),
                !caps.cpu && p.head_dim.max(p.head_dim_v) <= UNROLL_MAX_DIM,
            ),
            // A power of two holding at least one V row's vec4s (EVP) in each of two subsets.
            DecodeForm::GpuTiles => (
                caps.tuning
                    .decode_wg
                    .unwrap_or(TILES_WG)
                    .max(2 * evp(p.head_dim_v.div_ceil(4)) as u32),
                !caps.cpu && p.head_dim.max(p.head_dim_v) <= UNROLL_MAX_DIM,
            ),
            DecodeForm::Cpu => (8, false),
            DecodeForm::Subgroup => (
                caps.decode_subgroup().ok_or_else(|| {
                    format!(
                        "the subgroup decode form needs a fixed subgroup size, a power of two up to 64 \
                         (device: {:?})",
                        caps.subgroup
                    )
                })?,
                false,
            ),
        };
        if caps.max_invocations < wg || caps.max_workgroup_size_x < wg {
            return Err(format!("the {} decode form needs {wg} invocations", form.name()));
        }
        let mut kl = 1;
        if form == DecodeForm::GpuTiles {
            // qs, sc, red_m, red_s, red_acc (decode_tiles.wgsl), vrow where paged, and scp
            // where KL > 1: KL is halved until the workgroup memory holds it (KL = 1 needs no
            // scp).
            let vrow = if p.views.paged.is_some() {
                4 * wg as usize
            } else {
                0
            };
            let base = 16 * p.head_dim.div_ceil(4) + 20 * wg as usize + 8 * wg as usize + vrow;
            kl = key_lanes(p, wg, &caps.tuning);
            while kl > 1 && base + 4 * wg as usize * kl > caps.workgroup_storage as usize {
                kl /= 2;
            }
            let bytes = base + if kl > 1 { 4 * wg as usize * kl } else { 0 };
            if bytes > caps.workgroup_storage as usize {
                return Err(format!(
                    "the gpu-tiles decode form needs {bytes} bytes of workgroup memory at E = {}",
                    p.head_dim
                ));
            }
        }
        let (chunk, splits) = split(p, form, &caps.tuning);
        Ok(Config {
            form,
            wg,
            chunk,
            splits,
            unroll,
            e4: p.head_dim.div_ceil(4),
            ev4: p.head_dim_v.div_ceil(4),
            formats: p.storage,
            vec4: p.vec4_rows(),
            views: p.views,
            fp8_rows: super::access::fp8_rows(p),
            ev_odd: p.head_dim_v % 2 == 1,
            masks: p.mask.is_some(),
            bias: p.bias.is_some(),
            mods: super::Mods::of(p, &caps.tuning),
            kl,
        })
    }

    /// K and V are read 8 elements per load (half formats with E and Ev multiples of 8: one
    /// 16-byte load instead of two 8-byte ones; CPU adapters pay per load, not per byte).
    fn p8(&self) -> bool {
        self.vec4
            && self.e4.is_multiple_of(2)
            && self.ev4.is_multiple_of(2)
            && [self.formats.k, self.formats.v]
                .iter()
                .any(|f| f.is_half() || f.is_quantized())
            && self.views.aligned(8)
    }

    /// The kernel this form runs.
    pub(crate) fn spec(&self) -> &'static KernelSpec {
        match self.form {
            DecodeForm::GpuTiles => &DECODE_TILES,
            _ => &DECODE,
        }
    }

    /// The kernel's constants, reductions and I/O snippet.
    pub(crate) fn prelude(&self) -> Prelude {
        let masks = super::mask_consts(self.masks, self.bias, self.mods.clone(), self.formats.bias);
        let (wg, e4, ev4) = (self.wg, self.e4 as u32, self.ev4 as u32);
        if self.form == DecodeForm::GpuTiles {
            let evp = evp(self.ev4) as u32;
            let ns = wg / evp;
            let kl = self.kl as u32;
            let paged = self.views.paged.is_some();
            return Prelude::new()
                .consts(&TilesConsts {
                    WG: wg,
                    E4: e4,
                    EV4: ev4,
                    EVP: evp,
                    NS: ns,
                    KPS: wg / ns,
                    P8: self.p8(),
                    E8: e4 / 2,
                    UNROLL: self.unroll,
                    KL: kl,
                    SCP: if kl > 1 { wg * kl } else { 1 },
                    KC8: e4 / 2 / kl,
                    KC4: e4 / kl,
                    PAGED: paged,
                    VR: if paged { wg } else { 1 },
                })
                .then(masks)
                .then(self.io());
        }
        let reductions = if self.form == DecodeForm::Subgroup {
            [common::REDUCE_SUBGROUP, ACC_SUBGROUP]
        } else {
            [common::REDUCE_SHARED, ACC_SHARED]
        };
        // The shared accumulator reduction sums RB vec4s per tree (a divisor of EV4, at most 8).
        let rb = [8, 4, 2, 1]
            .into_iter()
            .find(|r| ev4.is_multiple_of(*r))
            .unwrap_or(1);
        Prelude::new()
            .consts(&SplitConsts {
                WG: wg,
                E4: e4,
                EV4: ev4,
                RB: rb,
                P8: self.p8(),
                E8: e4 / 2,
                EV8: ev4 / 2,
                NRB: ev4 / rb,
                UNROLL: self.unroll,
            })
            .then(masks)
            .then(self.io())
            .code(reductions[0])
            .code(reductions[1])
            .tag(if self.form == DecodeForm::Subgroup {
                "subgroup-sums"
            } else {
                "shared-sums"
            })
    }

    /// The I/O snippet. The partial outputs are f32 scratch; the merge writes the output's
    /// format.
    fn io(&self) -> Prelude {
        super::access::attention_io(
            &self.formats,
            crate::storage::Storage::F32,
            self.vec4,
            self.ev_odd,
            self.p8(),
            &crate::view::Views {
                out: None,
                ..self.views
            },
            (4 * self.e4, 4 * self.ev4),
            self.fp8_rows,
        )
    }
}

wgsl_consts! {
    /// The split pass's shared and subgroup forms (`shaders/decode.wgsl`): `WG` invocations,
    /// head dims in vec4s (`E8`, `EV8`: in pairs of them, read as 8 elements where `P8`), the
    /// accumulator reduced `RB` vec4s per tree over `NRB` trees.
    pub(crate) struct SplitConsts {
        WG: u32,
        E4: u32,
        EV4: u32,
        RB: u32,
        P8: bool,
        E8: u32,
        EV8: u32,
        NRB: u32,
        UNROLL: bool,
    }
}

wgsl_consts! {
    /// The split pass's GPU-tiled form (`shaders/decode_tiles.wgsl`): `NS` key slots of `KPS`
    /// invocations, `EVP` invocations per V row, `KL` lanes per key (`SCP`, `KC8`, `KC4` derived),
    /// paged caches read `VR` rows at a time.
    pub(crate) struct TilesConsts {
        WG: u32,
        E4: u32,
        EV4: u32,
        EVP: u32,
        NS: u32,
        KPS: u32,
        P8: bool,
        E8: u32,
        UNROLL: bool,
        KL: u32,
        SCP: u32,
        KC8: u32,
        KC4: u32,
        PAGED: bool,
        VR: u32,
    }
}

/// EV4 rounded up to a power of two: the invocations of the GPU-tiled form that read one V row.
fn evp(ev4: usize) -> usize {
    ev4.next_power_of_two()
}

/// Record the split pass. `buffers`: mask, bias, kv_lens, q, k, v, part_out, part_lse, then
/// an 8-bit cache's scales.
pub(crate) fn record_decode(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    cfg: &Config,
    buffers: Vec<wgpu::BufferBinding<'_>>,
    params: &Params,
) -> Result<()> {
    let grid = grid_1d(params.total, ctx.limits().max_compute_workgroups_per_dimension);
    dispatch(
        ctx,
        encoder,
        cfg.spec(),
        &cfg.prelude(),
        &[],
        &buffers,
        bytemuck::bytes_of(params),
        grid,
        cfg.mods.checks(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_of_one_row_makes_hundreds_of_workgroups() {
        let p = Problem::new(&[1, 32, 1, 128], &[1, 32, 4096, 128], &[1, 32, 4096, 128]).unwrap();
        for form in DecodeForm::ALL {
            let (chunk, splits) = split(&p, form, &Default::default());
            assert_eq!(chunk * splits, 4096);
            assert!(splits * 32 >= 256, "{splits}");
        }
        let p = Problem::new(&[1, 1, 1, 8], &[1, 1, 100_000, 8], &[1, 1, 100_000, 8]).unwrap();
        let (chunk, splits) = split(&p, DecodeForm::Gpu, &Default::default());
        assert!(chunk <= 1024 && chunk * splits >= 100_000);
    }

    /// Where the scores' partial sums (scp) would not fit the workgroup memory, the tiled form
    /// takes fewer invocations per key rather than failing: E = 1536 under WebGPU's 16 KiB.
    #[test]
    fn key_lanes_shrink_to_fit_workgroup_memory() {
        let p = Problem::new(&[1, 4, 1, 1536], &[1, 4, 4096, 1536], &[1, 4, 4096, 64]).unwrap();
        let caps = Caps::new(&wgpu::Limits::default(), false, Some(32));
        let cfg = Config::new(&p, &caps).unwrap();
        assert_eq!((cfg.form, cfg.wg, cfg.kl), (DecodeForm::GpuTiles, 256, 2));
        let small = Problem::new(&[1, 4, 1, 128], &[1, 4, 4096, 128], &[1, 4, 4096, 128]).unwrap();
        assert_eq!(Config::new(&small, &caps).unwrap().kl, KEY_LANES);
    }

    #[test]
    fn decode_forms_by_device() {
        let p = Problem::new(&[1, 32, 1, 128], &[1, 32, 4096, 128], &[1, 32, 4096, 128]).unwrap();
        let caps = |cpu, sg| Caps::new(&wgpu::Limits::default(), cpu, sg);
        assert_eq!(
            Config::new(&p, &caps(false, Some(32))).unwrap().form,
            DecodeForm::GpuTiles
        );
        assert_eq!(
            Config::new(&p, &caps(true, Some(8))).unwrap().form,
            DecodeForm::Subgroup
        );
        assert_eq!(Config::new(&p, &caps(true, None)).unwrap().form, DecodeForm::Cpu);
        let pinned = caps(true, None).with_forms(DecodeForm::Subgroup);
        assert!(Config::new(&p, &pinned).is_err());
    }
}
