//! Kernel stages: each module owns one WGSL file from `shaders/`, its params struct (declared
//! once with `wgsl_struct!`; the WGSL twin is generated), the prelude of
//! constants and snippets that picks its form, and the code that records its dispatch.
//!
//! [`source`] assembles a kernel's WGSL (generated params, prelude, `shaders/common/`
//! snippets, the kernel file); [`pipeline`] builds it once per (kernel, prelude, override
//! constants) in the context's [`PipelineCache`](crate::device::pipelines::PipelineCache).

#[macro_use]
pub(crate) mod wgsl;
pub(crate) mod access;
pub(crate) mod aux;
pub(crate) mod backward;
pub(crate) mod decode;
pub(crate) mod flash;
pub(crate) mod matmul;
pub(crate) mod merge;
pub(crate) mod mod_map;
pub(crate) mod permute;
pub(crate) mod pinv;
pub(crate) mod rope;
pub(crate) mod softmax;
#[cfg(test)]
pub(crate) mod stage_tests;
#[cfg(feature = "translation-check")]
pub(crate) mod translate;
pub(crate) mod unroll;

use crate::device::context::Context;
use crate::device::pipelines::{Key, Pipeline};
use crate::error::{Error, Result};
use wgsl::WgslType;

/// The WGSL snippets the kernels share (`shaders/common/`), prepended by the host.
pub(crate) mod common {
    /// Sentinels and the online-softmax step.
    pub(crate) const SOFTMAX: &str = include_str!("../../shaders/common/softmax.wgsl");
    /// Mask bindings 0-2 and the mask tests (causal limit, key length, bits, bias).
    pub(crate) const MASKS: &str = include_str!("../../shaders/common/masks.wgsl");
    /// The matmul forms' batch slices and epilogue.
    pub(crate) const MATMUL: &str = include_str!("../../shaders/common/matmul.wgsl");
    /// Workgroup reductions through workgroup memory.
    pub(crate) const REDUCE_SHARED: &str = include_str!("../../shaders/common/reduce_shared.wgsl");
    /// Workgroup reductions by subgroup operations (the workgroup is one subgroup).
    pub(crate) const REDUCE_SUBGROUP: &str = include_str!("../../shaders/common/reduce_subgroup.wgsl");
}

wgsl_struct! {
    /// The masks of an attention problem as the kernels read them (`shaders/common/masks.wgsl`):
    /// the causal limit, key lengths, and the strides of the packed boolean mask (in u32 words)
    /// and of the bias (in elements), 0 on broadcast dimensions.
    pub(crate) struct Masks {
        has_causal: u32,
        /// Query `i` may see keys `j <= i + causal_off` (plus the batch's key length when
        /// `causal_by_len` is set).
        causal_off: i32,
        has_lens: u32,
        /// Bottom-right causal with key lengths: the offset is `kv_len(b) - L`, `causal_off`
        /// holding `-L`.
        causal_by_len: u32,
        mask_b: u32,
        mask_h: u32,
        mask_l: u32,
        bias_b: u32,
        bias_h: u32,
        bias_l: u32,
        bias_s: u32,
        /// The bias's element offset from its binding's start (a view's; 0 when dense).
        bias_off: u32,
        /// The sliding window's sides (-1: unbounded), read where HAS_WINDOW.
        win_left: i32,
        win_right: i32,
        /// The window's diagonal offset `S - L`, or `-L` with key lengths (the batch's length
        /// is added).
        win_off: i32,
        /// Keys `j < win_sinks` are exempt from the window.
        win_sinks: u32,
        /// The logit softcap C and 1 / C, read where HAS_SOFTCAP.
        softcap: f32,
        softcap_inv: f32,
        /// Where the ALiBi slopes start among the auxiliary words (`aux_word`: after the B key
        /// lengths), read where HAS_ALIBI.
        alibi_off: u32,
        /// Where the sink logits start among the auxiliary words (after the slopes), read
        /// where HAS_SINKS.
        sink_off: u32,
        /// Where the document ids start among the auxiliary words (after the sink logits),
        /// read where HAS_DOCS: the queries' `[B, L]` at doc_q, the keys' `[B, S]` at doc_k,
        /// then the (min, max) id of each block of DOC_BLOCK queries (doc_qb) and keys
        /// (doc_kb) of each batch; doc_l is L.
        doc_q: u32,
        doc_k: u32,
        doc_qb: u32,
        doc_kb: u32,
        doc_l: u32,
        /// Where the user functions' capture table starts among the auxiliary words (an
        /// (offset, length) pair per capture, then their values).
        cap_tab: u32,
        /// The mask_mod block map (`shaders/mod_map.wgsl`): 1 + its first word in binding 0
        /// (0: none: the kernels classify blocks themselves), and the query heads it counts.
        mod_map: u32,
        map_heads: u32,
        /// Added to the query and key positions the user functions see: a ring pair's chunk
        /// starts, so that they see the global positions (0 else).
        pos_q: u32,
        pos_k: u32,
        /// Where q's RoPE angles start among the auxiliary words ((cos, sin) per pair of each
        /// row (b, i) of q, `[B, L, D/2, 2]`), read where the views rotate q.
        rope_off: u32,
        /// `q_pos(b, i)` (the position of query `i` of batch `b`, as user functions see it)
        /// is `i + qpos_off`, plus the batch's key length with key lengths: `S - L`, or `-L`.
        qpos_off: i32,
    }
}

wgsl_struct! {
    /// One tensor's view as the kernels read it (`p.x.q`, ...; see [`crate::view`]): the
    /// element offset, the strides of B, H and S, and the rows per head `n` and the heads that
    /// split a kernel's row index `(b·heads + h)·n + s`. A paged cache's (`bs` > 0: tokens per
    /// block; [`crate::problem::Paged`]): `b` is the block table's entries per sequence, `tab`
    /// the auxiliary word where the table starts, `s` the stride of a token slot.
    pub(crate) struct RowView {
        off: u32,
        b: u32,
        h: u32,
        s: u32,
        n: u32,
        heads: u32,
        bs: u32,
        tab: u32,
    }
}

wgsl_struct! {
    /// The views of q, k, v, the output (`o`; the backward's saved output) and the backward's
    /// dout (`g`), read by the `X_base` functions of the tensors that are views
    /// ([`access::row_base`]); zero for dense tensors.
    pub(crate) struct TensorViews {
        q: RowView,
        k: RowView,
        v: RowView,
        o: RowView,
        g: RowView,
    }
}

impl TensorViews {
    /// From the problem's views.
    pub(crate) fn new(p: &crate::problem::Problem) -> Self {
        let row = |v: Option<crate::view::View>, n: usize, heads: usize| {
            v.map_or(RowView::default(), |v| RowView::new(v, heads, n))
        };
        let (l, s) = (p.seq_q, p.seq_kv);
        let (hq, hkv) = (p.q_heads, p.kv_heads);
        let x = &p.views;
        // A paged cache `[NB, BS, Hkv, E]`: token slots Hkv·E apart, heads E apart; head-major
        // `[NB, Hkv, BS, E]`: slots E apart, heads BS·E (a block is BS·Hkv·E either way).
        let paged = |v: Option<crate::view::View>, e: usize| {
            p.paged.as_ref().map(|pg| RowView {
                off: v.map_or(0, |v| v.offset) as u32,
                b: pg.max_blocks as u32,
                h: if pg.head_major { pg.block_size * e } else { e } as u32,
                s: if pg.head_major { e } else { hkv * e } as u32,
                n: s as u32,
                heads: hkv as u32,
                bs: pg.block_size as u32,
                tab: aux::page_table_at(p) as u32,
            })
        };
        TensorViews {
            q: row(x.q, l, hq),
            k: paged(x.k, p.head_dim).unwrap_or_else(|| row(x.k, s, hkv)),
            v: paged(x.v, p.head_dim_v).unwrap_or_else(|| row(x.v, s, hkv)),
            o: row(x.out, l, hq),
            g: row(x.dout, l, hq),
        }
    }

