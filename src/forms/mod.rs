//! The forms of the kernels: how a kernel lays its work out on a device. Each path's kernel has
//! several forms that compute the same thing (tests check every one against the reference);
//! [`Plan`](crate::Plan) picks one per call from the device's capabilities, or takes the one
//! pinned by [`Context::with_forms`](crate::Context::with_forms).

pub(crate) mod tune;

pub use tune::Tuning;

use crate::error::{Error, Result};

/// A form of the fused kernel (`shaders/flash.wgsl`).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedForm {
    /// Register tiles for GPUs (FlashAttention-2's forward built like a SIMT matmul): each
    /// invocation owns a 4 x 4 block of logits (4 query rows x 4 keys of the tile) and the
    /// output columns of its 4 rows that it accumulates, with Q, K, V and the weights staged in
    /// workgroup memory (up to 48 KiB). Twice the arithmetic per workgroup-memory load of
    /// [`FusedForm::Gpu`], a quarter of its registers. Head dims up to 128 where 48 KiB are
    /// available (`shaders/flash_tiles.wgsl`).
    GpuTiles,
    /// 128 invocations, one query row each, K/V tiles staged in up to 32 KiB of workgroup memory, loops
    /// unrolled. The form for GPUs.
    Gpu,
    /// One subgroup per workgroup, `rows` query rows per invocation; each invocation holds
    /// one key of the K/V tile in registers and the others read it by subgroup shuffles (no
    /// workgroup memory, no barriers); unrolled. CPU adapters with a fixed subgroup size of 4
    /// to 16 (lavapipe: 8).
    Subgroup {
        /// Query rows per invocation (1 to 16).
        rows: u32,
    },
    /// 8 invocations, `rows` rows each, K/V tiles in workgroup memory, unrolled. Large problems
    /// on CPU adapters without a fixed subgroup size.
    Tiled {
        /// Query rows per invocation (1 to 16).
        rows: u32,
    },
    /// 8 invocations, `rows` rows each, K/V tiles in workgroup memory, loops as written
    /// (quickest to compile). Small problems on CPU adapters without a fixed subgroup size.
    Loop {
        /// Query rows per invocation (1 to 16).
        rows: u32,
    },
    /// The matrix units (`shaders/flash_coop.wgsl`): `Q Kᵀ` and `P V` in cooperative-matrix
    /// tiles of `tile` x `tile` f16 operands with f32 accumulators, the softmax in f32
    /// scalar code, P rounded to f16 (as FlashAttention's f16 kernels do). Where the adapter
    /// lists a tile ([`CoopTiles`]); `None` takes the largest. The default for f16 q, k and v;
    /// f32 inputs only when pinned (rounded to f16); bf16 refused.
    Coop {
        /// The tile edge: 8, 16, or `None` for the largest the adapter lists.
        tile: Option<u32>,
    },
}

impl FusedForm {
    /// Query rows per invocation.
    pub fn rows(self) -> u32 {
        match self {
            FusedForm::Gpu | FusedForm::Coop { .. } => 1,
            FusedForm::GpuTiles => 4,
            FusedForm::Subgroup { rows } | FusedForm::Tiled { rows } | FusedForm::Loop { rows } => rows,
        }
    }

    /// The same form with `rows` query rows per invocation (the GPU form has one).
    pub fn with_rows(self, rows: u32) -> FusedForm {
        match self {
            FusedForm::Gpu => FusedForm::Gpu,
            FusedForm::GpuTiles => FusedForm::GpuTiles,
            FusedForm::Coop { tile } => FusedForm::Coop { tile },
            FusedForm::Subgroup { .. } => FusedForm::Subgroup { rows },
            FusedForm::Tiled { .. } => FusedForm::Tiled { rows },
            FusedForm::Loop { .. } => FusedForm::Loop { rows },
        }
    }

    /// Whether the form needs subgroup operations with a fixed subgroup size.
    pub fn needs_subgroups(self) -> bool {
        matches!(self, FusedForm::Subgroup { .. })
    }

    /// Whether the form runs on the matrix units.
    pub fn is_coop(self) -> bool {
        matches!(self, FusedForm::Coop { .. })
    }

