//! Inputs: host data (slices, ndarray arrays) or the caller's own `wgpu::Buffer`s.

use std::borrow::Cow;

use ndarray::{ArrayBase, Data, Dimension};

use crate::error::{Error, Result};
use crate::storage::{Element, HostData, Storage};
use crate::view::{TensorLayout, View, ViewSpec};

/// Borrow a standard-layout array's data; copy any other layout into row-major order.
fn row_major<T: Copy, S: Data<Elem = T>, D: Dimension>(a: &ArrayBase<S, D>) -> Cow<'_, [T]> {
    match a.as_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().copied().collect()),
    }
}

/// [`row_major`] for a view, keeping the view's lifetime.
fn view_row_major<T: Copy, D: Dimension>(a: ndarray::ArrayView<'_, T, D>) -> Cow<'_, [T]> {
    match a.to_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().copied().collect()),
    }
}

/// A tensor given to the GPU: host data (copied up once) or a caller's GPU buffer (bound in
/// place, no copy). Host data is row-major and contiguous; a GPU buffer is too unless given
/// a layout, a sequence capacity or strides ([`Tensor::with_layout`],
/// [`Tensor::with_seq_capacity`], [`Tensor::with_strides`]: read in place, see
/// [`TensorLayout`]). Host data is `f32`, [`half::f16`] or [`half::bf16`]
/// (slices or ndarray arrays) and keeps its format on the device; a GPU buffer holds the
/// format declared in [`Tensor::from_buffer`].
#[derive(Debug, Clone)]
pub struct Tensor<'a> {
    pub(crate) data: TensorData<'a>,
    pub(crate) shape: Vec<usize>,
    /// A builder call that does not apply to this tensor, reported when it is used.
    pub(crate) misuse: Option<&'static str>,
    /// The layout, capacity or strides asked for (GPU buffers; dense when unset).
    pub(crate) view: ViewSpec,
    /// The scales of an 8-bit K or V cache ([`Tensor::with_scales`]).
    pub(crate) scales: Option<Box<Tensor<'a>>>,
}

#[derive(Debug, Clone)]
pub(crate) enum TensorData<'a> {
    Host(HostData<'a>),
    Gpu {
        buffer: &'a wgpu::Buffer,
        offset: u64,
        storage: Storage,
    },
}

impl<'a> Tensor<'a> {
    /// Host data in row-major order with the given shape (the length is checked against the
    /// shape before any GPU work).
    pub fn from_slice<T: Element>(data: &'a [T], shape: &[usize]) -> Self {
        Tensor {
            data: TensorData::Host(T::host_data(Cow::Borrowed(data))),
            shape: shape.to_vec(),
            misuse: None,
            view: ViewSpec::default(),
            scales: None,
        }
    }

    /// A caller's GPU buffer holding the tensor row-major, its elements in format `storage`
    /// (declared, as the buffer cannot say: f32 data declared [`Storage::F16`] would be read as
    /// halves), from the buffer's start; [`Tensor::at_offset`] moves the start.
    /// The buffer needs `STORAGE` usage (and `COPY_SRC` if it is read back) and must belong to
    /// the context's device. Half formats: two elements per 4-byte word, little-endian, the
    /// buffer's size rounded up to whole words.
    pub fn from_buffer(buffer: &'a wgpu::Buffer, storage: Storage, shape: &[usize]) -> Self {
        Tensor {
            data: TensorData::Gpu {
                buffer,
                offset: 0,
                storage,
            },
            shape: shape.to_vec(),
            misuse: None,
            view: ViewSpec::default(),
            scales: None,
        }
    }

