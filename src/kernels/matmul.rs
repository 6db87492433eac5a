//! `shaders/matmul.wgsl`: the batched, tiled, register-blocked matrix product used for the
//! scores (`scale · Q Kᵀ`, `TRANS_B`) and the value weighting (`P V`), and by benchmarks as the
//! crate's plain matmul. 64×64 output tile per workgroup, 4×4 per invocation, K in steps of 16.

use super::access::{array, Access};
use super::consts::Prelude;
use super::{dispatch, params_of, Binding, KernelSpec};
use crate::device::context::Context;
use crate::error::Result;
use crate::storage::Storage;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "matmul",
    source: include_str!("../../shaders/matmul.wgsl"),
    common: &[super::common::MATMUL],
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::Params,
    ],
    params: params_of::<Params>,
    trusted: false,
};

/// The form for CPU adapters whose subgroup is exactly 8 invocations (lavapipe):
/// `shaders/matmul_sg.wgsl`.
pub(crate) const SG_SPEC: KernelSpec = KernelSpec {
    name: "matmul_sg",
    source: include_str!("../../shaders/matmul_sg.wgsl"),
    common: &[super::common::MATMUL],
    bindings: SPEC.bindings,
    params: params_of::<Params>,
    trusted: false,
};

/// The GPU form: `shaders/matmul_tiles.wgsl`.
pub(crate) const TILES_SPEC: KernelSpec = KernelSpec {
    name: "matmul_tiles",
    source: include_str!("../../shaders/matmul_tiles.wgsl"),
    common: &[super::common::MATMUL],
    bindings: SPEC.bindings,
    params: params_of::<Params>,
    trusted: false,
};

/// The matrix-unit form: `shaders/matmul_coop.wgsl`.
pub(crate) const COOP_SPEC: KernelSpec = KernelSpec {
    name: "matmul_coop",
    source: include_str!("../../shaders/matmul_coop.wgsl"),
    common: &[super::common::MATMUL],
    bindings: SPEC.bindings,
    params: params_of::<Params>,
    trusted: false,
};

/// The coop form's prelude for tiles of `t` in workgroups of `wg`: the `enable` directives,
/// `TILE`, `WG` and the matrix types AT, BT, CT.
pub(crate) fn coop_prelude(t: u32, wg: u32) -> Prelude {
    Prelude::new()
        .code("enable f16;\nenable wgpu_cooperative_matrix;\n")
        .consts(&CoopConsts { TILE: t, WG: wg })
        .code(&format!(
            "alias AT = coop_mat{t}x{t}<f16, A>;\nalias BT = coop_mat{t}x{t}<f16, B>;\nalias CT = coop_mat{t}x{t}<f32, C>;\n"
        ))
}

wgsl_consts! {
    /// The matrix units' tiles: `TILE` x `TILE` matrices in workgroups of `WG` invocations.
    pub(crate) struct CoopConsts {
        TILE: u32,
        WG: u32,
    }
}

wgsl_consts! {
    /// The matmul kernels' override constants (`override TRANS_B: bool` in the WGSL).
    pub(crate) struct Overrides {
        /// B is read transposed (`A Bᵀ`).
        TRANS_B: bool,
        /// A bias row is added.
        HAS_BIAS: bool,
        /// The product is added to C.
        ACCUM: bool,
    }
}

wgsl_consts! {
    /// The subgroup form's tiles: `RQ` rows per invocation, `NB` column blocks of 8, `NB2`
    /// and `ACC` derived, `KC4` vec4 steps of k per chunk.
    pub(crate) struct SgConsts {
        RQ: u32,
        NB: u32,
        NB2: u32,
        ACC: u32,
        KC4: u32,
        UNROLL: bool,
    }
}

wgsl_consts! {
    /// Whether a kernel's marked loops are unrolled at the source.
    pub(crate) struct Unroll {
        UNROLL: bool,
    }
}

/// Output tile edge (rows and columns) per workgroup of the tiled form; the grid is sized for
/// it (the subgroup form's tiles are smaller, see `Form::tile`).
pub(crate) const TILE: u32 = 64;

/// How the product is laid out on the device.
pub(crate) use crate::forms::MatmulForm as Form;

