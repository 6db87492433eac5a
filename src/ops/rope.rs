//! Rotary position embedding as an op: token rows `[T, H, E]` rotated in place, or written
//! into a paged cache's slots (the cache's append: K rotated, V copied). The op builds the
//! kernel's auxiliary words (the angles, computed on the host in f64, and the slots), checks
//! that every row it reads or writes lies inside its binding, and records the kernel.

use crate::device::buffers::{constant, dummy, Operand as Checked};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::kernels::rope::{record, Rotation};
use crate::rope::{check_positions, Rope, RopeStyle};
use crate::storage::Storage;
use crate::tensor::Tensor;

/// A GPU operand of the op: its binding and its elements' format.
pub(crate) type Operand<'b> = (wgpu::BufferBinding<'b>, Storage);

/// Where the rows go.
pub(crate) enum Dest<'b> {
    /// Rotated in place.
    InPlace(Operand<'b>),
    /// From `src` into a paged cache: token `t` to the step's slot `t` of `cache` (see
    /// [`Slots`]).
    Slots { src: Operand<'b>, cache: Operand<'b> },
    /// From `src` into an 8-bit paged cache's slots as [`Dest::Slots`], quantised: `cache`
    /// holds the codes, `scales` the int8 rows' scales (written) or the fp8 heads' (read).
    Quantized {
        src: Operand<'b>,
        cache: Operand<'b>,
        scales: wgpu::BufferBinding<'b>,
    },
}

/// The cache slots of an append's tokens, head-major with blocks of `head_major_block` tokens
/// (0: token-major `[slots, H, E]`).
#[derive(Clone, Copy)]
pub(crate) struct Slots<'b> {
    pub slots: &'b [u32],
    pub head_major_block: usize,
}

/// One set of `[tokens, heads, e]` rows: rotated by the rotation's angles (`rotate`) or copied.
pub(crate) struct Rows<'b> {
    pub dims: [usize; 3],
    pub dest: Dest<'b>,
    pub rotate: bool,
}

/// Record `rope` (its rotated dimensions `d`) over each of `rows` at `positions` (one per
/// token; the rows' token counts are equal): one auxiliary buffer of the angles (computed on
/// the host in f64) and the `slots` for them all (a cache's K and V share it).
pub(crate) fn rotate(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    rope: Option<(Rope, usize)>,
    positions: &[usize],
    slots: Option<Slots<'_>>,
    rows: Vec<Rows<'_>>,
) -> Result<()> {
    let (d, half) = match rope {
        Some((r, d)) => (d, r.style == RopeStyle::HalfSplit),
        None => (0, false),
    };
    let bad = |reason: String| Err(Error::Internal(format!("rope op: {reason}")));
    let tokens = positions.len();
    let mut aux = match rope {
        Some((r, _)) if d > 0 => r.angle_words(d, positions.iter().copied()),
        _ => Vec::new(),
    };
    let slot_off = slots.map(|s| {
        let off = aux.len();
        aux.extend(s.slots);
        off
    });
    // An empty aux still binds a buffer: one zero word.
    if aux.is_empty() {
        aux.push(0);
    }
    // Every row checked before anything is recorded.
    for r in &rows {
        let [t, heads, e] = r.dims;
        let n = (t * heads * e) as u64;
        let rotated = if r.rotate { d } else { 0 };
        if t != tokens || rotated > e || rotated % 2 == 1 {
            return bad(format!(
                "{rotated} rotated of {e}, {tokens} positions for {t} tokens"
            ));
        }
        let ok = inside(r, slots, n, rotated);
        if !ok {
            return bad(format!(
                "rows {:?} outside their buffers, or slots for an in-place rotation",
                r.dims
            ));
        }
    }
    let aux = constant(
        ctx,
        "rope aux",
        bytemuck::cast_slice(&aux),
        wgpu::BufferUsages::STORAGE,
    );
    let dummy = dummy(ctx);
    for r in rows {
        let [tokens, heads, e] = r.dims;
        let rotation = Rotation {
            tokens,
            heads,
            e,
            d: if r.rotate { d } else { 0 },
            half,
            ang_off: 0,
            slot_off,
            head_major_block: slots.map_or(0, |s| s.head_major_block),
        };
        let (src, dst) = match r.dest {
            Dest::InPlace(x) => (None, x),
            Dest::Slots { src, cache } => (Some(src), cache),
            Dest::Quantized { src, cache, scales } => {
                crate::kernels::rope::record_quantize(
                    ctx,
                    encoder,
                    src,
                    cache,
                    scales,
                    aux.as_entire_buffer_binding(),
                    rotation,
                )?;
                continue;
            }
        };
        record(
            ctx,
            encoder,
            src,
            dst,
            aux.as_entire_buffer_binding(),
            dummy.as_entire_buffer_binding(),
            rotation,
        )?;
    }
    Ok(())
}