    /// Start a GPU buffer's tensor at byte `offset`. q, k, v and the output of [`Sdpa`] and
    /// [`Backward`] take any multiple of the element size (an offset that is not a multiple
    /// of 256 is read through a view, see [`TensorLayout`]); other entry points need a
    /// multiple of the device's `min_storage_buffer_offset_alignment`. Checked before any
    /// GPU work. Host data has no offset: calling this on it makes the call fail with
    /// [`Error::BadBuffer`].
    ///
    /// [`Error::BadBuffer`]: crate::Error::BadBuffer
    /// [`Sdpa`]: crate::Sdpa
    /// [`Backward`]: crate::Backward
    pub fn at_offset(mut self, offset: u64) -> Self {
        match &mut self.data {
            TensorData::Gpu { offset: o, .. } => *o = offset,
            TensorData::Host(_) => self.misuse = Some("at_offset was given host data, which has no offset"),
        }
        self
    }

    /// Read a GPU buffer's `[B, H, S, E]` tensor (the shape keeps that order) in `layout`:
    /// [`TensorLayout::Bshe`] for a buffer holding `[B, S, H, E]`. In place, no copy. With
    /// [`Tensor::with_seq_capacity`] the buffer holds more rows than the shape's S. Host data
    /// is row-major `[B, H, S, E]`: calling this on it makes the call fail with
    /// [`Error::BadBuffer`](crate::Error::BadBuffer).
    pub fn with_layout(mut self, layout: TensorLayout) -> Self {
        self.view.layout = Some(layout);
        self.gpu_only("with_layout")
    }

    /// The buffer holds `capacity` rows per head (a KV cache allocated for `capacity` tokens,
    /// of which the shape's `S` are used): row `s` of head `h` of batch `b` is where the layout
    /// puts it in a `[B, H, capacity, E]` (or `[B, capacity, H, E]`) buffer. GPU buffers only.
    pub fn with_seq_capacity(mut self, capacity: usize) -> Self {
        self.view.capacity = Some(capacity);
        self.gpu_only("with_seq_capacity")
    }

    /// Explicit element strides of the shape's four dims `[B, H, S, E]` (E's must be 1: rows
    /// are contiguous, and may be anywhere): element `(b, h, s, e)` is at element
    /// `b·strides[0] + h·strides[1] + s·strides[2] + e` from the tensor's offset. Inputs may
    /// repeat elements (stride 0 broadcasts); an output may not. For q, k, v and the output of
    /// [`Sdpa`](crate::Sdpa) and [`Backward`](crate::Backward); GPU buffers only.
    ///
    /// The additive bias of [`Sdpa`](crate::Sdpa) and [`Backward`](crate::Backward) takes
    /// strides too: one per dimension of its shape (rank 1 to 4), any values (its key stride
    /// need not be 1; a dimension of size 1 ignores its stride), for a bias inside a larger
    /// buffer (allocated for a KV cache's capacity, or transposed); an offset alone
    /// ([`Tensor::at_offset`], any whole element) also reads it in place. Its gradient comes out
    /// dense in its shape.
    pub fn with_strides(mut self, strides: &[usize]) -> Self {
        self.view.strides = Some(strides.to_vec());
        self.gpu_only("with_strides")
    }

    fn gpu_only(mut self, call: &'static str) -> Self {
        if matches!(self.data, TensorData::Host(_)) {
            self.misuse = Some(match call {
                "with_layout" => "with_layout describes a GPU buffer; host data is row-major [B, H, S, E]",
                "with_seq_capacity" => {
                    "with_seq_capacity describes a GPU buffer; host data is row-major [B, H, S, E]"
                }
                _ => "with_strides describes a GPU buffer; host data is row-major [B, H, S, E]",
            });
        }
        self
    }