    /// The name: `gpu`, `gpu-tiles`, `subgroup:R`, `tiled:R`, `loop:R` (R rows per
    /// invocation), `coop`, `coop:T` (T x T tiles).
    pub fn name(self) -> String {
        match self {
            FusedForm::Gpu => "gpu".into(),
            FusedForm::GpuTiles => "gpu-tiles".into(),
            FusedForm::Coop { tile: None } => "coop".into(),
            FusedForm::Coop { tile: Some(t) } => format!("coop:{t}"),
            FusedForm::Subgroup { rows } => format!("subgroup:{rows}"),
            FusedForm::Tiled { rows } => format!("tiled:{rows}"),
            FusedForm::Loop { rows } => format!("loop:{rows}"),
        }
    }
}

/// A form's name split into its kind and its rows per invocation (`kind:R`, R from 1 to
/// `max`), or None where R is not such a number.
fn split_rows(s: &str, max: u32) -> Option<(&str, Option<u32>)> {
    match s.split_once(':') {
        Some((kind, r)) => {
            let rows = r.parse::<u32>().ok().filter(|r| (1..=max).contains(r))?;
            Some((kind, Some(rows)))
        }
        None => Some((s, None)),
    }
}

impl std::str::FromStr for FusedForm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::UnknownName {
            kind: "fused kernel form",
            name: s.to_string(),
            expected: "gpu, gpu-tiles, subgroup:R, tiled:R, loop:R (R = rows per invocation, 1 to 16), coop, coop:8, coop:16",
        }
        };
        match s {
            "coop" => return Ok(FusedForm::Coop { tile: None }),
            "coop:8" => return Ok(FusedForm::Coop { tile: Some(8) }),
            "coop:16" => return Ok(FusedForm::Coop { tile: Some(16) }),
            _ => {}
        }
        let (kind, rows) = split_rows(s, 16).ok_or_else(bad)?;
        match (kind, rows) {
            ("gpu", None) => return Ok(FusedForm::Gpu),
            ("gpu-tiles", None) => return Ok(FusedForm::GpuTiles),
            ("gpu", Some(_)) | ("gpu-tiles", Some(_)) => return Err(bad()),
            _ => {}
        }
        let rows = rows.unwrap_or(1);
        match kind {
            "subgroup" => Ok(FusedForm::Subgroup { rows }),
            "tiled" => Ok(FusedForm::Tiled { rows }),
            "loop" => Ok(FusedForm::Loop { rows }),
            _ => Err(bad()),
        }
    }
}

/// A form of the decode kernel (`shaders/decode.wgsl`).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecodeForm {
    /// 64 invocations, each scoring and accumulating whole keys, loops over the head dims
    /// unrolled, reductions through workgroup memory.
    Gpu,
    /// Tiles of 128 keys (`shaders/decode_tiles.wgsl`): each invocation scores one key, then
    /// the workgroup reads each V row together (one coalesced load per key), one vec4 of
    /// accumulator per invocation. No subgroup operations. The form for GPUs.
    GpuTiles,
    /// One subgroup per workgroup, loops as written, reductions by subgroup operations. CPU
    /// adapters with a fixed subgroup size.
    Subgroup,
    /// 8 invocations, loops as written, reductions through workgroup memory. CPU adapters
    /// without a fixed subgroup size.
    Cpu,
}

impl DecodeForm {
    /// Every decode form.
    pub const ALL: [DecodeForm; 4] = [
        DecodeForm::Gpu,
        DecodeForm::GpuTiles,
        DecodeForm::Subgroup,
        DecodeForm::Cpu,
    ];

    /// The name: `gpu`, `gpu-tiles`, `subgroup`, `cpu`.
    pub fn name(self) -> &'static str {
        match self {
            DecodeForm::Gpu => "gpu",
            DecodeForm::GpuTiles => "gpu-tiles",
            DecodeForm::Subgroup => "subgroup",
            DecodeForm::Cpu => "cpu",
        }
    }
}

impl std::str::FromStr for DecodeForm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DecodeForm::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| Error::UnknownName {
                kind: "decode kernel form",
                name: s.to_string(),
                expected: "gpu, gpu-tiles, subgroup, cpu",
            })
    }
}

