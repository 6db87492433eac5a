//! Storage formats: how a tensor's elements are held on the device.
//!
//! Every kernel reads and writes f32, f16 or bf16 storage and accumulates in f32. Half formats
//! are packed two per `u32` word and converted with WGSL's core `unpack2x16float` /
//! `pack2x16float` (f16) or by bit shifts (bf16 is the upper half of an f32), so they need no
//! optional device feature and run on every backend, the browser included. K and V caches may
//! also be 8-bit ([`Storage::Int8`], [`Storage::Fp8`]: four codes per word, with their scales
//! in a buffer of their own; `crate::quant`), dequantised as the attention kernels load them.

use std::borrow::Cow;

use half::{bf16, f16};

/// The format of a tensor's elements on the device.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Storage {
    /// IEEE binary32, 4 bytes.
    #[default]
    F32,
    /// IEEE binary16 (`half::f16`), 2 bytes: 11-bit significand, range ±65504.
    F16,
    /// bfloat16 (`half::bf16`), 2 bytes: the upper half of an f32 (8-bit significand, f32's
    /// range).
    Bf16,
    /// Symmetric int8 codes, 1 byte, for K and V caches only: element `x` of a row of E is
    /// `code · scale` with one f32 scale per row (per token and kv head: `scale = max |x| /
    /// 127`, `code = round(x / scale)` to nearest even, within ±127). The scales are a tensor
    /// of their own ([`Tensor::with_scales`](crate::Tensor::with_scales)); see
    /// [`quant`](crate::quant).
    Int8,
    /// FP8 e4m3 codes as PyTorch's `torch.float8_e4m3fn` (no infinities, ±448 at most), 1 byte,
    /// for K and V caches only: element `x` is `e4m3(x / scale)` with one f32 scale per kv head
    /// (vLLM's `k_scale` / `v_scale`), saturated to ±448. See [`quant`](crate::quant).
    Fp8,
}

impl Storage {
    /// The float formats, which every tensor takes.
    pub const ALL: [Storage; 3] = [Storage::F32, Storage::F16, Storage::Bf16];

    /// The 8-bit formats of K and V caches, read with their scales.
    pub const QUANTIZED: [Storage; 2] = [Storage::Int8, Storage::Fp8];

    /// The name used by the CLI: `f32`, `f16`, `bf16`, `int8`, `fp8`.
    pub fn name(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::F16 => "f16",
            Storage::Bf16 => "bf16",
            Storage::Int8 => "int8",
            Storage::Fp8 => "fp8",
        }
    }

    /// Bytes per element (the scales of an 8-bit format not counted).
    pub fn element_bytes(self) -> u64 {
        match self {
            Storage::F32 => 4,
            Storage::F16 | Storage::Bf16 => 2,
            Storage::Int8 | Storage::Fp8 => 1,
        }
    }

    /// Bytes of `elems` elements on the device, rounded up to whole 4-byte words (WGSL reads
    /// half formats two per `u32`, 8-bit ones four).
    pub fn bytes(self, elems: usize) -> u64 {
        (elems as u64 * self.element_bytes()).next_multiple_of(4)
    }

    /// Whether the format packs two elements per 32-bit word (f16, bf16).
    pub fn is_half(self) -> bool {
        matches!(self, Storage::F16 | Storage::Bf16)
    }

    /// Whether the format is an 8-bit one read with scales ([`Storage::Int8`],
    /// [`Storage::Fp8`]): K and V caches only.
    pub fn is_quantized(self) -> bool {
        matches!(self, Storage::Int8 | Storage::Fp8)
    }

    /// `x` rounded to this format (round to nearest, ties to even) and widened back to f32:
    /// the value the device holds. NaN stays NaN, out-of-range values become ±inf. The 8-bit
    /// formats round the value itself, with a scale of 1: [`Storage::Int8`] to an integer
    /// within ±127, [`Storage::Fp8`] to e4m3, saturating at ±448.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Storage::F32 => x,
            Storage::F16 => f16::from_f32(x).to_f32(),
            Storage::Bf16 => bf16::from_f32(x).to_f32(),
            Storage::Int8 => int8_code(x, 1.0) as f32,
            Storage::Fp8 => E4m3::from_f32(x).to_f32(),
        }
    }

    /// The largest finite value of the format (of the codes, for the 8-bit formats).
    pub fn max_finite(self) -> f32 {
        match self {
            Storage::F32 => f32::MAX,
            Storage::F16 => f16::MAX.to_f32(),
            Storage::Bf16 => bf16::MAX.to_f32(),
            Storage::Int8 => 127.0,
            Storage::Fp8 => E4m3::MAX,
        }
    }

    /// Little-endian bytes of `data` in this format (rounded to nearest even, as
    /// [`Storage::round`]), padded to whole words: what a buffer of this format holds.
    pub fn encode(self, data: &[f32]) -> Vec<u8> {
        let mut bytes = match self {
            Storage::F32 => bytemuck::cast_slice(data).to_vec(),
            Storage::F16 => data
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
            Storage::Bf16 => data
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            Storage::Int8 => data.iter().map(|&x| int8_code(x, 1.0) as u8).collect(),
            Storage::Fp8 => data.iter().map(|&x| E4m3::from_f32(x).0).collect(),
        };
        bytes.resize(self.bytes(data.len()) as usize, 0);
        bytes
    }

    /// The first `elems` elements of little-endian `bytes` in this format, widened to f32
    /// (exact; the codes' values for the 8-bit formats, unscaled). `bytes` must hold them.
    pub fn decode(self, bytes: &[u8], elems: usize) -> Vec<f32> {
        let n = self.element_bytes() as usize;
        let bytes = &bytes[..elems * n];
        match self {
            Storage::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Storage::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Storage::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Storage::Int8 => bytes.iter().map(|&c| c as i8 as f32).collect(),
            Storage::Fp8 => bytes.iter().map(|&c| E4m3(c).to_f32()).collect(),
        }
    }
}

