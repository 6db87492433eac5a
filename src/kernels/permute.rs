//! `shaders/permute.wgsl`: a strided 4-D copy into a contiguous buffer. Multi-head attention
//! uses it to split projections `[B, L, H, d]` into heads `[B, H, L, d]`, to merge the attention
//! output back, and to broadcast a batch-1 constant over the batch (stride 0).

use super::access::{array, Access};
use super::{dispatch, grid_1d, params_of, Binding, KernelSpec};
use crate::device::context::Context;
use crate::error::Result;
use crate::storage::Storage;

pub(crate) const SPEC: KernelSpec = KernelSpec {
    name: "permute",
    source: include_str!("../../shaders/permute.wgsl"),
    common: &[],
    bindings: &[Binding::Read, Binding::ReadWrite, Binding::Params],
    params: params_of::<Params>,
    trusted: false,
};

/// Invocations per workgroup (`WG` in the shader).
const WG: u32 = 256;

wgsl_struct! {
    /// The permute kernel's params (`p` in `permute.wgsl`): the trailing dims of dst, the
    /// element count and src's strides.
    pub(crate) struct Params {
        n1: u32,
        n2: u32,
        n3: u32,
        total: u32,
        s0: u32,
        s1: u32,
        s2: u32,
        s3: u32,
        /// src's element offset from its binding's start.
        off: u32,
        /// To 48 bytes: uniform structs are multiples of 16 bytes.
        _pad1: u32,
        _pad2: u32,
        _pad3: u32,
    }
}

/// The declarations of src and dst in their formats, and `store_pair`.
pub(crate) fn prelude(src: Storage, dst: Storage) -> super::consts::Prelude {
    let store = if dst.is_half() {
        // A half dst is padded to whole words: the pair past an odd end writes the padding.
        "fn store_pair(i: u32, x: vec2<f32>) { dst_set2(i, x); }\n"
    } else {
        "fn store_pair(i: u32, x: vec2<f32>) {\n    if (i + 1u < p.total) { dst_set2(i, x); } else { dst_set(i, x.x); }\n}\n"
    };
    super::consts::Prelude::from(format!(
        "{}{}{store}",
        array("src", 0, src, false, Access::Read),
        array("dst", 1, dst, false, Access::Write)
    ))
    .tag(format!("src={src} dst={dst}"))
}

/// Record `dst[i0][i1][i2][i3] = src[Σ ik · strides[k]]` for the contiguous `dims` of `dst`,
/// converting from the format of `src` to that of `dst` (`formats`).
/// The caller checks that every index fits in u32 and in the buffers.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: wgpu::BufferBinding<'_>,
    dst: wgpu::BufferBinding<'_>,
    dims: [usize; 4],
    (strides, off): ([usize; 4], usize),
    formats: (Storage, Storage),
) -> Result<()> {
    let total = dims.iter().product::<usize>() as u32;
    let params = Params {
        n1: dims[1] as u32,
        n2: dims[2] as u32,
        n3: dims[3] as u32,
        total,
        s0: strides[0] as u32,
        s1: strides[1] as u32,
        s2: strides[2] as u32,
        s3: strides[3] as u32,
        off: off as u32,
        ..Default::default()
    };
    let grid = grid_1d(
        total.div_ceil(2 * WG),
        ctx.limits().max_compute_workgroups_per_dimension,
    );
    dispatch(
        ctx,
        encoder,
        &SPEC,
        &prelude(formats.0, formats.1),
        &[],
        &[src, dst],
        bytemuck::bytes_of(&params),
        grid,
        super::Checks::Kernel,
    )
}