/// The pinned form (`caps.forms.matmul`) or the default one: on CPU adapters with a fixed
/// subgroup of 8 the subgroup form, on GPUs the register-tiled form, else the tiled form. Or
/// why the pinned one cannot run on this device.
pub(crate) fn form_for(caps: &crate::forms::Caps) -> std::result::Result<Form, String> {
    let form = caps
        .forms
        .matmul
        .unwrap_or(if caps.cpu && caps.subgroup == Some(8) {
            // Measured on lavapipe at 1024^3 (A Bᵀ, `wgpu-attention bench`), GFLOP/s (first call
            // incl. compilation): 4 rows x 4 blocks x 2 k-steps 35 (1.4 s), 4 x 6 x 2 37 (2.9 s),
            // 4 x 4 x 4 37 (2.2 s), 8 x 2 x 2 31, 8 x 1 x 2 21, 2 x 8 x 2 30, 4 x 8 x 2 32 (4.5 s).
            Form::Subgroup
        } else if !caps.cpu && caps.tuning.matmul_tiles != Some(0) {
            Form::GpuTiles
        } else {
            Form::Tiled
        });
    if let Form::Coop { tile } = form {
        let t = caps.coop_tile(tile)?;
        return Ok(Form::Coop { tile: Some(t) });
    }
    if !caps.matmul_forms().contains(&form) {
        return Err(format!(
            "the {} matmul form needs a fixed subgroup size of 8 (device: {:?})",
            form.name(),
            caps.subgroup
        ));
    }
    if form != Form::Subgroup && !runs_16x16(caps) {
        return Err(format!(
            "the {} matmul form needs 16 x 16 invocations",
            form.name()
        ));
    }
    Ok(form)
}

/// Whether the device runs the tiled forms' workgroups: 16 x 16 invocations (with 8 KiB of
/// workgroup memory).
fn runs_16x16(caps: &crate::forms::Caps) -> bool {
    caps.max_invocations >= 256 && caps.max_workgroup_size_x >= 16
}

/// Products of fewer FLOPs than this (2 m n k over every slice) run the tiled form on CPU
/// adapters whose default is the subgroup form, unless a form is pinned. Measured on lavapipe
/// (`kernels::stage_tests::matmul_forms_and_formats_match_f64_product`, an empty Mesa cache):
/// a subgroup-form kernel takes 4.0 s to compile, a tiled one 0.32 s, and each new shape class
/// or storage format of a small product is a kernel of its own; at 1e7 FLOPs the tiled form's
/// run (about 1 ms) costs less than the subgroup form's compilation by three orders of
/// magnitude. Larger products (the benchmarks' projections and scores: 2.5e7 FLOPs and up)
/// keep the subgroup form, which runs them 3-4x faster.
pub(crate) const CPU_SMALL_PRODUCT_FLOPS: f64 = 1e7;

/// [`form_for`] for a product of `flops` (2 m n k over every slice) with A and B in
/// `operands`: f16 operands on the matrix units where the device has them (the products of f16
/// values are exact in f32, and the sums are f32 as in the scalar forms); small products on CPU
/// adapters in the tiled form ([`CPU_SMALL_PRODUCT_FLOPS`]). A pinned coop form takes f16 and
/// f32 operands (f32 rounded to f16: the opt-in) and refuses bf16.
pub(crate) fn form_for_size(
    caps: &crate::forms::Caps,
    flops: f64,
    operands: [Storage; 2],
) -> std::result::Result<Form, String> {
    let halves = operands.iter().all(|&s| s == Storage::F16);
    if caps.forms.matmul.is_none() && halves && caps.coop_by_default() {
        let t = caps.coop_tile(None)?;
        return Ok(Form::Coop { tile: Some(t) });
    }
    let form = form_for(caps)?;
    if form.is_coop() {
        crate::forms::coop_takes("coop matmul", &operands)?;
    }
    let small = caps.cpu && caps.forms.matmul.is_none() && flops < CPU_SMALL_PRODUCT_FLOPS;
    if form == Form::Subgroup && small && runs_16x16(caps) {
        return Ok(Form::Tiled);
    }
    Ok(form)
}

/// [`form_for`] `ctx`'s device, its refusal an [`Error::Unsupported`](crate::Error).
pub(crate) fn form(ctx: &Context) -> Result<Form> {
    form_for(&ctx.caps()).map_err(|reason| crate::error::Error::Unsupported {
        path: "matmul",
        reason,
    })
}

impl Form {
    /// Rows and columns of C per workgroup.
    pub(crate) fn tile(self) -> [u32; 2] {
        match self {
            Form::Tiled => [TILE, TILE],
            Form::GpuTiles => [2 * TILE, 2 * TILE],
            Form::Subgroup => [8 * SG_ROWS, 8 * SG_NB],
            // A tile not yet resolved: the smallest (grids are checked against it).
            Form::Coop { tile } => [4 * tile.unwrap_or(8); 2],
        }
    }
}