/// A form of the fused backward's kernels (`shaders/bwd_dq.wgsl`, `shaders/bwd_dkv.wgsl`).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackwardForm {
    /// 64 invocations, one query row (dQ) or key (dK, dV) each, unrolled, the other operand's
    /// tiles staged in up to 32 KiB of workgroup memory. The form for GPUs.
    Gpu,
    /// One subgroup per workgroup, `rows` rows (keys) per invocation in registers, the other
    /// operand's tile held one row per invocation and read by subgroup shuffles (no workgroup
    /// memory); unrolled. CPU adapters with a fixed subgroup size of 4 to 16 (lavapipe: 8).
    Subgroup {
        /// Rows (keys) per invocation (1 to 8).
        rows: u32,
    },
    /// 8 invocations, `rows` rows (keys) each in registers, tiles in workgroup memory,
    /// unrolled. CPU adapters without a fixed subgroup size.
    Tiled {
        /// Rows (keys) per invocation (1 to 8).
        rows: u32,
    },
    /// The matrix units (`shaders/bwd_dq_coop.wgsl`, `shaders/bwd_dkv_coop.wgsl`): the
    /// products S = Q Kᵀ, dP = dO Vᵀ, dV += Pᵀ dO, dK += dSᵀ Q and dQ += dS K in
    /// cooperative-matrix tiles of f16 operands with f32 accumulators, P and dS rounded to f16
    /// as FlashAttention rounds them; `tile` is 8 or 16, one the adapter lists ([`CoopTiles`]),
    /// `None` the largest. The default for f16 q, k, v and dO where the units are the
    /// device's default ([`Caps::coop_by_default`]); f32 inputs only when pinned (rounded to
    /// f16); bf16 refused.
    Coop {
        /// The tile edge (8 or 16), or `None` for the largest the adapter lists.
        tile: Option<u32>,
    },
}

impl BackwardForm {
    /// Rows (keys) per invocation (1 for the matrix units' form, whose tiles are shared by a
    /// subgroup).
    pub fn rows(self) -> u32 {
        match self {
            BackwardForm::Gpu | BackwardForm::Coop { .. } => 1,
            BackwardForm::Subgroup { rows } | BackwardForm::Tiled { rows } => rows,
        }
    }

    /// Whether this is the matrix units' form.
    pub fn is_coop(self) -> bool {
        matches!(self, BackwardForm::Coop { .. })
    }

    /// The name: `gpu`, `subgroup:R`, `tiled:R` (R rows per invocation), `coop`, `coop:T`
    /// (T x T tiles).
    pub fn name(self) -> String {
        match self {
            BackwardForm::Gpu => "gpu".into(),
            BackwardForm::Subgroup { rows } => format!("subgroup:{rows}"),
            BackwardForm::Tiled { rows } => format!("tiled:{rows}"),
            BackwardForm::Coop { tile: None } => "coop".into(),
            BackwardForm::Coop { tile: Some(t) } => format!("coop:{t}"),
        }
    }
}

impl std::str::FromStr for BackwardForm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::UnknownName {
            kind: "backward kernel form",
            name: s.to_string(),
            expected: "gpu, subgroup:R, tiled:R (R = rows per invocation, 1 to 8), coop, coop:8, coop:16",
        };
        match s {
            "coop" => return Ok(BackwardForm::Coop { tile: None }),
            "coop:8" => return Ok(BackwardForm::Coop { tile: Some(8) }),
            "coop:16" => return Ok(BackwardForm::Coop { tile: Some(16) }),
            _ => {}
        }
        let (kind, rows) = split_rows(s, 8).ok_or_else(bad)?;
        match (kind, rows) {
            ("gpu", None) => Ok(BackwardForm::Gpu),
            ("subgroup", r) => Ok(BackwardForm::Subgroup { rows: r.unwrap_or(1) }),
            ("tiled", r) => Ok(BackwardForm::Tiled { rows: r.unwrap_or(1) }),
            _ => Err(bad()),
        }
    }
}

