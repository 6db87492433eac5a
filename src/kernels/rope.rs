//! `shaders/rope.wgsl`: rotary position embedding of token rows `[T, H, E]`, in place or
//! into a paged cache's slots (the cache's append, which also copies V with no rotation).

use super::access::{array, Access};
use super::{dispatch, grid_1d, params_of, Binding, KernelSpec};
use crate::device::context::Context;
use crate::error::Result;
use crate::storage::Storage;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "rope",
    source: include_str!("../../shaders/rope.wgsl"),
    common: &[],
    bindings: &[Binding::Read, Binding::ReadWrite, Binding::Read, Binding::Params],
    params: params_of::<Params>,
    trusted: false,
};

/// Invocations per workgroup (`WG` in the shader).
const WG: u32 = 64;

wgsl_struct! {
    /// The rope kernel's params (`p` in `rope.wgsl`).
    pub(crate) struct Params {
        /// Token rows times heads.
        rows: u32,
        heads: u32,
        /// Elements per row, and the rotated ones (even, at most e).
        e: u32,
        d: u32,
        /// 1: half-split pairs (k, k + d/2); 0: interleaved (2k, 2k + 1).
        half: u32,
        /// Copy the elements past d (not in place).
        copy_rest: u32,
        /// Destination rows from the slot words (an append), else row t.
        has_slots: u32,
        /// Where the (cos, sin) words and the slot words start in aux.
        ang_off: u32,
        slot_off: u32,
        /// The destination is a head-major paged cache `[NB, H, BS, E]` of this block size
        /// (0: rows `[.., H, E]`).
        hm_bs: u32,
        _pad1: u32,
        _pad2: u32,
    }
}

/// One rotation (or copy) of `rows` token rows: what [`record`] dispatches.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rotation {
    /// Tokens T and heads H of the source `[T, H, E]`.
    pub tokens: usize,
    pub heads: usize,
    pub e: usize,
    /// Rotated elements (0: a plain copy) and the style.
    pub d: usize,
    pub half: bool,
    /// Angle words' offset in aux; slot words' offset (an append), if any.
    pub ang_off: usize,
    pub slot_off: Option<usize>,
    /// With slots: the cache is head-major with blocks of this many tokens (0: token-major).
    pub head_major_block: usize,
}

/// The kernel's prelude: `dst` (binding 1, written by atomics when half) in its format, and
/// `load(i)` reading `src` (binding 0) in its format, or `dst` itself when rotating in place.
pub(crate) fn prelude(src: Option<Storage>, dst: Storage) -> super::consts::Prelude {
    let dst_access = if dst.is_half() {
        Access::Atomic
    } else {
        Access::Write
    };
    let mut prelude = array("dst", 1, dst, false, dst_access);
    match src {
        Some(s) => {
            prelude += &array("src", 0, s, false, Access::Read);
            prelude += "fn load(i: u32) -> f32 { return src_get(i); }\n";
        }
        None => prelude += "fn load(i: u32) -> f32 { return dst_get(i); }\n",
    }
    let tag = match src {
        Some(s) => format!("src={s} dst={dst}"),
        None => format!("dst={dst}"),
    };
    super::consts::Prelude::from(prelude).tag(tag)
}

/// Record the rotation: `src` into `dst` (in place when `src` is `None`: `dst` read and
/// written). The caller has checked every index against the bindings.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: Option<(wgpu::BufferBinding<'_>, Storage)>,
    dst: (wgpu::BufferBinding<'_>, Storage),
    aux: wgpu::BufferBinding<'_>,
    dummy: wgpu::BufferBinding<'_>,
    r: Rotation,
) -> Result<()> {
    let prelude = prelude(src.as_ref().map(|s| s.1), dst.1);
    let src_binding = match &src {
        Some((b, _)) => b.clone(),
        None => dummy,
    };
    dispatch_rows(
        ctx,
        encoder,
        &SPEC,
        &prelude,
        &[src_binding, dst.0, aux],
        &r,
        src.is_some(),
    )
}

/// The 8-bit cache's append (`shaders/kv_quantize.wgsl`): rows rotated like [`SPEC`]'s, then
/// quantised into the cache's slots (int8 writing each row's scale, fp8 reading its head's).
pub(crate) const QUANTIZE: KernelSpec = KernelSpec {
    name: "kv_quantize",
    source: include_str!("../../shaders/kv_quantize.wgsl"),
    common: &[],
    bindings: &[
        Binding::Read,
        Binding::ReadWrite,
        Binding::Read,
        Binding::ReadWrite,
        Binding::Params,
    ],
    params: params_of::<Params>,
    trusted: false,
};

wgsl_consts! {
    /// The 8-bit append's format: int8 (else fp8).
    pub(crate) struct QuantConsts {
        INT8: bool,
    }
}

/// The quantising append's prelude: `src` (binding 0) in its format, and the cache's format.
pub(crate) fn quantize_prelude(src: Storage, cache: Storage) -> super::consts::Prelude {
    super::consts::Prelude::new()
        .consts(&QuantConsts {
            INT8: cache == Storage::Int8,
        })
        .code(&array("src", 0, src, false, Access::Read))
        .tag(format!("src={src}"))
}

/// Record the quantising append of `r`'s rows (`r.slot_off` set) from `src` into the 8-bit
/// cache `codes` with its `scales`. The caller has checked every index against the bindings.
pub(crate) fn record_quantize(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: (wgpu::BufferBinding<'_>, Storage),
    codes: (wgpu::BufferBinding<'_>, Storage),
    scales: wgpu::BufferBinding<'_>,
    aux: wgpu::BufferBinding<'_>,
    r: Rotation,
) -> Result<()> {
    let prelude = quantize_prelude(src.1, codes.1);
    dispatch_rows(
        ctx,
        encoder,
        &QUANTIZE,
        &prelude,
        &[src.0, codes.0, aux, scales],
        &r,
        true,
    )
}

/// Dispatch `spec` over `r`'s rows (one invocation each) with the rope kernels' params:
/// `copy_rest` copies the elements past the rotated ones (not in place), the slot words are
/// read where `r` has them.
fn dispatch_rows(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    spec: &KernelSpec,
    prelude: &super::consts::Prelude,
    buffers: &[wgpu::BufferBinding<'_>],
    r: &Rotation,
    copy_rest: bool,
) -> Result<()> {
    let rows = (r.tokens * r.heads) as u32;
    let params = Params {
        rows,
        heads: r.heads as u32,
        e: r.e as u32,
        d: r.d as u32,
        half: r.half as u32,
        copy_rest: copy_rest as u32,
        has_slots: r.slot_off.is_some() as u32,
        ang_off: r.ang_off as u32,
        slot_off: r.slot_off.unwrap_or(0) as u32,
        hm_bs: r.head_major_block as u32,
        ..Default::default()
    };
    let grid = grid_1d(
        rows.div_ceil(WG),
        ctx.limits().max_compute_workgroups_per_dimension,
    );
    dispatch(
        ctx,
        encoder,
        spec,
        prelude,
        &[],
        buffers,
        bytemuck::bytes_of(&params),
        grid,
        super::Checks::Kernel,
    )
}