    /// Only the output's view (`o`), of `heads` heads of `n` rows: the merge's.
    pub(crate) fn output(v: crate::view::View, heads: usize, n: usize) -> Self {
        TensorViews {
            o: RowView::new(v, heads, n),
            ..Default::default()
        }
    }
}

impl RowView {
    /// `v`'s offset and strides, for `heads` heads of `n` rows each.
    fn new(v: crate::view::View, heads: usize, n: usize) -> Self {
        RowView {
            off: v.offset as u32,
            b: v.strides[0] as u32,
            h: v.strides[1] as u32,
            s: v.strides[2] as u32,
            n: n as u32,
            heads: heads as u32,
            ..Default::default()
        }
    }
}

impl Masks {
    /// These masks reading the mask_mod block map from word `word` of binding 0, counting
    /// `heads` query heads.
    pub(crate) fn with_mod_map(self, word: usize, heads: usize) -> Self {
        Masks {
            mod_map: word as u32 + 1,
            map_heads: heads as u32,
            ..self
        }
    }

    /// From the problem and the word strides of its packed mask (if any).
    pub(crate) fn new(p: &crate::problem::Problem, mask_strides: Option<[u32; 3]>) -> Self {
        // A bias view's strides (0 on broadcast dimensions) and offset, else its dense ones.
        let (bias, bias_off) = match (p.bias, p.views.bias) {
            (Some(_), Some(v)) => (v.strides, v.offset),
            (b, _) => (b.map(|b| b.strides()).unwrap_or([0; 4]), 0),
        };
        let mask = mask_strides.unwrap_or([0; 3]);
        // Bottom-right alignment follows each batch's key length when key lengths are given.
        let by_len = p.causal == crate::problem::Causal::BottomRight && p.kv_lens.is_some();
        // Window sides past 2^30 keys are unbounded in effect (no binding holds that many
        // keys) and keep the kernels' i32 arithmetic from overflowing.
        let window = p.window;
        let side = |v: i64| v.min(1 << 30) as i32;
        let doc = aux::doc_offsets(p);
        Masks {
            has_causal: (p.causal != crate::problem::Causal::None) as u32,
            causal_off: p
                .causal
                .offset(p.seq_q, if by_len { 0 } else { p.seq_kv })
                .unwrap_or(0)
                .clamp(i32::MIN as i64, i32::MAX as i64) as i32,
            has_lens: p.kv_lens.is_some() as u32,
            causal_by_len: by_len as u32,
            mask_b: mask[0],
            mask_h: mask[1],
            mask_l: mask[2],
            bias_b: bias[0] as u32,
            bias_h: bias[1] as u32,
            bias_l: bias[2] as u32,
            bias_s: bias[3] as u32,
            bias_off: bias_off as u32,
            win_left: window.map_or(-1, |w| side(w.left)),
            win_right: window.map_or(-1, |w| side(w.right)),
            win_off: (if p.kv_lens.is_some() { 0 } else { p.seq_kv as i64 } - p.seq_q as i64 + p.diag_shift)
                .clamp(i32::MIN as i64, i32::MAX as i64) as i32,
            win_sinks: window.map_or(0, |w| w.sink_tokens.min(u32::MAX as usize) as u32),
            softcap: p.softcap.unwrap_or(0.0),
            softcap_inv: p.softcap.map_or(0.0, |c| 1.0 / c),
            alibi_off: p.batch as u32,
            sink_off: (p.batch + p.alibi.as_ref().map_or(0, Vec::len)) as u32,
            doc_q: doc[0] as u32,
            doc_k: doc[1] as u32,
            doc_qb: doc[2] as u32,
            doc_kb: doc[3] as u32,
            doc_l: p.seq_q as u32,
            cap_tab: aux::aux_tail(p) as u32,
            pos_q: p.pos_offset[0] as u32,
            pos_k: p.pos_offset[1] as u32,
            rope_off: aux::rope_at(p) as u32,
            qpos_off: (if p.kv_lens.is_some() { 0 } else { p.seq_kv as i64 } - p.seq_q as i64)
                .clamp(i32::MIN as i64, i32::MAX as i64) as i32,
            ..Default::default()
        }
    }
}

/// Whether a form computes its logits as scalars summed by FMAs (`dot_fma` in
/// `shaders/common/softmax.wgsl`) rather than vec4 partials summed at the end: the GPU forms of
/// the fused forward and backward (`gpu_form`), unless the `scalar_logits=0` knob says
/// otherwise. The forward and backward forms a device picks agree, so the backward's recomputed
/// logits match the forward's logsumexp to the bit (FlashAttention's rule on large logits needs
/// it). Measured on an H200 (gpu-tiles, c_h8_s4096_causal f32): 0.978 -> 0.939 ms, a quarter of
/// the logits' registers.
pub(crate) fn scalar_logits(gpu_form: bool, tuning: &crate::forms::Tuning) -> bool {
    gpu_form && tuning.scalar_logits != Some(0)
}

/// The constants every masked forward kernel's prelude declares: whether a boolean mask and a
/// bias are bound (their code is compiled out when absent), the bias (binding 1) in its format
/// `bias`, and the key lengths (binding 2, read by `kv_len`).
pub(crate) fn mask_consts(
    has_mask: bool,
    has_bias: bool,
    mods: Mods,
    bias: crate::storage::Storage,
) -> String {
    mask_flags(has_mask, has_bias, mods, bias)
        + "@group(0) @binding(2) var<storage, read> kv_lens: array<u32>;\n\
           fn aux_word(i: u32) -> u32 { return kv_lens[i]; }\n"
}

/// Whether a kernel's code may run without wgpu's runtime checks (bounds checks, loop bounds)
/// where its spec is trusted: the crate's own code may, user code only once proved safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Checks {
    /// The crate's code alone, or user code proved safe.
    #[default]
    Kernel,
    /// User code that keeps the checks (a loop or a dynamic index).
    User,
}

impl Checks {
    /// The checks of `p`'s kernels: [`Checks::User`] for user code not proved safe.
    pub(crate) fn of(p: &crate::problem::Problem) -> Checks {
        match &p.user_fns {
            Some(u) if !u.code.proved_safe => Checks::User,
            _ => Checks::Kernel,
        }
    }
}

/// The built-in modifiers a kernel specialises on (the code of each is compiled out when
/// absent: CPU adapters execute both sides of every branch).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct Mods {
    /// A sliding window (with sink tokens).
    pub window: bool,
    /// A logit softcap.
    pub softcap: bool,
    /// ALiBi slopes (read from the auxiliary words after the key lengths).
    pub alibi: bool,
    /// Sink logits (the auxiliary words after the slopes).
    pub sinks: bool,
    /// Document ids (the auxiliary words after the sink logits).
    pub docs: bool,
    /// User functions: their checked code (none: the stubs) and which of the two they define.
    pub user: Option<std::sync::Arc<crate::user_mod::Checked>>,
    pub score_mod: bool,
    pub mask_mod: bool,
    /// How the softcap's tanh is taken (the tuning knob `softcap_form`, 0 to 2).
    pub softcap_form: u32,
}

impl Mods {
    /// Whether the user code of these modifiers keeps wgpu's runtime checks.
    pub(crate) fn checks(&self) -> Checks {
        match &self.user {
            Some(code) if !code.proved_safe => Checks::User,
            _ => Checks::Kernel,
        }
    }

