//! Buffers: element sizes, size checks against the device, uploads of host inputs (or the
//! caller's own buffers bound in place) and readback.

use std::num::NonZeroU64;

use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::tensor::{check_len, Tensor, TensorData};

/// Bytes per element of the f32 storage every buffer uses today.
pub(crate) const F32: u64 = 4;

/// Bytes of `elems` f32 elements.
pub(crate) fn f32_bytes(elems: usize) -> u64 {
    elems as u64 * F32
}

/// Bytes of an f32 tensor of `shape`.
pub(crate) fn shape_bytes(shape: &[usize]) -> u64 {
    f32_bytes(shape.iter().product())
}

pub(crate) fn fits(what: &str, bytes: u64, limit: u64, limit_name: &'static str) -> Result<()> {
    if bytes > limit {
        return Err(Error::TooLargeForDevice {
            what: what.to_string(),
            bytes,
            limit_name,
            limit,
            hint: "",
        });
    }
    Ok(())
}

/// Check a caller's buffer holding a tensor of `shape` in format `storage` at byte `offset`:
/// `STORAGE` usage, the offset's alignment, and the size (a size error names the format
/// assumed and the formats that would fit).
pub(crate) fn check_gpu_buffer(
    ctx: &Context,
    tensor: &'static str,
    buf: &wgpu::Buffer,
    offset: u64,
    shape: &[usize],
    storage: Storage,
) -> Result<()> {
    let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
    let bad = |reason: String| Err(Error::BadBuffer { tensor, reason });
    if !buf.usage().contains(wgpu::BufferUsages::STORAGE) {
        return bad(format!("usage {:?} lacks STORAGE", buf.usage()));
    }
    if !offset.is_multiple_of(align) {
        return bad(format!(
            "offset {offset} is not a multiple of min_storage_buffer_offset_alignment ({align})"
        ));
    }
    let elems: usize = shape.iter().product();
    let bytes = storage.bytes(elems);
    if offset.checked_add(bytes).is_none_or(|end| end > buf.size()) {
        let room = buf.size().saturating_sub(offset);
        let fit: Vec<&str> = [Storage::F32, Storage::F16, Storage::Bf16]
            .into_iter()
            .filter(|s| s.bytes(elems) <= room)
            .map(Storage::name)
            .collect();
        let fit = if fit.is_empty() {
            "no format fits".to_string()
        } else {
            format!("it would fit {}", fit.join(" or "))
        };
        return bad(format!(
            "needs {bytes} bytes at offset {offset}, buffer has {}: shape {shape:?} in the declared format {} ({} bytes an element); {fit}",
            buf.size(),
            storage.name(),
            storage.element_bytes()
        ));
    }
    Ok(())
}

/// [`check_gpu_buffer`] for a view: `bytes` from `bind_offset` (the tensor at `offset`) must
/// lie in the buffer.
#[allow(clippy::too_many_arguments)]
fn check_view_buffer(
    tensor: &'static str,
    buf: &wgpu::Buffer,
    bind_offset: u64,
    bytes: u64,
    offset: u64,
    shape: &[usize],
    view: &crate::view::View,
    storage: Storage,
) -> Result<()> {
    let bad = |reason: String| Err(Error::BadBuffer { tensor, reason });
    if !buf.usage().contains(wgpu::BufferUsages::STORAGE) {
        return bad(format!("usage {:?} lacks STORAGE", buf.usage()));
    }
    if bind_offset.checked_add(bytes).is_none_or(|end| end > buf.size()) {
        return bad(format!(
            "shape {shape:?} through strides {:?} from byte offset {offset} reaches byte {} in the declared format {} ({} bytes an element), buffer has {}",
            view.strides,
            bind_offset + bytes,
            storage.name(),
            storage.element_bytes(),
            buf.size()
        ));
    }
    Ok(())
}

pub(crate) fn binding(buf: &wgpu::Buffer, offset: u64, bytes: u64) -> wgpu::BufferBinding<'_> {
    wgpu::BufferBinding {
        buffer: buf,
        offset,
        size: NonZeroU64::new(bytes),
    }
}

/// A storage buffer holding `contents` (read-only input of the kernels).
pub(crate) fn storage_init(ctx: &Context, label: &str, contents: &[u8]) -> wgpu::Buffer {
    init(ctx, label, contents, wgpu::BufferUsages::STORAGE)
}