/// Check that an `m × n` product fits the device's grid (in the form `ctx` runs) before any
/// GPU work: `what` names it in the error.
pub(crate) fn check_grid(ctx: &Context, what: &str, m: usize, n: usize) -> Result<()> {
    // The smallest tile any form the call may take has (f16 products take a coop form).
    let caps = ctx.caps();
    let mut tile = form(ctx)?.tile();
    if let Some(t) = caps.coop.list().first() {
        tile = [tile[0].min(4 * t), tile[1].min(4 * t)];
    }
    let [tm, tn] = tile;
    let max = ctx.limits().max_compute_workgroups_per_dimension as usize;
    for (extent, tile, axis) in [(m, tm, "rows"), (n, tn, "columns")] {
        if extent.div_ceil(tile as usize) > max {
            return Err(crate::error::Error::TooLargeForDevice {
                what: format!("{what}: {extent} {axis} of a product, {tile} per workgroup"),
                bytes: 0,
                limit_name: "max_compute_workgroups_per_dimension",
                limit: max as u64,
                hint: " (a grid limit, not a memory one)",
            });
        }
    }
    Ok(())
}

/// Rows per invocation of the subgroup form.
pub(crate) const SG_ROWS: u32 = 4;
/// Column blocks of 8 per workgroup of the subgroup form.
pub(crate) const SG_NB: u32 = 4;

/// vec4 steps of k per unrolled chunk of the subgroup form.
pub(crate) const SG_KC4: u32 = 2;

/// `load_a`/`load_b` of the subgroup form: 4 consecutive k of a row of A (of column `col` of
/// B'), zero past M, N or K. `vec4`: one vec4 load (K and every row start multiples of 4).
pub(crate) fn sg_prelude(rows: u32, trans_b: bool, a_vec4: bool, b_vec4: bool) -> Prelude {
    let nb = SG_NB;
    let consts = SgConsts {
        RQ: rows,
        NB: nb,
        NB2: 2 * nb,
        ACC: 2 * nb * rows,
        KC4: SG_KC4,
        UNROLL: true,
    };
    let mut s = String::new();
    let rowwise = |name: &str, x: &str, lim: &str, row_stride: &str, vec4: bool| {
        let body = if vec4 {
            format!("    if (k < p.k) {{ return {x}_get4(base + r * {row_stride} + k); }}\n    return vec4<f32>(0.0);\n")
        } else {
            format!(
                "    var x = vec4<f32>(0.0);\n    for (var c = 0u; c < 4u; c++) {{ // unroll\n        \
                 if (k + c < p.k) {{ x[c] = {x}_get(base + r * {row_stride} + k + c); }}\n    }}\n    return x;\n"
            )
        };
        format!(
            "fn {name}(base: u32, r: u32, k: u32) -> vec4<f32> {{\n    if (r >= {lim}) {{ return vec4<f32>(0.0); }}\n{body}}}\n"
        )
    };
    s += &rowwise("load_a", "a", "p.m", "p.a_row", a_vec4);
    if trans_b {
        s += &rowwise("load_b", "b", "p.n", "p.b_row", b_vec4);
        s += "fn load_b_lane(base: u32, col0: u32, k: u32, lane: u32) -> vec4<f32> { return load_b(base, col0 + lane, k); }\n";
        s += "fn b_column(b: vec4<f32>, j: u32) -> vec4<f32> { return subgroupShuffle(b, j); }\n";
    } else {
        // Invocation l: row k + l % 4 of B, columns col0 + 4 (l / 4) .. + 4.
        let body = if b_vec4 {
            "    if (col < p.n) { return b_get4(base + kk * p.b_row + col); }\n    return vec4<f32>(0.0);\n"
        } else {
            "    var x = vec4<f32>(0.0);\n    for (var c = 0u; c < 4u; c++) { // unroll\n        \
             if (col + c < p.n) { x[c] = b_get(base + kk * p.b_row + col + c); }\n    }\n    return x;\n"
        };
        s += &format!(
            "fn load_b_lane(base: u32, col0: u32, k: u32, lane: u32) -> vec4<f32> {{\n    \
             let kk = k + lane % 4u;\n    let col = col0 + 4u * (lane / 4u);\n    \
             if (kk >= p.k) {{ return vec4<f32>(0.0); }}\n{body}}}\n"
        );
        s += "fn b_column(b: vec4<f32>, j: u32) -> vec4<f32> {\n    let l = 4u * (j / 4u);\n    \
              return vec4<f32>(subgroupShuffle(b[j % 4u], l), subgroupShuffle(b[j % 4u], l + 1u), \
              subgroupShuffle(b[j % 4u], l + 2u), subgroupShuffle(b[j % 4u], l + 3u));\n}\n";
    }
    Prelude::new()
        .consts(&consts)
        .code(&s)
        .tag(if trans_b { "b-transposed" } else { "b-rows" })
}

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
        /// Element offset added to every slice of B.
        b_off: u32,
        c_batch: u32,
        c_row: u32,
        c_off: u32,
        alpha: f32,
        /// Strides between the heads of one batch (slices `z` split as `(z / heads, z % heads)`;
        /// B's head `(z % heads) / group`); `*_batch` then step over whole batches.
        a_head: u32,
        b_head: u32,
        c_head: u32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