    /// The modifiers of `p`, taken as `tuning` says.
    pub(crate) fn of(p: &crate::problem::Problem, tuning: &crate::forms::Tuning) -> Self {
        Mods {
            window: p.window.is_some(),
            softcap: p.softcap.is_some(),
            alibi: p.alibi.is_some(),
            sinks: p.sink_logits.is_some(),
            docs: p.doc_ids.is_some(),
            user: p.user_fns.as_ref().map(|u| u.code.clone()),
            score_mod: p.has_score_mod(),
            mask_mod: p.has_mask_mod(),
            softcap_form: tuning.softcap_form.unwrap_or(0).min(2),
        }
    }
}

/// [`mask_consts`] without the key lengths (the backward kernels read them from their
/// statistics buffer).
pub(crate) fn mask_flags(
    has_mask: bool,
    has_bias: bool,
    mods: Mods,
    bias: crate::storage::Storage,
) -> String {
    // MASKED_LOGIT: whether the fused kernels pass each logit through masked_logit (the window
    // alone they apply by key ranges).
    format!(
        "const HAS_MASK: bool = {has_mask};\nconst HAS_BIAS: bool = {has_bias};\nconst HAS_WINDOW: bool = {};\n\
         const HAS_SOFTCAP: bool = {};\nconst HAS_ALIBI: bool = {};\nconst HAS_SINKS: bool = {};\n\
         const HAS_DOCS: bool = {};\nconst HAS_SCORE_MOD: bool = {};\nconst HAS_MASK_MOD: bool = {};\n\
         const MASKED_LOGIT: bool = {};\nconst SOFTCAP_FORM: u32 = {}u;\n{}{}",
        mods.window,
        mods.softcap,
        mods.alibi,
        mods.sinks,
        mods.docs,
        mods.score_mod,
        mods.mask_mod,
        has_mask || has_bias || mods.softcap || mods.alibi || mods.docs || mods.score_mod || mods.mask_mod,
        mods.softcap_form,
        access::bias(bias),
        crate::user_mod::prelude(mods.user.as_deref()),
    )
}

/// Every kernel of the crate, once. The GPU-free tests assemble every one of them (naga,
/// `spirv-val`, MSL and HLSL), and a test holds the list complete: a new `KernelSpec` that is
/// not here fails it, and one here that no GPU-free test assembles fails those tests.
#[cfg(test)]
pub(crate) const ALL: &[&KernelSpec] = &[
    &flash::SPEC,
    &flash::TILES_SPEC,
    &flash::COOP_SPEC,
    &decode::DECODE,
    &decode::DECODE_TILES,
    &merge::MERGE,
    &softmax::SPEC,
    &matmul::SPEC,
    &matmul::SG_SPEC,
    &matmul::TILES_SPEC,
    &matmul::COOP_SPEC,
    &permute::SPEC,
    &rope::SPEC,
    &pinv::INIT,
    &pinv::EYE_MINUS,
    &mod_map::SPEC,
    &backward::PREP,
    &backward::DQ,
    &backward::DKV,
    &backward::DBIAS,
    &backward::DCAP,
    &backward::DCAP_SUM,
    &backward::DSINK,
    &backward::DS,
    &backward::DQ_COOP,
    &backward::DKV_COOP,
];

/// How a kernel binds one buffer; the binding number is the index in [`KernelSpec::bindings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Binding {
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    ReadWrite,
    /// `p: Params` (always last): a uniform buffer, or a read-only storage buffer where
    /// [`Context::params_in_storage`] says so. Declared by the host, not in the WGSL file.
    Params,
}

/// The bindings of the fused and decode kernels: mask, bias, kv_lens, q, k, v (read), two
/// outputs (read_write), params.
pub(crate) const ATTENTION_BINDINGS: &[Binding] = &[
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::ReadWrite,
    Binding::ReadWrite,
    Binding::Params,
];

/// A kernel: its name, WGSL source, the shared snippets it always uses, its bindings in order
/// and its params struct.
pub(crate) struct KernelSpec {
    pub(crate) name: &'static str,
    pub(crate) source: &'static str,
    /// Snippets from `shaders/common/` every form of the kernel uses; a form's own choices
    /// (I/O, reductions) come in its prelude.
    pub(crate) common: &'static [&'static str],
    pub(crate) bindings: &'static [Binding],
    /// The WGSL declarations of the params struct and its name.
    pub(crate) params: fn() -> (String, &'static str),
    /// Every storage index the kernel forms is in range by construction (rows clamped into the
    /// tensor, columns and tails guarded, loops bounded by params), given the bindings the host
    /// checks against the shapes before any dispatch: on GPUs its module is created without
    /// wgpu's runtime checks (`create_shader_module_trusted`), which cost the fused forward
    /// 24-44% on an H200 (docs/gpu/nvidia-h200.md). Marked: the fused forward and the fused
    /// backward (`bwd_prep`, `bwd_dq`, `bwd_dkv`: rows clamped to L and S, keys past S read
    /// through the clamped mask and bias accessors); zero-sized dimensions never reach them
    /// (`Error::ZeroSized`).
    pub(crate) trusted: bool,
}

/// [`KernelSpec::params`] of a struct declared by `wgsl_struct!`.
pub(crate) fn params_of<T: WgslType>() -> (String, &'static str) {
    (T::wgsl_decls(), T::wgsl_name())
}

/// The full WGSL of `spec` with `prelude`: the generated params struct and its binding, the
/// prelude, the shared snippets and the kernel, with marked loops unrolled where the prelude
/// asks for it.
pub(crate) fn source(spec: &KernelSpec, prelude: &str, params_in_storage: bool) -> String {
    let (decls, name) = (spec.params)();
    let space = if params_in_storage {
        "storage, read"
    } else {
        "uniform"
    };
    // `enable` directives (the coop forms') go before every declaration.
    let (enables, prelude): (Vec<&str>, Vec<&str>) = prelude
        .split_inclusive('\n')
        .partition(|l| l.starts_with("enable "));
    let mut s = format!(
        "// {} (assembled by src/kernels/mod.rs)\n{}{decls}@group(0) @binding({}) var<{space}> p: {name};\n{}{}",
        spec.name,
        enables.concat(),
        spec.bindings.len() - 1,
        access::HELPERS,
        prelude.concat(),
    );
    for c in spec.common {
        s.push_str(c);
    }
    s.push_str(spec.source);
    if !enables.is_empty() {
        s = without_atomics(s);
    }
    unroll::unroll(&s)
}

/// The matrix units' form of common/masks.wgsl's `mask_mod_any`: the invocations' votes in an
/// array that invocation 0 reads (its callers pass `nt == WG`), where the shared form has a
/// workgroup atomic. naga writes atomics with device scope, which SPIR-V under the Vulkan
/// memory model (what cooperative matrices turn on) allows only with a capability naga does
/// not declare: `spirv-val` refuses it, and a driver may.
const COOP_MOD_ANY: &str = "var<workgroup> wg_mod_votes: array<u32, WG>;
var<workgroup> wg_mod_flag: u32;
fn mask_mod_any(b: u32, h: u32, i0: u32, ni: u32, j0: u32, nj: u32, tid: u32, nt: u32) -> bool {
    var any = false;
    for (var t = tid; t < ni * nj; t += nt) {
        let i = i0 + t / nj;
        let j = j0 + t % nj;
        any = any || (i < p.m.doc_l && j < p.s && u_mask_mod(b, h, min(i, p.m.doc_l - 1u) + p.m.pos_q, min(j, p.s - 1u) + p.m.pos_k));
    }
    wg_mod_votes[tid] = u32(any);
    workgroupBarrier();
    if (tid == 0u) {
        var f = 0u;
        for (var t = 0u; t < WG; t++) {
            f |= wg_mod_votes[t];
        }
        wg_mod_flag = f;
    }
    return workgroupUniformLoad(&wg_mod_flag) != 0u;
}
";