/// Whether `r`'s `n` elements (`rotated` of each row rotated) and its destination lie inside
/// their bindings, and its slots fit the destination.
fn inside(r: &Rows<'_>, slots: Option<Slots<'_>>, n: u64, rotated: usize) -> bool {
    let fits = |(b, st): &Operand<'_>, elems: u64| {
        let size = b.size.map_or(b.buffer.size() - b.offset, |s| s.get());
        st.bytes(elems as usize) <= size
    };
    let [t, heads, e] = r.dims;
    match (&r.dest, slots) {
        (Dest::InPlace(x), None) => rotated > 0 && fits(x, n),
        (Dest::Slots { src, cache }, Some(s)) => {
            let last = s.slots.iter().max().map_or(0, |&x| x as u64 + 1);
            let held = last.next_multiple_of(s.head_major_block.max(1) as u64) * (heads * e) as u64;
            s.slots.len() == t && fits(src, n) && fits(cache, held)
        }
        (Dest::Quantized { src, cache, scales }, Some(s)) => {
            let last = s.slots.iter().max().map_or(0, |&x| x as u64 + 1);
            let rows = last.next_multiple_of(s.head_major_block.max(1) as u64) * heads as u64;
            let scale_rows = if cache.1 == Storage::Int8 {
                rows
            } else {
                heads as u64
            };
            s.slots.len() == t
                && e % 4 == 0
                && fits(src, n)
                && fits(cache, rows * e as u64)
                && fits(&(scales.clone(), Storage::F32), scale_rows)
        }
        _ => false,
    }
}

/// The GPU side of [`Rope`]: its rotation of a caller's buffer in place, and of host rows on
/// the GPU.
impl Rope {
    /// Record the rotation of the GPU tensor `x` `[T, H, E]` (dense, any storage format) in
    /// place, token `t` at `positions[t]`. Checked before anything is recorded.
    pub fn record(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        x: &Tensor<'_>,
        positions: &[usize],
    ) -> Result<()> {
        let (shape, d) = self.check(x, positions)?;
        let crate::tensor::TensorData::Gpu { .. } = &x.data else {
            return Err(Error::BadBuffer {
                tensor: "x",
                reason: "Rope::record rotates a GPU buffer in place (Tensor::from_buffer); use Rope::apply for host data".into(),
            });
        };
        let op = Checked::check(ctx, "x", x)?;
        let up = op.upload(ctx, "x");
        rotate(
            ctx,
            encoder,
            Some((*self, d)),
            positions,
            None,
            vec![Rows {
                dims: shape,
                dest: Dest::InPlace((up.binding(), x.storage())),
                rotate: true,
            }],
        )
    }

    /// Rotate host rows `[T, H, E]` on the GPU in format `x`'s storage (upload, rotate, read
    /// back widened to f32): [`record`](Rope::record) for host data.
    pub async fn run(
        &self,
        ctx: &Context,
        x: &Tensor<'_>,
        positions: &[usize],
    ) -> Result<ndarray::Array3<f32>> {
        let (shape, _) = self.check(x, positions)?;
        let st = x.storage();
        let Some(host) = x.host_f32() else {
            return Err(Error::BadBuffer {
                tensor: "x",
                reason: "Rope::run takes host data; record a GPU buffer's rotation with Rope::record".into(),
            });
        };
        let buf = crate::device::buffers::init(
            ctx,
            "rope x",
            &st.encode(&host),
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        );
        let n = shape.iter().product();
        ctx.submit("wgpu-attention rope", |enc| {
            self.record(ctx, enc, &Tensor::from_buffer(&buf, st, &shape), positions)
        })
        .await?;
        let v = ctx.read_as_f32(&buf, 0, n, st).await?;
        Ok(ndarray::Array3::from_shape_vec((shape[0], shape[1], shape[2]), v).expect("length"))
    }

    /// Blocking version of [`run`](Rope::run).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run_blocking(
        &self,
        ctx: &Context,
        x: &Tensor<'_>,
        positions: &[usize],
    ) -> Result<ndarray::Array3<f32>> {
        pollster::block_on(self.run(ctx, x, positions))
    }

    /// The shape `[T, H, E]` of `x` and the rotated dimensions, checked against `positions`.
    pub(crate) fn check(&self, x: &Tensor<'_>, positions: &[usize]) -> Result<([usize; 3], usize)> {
        let shape: [usize; 3] = x.shape.as_slice().try_into().map_err(|_| Error::WrongRank {
            tensor: "x",
            expected: 3,
            actual: x.shape.len(),
            shape: x.shape.clone(),
        })?;
        if shape.contains(&0) {
            return Err(Error::ZeroSized {
                tensor: "x",
                shape: x.shape.clone(),
            });
        }
        let d = self.rotated_dims(shape[2])?;
        check_positions(positions, shape[0])?;
        Ok((shape, d))
    }
}