/// A form of the matmul kernel (the unfused paths' products, the multi-head layer's
/// projections, the variants' stages).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulForm {
    /// 16 x 16 invocations, a 64 x 64 tile of C staged through workgroup memory
    /// (`shaders/matmul.wgsl`): CPU adapters without a subgroup of 8.
    Tiled,
    /// 16 x 16 invocations, a 128 x 128 tile of C, 8 x 8 per invocation, the next K step
    /// prefetched into registers (`shaders/matmul_tiles.wgsl`). The form for GPUs.
    GpuTiles,
    /// One subgroup of 8, 4 rows per invocation, B shared by shuffles, unrolled
    /// (`shaders/matmul_sg.wgsl`): CPU adapters with a fixed subgroup size of 8 (lavapipe).
    Subgroup,
    /// The matrix units (tensor cores, matrix cores, simdgroup matrices) through cooperative
    /// matrices: tiles of `tile` x `tile` f16 operands accumulated in f32, a 4 `tile` square
    /// of C per workgroup (`shaders/matmul_coop.wgsl`). `tile` is 8 or 16, one the adapter
    /// lists ([`CoopTiles`]); `None` takes the largest listed. Operands in f32 are rounded to
    /// f16 (an opt-in: only a pinned form does that); bf16 operands are refused (values beyond
    /// f16's range would overflow).
    Coop {
        /// The tile edge: 8, 16, or `None` for the largest the adapter lists.
        tile: Option<u32>,
    },
}

impl MatmulForm {
    /// Every scalar matmul form (the coop forms need the adapter's matrix units:
    /// [`Caps::matmul_forms`]).
    pub const ALL: [MatmulForm; 3] = [MatmulForm::Tiled, MatmulForm::GpuTiles, MatmulForm::Subgroup];

    /// The name: `tiled`, `gpu-tiles`, `subgroup`, `coop`, `coop:8`, `coop:16`.
    pub fn name(self) -> String {
        match self {
            MatmulForm::Tiled => "tiled".into(),
            MatmulForm::GpuTiles => "gpu-tiles".into(),
            MatmulForm::Subgroup => "subgroup".into(),
            MatmulForm::Coop { tile: None } => "coop".into(),
            MatmulForm::Coop { tile: Some(t) } => format!("coop:{t}"),
        }
    }

    /// Whether the form runs on the matrix units.
    pub fn is_coop(self) -> bool {
        matches!(self, MatmulForm::Coop { .. })
    }
}

impl std::str::FromStr for MatmulForm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::UnknownName {
            kind: "matmul kernel form",
            name: s.to_string(),
            expected: "tiled, gpu-tiles, subgroup, coop, coop:8, coop:16",
        };
        match s {
            "coop" => Ok(MatmulForm::Coop { tile: None }),
            "coop:8" => Ok(MatmulForm::Coop { tile: Some(8) }),
            "coop:16" => Ok(MatmulForm::Coop { tile: Some(16) }),
            _ => MatmulForm::ALL
                .into_iter()
                .find(|f| f.name() == s)
                .ok_or_else(bad),
        }
    }
}

/// The cooperative-matrix tiles (the GPU's matrix units) a device offers the kernels: square
/// tiles of f16 operands accumulated in f32 that the adapter lists
/// (`wgpu::Adapter::cooperative_matrix_properties`) and WGSL can spell. wgpu does not check a
/// shader's tiles against that list (an unlisted one is undefined behaviour), so the kernels
/// use only these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct CoopTiles {
    /// 8 x 8 x 8 (Apple's simdgroup matrices, Mesa 26.1's lavapipe).
    pub t8: bool,
    /// 16 x 16 x 16 (NVIDIA's tensor cores, AMD's matrix cores).
    pub t16: bool,
    /// Why the device offers none, where it offers none: no such units, the feature not
    /// enabled on the device, a device adopted without its adapter, or turned off.
    pub none_because: Option<&'static str>,
}

impl CoopTiles {
    /// No tiles, for `reason`.
    pub fn none(reason: &'static str) -> CoopTiles {
        CoopTiles {
            none_because: Some(reason),
            ..CoopTiles::default()
        }
    }