/// A buffer of `usage` holding `contents` (zero-padded to whole 4-byte words), written by
/// `queue.write_buffer`: ordered before the next submission. Not `create_buffer_init`, whose
/// mapping panics when the device is lost; here a lost device's error reaches the call's
/// error scope and is returned.
pub(crate) fn init(ctx: &Context, label: &str, contents: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
    let size = (contents.len() as u64).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
    let buffer = create(ctx, label, size, usage | wgpu::BufferUsages::COPY_DST);
    if size > 0 {
        if size == contents.len() as u64 {
            ctx.queue().write_buffer(&buffer, 0, contents);
        } else {
            let mut padded = contents.to_vec();
            padded.resize(size as usize, 0);
            ctx.queue().write_buffer(&buffer, 0, &padded);
        }
    }
    buffer
}

/// Constant inputs up to this size are cached by their bytes ([`constant`]).
const CONSTANT_CACHED: usize = 64 << 10;

/// A buffer of `usage` holding `contents` that nothing ever writes again (kernel parameters,
/// key lengths, block tables, angles): one the context cached for the same bytes when there
/// is one (see `device/cache.rs`), else a new one ([`init`]). Never bind it read-write.
pub(crate) fn constant(
    ctx: &Context,
    label: &str,
    contents: &[u8],
    usage: wgpu::BufferUsages,
) -> wgpu::Buffer {
    if contents.len() > CONSTANT_CACHED {
        return init(ctx, label, contents, usage);
    }
    ctx.cache()
        .init(|| init(ctx, label, contents, usage), contents, usage)
}

/// An uninitialised buffer of `bytes` the kernels write and the host may read back or copy.
pub(crate) fn output(ctx: &Context, label: &str, bytes: u64) -> wgpu::Buffer {
    use wgpu::BufferUsages as U;
    create(ctx, label, bytes, U::STORAGE | U::COPY_SRC | U::COPY_DST)
}

/// A GPU-only scratch buffer of `bytes`.
pub(crate) fn scratch(ctx: &Context, label: &str, bytes: u64) -> wgpu::Buffer {
    create(ctx, label, bytes, wgpu::BufferUsages::STORAGE)
}

/// Every buffer a call allocates is made here (where an injected out-of-memory strikes:
/// [`crate::device::faults`]).
pub(crate) fn create(ctx: &Context, label: &str, bytes: u64, usage: wgpu::BufferUsages) -> wgpu::Buffer {
    ctx.faults().allocation();
    ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: bytes,
        usage,
        mapped_at_creation: false,
    })
}

/// The buffer bound where a kernel's optional input (mask, bias, key lengths) is absent.
pub(crate) fn dummy(ctx: &Context) -> wgpu::Buffer {
    ctx.dummy().clone()
}

/// Which views an operand may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Viewing {
    /// None: dense row-major.
    Dense,
    /// A `[B, H, S, E]` tensor's ([`crate::view::resolve`]).
    Rows,
    /// A bias's ([`crate::view::resolve_bias`]).
    Bias,
}

/// A validated input, before upload.
pub(crate) struct Operand<'t, 'a> {
    tensor: &'t Tensor<'a>,
    /// Bytes bound.
    pub(crate) bytes: u64,
    pub(crate) storage: Storage,
    /// Where the binding starts in a caller's buffer (its offset, or the 256-aligned byte
    /// below a view's offset).
    bind_offset: u64,
}

/// An input on the GPU: our upload, or the caller's buffer.
pub(crate) enum Uploaded<'a> {
    Owned(wgpu::Buffer, u64),
    Borrowed(&'a wgpu::Buffer, u64, u64),
}

impl<'t, 'a> Operand<'t, 'a> {
    /// A dense input (no view: the layer, the variants, the matmul).
    pub(crate) fn check(ctx: &Context, name: &'static str, t: &'t Tensor<'a>) -> Result<Self> {
        if t.view.is_set() && t.misuse.is_none() {
            return Err(Error::BadBuffer {
                tensor: name,
                reason: "layouts, capacities and strides are read by Sdpa and Backward (q, k, v, the output, dout); here the tensor must be dense row-major".into(),
            });
        }
        Self::check_inner(ctx, name, t, Viewing::Dense)
    }

    /// An input or output that may be a view ([`crate::view`]): bound from the 256-aligned
    /// byte at or below its offset, over the elements the view reaches.
    pub(crate) fn check_viewed(ctx: &Context, name: &'static str, t: &'t Tensor<'a>) -> Result<Self> {
        Self::check_inner(ctx, name, t, Viewing::Rows)
    }

    /// The additive bias of [`Sdpa`](crate::Sdpa) and [`Backward`](crate::Backward), which
    /// may be a view with strides of its own ([`crate::view::resolve_bias`]).
    pub(crate) fn check_bias(ctx: &Context, t: &'t Tensor<'a>) -> Result<Self> {
        Self::check_inner(ctx, "bias", t, Viewing::Bias)
    }

