//! Strided copies with a change of storage format (`shaders/permute.wgsl`, through
//! [`crate::kernels::permute`]): the layer's head split and merge, transposes, broadcasts of a
//! batch-1 tensor, and format conversions.

use super::held;
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::kernels::permute as kernel;
use crate::storage::Storage;

/// A 4-D tensor read through element strides (0 broadcasts).
#[derive(Clone, Debug)]
pub(crate) struct Strided<'a> {
    pub(crate) binding: wgpu::BufferBinding<'a>,
    pub(crate) storage: Storage,
    pub(crate) strides: [usize; 4],
    /// The element offset of element 0 from the binding's start.
    pub(crate) offset: usize,
}

/// A dense destination in its format.
pub(crate) type Dense<'a> = (wgpu::BufferBinding<'a>, Storage);

impl<'a> Strided<'a> {
    /// The binding `src` in its format, read through `strides`.
    pub(crate) fn new((binding, storage): Dense<'a>, strides: [usize; 4]) -> Self {
        Strided {
            binding,
            storage,
            strides,
            offset: 0,
        }
    }

    /// Element 0 at element `offset` of the binding.
    pub(crate) fn at(mut self, offset: usize) -> Self {
        self.offset = offset;
        self
    }
}

/// Record `dst[i0][i1][i2][i3] = src[Σ ik · strides[k]]` for the dense `dims` of dst,
/// converting formats, after checking that both lie inside their bindings.
pub(crate) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: &Strided<'_>,
    (dst, dst_storage): Dense<'_>,
    dims: [usize; 4],
) -> Result<()> {
    let total: usize = dims.iter().product();
    if total == 0 {
        return Ok(());
    }
    let reach = 1
        + src.offset
        + dims
            .iter()
            .zip(src.strides)
            .map(|(&n, s)| (n - 1) * s)
            .sum::<usize>();
    let (src_held, dst_held) = (held(&src.binding, src.storage), held(&dst, dst_storage));
    if reach > src_held || total > dst_held || u32::try_from(reach.max(total)).is_err() {
        return Err(Error::Internal(format!(
            "copy of {dims:?} through strides {:?}: reaches element {reach} of {src_held}, \
             writes {total} of {dst_held}",
            src.strides
        )));
    }
    kernel::record(
        ctx,
        encoder,
        src.binding.clone(),
        dst,
        dims,
        (src.strides, src.offset),
        (src.storage, dst_storage),
    )
}

/// `[B, T, H, d]` (a projection's rows) to `[B, H, T, d]` (heads).
pub(crate) fn split_heads(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: Dense<'_>,
    dst: Dense<'_>,
    [b, t, h, d]: [usize; 4],
) -> Result<()> {
    record(
        ctx,
        encoder,
        &Strided::new(src, [t * h * d, d, h * d, 1]),
        dst,
        [b, h, t, d],
    )
}

/// `[B, H, L, d]` (heads) to `[B, L, H, d]` (rows of the merged heads).
pub(crate) fn merge_heads(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: Dense<'_>,
    dst: Dense<'_>,
    [b, h, l, d]: [usize; 4],
) -> Result<()> {
    record(
        ctx,
        encoder,
        &Strided::new(src, [h * l * d, d, l * d, 1]),
        dst,
        [b, l, h, d],
    )
}

/// `[rows, cols]` to its transpose `[cols, rows]`.
pub(crate) fn transpose(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: Dense<'_>,
    dst: Dense<'_>,
    [rows, cols]: [usize; 2],
) -> Result<()> {
    record(
        ctx,
        encoder,
        &Strided::new(src, [0, 0, 1, cols]),
        dst,
        [1, 1, cols, rows],
    )
}

/// `elems` elements converted from one format to another.
pub(crate) fn convert(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: Dense<'_>,
    dst: Dense<'_>,
    elems: usize,
) -> Result<()> {
    record(
        ctx,
        encoder,
        &Strided::new(src, [0, 0, 0, 1]),
        dst,
        [1, 1, 1, elems],
    )
}

/// Record the copy of a [`crate::tensor::rows_view`] (`[1, T, H, E]` rows anywhere in a GPU
/// buffer, from any element offset) into the dense `dst`, the view checked against its buffer
/// first (`Error::BadBuffer` naming `name`).
pub(crate) fn gather_rows(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    name: &'static str,
    viewed: &crate::tensor::Tensor<'_>,
    dst: Dense<'_>,
) -> Result<()> {
    let op = crate::device::buffers::Operand::check_viewed(ctx, name, viewed)?;
    let up = op.upload(ctx, name);
    let st = viewed.storage();
    let crate::tensor::TensorData::Gpu { offset, .. } = &viewed.data else {
        return Err(Error::Internal(format!(
            "gather_rows: {name} is not a GPU buffer"
        )));
    };
    let strides: [usize; 4] = viewed
        .view
        .strides
        .as_deref()
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| Error::Internal(format!("gather_rows: {name} is not a 4-D view")))?;
    let dims: [usize; 4] = viewed
        .shape
        .as_slice()
        .try_into()
        .map_err(|_| Error::Internal(format!("gather_rows: {name} is not 4-D")))?;
    let at = (offset % crate::view::BIND_ALIGN / st.element_bytes()) as usize;
    record(
        ctx,
        encoder,
        &Strided::new((up.binding(), st), strides).at(at),
        dst,
        dims,
    )
}