    /// The f16 x f16 -> f32 square tiles of 8 or 16 in an adapter's list.
    pub fn from_properties(list: &[wgpu::CooperativeMatrixProperties]) -> CoopTiles {
        let has = |t: u32| {
            list.iter().any(|c| {
                c.m_size == t
                    && c.n_size == t
                    && c.k_size == t
                    && c.ab_type == wgpu::CooperativeScalarType::F16
                    && c.cr_type == wgpu::CooperativeScalarType::F32
            })
        };
        let tiles = CoopTiles {
            t8: has(8),
            t16: has(16),
            none_because: None,
        };
        match tiles.largest() {
            Some(_) => tiles,
            None => CoopTiles::none(
                "the adapter lists no square 8 or 16 tile of f16 operands with f32 accumulators",
            ),
        }
    }

    /// Whether tiles of `t` are listed.
    pub fn has(&self, t: u32) -> bool {
        match t {
            8 => self.t8,
            16 => self.t16,
            _ => false,
        }
    }

    /// The largest listed tile.
    pub fn largest(&self) -> Option<u32> {
        [16, 8].into_iter().find(|&t| self.has(t))
    }

    /// The listed tiles, smallest first.
    pub fn list(&self) -> Vec<u32> {
        [8, 16].into_iter().filter(|&t| self.has(t)).collect()
    }
}

/// Forms pinned for a context's calls (tests, benchmarks, tuning); `None` lets the plan choose.
/// A pinned form the device cannot run makes the call fail with [`Error::Unsupported`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Forms {
    /// The fused kernel's form.
    pub fused: Option<FusedForm>,
    /// The decode kernel's form.
    pub decode: Option<DecodeForm>,
    /// The fused backward's form.
    pub backward: Option<BackwardForm>,
    /// The matmul's form (every product: the unfused forward and backward, the layer, the
    /// variants).
    pub matmul: Option<MatmulForm>,
}

/// Only the fused kernel's form pinned.
impl From<FusedForm> for Forms {
    fn from(f: FusedForm) -> Forms {
        Forms {
            fused: Some(f),
            ..Forms::default()
        }
    }
}

/// Only the decode kernel's form pinned.
impl From<DecodeForm> for Forms {
    fn from(f: DecodeForm) -> Forms {
        Forms {
            decode: Some(f),
            ..Forms::default()
        }
    }
}

/// Only the fused backward's form pinned.
impl From<BackwardForm> for Forms {
    fn from(f: BackwardForm) -> Forms {
        Forms {
            backward: Some(f),
            ..Forms::default()
        }
    }
}

/// Only the matmul's form pinned.
impl From<MatmulForm> for Forms {
    fn from(f: MatmulForm) -> Forms {
        Forms {
            matmul: Some(f),
            ..Forms::default()
        }
    }
}

impl Forms {
    /// Parse `fused=<form>,decode=<form>,backward=<form>,matmul=<form>` (any part may be left
    /// out), the syntax of the `WGPU_ATTENTION_FORMS` environment variable.
    pub fn parse(s: &str) -> Result<Forms> {
        let mut forms = Forms::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some(("fused", f)) => forms.fused = Some(f.parse()?),
                Some(("decode", f)) => forms.decode = Some(f.parse()?),
                Some(("backward", f)) => forms.backward = Some(f.parse()?),
                Some(("matmul", f)) => forms.matmul = Some(f.parse()?),
                _ => {
                    return Err(Error::UnknownName {
                        kind: "kernel form setting",
                        name: part.to_string(),
                        expected: "fused=<form>, decode=<form>, backward=<form>, matmul=<form>",
                    })
                }
            }
        }
        Ok(forms)
    }
}