/// `src` (a kernel with `enable` directives: the matrix units') with common/masks.wgsl's
/// `mask_mod_any` in its atomic-free form ([`COOP_MOD_ANY`]).
fn without_atomics(src: String) -> String {
    const BEGIN: &str = "var<workgroup> wg_mod_any: atomic<u32>;";
    const END: &str = "// mask_mod_any end\n";
    match (src.find(BEGIN), src.find(END)) {
        (Some(a), Some(z)) => format!("{}{COOP_MOD_ANY}{}", &src[..a], &src[z + END.len()..]),
        _ => src,
    }
}

/// Whether `spec`'s pipeline runs without wgpu's runtime checks on `ctx`. The `unchecked` knob
/// overrides (1: every kernel, 0: none), for measuring. User WGSL keeps the checks unless it
/// has no loops and no dynamic indexing (`user_mod::proved_safe`).
fn unchecked(ctx: &Context, spec: &KernelSpec, checks: Checks) -> bool {
    checks != Checks::User
        && match ctx.tuning().unchecked {
            Some(u) => u == 1,
            None => spec.trusted && !ctx.caps().cpu,
        }
}

/// The cached pipeline of `spec` with `prelude` and override `constants` on `ctx`.
pub(crate) fn pipeline(
    ctx: &Context,
    spec: &KernelSpec,
    prelude: &str,
    constants: &[(&'static str, f64)],
    checks: Checks,
) -> std::sync::Arc<Pipeline> {
    let unchecked = unchecked(ctx, spec, checks);
    ctx.pipelines()
        .get_or_build(Key::new(spec.name, prelude, constants, unchecked), || {
            let storage = ctx.params_in_storage(spec.bindings.len());
            let types: Vec<wgpu::BufferBindingType> = spec
                .bindings
                .iter()
                .map(|b| match b {
                    Binding::Read => wgpu::BufferBindingType::Storage { read_only: true },
                    Binding::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                    Binding::Params if storage => wgpu::BufferBindingType::Storage { read_only: true },
                    Binding::Params => wgpu::BufferBindingType::Uniform,
                })
                .collect();
            let src = source(spec, prelude, storage);
            // The crate's own tests: every pipeline also as Metal's and DX12's backends would
            // translate it (a failure there names the variant).
            #[cfg(feature = "translation-check")]
            if let Err(e) = translate::check(spec.name, &src, constants) {
                panic!("translation check: {e}");
            }
            #[cfg(not(target_arch = "wasm32"))]
            if crate::device::pipelines::compile_log::enabled() {
                let t0 = std::time::Instant::now();
                let p = Pipeline::new(ctx.device(), spec.name, src.clone(), &types, constants, unchecked);
                crate::device::pipelines::compile_log::first_dispatch(
                    ctx.device(),
                    ctx.queue(),
                    &p,
                    spec.name,
                    &src,
                    constants,
                    t0,
                );
                return p;
            }
            Pipeline::new(ctx.device(), spec.name, src, &types, constants, unchecked)
        })
}

/// Split `n` workgroups over x and y so that neither exceeds `max`; kernels recover the linear
/// index as `wg.x + wg.y * num_workgroups.x` and return when it is `>= n`.
pub(crate) fn grid_1d(n: u32, max: u32) -> [u32; 3] {
    if n <= max {
        [n.max(1), 1, 1]
    } else {
        [max, n.div_ceil(max), 1]
    }
}

/// Record one dispatch of `spec` in its own compute pass. `buffers` are bound in order to
/// bindings `0..buffers.len()`; `params` goes to the final params binding.
#[allow(clippy::too_many_arguments)] // each argument is a distinct part of one dispatch
pub(crate) fn dispatch(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    spec: &KernelSpec,
    prelude: &str,
    constants: &[(&'static str, f64)],
    buffers: &[wgpu::BufferBinding<'_>],
    params: &[u8],
    grid: [u32; 3],
    checks: Checks,
) -> Result<()> {
    let max = ctx.limits().max_compute_workgroups_per_dimension;
    if grid.iter().any(|&g| g > max) {
        return Err(Error::TooLargeForDevice {
            what: format!("{} dispatch grid {grid:?}", spec.name),
            bytes: 0,
            limit_name: "max_compute_workgroups_per_dimension",
            limit: max as u64,
            hint: "",
        });
    }
    if grid.contains(&0) {
        return Ok(());
    }
    debug_assert_eq!(buffers.len() + 1, spec.bindings.len());
    let device = ctx.device();
    let pipeline = pipeline(ctx, spec, prelude, constants, checks);
    // Either binding type (see `Context::params_in_storage`).
    let uniform = crate::device::buffers::constant(
        ctx,
        spec.name,
        params,
        wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::STORAGE,
    );
    let aliased = aliased_outputs(spec, buffers)?;
    let scratch: Vec<wgpu::Buffer> = aliased
        .iter()
        .map(|a| {
            let buf = crate::device::buffers::create(
                ctx,
                "aliased output",
                a.end - a.start,
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            );
            encoder.copy_buffer_to_buffer(a.buffer, a.start, &buf, 0, a.end - a.start);
            buf
        })
        .collect();
    let mut entries: Vec<wgpu::BufferBinding> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let mut b = b.clone();
            if let Some((a, s)) = aliased
                .iter()
                .zip(&scratch)
                .find(|(a, _)| a.bindings.contains(&i))
            {
                b.offset -= a.start;
                b.buffer = s;
            }
            b
        })
        .collect();
    entries.push(uniform.as_entire_buffer_binding());
    let bind_group = ctx.cache().bind_group(device, spec.name, &pipeline, &entries);
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(spec.name),
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipeline.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
    }
    for (a, s) in aliased.iter().zip(&scratch) {
        encoder.copy_buffer_to_buffer(s, 0, a.buffer, a.start, a.end - a.start);
    }
    Ok(())
}

/// A buffer bound read-write in a dispatch that also binds it read-only (an output in
/// another range of an input's buffer: a fused QKV buffer, a tensor allocator's pool), which
/// wgpu refuses: its read-write bindings (`bindings`) go through one scratch copy of bytes
/// `start..end` (the union of their ranges), copied in before the dispatch and back after.
/// The bytes the kernel does not write are copied back as they were.
struct Aliased<'b> {
    buffer: &'b wgpu::Buffer,
    start: u64,
    end: u64,
    bindings: Vec<usize>,
}

/// The read-write buffers of a dispatch that are also bound read-only (see [`Aliased`]).
/// The entry points check such outputs before any GPU work
/// ([`crate::device::buffers::check_aliasing`]); an internal misuse is an error here, not wgpu's panic.
fn aliased_outputs<'b>(spec: &KernelSpec, buffers: &[wgpu::BufferBinding<'b>]) -> Result<Vec<Aliased<'b>>> {
    let kind = |i: usize| spec.bindings[i];
    let mut out: Vec<Aliased<'b>> = Vec::new();
    for (i, b) in buffers.iter().enumerate() {
        if kind(i) != Binding::ReadWrite || out.iter().any(|a| a.buffer == b.buffer) {
            continue;
        }
        let read_too = buffers
            .iter()
            .enumerate()
            .any(|(j, o)| kind(j) == Binding::Read && o.buffer == b.buffer);
        if !read_too {
            continue;
        }
        let need = wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        if !b.buffer.usage().contains(need) {
            return Err(Error::BadBuffer {
                tensor: "output",
                reason: format!(
                    "{}: an output shares its buffer with an input, and is written through a scratch copy, which needs COPY_SRC and COPY_DST usage",
                    spec.name
                ),
            });
        }
        let bindings: Vec<usize> = (0..buffers.len())
            .filter(|&j| kind(j) == Binding::ReadWrite && buffers[j].buffer == b.buffer)
            .collect();
        let range = |j: usize| {
            let o = buffers[j].offset;
            let size = buffers[j].size.map_or(b.buffer.size() - o, |s| s.get());
            (o, o + size)
        };
        let start = bindings.iter().map(|&j| range(j).0).min().expect("one binding");
        let end = bindings.iter().map(|&j| range(j).1).max().expect("one binding");
        out.push(Aliased {
            buffer: b.buffer,
            start,
            end: end
                .next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT)
                .min(b.buffer.size()),
            bindings,
        });
    }
    Ok(out)
}

