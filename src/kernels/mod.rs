//! Kernel stages: each module owns one WGSL file from `shaders/`, its params struct (declared
//! once with `wgsl_struct!`; the WGSL twin is generated), the prelude of
//! constants and snippets that picks its form, and the code that records its dispatch.
//!
//! [`source`] assembles a kernel's WGSL (generated params, prelude, `shaders/common/`
//! snippets, the kernel file); [`pipeline`] builds it once per (kernel, prelude, override
//! constants) in the context's [`PipelineCache`](crate::device::pipelines::PipelineCache).

#[macro_use]
pub(crate) mod wgsl;
#[macro_use]
pub(crate) mod consts;
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
use consts::Prelude;
use wgsl::WgslType;

/// The WGSL snippets the kernels share (`shaders/common/`), prepended by the host.
pub(crate) mod common {
    /// Sentinels and the online-softmax step.
    pub(crate) const SOFTMAX: &str = include_str!("../../shaders/common/softmax.wgsl");
    /// Mask bindings 0-2 and the mask tests (causal limit, key length, bits, bias), with the
    /// modifiers, a file each.
    pub(crate) const MASKS: &str = concat!(
        include_str!("../../shaders/common/masks.wgsl"),
        include_str!("../../shaders/common/modifiers/softcap.wgsl"),
        include_str!("../../shaders/common/modifiers/alibi.wgsl"),
        include_str!("../../shaders/common/modifiers/sinks.wgsl"),
        include_str!("../../shaders/common/modifiers/window.wgsl"),
        include_str!("../../shaders/common/modifiers/docs.wgsl"),
        include_str!("../../shaders/common/modifiers/mask_mod.wgsl"),
    );
    /// Grouped-query attention's head mapping and the query-tile prologue (the attention
    /// kernels whose params carry `heads` and `group`).
    pub(crate) const HEADS: &str = include_str!("../../shaders/common/heads.wgsl");
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
        /// An fp8 K (V) cache's scale of element `i` is at `(i / k_hs) % kv_heads` (`v_hs`):
        /// the head stride in elements ([`crate::quant`]).
        k_hs: u32,
        v_hs: u32,
        kv_heads: u32,
        _qpad: u32,
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
        let (k, v) = (
            paged(x.k, p.head_dim).unwrap_or_else(|| row(x.k, s, hkv)),
            paged(x.v, p.head_dim_v).unwrap_or_else(|| row(x.v, s, hkv)),
        );
        // The head stride: the view's, else dense `[B, Hkv, S, E]`'s.
        let hs = |r: &RowView, e: usize| if r.h > 0 { r.h } else { (s * e) as u32 };
        TensorViews {
            q: row(x.q, l, hq),
            k_hs: hs(&k, p.head_dim),
            v_hs: hs(&v, p.head_dim_v),
            kv_heads: hkv as u32,
            k,
            v,
            o: row(x.out, l, hq),
            g: row(x.dout, l, hq),
            _qpad: 0,
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
) -> Prelude {
    mask_flags(has_mask, has_bias, mods, bias).code(
        "@group(0) @binding(2) var<storage, read> kv_lens: array<u32>;\n\
         fn aux_word(i: u32) -> u32 { return kv_lens[i]; }\n",
    )
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
    /// The checks of kernels holding the user code `code`: [`Checks::User`] for code not
    /// proved safe.
    pub(crate) fn of_code(code: Option<&crate::user_mod::Checked>) -> Checks {
        match code {
            Some(c) if !c.proved_safe => Checks::User,
            _ => Checks::Kernel,
        }
    }

    /// The checks of `p`'s kernels.
    pub(crate) fn of(p: &crate::problem::Problem) -> Checks {
        Checks::of_code(p.user_fns.as_ref().map(|u| &*u.code))
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
        Checks::of_code(self.user.as_deref())
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

wgsl_consts! {
    /// Which masks and modifiers a masked kernel compiles in (`shaders/common/masks.wgsl` and
    /// its modifiers): the code of each absent one is compiled out.
    pub(crate) struct MaskConsts {
        HAS_MASK: bool,
        HAS_BIAS: bool,
        HAS_WINDOW: bool,
        HAS_SOFTCAP: bool,
        HAS_ALIBI: bool,
        HAS_SINKS: bool,
        HAS_DOCS: bool,
        HAS_SCORE_MOD: bool,
        HAS_MASK_MOD: bool,
        /// Whether the fused kernels pass each logit through `masked_logit` (the window alone
        /// they apply by key ranges).
        MASKED_LOGIT: bool,
        SOFTCAP_FORM: u32,
    }
}

/// [`mask_consts`] without the key lengths (the backward kernels read them from their
/// statistics buffer).
pub(crate) fn mask_flags(
    has_mask: bool,
    has_bias: bool,
    mods: Mods,
    bias: crate::storage::Storage,
) -> Prelude {
    let c = MaskConsts {
        HAS_MASK: has_mask,
        HAS_BIAS: has_bias,
        HAS_WINDOW: mods.window,
        HAS_SOFTCAP: mods.softcap,
        HAS_ALIBI: mods.alibi,
        HAS_SINKS: mods.sinks,
        HAS_DOCS: mods.docs,
        HAS_SCORE_MOD: mods.score_mod,
        HAS_MASK_MOD: mods.mask_mod,
        MASKED_LOGIT: has_mask
            || has_bias
            || mods.softcap
            || mods.alibi
            || mods.docs
            || mods.score_mod
            || mods.mask_mod,
        SOFTCAP_FORM: mods.softcap_form,
    };
    let user = mods.user.as_deref();
    let p = Prelude::new()
        .consts(&c)
        .code(&access::bias(bias))
        .code(&crate::user_mod::prelude(user))
        .tag(format!("bias={bias}"));
    match user {
        Some(code) => p.tag(format!("user={:016x}", code.id)),
        None => p,
    }
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
    &rope::QUANTIZE,
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
pub(crate) fn source(spec: &KernelSpec, prelude: &str, extra: usize, params_in_storage: bool) -> String {
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
        spec.bindings.len() - 1 + extra,
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

/// The matrix units' form of common/modifiers/mask_mod.wgsl's `mask_mod_any`: the invocations' votes in an
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

/// `src` (a kernel with `enable` directives: the matrix units') with common/modifiers/mask_mod.wgsl's
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
            None => spec.trusted && !ctx.is_cpu(),
        }
}

/// The cached pipeline of `spec` with `prelude` and override `constants` on `ctx`.
pub(crate) fn pipeline(
    ctx: &Context,
    spec: &KernelSpec,
    prelude: &Prelude,
    constants: &[(&'static str, f64)],
    checks: Checks,
) -> std::sync::Arc<Pipeline> {
    let unchecked = unchecked(ctx, spec, checks);
    ctx.pipelines()
        .get_or_build(Key::new(spec.name, prelude.text(), constants, unchecked), || {
            let storage = ctx.params_in_storage(spec.bindings.len() + prelude.extra());
            let (own, params) = spec.bindings.split_at(spec.bindings.len() - 1);
            let extra = vec![Binding::Read; prelude.extra()];
            let types: Vec<wgpu::BufferBindingType> = own
                .iter()
                .chain(&extra)
                .chain(params)
                .map(|b| match b {
                    Binding::Read => wgpu::BufferBindingType::Storage { read_only: true },
                    Binding::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                    Binding::Params if storage => wgpu::BufferBindingType::Storage { read_only: true },
                    Binding::Params => wgpu::BufferBindingType::Uniform,
                })
                .collect();
            let src = source(spec, prelude.text(), prelude.extra(), storage);
            let label = prelude.label(spec.name);
            // The crate's own tests: every pipeline also as Metal's and DX12's backends would
            // translate it (a failure there names the variant).
            #[cfg(feature = "translation-check")]
            if let Err(e) = translate::check(&label, &src, constants) {
                panic!("translation check: {e}");
            }
            #[cfg(not(target_arch = "wasm32"))]
            if crate::device::pipelines::compile_log::enabled() {
                let t0 = std::time::Instant::now();
                let p = Pipeline::new(ctx.device(), &label, src.clone(), &types, constants, unchecked);
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
            Pipeline::new(ctx.device(), &label, src, &types, constants, unchecked)
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
    prelude: &Prelude,
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
    debug_assert_eq!(buffers.len() + 1, spec.bindings.len() + prelude.extra());
    let needed = buffers.len() as u32;
    if needed > ctx.limits().max_storage_buffers_per_shader_stage {
        return Err(Error::TooLargeForDevice {
            what: format!(
                "{} with {needed} storage buffers (an 8-bit K/V cache's scales bind two more)",
                spec.name
            ),
            bytes: 0,
            limit_name: "max_storage_buffers_per_shader_stage",
            limit: ctx.limits().max_storage_buffers_per_shader_stage as u64,
            hint: "",
        });
    }
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
    // Past the kernel's own bindings: the extra read-only ones (an 8-bit cache's scales).
    let own = spec.bindings.len() - 1;
    let kind = |i: usize| if i < own { spec.bindings[i] } else { Binding::Read };
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
pub(crate) fn warm(ctx: &Context, spec: &'static KernelSpec, prelude: Prelude, checks: Checks) -> bool {
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
        let key = Key::new(spec.name, prelude.text(), &[], unchecked(ctx, spec, checks));
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
mod tests;
#[cfg(test)]
pub(crate) mod variants;