/// What a device offers the kernels, as the plan sees it: read from a
/// [`Context`](crate::Context) by [`Context::caps`](crate::Context::caps), or written down for
/// a device one does not have (plans are pure functions of the problem and these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// A CPU implementation (lavapipe, llvmpipe, WARP): memory accesses cost far more than
    /// arithmetic, and unrolled code compiles for seconds.
    pub cpu: bool,
    /// The subgroup size, when subgroup operations are enabled and the adapter has one size.
    pub subgroup: Option<u32>,
    /// `max_compute_invocations_per_workgroup`.
    pub max_invocations: u32,
    /// `max_compute_workgroup_size_x`.
    pub max_workgroup_size_x: u32,
    /// `max_compute_workgroup_storage_size`, bytes.
    pub workgroup_storage: u32,
    /// `max_compute_workgroups_per_dimension`.
    pub max_workgroups: u32,
    /// The largest storage binding, bytes (`max_storage_buffer_binding_size`, at most
    /// `max_buffer_size`).
    pub max_binding: u64,
    /// `max_buffer_size`, bytes.
    pub max_buffer: u64,
    /// Kernels can be compiled on a background thread while a quicker-to-compile form serves
    /// (native; not on the web, which has no threads, nor on wgpu's GL backend, whose one GL
    /// context a long compilation would hold past wgpu-hal's 6 s lock timeout). Without it a CPU adapter's default fused
    /// form stays small enough to compile in about a second: Chromium's SwiftShader adapter
    /// spends over a minute on the 8-row tiled form at E = 64 and its GPU process is then
    /// killed by the browser's watchdog (measured: `tiled:4` 1.6 s to a first result, 82 ms
    /// after; `tiled:8` device lost after 90 s).
    pub background_compile: bool,
    /// Forms pinned by the context.
    pub forms: Forms,
    /// The matrix units' tiles ([`CoopTiles`]).
    pub coop: CoopTiles,
    /// The largest subgroup size the adapter may run a kernel with (a coop form's workgroup
    /// is a multiple of it).
    pub max_subgroup: u32,
    /// The tuning knobs of the GPU forms (a context's: [`Context::with_tuning`](crate::Context::with_tuning);
    /// none by [`Caps::new`]).
    pub tuning: Tuning,
}

/// The largest storage binding a device allows, bytes: `max_storage_buffer_binding_size`, at most
/// `max_buffer_size`.
pub(crate) fn max_binding(limits: &wgpu::Limits) -> u64 {
    limits.max_storage_buffer_binding_size.min(limits.max_buffer_size)
}

impl Caps {
    /// A device with `limits`, a CPU or not, with a fixed subgroup size or not; no pinned forms.
    pub fn new(limits: &wgpu::Limits, cpu: bool, subgroup: Option<u32>) -> Caps {
        Caps {
            cpu,
            subgroup,
            max_invocations: limits.max_compute_invocations_per_workgroup,
            max_workgroup_size_x: limits.max_compute_workgroup_size_x,
            workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_workgroups: limits.max_compute_workgroups_per_dimension,
            max_binding: max_binding(limits),
            max_buffer: limits.max_buffer_size,
            background_compile: cfg!(not(target_arch = "wasm32")),
            forms: Forms::default(),
            coop: CoopTiles::none("not read from a device"),
            max_subgroup: subgroup.unwrap_or(64),
            tuning: Tuning::default(),
        }
    }

    /// These capabilities with the tuning knobs `tuning`.
    pub fn with_tuning(mut self, tuning: Tuning) -> Caps {
        self.tuning = tuning;
        self
    }

    /// The same device with the matrix units' `tiles`, run with subgroups of at most
    /// `max_subgroup` invocations.
    pub fn with_coop(self, tiles: CoopTiles, max_subgroup: u32) -> Caps {
        Caps {
            coop: tiles,
            max_subgroup,
            ..self
        }
    }

    /// The same device with `forms` pinned (a [`FusedForm`] or [`DecodeForm`] pins that one).
    pub fn with_forms(self, forms: impl Into<Forms>) -> Caps {
        Caps {
            forms: forms.into(),
            ..self
        }
    }

    /// The fused kernel's forms this device can run (the ones the tests check it with): the
    /// GPU form, the loop and tiled forms, and the subgroup form where subgroups allow.
    pub fn fused_forms(&self) -> Vec<FusedForm> {
        let mut v = vec![
            FusedForm::Gpu,
            FusedForm::GpuTiles,
            FusedForm::Loop { rows: 3 },
            FusedForm::Tiled { rows: 2 },
        ];
        if self.fused_subgroup().is_some() {
            v.extend([FusedForm::Subgroup { rows: 1 }, FusedForm::Subgroup { rows: 2 }]);
        }
        v.extend(
            self.coop
                .list()
                .into_iter()
                .map(|t| FusedForm::Coop { tile: Some(t) }),
        );
        v
    }