/// Tiered compilation, for kernels whose fastest form compiles slowly on CPU adapters
/// (lavapipe compiles a shader with LLVM at its first dispatch: seconds for the unrolled
/// fused kernel). Returns whether the pipeline of `spec` with `prelude` is ready. If it is
/// not, and this is a native CPU adapter, it is created on a background thread and
/// dispatched once on an empty problem (`params` all zero: the kernel returns at once) so
/// that the driver compiles it while the caller is served by a quicker-to-compile form;
/// returns `false` then, and the caller uses that form. Elsewhere (GPUs compile at pipeline
/// creation; the web has no threads; on GL one context serves every thread, see
/// [`Context::caps`]) returns `true`: use the pipeline directly.
pub(crate) fn warm(ctx: &Context, spec: &'static KernelSpec, prelude: String, checks: Checks) -> bool {
    #[cfg(target_arch = "wasm32")]
    {
        let _ = (ctx, spec, prelude, checks);
        true
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        if !ctx.is_cpu() || !ctx.caps().background_compile {
            return true;
        }
        let key = Key::new(spec.name, &prelude, &[], unchecked(ctx, spec, checks));
        if ctx.pipelines().contains(&key) {
            return true;
        }
        if !ctx.pipelines().start_warming(key.clone()) {
            return false;
        }
        let bg = ctx.clone();
        let handle = std::thread::spawn(move || {
            // Errors here would recur, and be reported, where the pipeline is used.
            let _ = pollster::block_on(bg.scoped(|| {
                pipeline(&bg, spec, &prelude, &[], checks).dispatch_zeroed(bg.device(), bg.queue());
                Ok(())
            }));
            bg.pipelines().end_warming(&key);
        });
        ctx.pipelines().push_thread(handle);
        false
    }
}

/// The head dims past which CPU adapters keep the loops over them (`UNROLL_E` false): unrolled
/// with the rows and keys, a head dim of 255 took lavapipe 20-30 s per kernel to compile.
pub(crate) const CPU_UNROLL_MAX_DIM: usize = 128;

/// Whether the fused and backward kernels unroll their loops over the head dims (when they
/// unroll at all): on GPUs always, on CPU adapters up to [`CPU_UNROLL_MAX_DIM`].
pub(crate) fn unroll_dims(p: &crate::problem::Problem, caps: &crate::forms::Caps) -> bool {
    !caps.cpu || p.head_dim.max(p.head_dim_v) <= CPU_UNROLL_MAX_DIM
}

#[cfg(test)]
mod tests {
    thread_local! {
        /// The kernels this test thread assembled.
        static COVERED: std::cell::RefCell<std::collections::BTreeSet<&'static str>> = Default::default();
    }

    /// [`super::source`], recording the kernel as assembled by this test.
    fn covered_source(spec: &KernelSpec, prelude: &str, storage: bool) -> String {
        COVERED.with(|c| c.borrow_mut().insert(spec.name));
        super::source(spec, prelude, storage)
    }

    /// Which GPU-free test assembles which kernels (each asserts its own at its end); their
    /// union is every kernel of [`super::ALL`] (`the_kernel_list_is_complete`).
    const ASSEMBLED_BY: &[(&str, &[&str])] = &[
        (
            "attention",
            &["flash", "flash_tiles", "decode", "decode_tiles", "softmax"],
        ),
        (
            "ops",
            &[
                "merge",
                "matmul",
                "matmul_sg",
                "matmul_tiles",
                "permute",
                "rope",
                "pinv_init",
                "eye_minus",
                "bwd_dsink",
                "bwd_dcap_sum",
                "mod_map",
                "bwd_dcap",
            ],
        ),
        (
            "backward",
            &["bwd_prep", "bwd_dq", "bwd_dkv", "bwd_dbias", "bwd_ds"],
        ),
        ("coop matmul", &["matmul_coop"]),
        ("coop forward", &["flash_coop"]),
        ("coop backward", &["bwd_dq_coop", "bwd_dkv_coop"]),
    ];

    /// This test thread assembled every kernel `ASSEMBLED_BY` gives test `which`.
    fn assert_assembled(which: &str) {
        let (_, want) = ASSEMBLED_BY
            .iter()
            .find(|(w, _)| *w == which)
            .expect("a test of the table");
        let got = COVERED.with(|c| c.borrow().clone());
        let missing: Vec<&&str> = want.iter().filter(|n| !got.contains(*n)).collect();
        assert!(missing.is_empty(), "{which}: kernels not assembled: {missing:?}");
    }