impl std::fmt::Display for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The storage formats of one attention call's tensors ([`crate::Problem::storage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Formats {
    /// q.
    pub q: Storage,
    /// k.
    pub k: Storage,
    /// v.
    pub v: Storage,
    /// The additive bias (f32 when there is none).
    pub bias: Storage,
    /// The output.
    pub out: Storage,
}

impl Formats {
    /// Every tensor in `s`.
    pub fn all(s: Storage) -> Formats {
        Formats {
            q: s,
            k: s,
            v: s,
            bias: s,
            out: s,
        }
    }
}

/// One e4m3 code (`torch.float8_e4m3fn`'s bits): host data of a [`Storage::Fp8`] cache.
///
/// [`Storage::Fp8`]: Storage::Fp8
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct E4m3(pub u8);

impl E4m3 {
    /// The largest finite value, 448.
    pub const MAX: f32 = 448.0;

    /// `x` saturated to ±448 and rounded to the nearest e4m3 value, ties to even. NaN becomes
    /// the NaN code (`0x7f`, with x's sign); -0.0 keeps its sign.
    pub fn from_f32(x: f32) -> E4m3 {
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        if x.is_nan() {
            return E4m3(sign | 0x7f);
        }
        let a = x.abs().min(Self::MAX);
        // The spacing of e4m3 values at a's binade (2^-9 below the normal range, 2^-6).
        let e = (((a.to_bits() >> 23) & 0xff) as i32 - 127).max(-6);
        let ulp = 2f32.powi(e - 3);
        let r = (a / ulp).round_ties_even() * ulp; // exact: ulp is a power of two
        E4m3(sign | Self::bits_of(r))
    }

    /// The code of `r`, a non-negative e4m3 value.
    fn bits_of(r: f32) -> u8 {
        if r < 2f32.powi(-6) {
            return (r * 512.0) as u8;
        }
        let e = ((r.to_bits() >> 23) & 0xff) as i32 - 127;
        let m = (r.to_bits() >> 20) & 7;
        (((e + 7) as u32) << 3 | m) as u8
    }

    /// The value of the code (exact). The NaN codes give NaN.
    pub fn to_f32(self) -> f32 {
        let c = self.0;
        let (e, m) = ((c >> 3) & 15, (c & 7) as f32);
        let a = match (e, c & 0x7f) {
            (_, 0x7f) => f32::NAN,
            (0, _) => m * 2f32.powi(-9),
            _ => (8.0 + m) * 2f32.powi(e as i32 - 10),
        };
        if c & 0x80 != 0 {
            -a
        } else {
            a
        }
    }
}

/// The int8 code of `x` at `scale` (`round(x / scale)` to nearest even, within ±127; 0 where
/// the scale is 0). NaN gives 0.
pub fn int8_code(x: f32, scale: f32) -> i8 {
    if scale == 0.0 {
        return 0;
    }
    (x / scale).round_ties_even().clamp(-127.0, 127.0) as i8
}

/// The int8 scale of a row: `max |x| / 127` (0 for a row of zeros). A NaN in the row gives a
/// NaN scale, which reads back as NaN, as the row would in a float cache.
pub fn int8_scale(row: &[f32]) -> f32 {
    let amax = row.iter().fold(0f32, |m, &x| {
        if x.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(x.abs())
        }
    });
    amax / 127.0
}

/// The kv head of each row of a cache laid out as `dims` (row-major, the last dim E left out)
/// whose head dim is `head_axis`: the scale index of an fp8 cache's rows.
pub(crate) fn head_of_row(row: usize, dims: &[usize], head_axis: usize) -> usize {
    let inner: usize = dims[head_axis + 1..].iter().product();
    (row / inner) % dims[head_axis]
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i8 {}
    impl Sealed for super::E4m3 {}
}

/// An element type the crate takes from the host: `f32`, [`half::f16`] or [`half::bf16`]; for K
/// and V caches also int8 codes (`i8`, [`Storage::Int8`]) and e4m3 codes
/// ([`E4m3`](E4m3), [`Storage::Fp8`]), given with their scales.
pub trait Element: sealed::Sealed + bytemuck::Pod + Copy + Send + Sync + 'static {
    /// The device format that holds this type.
    const STORAGE: Storage;
    /// Host data of this type as [`HostData`].
    #[doc(hidden)]
    fn host_data(data: Cow<'_, [Self]>) -> HostData<'_>;
}