impl Params {
    /// `C[z] = alpha · A[z] op(B[z])` for row-major, contiguous `[M, K]` slices of A,
    /// `[N, K]` (`trans_b`) or `[K, N]` slices of B and `[M, N]` slices of C, one B per z
    /// (heads = group = 1), no offsets. Callers override the strides and offsets that differ.
    /// (The kernel's tests: everything else builds its params through [`crate::ops::matmul`].)
    #[cfg(test)]
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

    /// Reread the per-slice strides `*_batch` of a product over `heads` heads sharing B by
    /// groups of `group` as per-head strides (`*_head`) and per-batch strides (`*_batch` times
    /// the heads of a batch): the same slices, in the form views need.
    #[cfg(test)]
    pub(crate) fn split_heads(self) -> Params {
        let kv = self.heads / self.group;
        Params {
            a_head: self.a_batch,
            a_batch: self.a_batch * self.heads,
            b_head: self.b_batch,
            b_batch: self.b_batch * kv,
            c_head: self.c_batch,
            c_batch: self.c_batch * self.heads,
            ..self
        }
    }
}

/// The declarations of a, b, bias, c in `formats` and `store_c4`. `c_words`: every row of c
/// starts at an even element and N is even, so half-format pairs are whole words (else they
/// are stored element by element, by atomics).
pub(crate) fn prelude(formats: [Storage; 4], c_words: bool) -> Prelude {
    prelude_vec4(formats, c_words, [false, false])
}

/// [`prelude`] with a and b in the vec4 layout where `vec4` says so.
pub(crate) fn prelude_vec4(formats: [Storage; 4], c_words: bool, vec4: [bool; 2]) -> Prelude {
    let [fa, fb, fbias, fc] = formats;
    let atomic = fc.is_half() && !c_words;
    let mut s = array("a", 0, fa, vec4[0], Access::Read);
    s += &array("b", 1, fb, vec4[1], Access::Read);
    s += &array("bias", 2, fbias, false, Access::Read);
    s += &array(
        "c",
        3,
        fc,
        false,
        if atomic { Access::Atomic } else { Access::Write },
    );
    s += if fc.is_half() && !atomic {
        // N even and rows at even elements: n_left is even too.
        "fn store_c4(i: u32, n_left: u32, x: vec4<f32>) {\n    c_set2(i, x.xy);\n    if (n_left > 2u) { c_set2(i + 2u, x.zw); }\n}\n"
    } else {
        "fn store_c4(i: u32, n_left: u32, x: vec4<f32>) {\n    for (var j = 0u; j < 4u; j++) {\n        if (j < n_left) { c_set(i + j, x[j]); }\n    }\n}\n"
    };
    Prelude::from(s).tag(format!(
        "a={fa} b={fb} bias={fbias} c={fc}{}{}{}",
        if c_words { " c-words" } else { "" },
        if vec4[0] { " a-vec4" } else { "" },
        if vec4[1] { " b-vec4" } else { "" }
    ))
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
    /// Storage formats of a, b, bias, c.
    pub formats: [Storage; 4],
    /// Add the product to C (f32 C only).
    pub accumulate: bool,
}