    /// The decode kernel's forms this device can run.
    pub fn decode_forms(&self) -> Vec<DecodeForm> {
        DecodeForm::ALL
            .into_iter()
            .filter(|f| *f != DecodeForm::Subgroup || self.decode_subgroup().is_some())
            .collect()
    }

    /// The fused backward's forms this device can run (the ones the tests check it with).
    pub fn backward_forms(&self) -> Vec<BackwardForm> {
        let mut v = vec![BackwardForm::Gpu, BackwardForm::Tiled { rows: 2 }];
        if self.fused_subgroup().is_some() {
            v.extend([
                BackwardForm::Subgroup { rows: 1 },
                BackwardForm::Subgroup { rows: 2 },
            ]);
        }
        v.extend(
            self.coop
                .list()
                .into_iter()
                .map(|t| BackwardForm::Coop { tile: Some(t) }),
        );
        v
    }

    /// The matmul's forms this device can run.
    pub fn matmul_forms(&self) -> Vec<MatmulForm> {
        let mut v: Vec<MatmulForm> = MatmulForm::ALL
            .into_iter()
            .filter(|f| *f != MatmulForm::Subgroup || self.subgroup == Some(8))
            .collect();
        v.extend(
            self.coop
                .list()
                .into_iter()
                .map(|t| MatmulForm::Coop { tile: Some(t) }),
        );
        v
    }

    /// The tile a coop form (`pinned`: 8, 16, or `None` for the largest) runs with on this
    /// device, or why it cannot run.
    pub fn coop_tile(&self, pinned: Option<u32>) -> std::result::Result<u32, String> {
        let Some(largest) = self.coop.largest() else {
            return Err(format!(
                "the matrix units are not available: {}",
                self.coop.none_because.unwrap_or("no tiles listed")
            ));
        };
        let t = pinned.unwrap_or(largest);
        if !self.coop.has(t) {
            return Err(format!(
                "the adapter does not list {t} x {t} f16 tiles with f32 accumulators (it lists {:?})",
                self.coop.list()
            ));
        }
        if self.max_invocations < self.coop_workgroup() || self.max_workgroup_size_x < self.coop_workgroup() {
            return Err(format!(
                "the coop matmul needs workgroups of {} invocations",
                self.coop_workgroup()
            ));
        }
        if self.workgroup_storage < coop_workgroup_bytes(t) {
            return Err(format!(
                "the {t} x {t} coop matmul needs {} bytes of workgroup memory",
                coop_workgroup_bytes(t)
            ));
        }
        Ok(t)
    }

    /// Whether f16 calls take the matrix units' forms without a pin: on a GPU that lists a
    /// tile. CPU adapters that have them (Mesa 26.1's lavapipe) run them about 10x slower
    /// than their scalar forms (measured: docs/benchmarks.md), so there they are opt-in
    /// (pinned, or `WGPU_ATTENTION_TUNE=coop=1`, which CI's coop pass sets).
    pub fn coop_by_default(&self) -> bool {
        let knob = self.tuning.coop;
        self.coop.largest().is_some() && knob != Some(0) && (!self.cpu || knob == Some(1))
    }

    /// The workgroup size of a coop form: 128 invocations, or the largest subgroup if larger.
    pub(crate) fn coop_workgroup(&self) -> u32 {
        self.max_subgroup.max(128)
    }

    /// The subgroup size of the fused kernel's subgroup form: the subgroup size, when it is fixed
    /// and 4 to 16 (the workgroup is one subgroup, each invocation holding one key of the tile).
    pub(crate) fn fused_subgroup(&self) -> Option<u32> {
        self.subgroup.filter(|s| (4..=16).contains(s))
    }