impl Element for f32 {
    const STORAGE: Storage = Storage::F32;
    fn host_data(data: Cow<'_, [Self]>) -> HostData<'_> {
        HostData::F32(data)
    }
}

impl Element for f16 {
    const STORAGE: Storage = Storage::F16;
    fn host_data(data: Cow<'_, [Self]>) -> HostData<'_> {
        HostData::F16(data)
    }
}

impl Element for bf16 {
    const STORAGE: Storage = Storage::Bf16;
    fn host_data(data: Cow<'_, [Self]>) -> HostData<'_> {
        HostData::Bf16(data)
    }
}

impl Element for i8 {
    const STORAGE: Storage = Storage::Int8;
    fn host_data(data: Cow<'_, [Self]>) -> HostData<'_> {
        HostData::Int8(data)
    }
}

impl Element for E4m3 {
    const STORAGE: Storage = Storage::Fp8;
    fn host_data(data: Cow<'_, [Self]>) -> HostData<'_> {
        HostData::Fp8(data)
    }
}

/// Host elements in one of the [`Element`] types.
#[doc(hidden)]
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum HostData<'a> {
    /// f32 elements.
    F32(Cow<'a, [f32]>),
    /// f16 elements.
    F16(Cow<'a, [f16]>),
    /// bf16 elements.
    Bf16(Cow<'a, [bf16]>),
    /// int8 codes.
    Int8(Cow<'a, [i8]>),
    /// e4m3 codes.
    Fp8(Cow<'a, [E4m3]>),
}

impl HostData<'_> {
    /// The number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            HostData::F32(d) => d.len(),
            HostData::F16(d) => d.len(),
            HostData::Bf16(d) => d.len(),
            HostData::Int8(d) => d.len(),
            HostData::Fp8(d) => d.len(),
        }
    }

    /// The format.
    pub(crate) fn storage(&self) -> Storage {
        match self {
            HostData::F32(_) => Storage::F32,
            HostData::F16(_) => Storage::F16,
            HostData::Bf16(_) => Storage::Bf16,
            HostData::Int8(_) => Storage::Int8,
            HostData::Fp8(_) => Storage::Fp8,
        }
    }

    /// The device bytes, padded to whole words.
    pub(crate) fn bytes(&self) -> Cow<'_, [u8]> {
        let (raw, storage): (&[u8], Storage) = match self {
            HostData::F32(d) => (bytemuck::cast_slice(d), Storage::F32),
            HostData::F16(d) => (bytemuck::cast_slice(d), Storage::F16),
            HostData::Bf16(d) => (bytemuck::cast_slice(d), Storage::Bf16),
            HostData::Int8(d) => (bytemuck::cast_slice(d), Storage::Int8),
            HostData::Fp8(d) => (bytemuck::cast_slice(d), Storage::Fp8),
        };
        let padded = storage.bytes(self.len()) as usize;
        if raw.len() == padded && cfg!(target_endian = "little") {
            Cow::Borrowed(raw)
        } else {
            let mut v = raw.to_vec();
            v.resize(padded, 0);
            Cow::Owned(v)
        }
    }

    /// The elements widened to f32 (exact; unscaled codes for the 8-bit formats).
    pub(crate) fn to_f32(&self) -> Cow<'_, [f32]> {
        match self {
            HostData::F32(d) => Cow::Borrowed(d),
            HostData::F16(d) => Cow::Owned(d.iter().map(|x| x.to_f32()).collect()),
            HostData::Bf16(d) => Cow::Owned(d.iter().map(|x| x.to_f32()).collect()),
            HostData::Int8(d) => Cow::Owned(d.iter().map(|&x| x as f32).collect()),
            HostData::Fp8(d) => Cow::Owned(d.iter().map(|x| x.to_f32()).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rounds_to_nearest_even() {
        for s in Storage::ALL {
            assert_eq!(s.name().parse::<Storage>(), Ok(s));
            let xs = [
                0.0f32,
                -1.5,
                1.0 + 1.0 / 4096.0,
                3.0e4,
                f32::INFINITY,
                -f32::INFINITY,
            ];
            let back = s.decode(&s.encode(&xs), xs.len());
            for (x, y) in xs.iter().zip(&back) {
                assert_eq!(s.round(*x), *y, "{s} {x}");
            }
            assert!(s.decode(&s.encode(&[f32::NAN]), 1)[0].is_nan());
        }
        // 1 + 2^-11 is halfway between two f16 values: ties to even gives 1.
        assert_eq!(Storage::F16.round(1.0 + 1.0 / 2048.0), 1.0);
        assert_eq!(Storage::Bf16.round(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(Storage::F16.round(1.0e5), f32::INFINITY);
        assert_eq!(Storage::F16.bytes(37), 76);
        assert_eq!(Storage::Bf16.bytes(3), 8);
        assert!("f64".parse::<Storage>().is_err());
    }
}