    /// [`super::ALL`] names every `KernelSpec` of `src/kernels/`, once.
    #[test]
    fn the_kernel_list_is_complete() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
        let mut declared = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                if line.starts_with("pub(crate) const ") && line.ends_with(": KernelSpec = KernelSpec {") {
                    let name = lines[i + 1].trim().strip_prefix("name: \"").expect("name first");
                    declared.push(name.trim_end_matches("\",").to_string());
                }
            }
        }
        declared.sort();
        let mut listed: Vec<String> = super::ALL.iter().map(|s| s.name.to_string()).collect();
        listed.sort();
        assert_eq!(
            declared, listed,
            "kernels::ALL and the KernelSpecs of src/kernels/"
        );
        listed.dedup();
        assert_eq!(listed.len(), super::ALL.len(), "a kernel listed twice");
        let mut assembled: Vec<String> = ASSEMBLED_BY
            .iter()
            .flat_map(|(_, n)| n.iter().map(|n| n.to_string()))
            .collect();
        assembled.sort();
        assert_eq!(assembled, listed, "the GPU-free tests' kernels and kernels::ALL");
    }
    use super::*;

    use crate::forms::Caps;
    use crate::problem::{Causal, Problem};
    use wgsl::WgslStruct;

    /// Every kernel fits WebGPU's default of 8 storage buffers per shader stage with its params
    /// in a uniform buffer, and its params binding comes last (see `params_in_storage` for
    /// where the params take a storage binding instead).
    #[test]
    fn every_kernel_fits_webgpu_default_binding_limits() {
        let webgpu = wgpu::Limits::default().max_storage_buffers_per_shader_stage as usize;
        assert_eq!(webgpu, 8);
        for spec in [
            &flash::SPEC,
            &flash::TILES_SPEC,
            &pinv::INIT,
            &pinv::EYE_MINUS,
            &decode::DECODE,
            &decode::DECODE_TILES,
            &merge::MERGE,
            &matmul::SPEC,
            &matmul::SG_SPEC,
            &matmul::TILES_SPEC,
            &permute::SPEC,
            &softmax::SPEC,
        ]
        .into_iter()
        .chain(backward::ALL)
        {
            let storage = spec
                .bindings
                .iter()
                .filter(|b| !matches!(b, Binding::Params))
                .count();
            assert!(storage <= webgpu, "{}: {storage} storage buffers", spec.name);
            assert!(
                matches!(spec.bindings.last(), Some(Binding::Params)),
                "{}: params last",
                spec.name
            );
        }
    }

    /// Views of every tensor (odd offsets and strides: the scalar form of each accessor).
    fn test_views() -> crate::view::Views {
        let v = |offset| {
            Some(crate::view::View {
                offset,
                strides: [9001, 97, 131, 1],
            })
        };
        crate::view::Views {
            q: v(1),
            k: v(3),
            v: v(0),
            out: v(5),
            dout: v(7),
            bias: v(9),
            paged: None,
            q_rope: None,
        }
    }

    /// Parse and validate `src` with naga (the front end wgpu uses), then check that the WGSL
    /// struct `T` has the Rust struct's fields, in order, at the same offsets.
    fn validate_with<T: WgslStruct>(label: &str, src: &str) {
        let module = naga::front::wgsl::parse_str(src)
            .unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(src)));
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{label}: {e:?}"));
        drop(info);
        check_struct::<T>(label, &module);
        // As wgpu's Metal and DX12 backends would translate it.
        translate::check(label, src, &[]).unwrap_or_else(|e| panic!("{e}"));
    }

    fn check_struct<T: WgslStruct>(label: &str, module: &naga::Module) {
        let name = T::wgsl_name();
        let (_, ty) = module
            .types
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("{label}: no struct {name}"));
        let naga::TypeInner::Struct { members, span } = &ty.inner else {
            panic!("{label}: {name} is not a struct")
        };
        let wgsl: Vec<(&str, usize)> = members
            .iter()
            .map(|m| (m.name.as_deref().unwrap(), m.offset as usize))
            .collect();
        assert_eq!(wgsl, T::fields(), "{label}: {name} fields and offsets");
        assert_eq!(*span as usize, std::mem::size_of::<T>(), "{label}: {name} size");
        assert_eq!(
            std::mem::size_of::<T>() % 16,
            0,
            "{name}: uniform structs are multiples of 16 bytes"
        );
    }

    /// Every kernel, in every form and specialisation, assembles into WGSL that naga accepts,
    /// and its params struct has the Rust struct's layout field by field (the nested masks
    /// included). Runs without a GPU.
    #[test]
    fn every_kernel_assembles_and_params_match_rust() {
        let caps_list = [
            Caps::new(&wgpu::Limits::default(), false, Some(32)),
            Caps::new(&wgpu::Limits::default(), true, Some(8)),
            Caps::new(&wgpu::Limits::default(), true, None),
        ];
        use crate::storage::{Formats, Storage};
        let formats = [
            Formats::all(Storage::F32),
            Formats::all(Storage::F16),
            Formats::all(Storage::Bf16),
            Formats {
                out: Storage::F32,
                bias: Storage::F16,
                ..Formats::all(Storage::Bf16)
            },
        ];
        for (e, ev, fi) in [
            (64, 64, 0),
            (37, 5, 0),
            (64, 64, 1),
            (37, 5, 1),
            (64, 64, 2),
            (37, 6, 2),
            (37, 5, 3),
        ] {
            for masked in [false, true] {
                let mut p = Problem::new(&[2, 4, 9, e], &[2, 2, 600, e], &[2, 2, 600, ev])
                    .unwrap()
                    .with_storage(formats[fi]);
                if masked {
                    p = p
                        .with_causal(Causal::BottomRight)
                        .with_mask(&[9, 600])
                        .unwrap()
                        .with_bias(&[4, 1, 600])
                        .unwrap()
                        .with_kv_lens(&[5, 600])
                        .unwrap()
                        .with_window(Some((20, 3)), 2)
                        .unwrap()
                        .with_softcap(Some(5.0))
                        .unwrap()
                        .with_alibi(Some(&[0.5, 0.25, 0.125, 0.0625]))
                        .unwrap();
                    p.views = test_views();
                    // Paged caches (the block table's reads) in half of the cases.
                    p.views.paged = [None, Some(16), None, Some(3)][fi];
                    // q rotated as it is read: half-split, interleaved, none.
                    p.views.q_rope = [Some((e - e % 2, true)), Some((4, false)), None, None][fi];
                }
                for caps in caps_list {
                    for form in caps.fused_forms() {
                        let c = caps.with_forms(form);
                        let cfg = flash::Config::new(&p, &c).unwrap();
                        for storage in [false, true] {
                            let label = format!("flash {form:?} E {e} Ev {ev} masked {masked} formats {fi}");
                            validate_with::<flash::Params>(
                                &label,
                                &covered_source(cfg.spec(), &cfg.prelude(), storage),
                            );
                        }
                    }
                    for form in caps.decode_forms() {
                        let c = caps.with_forms(form);
                        let cfg = decode::Config::new(&p, &c).unwrap();
                        let label = format!("decode {form:?} E {e} Ev {ev} masked {masked} formats {fi}");
                        validate_with::<decode::Params>(
                            &label,
                            &covered_source(cfg.spec(), &cfg.prelude(), false),
                        );
                    }
                }
                validate_with::<softmax::Params>(
                    "softmax",
                    &covered_source(
                        &softmax::SPEC,
                        &mask_consts(
                            p.mask.is_some(),
                            p.bias.is_some(),
                            Mods::of(&p, &Default::default()),
                            p.storage.bias,
                        ),
                        false,
                    ),
                );
            }
        }
        assert_assembled("attention");
    }

    /// The other kernels (the ops' merge, matmul forms, strided copy and RoPE, the
    /// pseudo-inverse's steps, the backward's d(sinks) and captures' sum) assemble into WGSL
    /// that naga accepts with the Rust params layout, in every format, and translate to MSL
    /// and HLSL; and the nested masks' layout, through the fused kernel. Runs without a GPU.
    #[test]
    fn every_op_kernel_assembles_and_params_match_rust() {
        use crate::storage::Storage;
        for parts in Storage::ALL {
            for out in Storage::ALL {
                for ev in [4, 5] {
                    for view in [None, test_views().out] {
                        validate_with::<merge::Params>(
                            "merge",
                            &covered_source(&merge::MERGE, &merge::prelude(parts, out, ev, view), false),
                        );
                    }
                }
            }
        }
        for f in Storage::ALL {
            for words in [false, true] {
                validate_with::<matmul::Params>(
                    "matmul",
                    &covered_source(&matmul::SPEC, &matmul::prelude([f, f, f, f], words), false),
                );
                validate_with::<matmul::Params>(
                    "matmul_tiles",
                    &covered_source(
                        &matmul::TILES_SPEC,
                        &(matmul::prelude([f, f, f, f], words) + "const UNROLL: bool = true;\n"),
                        false,
                    ),
                );
                for trans_b in [false, true] {
                    for vec4 in [false, true] {
                        let pre = matmul::prelude_vec4([f, f, f, f], words, [vec4, vec4])
                            + &matmul::sg_prelude(3, trans_b, vec4, vec4);
                        validate_with::<matmul::Params>(
                            "matmul_sg",
                            &covered_source(&matmul::SG_SPEC, &pre, false),
                        );
                    }
                }
            }
        }
        for src in Storage::ALL {
            for dst in Storage::ALL {
                let label = format!("permute {src:?} -> {dst:?}");
                validate_with::<permute::Params>(
                    &label,
                    &covered_source(&permute::SPEC, &permute::prelude(src, dst), false),
                );
                let label = format!("rope {src:?} -> {dst:?}");
                validate_with::<rope::Params>(
                    &label,
                    &covered_source(&rope::SPEC, &rope::prelude(Some(src), dst), false),
                );
            }
            let label = format!("rope in place {src:?}");
            validate_with::<rope::Params>(
                &label,
                &covered_source(&rope::SPEC, &rope::prelude(None, src), false),
            );
        }
        // The pseudo-inverse's steps, d(sink logits) and the captures' gradients' sum (no
        // prelude). The mask_mod block map and the captures' gradients themselves need a
        // user function: tests/sdpa.rs and tests/backward.rs run them, translated at pipeline
        // creation (src/kernels/translate.rs).
        validate_with::<pinv::InitParams>("pinv_init", &covered_source(&pinv::INIT, "", false));
        validate_with::<pinv::EyeParams>("eye_minus", &covered_source(&pinv::EYE_MINUS, "", false));
        validate_with::<backward::Params>("bwd_dsink", &covered_source(&backward::DSINK, "", false));
        validate_with::<backward::Params>("bwd_dcap_sum", &covered_source(&backward::DCAP_SUM, "", false));
        // The nested masks, through the fused kernel.
        let cfg = flash::Config::new(
            &Problem::new(&[1, 1, 1, 4], &[1, 1, 1, 4], &[1, 1, 1, 4]).unwrap(),
            &Caps::new(&wgpu::Limits::default(), false, Some(32)),
        )
        .unwrap();
        let src = covered_source(&flash::SPEC, &cfg.prelude(), false);
        check_struct::<Masks>("masks", &naga::front::wgsl::parse_str(&src).unwrap());
        // The user functions' kernels: the mask_mod block map and the capture gradients.
        let q = ndarray::Array4::<f32>::zeros((1, 2, 5, 8));
        let k = ndarray::Array4::<f32>::zeros((1, 2, 7, 8));
        let table = [0.5f32; 4];
        let user = crate::user_mod::UserMod::wgsl(
            "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s + t(h); }\n\
             fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }\n\
             fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) { d_t(h, g); }\n\
             fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return i >= j; }",
        )
        .capture("t", &table);
        let p = crate::sdpa::Sdpa::new(&q, &k, &k)
            .user_mod(user)
            .problem()
            .unwrap();
        let mods = Mods {
            mask_mod: true,
            user: p.user_fns.as_ref().map(|u| u.code.clone()),
            ..Default::default()
        };
        validate_with::<mod_map::Params>(
            "mod_map",
            &covered_source(
                &mod_map::SPEC,
                &mask_consts(false, false, mods, Storage::F32),
                false,
            ),
        );
        let dcap =
            backward::dcap_prelude(&p, &Default::default()).expect("the source has score_mod_dcapture");
        validate_with::<backward::Params>("bwd_dcap", &covered_source(&backward::DCAP, &dcap, false));
        assert_assembled("ops");
    }

    /// Every backward kernel, in both forms, every layout and format, masked or not, assembles
    /// into WGSL that naga accepts with the Rust params layout.
    #[test]
    fn backward_kernels_assemble() {
        use crate::storage::{Formats, Storage};
        for (e, ev) in [(64, 64), (37, 5), (8, 12)] {
            for fmt in Storage::ALL {
                for masked in [false, true] {
                    let mut p = Problem::new(&[2, 4, 9, e], &[2, 2, 60, e], &[2, 2, 60, ev])
                        .unwrap()
                        .with_storage(Formats::all(fmt));
                    if masked {
                        p = p
                            .with_causal(Causal::BottomRight)
                            .with_mask(&[9, 60])
                            .unwrap()
                            .with_bias(&[4, 1, 60])
                            .unwrap()
                            .with_kv_lens(&[5, 60])
                            .unwrap();
                        p.views = test_views();
                    }
                    for (cpu, sg) in [(false, Some(32)), (true, Some(8)), (true, None)] {
                        let caps = Caps::new(&wgpu::Limits::default(), cpu, sg);
                        let c = backward::Config::new(&p, &caps).unwrap();
                        let label =
                            format!("E {e} Ev {ev} {fmt:?} masked {masked} cpu {cpu} subgroup {sg:?}");
                        for (spec, pre) in [
                            (&backward::DQ, c.dq_prelude()),
                            (&backward::DKV, c.dkv_prelude()),
                            (&backward::DBIAS, backward::dbias_prelude(&p, &Default::default())),
                            (
                                &backward::DS,
                                backward::ds_prelude(masked, masked, Mods::of(&p, &Default::default()), fmt),
                            ),
                            (
                                &backward::PREP,
                                backward::prep_prelude(fmt, Storage::F32, &p.views),
                            ),
                        ] {
                            validate_with::<backward::Params>(
                                &format!("{} {label}", spec.name),
                                &covered_source(spec, &pre, cpu),
                            );
                        }
                    }
                }
            }
        }
        assert_assembled("backward");
    }

    /// On CPU adapters the fused backward takes one row (key) per invocation for problems
    /// under the forward's threshold and several above it (the forward's rule); the
    /// several-row kernels, which only large problems get, assemble and match the Rust params.
    #[test]
    fn cpu_backward_rows_follow_the_problem_size() {
        for (e, ev) in [(64, 64), (37, 5), (8, 12)] {
            for sg in [Some(8), None] {
                let caps = Caps::new(&wgpu::Limits::default(), true, sg);
                let small = Problem::new(&[2, 4, 9, e], &[2, 2, 60, e], &[2, 2, 60, ev]).unwrap();
                assert!(small.flops() < flash::CPU_UNROLL_MIN_FLOPS);
                assert_eq!(backward::Config::new(&small, &caps).unwrap().rq, 1);
                let large = Problem::new(&[1, 8, 1024, e], &[1, 8, 1024, e], &[1, 8, 1024, ev]).unwrap();
                assert!(large.flops() >= flash::CPU_UNROLL_MIN_FLOPS);
                let c = backward::Config::new(&large, &caps).unwrap();
                assert!(c.rq > 1 && c.rk > 1, "E {e} Ev {ev} subgroup {sg:?}: {c:?}");
                for (spec, pre) in [(&backward::DQ, c.dq_prelude()), (&backward::DKV, c.dkv_prelude())] {
                    validate_with::<backward::Params>(
                        &format!("{} E {e} Ev {ev} subgroup {sg:?} rows {}", spec.name, c.rq),
                        &covered_source(spec, &pre, true),
                    );
                }
            }
        }
    }

    /// Every specialisation of the coop matmul (tiles 8 and 16, every storage format of its
    /// operands and output, both B layouts, with and without bias and accumulation) assembles
    /// into WGSL that naga validates with the Rust params layout, and into SPIR-V; where
    /// `WGPU_ATTENTION_SPIRV_VAL` names a `spirv-val` command (scripts/coopmat_driver.sh sets
    /// it), that SPIR-V passes it too (naga 30 writes invalid SPIR-V for a cooperative value
    /// bound with `let`, which lavapipe runs anyway and a GPU driver may refuse).
    #[test]
    fn coop_matmul_validates_and_makes_valid_spirv() {
        use crate::storage::Storage;
        let spirv_val = std::env::var("WGPU_ATTENTION_SPIRV_VAL").ok();
        for t in [8, 16] {
            for (fa, fb, fc) in [
                (Storage::F16, Storage::F16, Storage::F16),
                (Storage::F16, Storage::F16, Storage::F32),
                (Storage::F32, Storage::F16, Storage::F32),
                (Storage::F32, Storage::F32, Storage::Bf16),
            ] {
                for c_words in [true, false] {
                    // Half outputs stored element by element (atomics) are not the coop
                    // form's: naga's atomics under the Vulkan memory model lack a capability.
                    if fc.is_half() && !c_words {
                        continue;
                    }
                    let pre =
                        matmul::coop_prelude(t, 128) + &matmul::prelude([fa, fb, Storage::F32, fc], c_words);
                    let src = covered_source(&matmul::COOP_SPEC, &pre, false);
                    let label = format!("matmul_coop {t} {fa:?} {fb:?} -> {fc:?} words {c_words}");
                    validate_with::<matmul::Params>(&label, &src);
                    for trans_b in [true, false] {
                        for (bias, accum) in [(false, false), (true, false), (false, true)] {
                            let consts = [("TRANS_B", trans_b), ("HAS_BIAS", bias), ("ACCUM", accum)];
                            let words = spirv_of(&src, &consts, &label);
                            if let Some(cmd) = &spirv_val {
                                spirv_validates(cmd, &words, &format!("{label} {consts:?}"));
                            }
                        }
                    }
                }
            }
        }
        assert_assembled("coop matmul");
    }

    /// A GPU with 48 KiB of workgroup memory, subgroups of 32 and both coop tiles.
    fn coop_caps() -> Caps {
        let limits = wgpu::Limits {
            max_compute_workgroup_storage_size: 48 * 1024,
            ..wgpu::Limits::default()
        };
        let tiles = crate::forms::CoopTiles {
            t8: true,
            t16: true,
            none_because: None,
        };
        Caps::new(&limits, false, Some(32)).with_coop(tiles, 32)
    }

    /// The coop kernels' test problem (GQA, L != S, tails): with `masked` every mask kind,
    /// key lengths, a window with sinks, a softcap and views of every tensor.
    fn coop_problem(e: usize, ev: usize, formats: crate::storage::Formats, masked: bool) -> Problem {
        let p = Problem::new(&[2, 4, 9, e], &[2, 2, 60, e], &[2, 2, 60, ev])
            .unwrap()
            .with_storage(formats);
        if !masked {
            return p;
        }
        let mut p = p
            .with_causal(Causal::BottomRight)
            .with_mask(&[9, 60])
            .unwrap()
            .with_bias(&[4, 1, 60])
            .unwrap()
            .with_kv_lens(&[5, 60])
            .unwrap()
            .with_window(Some((5, 3)), 2)
            .unwrap()
            .with_softcap(Some(30.0))
            .unwrap();
        p.views = test_views();
        p
    }

    /// The fused forward's coop form, in both tiles, f16 and f32 inputs, head dims that are
    /// and are not multiples of the tile, without masks and with every mask kind, modifier
    /// and views: naga validates it with the Rust params layout, it makes SPIR-V, and where
    /// `WGPU_ATTENTION_SPIRV_VAL` names `spirv-val` that SPIR-V passes it.
    #[test]
    fn coop_fused_forward_validates_and_makes_valid_spirv() {
        use crate::storage::{Formats, Storage};
        let spirv_val = std::env::var("WGPU_ATTENTION_SPIRV_VAL").ok();
        for t in [8, 16] {
            let caps = coop_caps();
            let caps = caps.with_forms(crate::forms::FusedForm::Coop { tile: Some(t) });
            for (e, ev, fmt, masked) in [
                (64, 64, Storage::F16, false),
                (64, 64, Storage::F32, true),
                (37, 20, Storage::F32, true),
                (128, 128, Storage::F16, false),
            ] {
                let p = coop_problem(e, ev, Formats::all(fmt), masked);
                // A half output through a view whose pairs are not words (or of odd Ev) is
                // stored by atomics: refused.
                let half_view = p.clone().with_storage(Formats::all(Storage::F16));
                if masked {
                    assert!(flash::Config::new(&half_view, &caps).is_err());
                }
                let cfg = flash::Config::new(&p, &caps).unwrap();
                assert_eq!(cfg.form, crate::forms::FusedForm::Coop { tile: Some(t) });
                assert!(!src_has_atomics(&covered_source(
                    cfg.spec(),
                    &cfg.prelude(),
                    false
                )));
                let src = covered_source(cfg.spec(), &cfg.prelude(), false);
                let label = format!("flash_coop {t} E {e} Ev {ev} {fmt:?} masked {masked}");
                validate_with::<flash::Params>(&label, &src);
                let words = spirv_of(&src, &[], &label);
                if let Some(cmd) = &spirv_val {
                    spirv_validates(cmd, &words, &label);
                }
            }
        }
        assert_assembled("coop forward");
    }

    /// The fused backward's coop form (dQ and dK/dV), in both tiles, f16 and f32 inputs, head
    /// dims that are and are not multiples of the tile, GQA, without masks and with every mask
    /// kind, modifier and views: naga validates it with the Rust params layout, it makes
    /// SPIR-V, and where `WGPU_ATTENTION_SPIRV_VAL` names `spirv-val` that SPIR-V passes it. A
    /// half dQ of odd E (stored by atomics) and bf16 inputs are refused.
    #[test]
    fn coop_backward_validates_and_makes_valid_spirv() {
        use crate::storage::{Formats, Storage};
        let spirv_val = std::env::var("WGPU_ATTENTION_SPIRV_VAL").ok();
        for t in [8, 16] {
            let caps = coop_caps();
            let caps = caps.with_forms(crate::forms::BackwardForm::Coop { tile: Some(t) });
            for (e, ev, fmt, masked) in [
                (64, 64, Storage::F16, false),
                (64, 64, Storage::F32, true),
                (37, 20, Storage::F32, true),
                (128, 128, Storage::F16, true),
            ] {
                let p = coop_problem(e, ev, Formats::all(fmt), masked);
                let c = backward::Config::new(&p, &caps).unwrap();
                assert_eq!(c.form, crate::forms::BackwardForm::Coop { tile: Some(t) });
                for (spec, pre) in [(c.dq_spec(), c.dq_prelude()), (c.dkv_spec(), c.dkv_prelude())] {
                    let src = covered_source(spec, &pre, false);
                    assert!(!src_has_atomics(&src), "{}", spec.name);
                    let label = format!("{} {t} E {e} Ev {ev} {fmt:?} masked {masked}", spec.name);
                    validate_with::<backward::Params>(&label, &src);
                    let words = spirv_of(&src, &[], &label);
                    if let Some(cmd) = &spirv_val {
                        spirv_validates(cmd, &words, &label);
                    }
                }
            }
            let odd = Problem::new(&[1, 2, 9, 37], &[1, 2, 20, 37], &[1, 2, 20, 8])
                .unwrap()
                .with_storage(Formats::all(Storage::F16));
            assert!(backward::Config::new(&odd, &caps).is_err());
            let bf16 = Problem::new(&[1, 2, 9, 32], &[1, 2, 20, 32], &[1, 2, 20, 8])
                .unwrap()
                .with_storage(Formats::all(Storage::Bf16));
            assert!(backward::Config::new(&bf16, &caps).is_err());
        }
        assert_assembled("coop backward");
    }

    fn src_has_atomics(src: &str) -> bool {
        src.contains("atomic<")
    }

    /// `src` with its boolean overrides set, as SPIR-V for Vulkan 1.3 (what wgpu would hand
    /// the driver).
    fn spirv_of(src: &str, overrides: &[(&str, bool)], label: &str) -> Vec<u32> {
        let module = naga::front::wgsl::parse_str(src)
            .unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(src)));
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{label}: {e:?}"));
        let constants: naga::back::PipelineConstants = overrides
            .iter()
            .map(|(k, v)| (k.to_string(), f64::from(u8::from(*v))))
            .collect();
        let (module, info) =
            naga::back::pipeline_constants::process_overrides(&module, &info, None, &constants)
                .unwrap_or_else(|e| panic!("{label}: overrides: {e:?}"));
        let options = naga::back::spv::Options {
            lang_version: (1, 6),
            ..Default::default()
        };
        let pipeline = naga::back::spv::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: "main".into(),
        };
        naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
            .unwrap_or_else(|e| panic!("{label}: SPIR-V: {e:?}"))
    }

    /// Run `cmd` (a `spirv-val` command line) on `words`.
    fn spirv_validates(cmd: &str, words: &[u32], label: &str) {
        // One file per call: `cargo test` runs the tests that call this on threads of one process.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("wgpu-attention-{}-{n}.spv", std::process::id()));
        std::fs::write(&path, bytemuck::cast_slice(words)).unwrap();
        let mut parts = cmd.split_whitespace();
        let out = std::process::Command::new(parts.next().expect("a command"))
            .args(parts)
            .args(["--target-env", "vulkan1.3"])
            .arg(&path)
            .output()
            .unwrap_or_else(|e| panic!("{label}: cannot run {cmd}: {e}"));
        let _ = std::fs::remove_file(&path);
        assert!(
            out.status.success(),
            "{label}: spirv-val: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn grid_folds_over_the_limit() {
        assert_eq!(grid_1d(10, 65535), [10, 1, 1]);
        assert_eq!(grid_1d(65536, 65535), [65535, 2, 1]);
        let g = grid_1d(200_000, 65535);
        assert!(g[0] as u64 * g[1] as u64 >= 200_000);
    }
}