impl Matmul<'_> {
    /// Every row of C starts at an even element and N is even, so half-format pairs are whole
    /// words (else they are stored element by element, by atomics).
    fn c_words(&self) -> bool {
        let p = &self.params;
        p.n.is_multiple_of(2)
            && p.c_row.is_multiple_of(2)
            && p.c_off.is_multiple_of(2)
            && p.c_batch.is_multiple_of(2)
            && p.c_head.is_multiple_of(2)
    }

    /// Whether the coop form can store C: f32, or half formats in whole words (its atomics
    /// would need a SPIR-V capability naga does not declare under the Vulkan memory model).
    fn coop_stores(&self) -> bool {
        !self.formats[3].is_half() || self.c_words()
    }

    /// Record the dispatch. `dummy` is bound where there is no bias.
    pub(crate) fn record(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        dummy: &wgpu::Buffer,
    ) -> Result<()> {
        let p = &self.params;
        let flops = 2.0 * p.m as f64 * p.n as f64 * p.k as f64 * self.batch as f64;
        let operands = [self.formats[0], self.formats[1]];
        let unsupported = |reason| crate::error::Error::Unsupported {
            path: "matmul",
            reason,
        };
        let caps = ctx.caps();
        let mut form = form_for_size(&caps, flops, operands).map_err(unsupported)?;
        if form.is_coop() && caps.forms.matmul.is_none() && !self.coop_stores() {
            // The scalar forms store what the coop form cannot.
            let scalar = caps.with_coop(
                crate::forms::CoopTiles::none("odd half-format rows"),
                caps.max_subgroup,
            );
            form = form_for_size(&scalar, flops, operands).map_err(unsupported)?;
        }
        self.record_form(ctx, encoder, dummy, form)
    }

    /// [`Matmul::record`] in `form`.
    pub(crate) fn record_form(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        dummy: &wgpu::Buffer,
        form: Form,
    ) -> Result<()> {
        let p = &self.params;
        let caps = ctx.caps();
        let form = match form {
            Form::Coop { tile } => {
                let t = crate::forms::coop_takes("coop matmul", &self.formats[..2])
                    .and_then(|()| caps.coop_tile(tile))
                    .map_err(|reason| crate::error::Error::Unsupported {
                        path: "matmul",
                        reason,
                    })?;
                Form::Coop { tile: Some(t) }
            }
            f => f,
        };
        let [tm, tn] = form.tile();
        let grid = [p.n.div_ceil(tn), p.m.div_ceil(tm), self.batch];
        let bias = self.bias.clone().unwrap_or(dummy.as_entire_buffer_binding());
        let constants = super::consts::overrides(&Overrides {
            TRANS_B: self.trans_b,
            HAS_BIAS: self.bias.is_some(),
            ACCUM: self.accumulate,
        });
        debug_assert!(!self.accumulate || self.formats[3] == Storage::F32);
        let c_words = self.c_words();
        if form.is_coop() && !self.coop_stores() {
            return Err(crate::error::Error::Unsupported {
                path: "matmul",
                reason: "the coop matmul stores a half-format C as whole words: its N, row stride and offsets must be even".into(),
            });
        }
        let (spec, prelude) = match form {
            Form::Tiled => (&SPEC, prelude(self.formats, c_words)),
            // Unrolled at the source on GPUs; CPU adapters (where it runs only when a test pins
            // it) compile the loops as written, in a fraction of the time.
            Form::GpuTiles => (
                &TILES_SPEC,
                prelude(self.formats, c_words).consts(&Unroll {
                    UNROLL: !ctx.caps().cpu,
                }),
            ),
            Form::Subgroup => {
                let aligned = |x: u32| x.is_multiple_of(4);
                let a4 = aligned(p.k)
                    && aligned(p.a_row)
                    && aligned(p.a_batch)
                    && aligned(p.a_head)
                    && aligned(p.a_off);
                let b4 = aligned(if self.trans_b { p.k } else { p.n })
                    && aligned(p.b_row)
                    && aligned(p.b_batch)
                    && aligned(p.b_head)
                    && aligned(p.b_off);
                (
                    &SG_SPEC,
                    prelude_vec4(self.formats, c_words, [a4, b4]).then(sg_prelude(
                        SG_ROWS,
                        self.trans_b,
                        a4,
                        b4,
                    )),
                )
            }
            Form::Coop { tile } => (
                &COOP_SPEC,
                coop_prelude(tile.expect("resolved above"), caps.coop_workgroup())
                    .then(prelude(self.formats, c_words)),
            ),
        };
        dispatch(
            ctx,
            encoder,
            spec,
            &prelude,
            &constants,
            &[self.a.clone(), self.b.clone(), bias, self.c.clone()],
            bytemuck::bytes_of(p),
            grid,
            super::Checks::Kernel,
        )
    }
}