    fn check_inner(ctx: &Context, name: &'static str, t: &'t Tensor<'a>, viewing: Viewing) -> Result<Self> {
        let elems: usize = t.shape.iter().product();
        let storage = t.storage();
        let mut bytes = storage.bytes(elems);
        if let Some(reason) = t.misuse {
            return Err(Error::BadBuffer {
                tensor: name,
                reason: reason.into(),
            });
        }
        let mut bind_offset = 0;
        match &t.data {
            TensorData::Host(d) => check_len(name, &t.shape, d.len())?,
            TensorData::Gpu { buffer, offset, .. } => {
                let view = match viewing {
                    Viewing::Rows => crate::view::resolve(name, &t.view, &t.shape, *offset, storage)?,
                    Viewing::Bias => crate::view::resolve_bias(&t.view, &t.shape, *offset, storage)?,
                    Viewing::Dense => None,
                };
                match view {
                    None => {
                        check_gpu_buffer(ctx, name, buffer, *offset, &t.shape, storage)?;
                        bind_offset = *offset;
                    }
                    Some(view) => {
                        bind_offset = offset - offset % crate::view::BIND_ALIGN;
                        // A view is 4-D (a bias's shape left-padded with ones).
                        bytes = storage.bytes(view.extent(crate::view::pad4(&t.shape)));
                        check_view_buffer(
                            name,
                            buffer,
                            bind_offset,
                            bytes,
                            *offset,
                            &t.shape,
                            &view,
                            storage,
                        )?;
                    }
                }
            }
        }
        fits(name, bytes, ctx.max_binding(), "max_storage_buffer_binding_size")?;
        Ok(Operand {
            tensor: t,
            bytes,
            storage,
            bind_offset,
        })
    }

    pub(crate) fn upload(&self, ctx: &Context, label: &str) -> Uploaded<'a> {
        match &self.tensor.data {
            TensorData::Host(d) => Uploaded::Owned(storage_init(ctx, label, &d.bytes()), self.bytes),
            TensorData::Gpu { buffer, .. } => Uploaded::Borrowed(buffer, self.bind_offset, self.bytes),
        }
    }
}

impl Uploaded<'_> {
    /// The uploaded input as a GPU tensor of `shape` in `storage`, for a later stage.
    pub(crate) fn tensor(&self, shape: &[usize], storage: Storage) -> Tensor<'_> {
        let (buf, off) = match self {
            Uploaded::Owned(b, _) => (b, 0),
            Uploaded::Borrowed(b, off, _) => (*b, *off),
        };
        Tensor::from_buffer(buf, storage, shape).at_offset(off)
    }

    pub(crate) fn binding(&self) -> wgpu::BufferBinding<'_> {
        match self {
            Uploaded::Owned(b, bytes) => binding(b, 0, *bytes),
            Uploaded::Borrowed(b, off, bytes) => binding(b, *off, *bytes),
        }
    }
}

/// Readback, as methods of the context (here, so that `context.rs` needs nothing of this
/// module).
impl Context {
    /// Copy `size` bytes at `offset` of `buffer` (which needs `COPY_SRC`) back to the host as f32.
    pub async fn read_f32(&self, buffer: &wgpu::Buffer, offset: u64, size: u64) -> Result<Vec<f32>> {
        read_f32(self, buffer, offset, size).await
    }

    /// Read `elems` elements held in format `storage` at byte `offset` of `buffer` (which needs
    /// `COPY_SRC`), widened to f32 (exactly: every f16 and bf16 value is an f32).
    pub async fn read_as_f32(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        elems: usize,
        storage: Storage,
    ) -> Result<Vec<f32>> {
        read_as_f32(self, buffer, offset, elems, storage).await
    }
}

/// Copy `size` bytes at `offset` of `buffer` (which needs `COPY_SRC`) back to the host as f32.
pub(crate) async fn read_f32(
    ctx: &Context,
    buffer: &wgpu::Buffer,
    offset: u64,
    size: u64,
) -> Result<Vec<f32>> {
    let bytes = read_bytes(ctx, buffer, offset, size).await?;
    Ok(Storage::F32.decode(&bytes, (size / F32) as usize))
}

/// Read `elems` elements of format `storage` at `offset` of `buffer` (which needs
/// `COPY_SRC`), widened to f32 (exact).
pub(crate) async fn read_as_f32(
    ctx: &Context,
    buffer: &wgpu::Buffer,
    offset: u64,
    elems: usize,
    storage: Storage,
) -> Result<Vec<f32>> {
    let bytes = read_bytes(ctx, buffer, offset, storage.bytes(elems)).await?;
    Ok(storage.decode(&bytes, elems))
}