    /// The scales of an 8-bit K or V cache ([`Storage::Int8`], [`Storage::Fp8`]; the rules are
    /// [`crate::quant`]'s), f32, host data or a GPU buffer read in place:
    ///
    /// - **int8**: one scale per row of E codes, laid out as K's (V's) rows are: the tensor's
    ///   shape without E (`[B, Hkv, S]` for contiguous K; `[NB, BS, Hkv]` for token-major pages,
    ///   `[NB, Hkv, BS]` for head-major ones), and for a GPU cache read through a layout,
    ///   capacity or strides, the same layout, capacity and strides (divided by E): row `r` of
    ///   the cache, at element `r · E` of its buffer, has its scale at element `r` of the
    ///   scales' buffer.
    /// - **fp8**: one scale per kv head, `[Hkv]`.
    ///
    /// A scales buffer starts at its binding (an offset, if any, a multiple of the device's
    /// `min_storage_buffer_offset_alignment`) and takes no view of its own. Checked before
    /// any GPU work: scales on a float tensor, scales missing from an 8-bit one, a wrong
    /// shape or format are [`Error::Quantized`](crate::Error::Quantized).
    pub fn with_scales(mut self, scales: impl Into<Tensor<'a>>) -> Self {
        self.scales = Some(Box::new(scales.into()));
        self
    }

    /// The scales given with [`Tensor::with_scales`].
    pub fn scales(&self) -> Option<&Tensor<'a>> {
        self.scales.as_deref()
    }

    /// The device format of this tensor. Host data is converted to the format (round to nearest
    /// even) when it is not in it already (float formats only: quantise an 8-bit cache with
    /// [`crate::quant`], which gives the scales too). For a GPU buffer this re-declares what
    /// the buffer holds (as [`Tensor::from_buffer`]'s `storage` does).
    pub fn with_storage(mut self, storage: Storage) -> Self {
        match &mut self.data {
            TensorData::Gpu { storage: s, .. } => *s = storage,
            TensorData::Host(d)
                if d.storage() != storage && (storage.is_quantized() || d.storage().is_quantized()) =>
            {
                self.misuse = Some(
                    "with_storage converts host data between float formats only: quantise K and V with wgpu_attention::quant and give the codes with their scales",
                );
            }
            TensorData::Host(d) if d.storage() != storage => {
                let f = d.to_f32();
                let data = match storage {
                    Storage::F32 => HostData::F32(Cow::Owned(f.into_owned())),
                    Storage::F16 => {
                        HostData::F16(Cow::Owned(f.iter().map(|&x| half::f16::from_f32(x)).collect()))
                    }
                    Storage::Bf16 => {
                        HostData::Bf16(Cow::Owned(f.iter().map(|&x| half::bf16::from_f32(x)).collect()))
                    }
                    Storage::Int8 | Storage::Fp8 => unreachable!("refused above"),
                };
                self.data = TensorData::Host(data);
            }
            TensorData::Host(_) => {}
        }
        self
    }

    /// The device format.
    pub fn storage(&self) -> Storage {
        match &self.data {
            TensorData::Host(d) => d.storage(),
            TensorData::Gpu { storage, .. } => *storage,
        }
    }

    /// Host data widened to f32 (exact), or `None` for a GPU buffer. An 8-bit cache's codes
    /// are dequantised with its host scales ([`Tensor::host_values`] with the kv heads at axis
    /// 1: contiguous and head-major caches).
    pub(crate) fn host_f32(&self) -> Option<Cow<'_, [f32]>> {
        self.host_values(1)
    }

    /// [`Tensor::host_f32`], an fp8 cache's kv heads at axis `head_axis` of its shape (2 for
    /// token-major pages). `None` for a GPU buffer, and for 8-bit codes whose scales are not
    /// host data of the right length (the attention calls' checks refuse those first).
    pub(crate) fn host_values(&self, head_axis: usize) -> Option<Cow<'_, [f32]>> {
        let TensorData::Host(d) = &self.data else {
            return None;
        };
        let codes = d.to_f32();
        if !d.storage().is_quantized() {
            return Some(codes);
        }
        let scales = self.scales.as_ref()?.host_values(1)?;
        let e = *self.shape.last()?;
        let rows = codes.len() / e.max(1);
        let dims = &self.shape[..self.shape.len() - 1];
        let scale_of = |r: usize| match d.storage() {
            Storage::Int8 => scales.get(r).copied(),
            _ => scales
                .get(crate::storage::head_of_row(
                    r,
                    dims,
                    head_axis.min(dims.len() - 1),
                ))
                .copied(),
        };
        let mut out = Vec::with_capacity(codes.len());
        for r in 0..rows {
            let s = scale_of(r)?;
            out.extend(codes[r * e..(r + 1) * e].iter().map(|&c| c * s));
        }
        Some(Cow::Owned(out))
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The shape as exactly `N` non-zero dimensions, or the typed error naming `name`.
    pub(crate) fn dims<const N: usize>(&self, name: &'static str) -> crate::error::Result<[usize; N]> {
        let s: [usize; N] = self
            .shape
            .as_slice()
            .try_into()
            .map_err(|_| crate::error::Error::WrongRank {
                tensor: name,
                expected: N,
                actual: self.shape.len(),
                shape: self.shape.clone(),
            })?;
        if s.contains(&0) {
            return Err(crate::error::Error::ZeroSized {
                tensor: name,
                shape: s.to_vec(),
            });
        }
        Ok(s)
    }
}