    /// [`Caps::fused_subgroup`] for the form named `form` (the fused forward's or the
    /// backward's subgroup form), or why the device cannot run it.
    pub(crate) fn fused_subgroup_for(&self, form: &str) -> std::result::Result<u32, String> {
        self.fused_subgroup().ok_or_else(|| {
            format!(
                "the {form} form needs a fixed subgroup size of 4 to 16 (device: {:?})",
                self.subgroup
            )
        })
    }

    /// The workgroup size of the decode kernel's subgroup form: the subgroup size, when it is
    /// fixed, a power of two and at most 64.
    pub(crate) fn decode_subgroup(&self) -> Option<u32> {
        self.subgroup
            .filter(|s| s.is_power_of_two() && (4..=64).contains(s) && *s <= self.max_invocations)
    }
}

/// Whether the matrix units' forms (`what`) take inputs in `formats`: f16, or f32 (rounded
/// to f16, the pinned opt-in), but not bf16, whose values beyond f16's range would overflow.
pub(crate) fn coop_takes(what: &str, formats: &[crate::storage::Storage]) -> std::result::Result<(), String> {
    if formats.iter().any(|f| f.is_quantized()) {
        return Err(format!(
            "the {what} does not read 8-bit K/V caches (int8, fp8): the scalar forms do"
        ));
    }
    match formats.contains(&crate::storage::Storage::Bf16) {
        true => Err(format!(
            "the {what} takes f16 (or, pinned, f32) inputs: bf16 values beyond f16's range would overflow"
        )),
        false => Ok(()),
    }
}

/// Workgroup memory of the coop matmul with tiles of `t`: f16 A and B blocks, f32 C block.
pub(crate) fn coop_workgroup_bytes(t: u32) -> u32 {
    let (bm, bk) = (4 * t, 2 * t);
    2 * (bm * bk) * 2 + bm * bm * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_parse_from_their_names() {
        for f in [
            FusedForm::Gpu,
            FusedForm::GpuTiles,
            FusedForm::Subgroup { rows: 2 },
            FusedForm::Tiled { rows: 16 },
            FusedForm::Loop { rows: 3 },
        ] {
            assert_eq!(f.name().parse::<FusedForm>(), Ok(f));
        }
        for f in DecodeForm::ALL {
            assert_eq!(f.name().parse::<DecodeForm>(), Ok(f));
        }
        assert!("loop:0".parse::<FusedForm>().is_err());
        assert!("gpu:2".parse::<FusedForm>().is_err());
        assert!("loop:17".parse::<FusedForm>().is_err());
        assert!("warp".parse::<FusedForm>().is_err());
        assert_eq!(
            Forms::parse("fused=subgroup:2, decode=gpu"),
            Ok(Forms {
                fused: Some(FusedForm::Subgroup { rows: 2 }),
                decode: Some(DecodeForm::Gpu),
                ..Forms::default()
            })
        );
        for f in [
            BackwardForm::Gpu,
            BackwardForm::Subgroup { rows: 3 },
            BackwardForm::Tiled { rows: 8 },
            BackwardForm::Coop { tile: None },
            BackwardForm::Coop { tile: Some(8) },
            BackwardForm::Coop { tile: Some(16) },
        ] {
            assert_eq!(f.name().parse::<BackwardForm>(), Ok(f));
        }
        assert!("coop:32".parse::<BackwardForm>().is_err());
        for f in MatmulForm::ALL.into_iter().chain([
            MatmulForm::Coop { tile: None },
            MatmulForm::Coop { tile: Some(8) },
            MatmulForm::Coop { tile: Some(16) },
        ]) {
            assert_eq!(f.name().parse::<MatmulForm>(), Ok(f));
        }
        assert!("coop:32".parse::<MatmulForm>().is_err());
        assert!("tiled:9".parse::<BackwardForm>().is_err());
        assert!("gpu:1".parse::<BackwardForm>().is_err());
        assert_eq!(
            Forms::parse("backward=tiled:2,matmul=gpu-tiles"),
            Ok(Forms {
                backward: Some(BackwardForm::Tiled { rows: 2 }),
                matmul: Some(MatmulForm::GpuTiles),
                ..Forms::default()
            })
        );
        assert!(Forms::parse("flash=gpu").is_err());
    }
}