/// Copy `size` bytes (a multiple of 4) at `offset` of `buffer` (which needs `COPY_SRC`) back
/// to the host, staged in pieces no larger than a quarter of the buffer limit (and 256 MiB).
pub(crate) async fn read_bytes(
    ctx: &Context,
    buffer: &wgpu::Buffer,
    offset: u64,
    size: u64,
) -> Result<Vec<u8>> {
    let device = ctx.device();
    let mut out = vec![0u8; size as usize];
    // Stage in pieces no larger than a quarter of the buffer limit (and 256 MiB).
    let piece_max = (ctx.limits().max_buffer_size / 4).clamp(F32, 256 << 20) & !(F32 - 1);
    let mut done = 0u64;
    while done < size {
        let n = piece_max.min(size - done);
        let staging = ctx.scoped(|| {
            let staging = create(
                ctx,
                "wgpu-attention readback",
                n,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            );
            let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("wgpu-attention readback"),
            });
            enc.copy_buffer_to_buffer(buffer, offset + done, &staging, 0, n);
            ctx.queue().submit([enc.finish()]);
            Ok(staging)
        });
        let staging = staging.await?;
        let (tx, rx) = futures_intrusive::channel::shared::oneshot_channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        ctx.wait()?;
        let injected = ctx.faults().readback_fails();
        match rx.receive().await {
            Some(Ok(())) if injected => {
                return Err(Error::Readback("injected fault: the mapping failed".into()))
            }
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(Error::Readback(e.to_string())),
            None => return Err(Error::Readback("map callback dropped".into())),
        }
        {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| Error::Readback(e.to_string()))?;
            out[done as usize..(done + n) as usize].copy_from_slice(&view);
        }
        staging.unmap();
        done += n;
    }
    Ok(out)
}

/// The bytes `[start, end)` a GPU tensor's elements reach in its buffer (through its view:
/// strides, layout, capacity), or `None` for host data and empty tensors.
pub(crate) fn byte_range<'a>(t: &Tensor<'a>) -> Option<(&'a wgpu::Buffer, u64, u64)> {
    let TensorData::Gpu {
        buffer,
        offset,
        storage,
    } = &t.data
    else {
        return None;
    };
    if t.shape.contains(&0) {
        return None;
    }
    let spec = &t.view;
    let strides: Vec<usize> = match (&spec.strides, t.shape.as_slice()) {
        (Some(s), shape) if s.len() == shape.len() => s.clone(),
        (_, &[_, h, l, e]) if spec.layout.is_some() || spec.capacity.is_some() => spec
            .layout
            .unwrap_or_default()
            .strides(h, spec.capacity.unwrap_or(l).max(l), e)
            .to_vec(),
        (_, shape) => {
            // Dense row-major.
            let mut s = vec![1; shape.len()];
            for i in (0..shape.len().saturating_sub(1)).rev() {
                s[i] = s[i + 1] * shape[i + 1];
            }
            s
        }
    };
    let elems = 1 + t
        .shape
        .iter()
        .zip(&strides)
        .map(|(&d, &s)| (d - 1) * s)
        .sum::<usize>();
    Some((buffer, *offset, offset + elems as u64 * storage.element_bytes()))
}

/// Outputs against inputs (and each other) that share a buffer: overlapping bytes are a typed
/// error naming the output; disjoint ranges of one buffer are fine (the kernels write such an
/// output through a scratch copy, [`crate::kernels::dispatch`], as wgpu binds a buffer either
/// read-only or read-write in one dispatch), given the buffer's `COPY_SRC` and `COPY_DST`.
pub(crate) fn check_aliasing(
    outputs: &[(&'static str, &Tensor<'_>)],
    inputs: &[(&'static str, &Tensor<'_>)],
) -> Result<()> {
    for (i, &(name, out)) in outputs.iter().enumerate() {
        let Some((buf, s0, e0)) = byte_range(out) else {
            continue;
        };
        let others = inputs.iter().chain(&outputs[..i]).chain(&outputs[i + 1..]);
        for &(other, t) in others {
            let Some((b, s1, e1)) = byte_range(t) else {
                continue;
            };
            if b != buf {
                continue;
            }
            let bad = |reason: String| Err(Error::BadBuffer { tensor: name, reason });
            if s0 < e1 && s1 < e0 {
                return bad(format!(
                    "its bytes {s0}..{e0} overlap {other}'s {s1}..{e1} in the same buffer: an output must not overlap an input or another output (give it a range of its own)"
                ));
            }
            let need = wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
            if !buf.usage().contains(need) {
                return bad(format!(
                    "it shares its buffer with {other} (bytes {s1}..{e1}): wgpu binds one buffer either read-only or read-write in a dispatch, so such an output is written through a scratch copy, which needs the buffer's COPY_SRC and COPY_DST usage (it has {:?})",
                    buf.usage()
                ));
            }
        }
    }
    Ok(())
}