impl<'a, T, S, D> From<&'a ArrayBase<S, D>> for Tensor<'a>
where
    T: Element,
    S: Data<Elem = T>,
    D: Dimension,
{
    /// Borrows standard-layout arrays; copies others into row-major order.
    fn from(a: &'a ArrayBase<S, D>) -> Self {
        Tensor {
            data: TensorData::Host(T::host_data(row_major(a))),
            shape: a.shape().to_vec(),
            misuse: None,
            view: ViewSpec::default(),
            scales: None,
        }
    }
}

impl<'a, T: Element, D: Dimension> From<ndarray::ArrayView<'a, T, D>> for Tensor<'a> {
    /// Borrows standard-layout views; copies others into row-major order.
    fn from(a: ndarray::ArrayView<'a, T, D>) -> Self {
        let shape = a.shape().to_vec();
        Tensor {
            data: TensorData::Host(T::host_data(view_row_major(a))),
            shape,
            misuse: None,
            view: ViewSpec::default(),
            scales: None,
        }
    }
}

/// A boolean attention mask on the host, **true = may attend** (PyTorch SDPA's convention),
/// broadcastable to `[B, Hq, L, S]` (rank 1 to 4, numpy rules).
#[derive(Debug, Clone)]
pub struct Mask<'a> {
    pub(crate) data: Cow<'a, [bool]>,
    pub(crate) shape: Vec<usize>,
}

impl<'a> Mask<'a> {
    /// Row-major host data with the given shape.
    pub fn from_slice(data: &'a [bool], shape: &[usize]) -> Self {
        Mask {
            data: Cow::Borrowed(data),
            shape: shape.to_vec(),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl<'a, S, D> From<&'a ArrayBase<S, D>> for Mask<'a>
where
    S: Data<Elem = bool>,
    D: Dimension,
{
    fn from(a: &'a ArrayBase<S, D>) -> Self {
        Mask {
            data: row_major(a),
            shape: a.shape().to_vec(),
        }
    }
}

impl<'a, D: Dimension> From<ndarray::ArrayView<'a, bool, D>> for Mask<'a> {
    fn from(a: ndarray::ArrayView<'a, bool, D>) -> Self {
        let shape = a.shape().to_vec();
        Mask {
            data: view_row_major(a),
            shape,
        }
    }
}

/// [`Error::DataLength`] unless `actual` elements fill `shape`.
pub(crate) fn check_len(tensor: &'static str, shape: &[usize], actual: usize) -> Result<()> {
    let expected: usize = shape.iter().product();
    if expected != actual {
        return Err(Error::DataLength {
            tensor,
            shape: shape.to_vec(),
            expected,
            actual,
        });
    }
    Ok(())
}

// The views of a tensor: where its elements lie in its buffer.

/// The view of tensor `name`, `None` when it is dense (or host data).
pub(crate) fn of_tensor(name: &'static str, t: &Tensor) -> Result<Option<View>> {
    match &t.data {
        TensorData::Gpu { offset, storage, .. } => {
            let v = crate::view::resolve(name, &t.view, &t.shape, *offset, *storage)?;
            Ok(v.filter(|v| !v.is_dense(t.shape.as_slice().try_into().expect("a view is 4-D"))))
        }
        TensorData::Host(_) => Ok(None),
    }
}

/// The bias's view (see [`resolve_bias`]), `None` when it is dense (or host data): a view
/// equal to the dense broadcast one, from the buffer's aligned start, is no view.
pub(crate) fn of_bias(t: &Tensor) -> Result<Option<View>> {
    match &t.data {
        TensorData::Gpu { offset, storage, .. } => {
            let v = crate::view::resolve_bias(&t.view, &t.shape, *offset, *storage)?;
            // `resolve_bias` gives a view only for a valid shape (rank 1 to 4).
            Ok(v.filter(|v| {
                let dense = crate::problem::Broadcast {
                    shape: crate::view::pad4(&t.shape),
                }
                .strides();
                v.offset != 0 || v.strides != dense
            }))
        }
        TensorData::Host(_) => Ok(None),
    }
}

/// [`of_tensor`] for an output: its view must not reach one element from two indices.
pub(crate) fn of_output(name: &'static str, t: &Tensor) -> Result<Option<View>> {
    let v = of_tensor(name, t)?;
    if let Some(v) = v {
        let shape: [usize; 4] = t.shape.as_slice().try_into().expect("a view is 4-D");
        if v.overlaps(shape) {
            return Err(Error::BadBuffer {
                tensor: name,
                reason: format!(
                    "an output's elements must not overlap: shape {shape:?} through strides {:?} writes some elements twice",
                    v.strides
                ),
            });
        }
    }
    Ok(v)
}

/// The element strides of T and H of a packed `[T, H, E]` tensor `name` (a ragged batch's q,
/// a cache append's k and v): three of its own ([`Tensor::with_strides`], E's 1: the parts of
/// a fused QKV projection), or dense. A layout or capacity (which describe `[B, H, S, E]`
/// tensors), another count of strides, an E stride other than 1 and a view asked of host data
/// are typed errors naming it.
///
/// [`Tensor::with_strides`]: crate::Tensor::with_strides
pub(crate) fn packed_rows(name: &'static str, x: &Tensor<'_>, [_, h, e]: [usize; 3]) -> Result<[usize; 2]> {
    let bad = |reason: String| Err(Error::BadBuffer { tensor: name, reason });
    if let Some(m) = x.misuse {
        return bad(m.into());
    }
    let spec = &x.view;
    if spec.layout.is_some() || spec.capacity.is_some() {
        return bad(format!(
            "{name} is packed [T, H, E]: a layout or sequence capacity describes [B, H, S, E] tensors; give its strides instead (Tensor::with_strides with three strides [T, H, E])"
        ));
    }
    match spec.strides.as_deref() {
        None => Ok([h * e, e]),
        Some(&[ts, hs, 1]) => Ok([ts, hs]),
        Some(&[_, _, es]) => bad(format!(
            "{name}'s head-dim stride is {es}: each row of E elements must be contiguous (stride 1)"
        )),
        Some(other) => bad(format!(
            "{name} is [T, H, E] and takes three strides (T, H, E), not {} ({other:?})",
            other.len()
        )),
    }
}

/// A GPU tensor's packed `[T, H, E]` rows at strides `[ts, hs]` as a `[1, T, H, E]` view from
/// its offset (what [`crate::ops::copy::gather_rows`] reads); `None` for host data.
pub(crate) fn rows_view<'a>(
    x: &Tensor<'a>,
    [t, h, e]: [usize; 3],
    [ts, hs]: [usize; 2],
) -> Option<Tensor<'a>> {
    match &x.data {
        TensorData::Gpu {
            buffer,
            offset,
            storage,
        } => Some(
            Tensor::from_buffer(buffer, *storage, &[1, t, h, e])
                .at_offset(*offset)
                .with_strides(&[0, ts, hs, 1]),
        ),
        TensorData::Host(_) => None,
    }
}
