//! 8-bit K/V caches: the rules by which values become codes and back, on the host, the same as
//! the GPU applies them when a [`KvCache`](crate::KvCache) appends and when the attention
//! kernels load K and V.
//!
//! - **int8** ([`Storage::Int8`](crate::storage::Storage::Int8)): symmetric, one f32 scale per row of E
//!   values (one token of one kv head): `scale = max |x| / 127`, `code = round(x / scale)` to
//!   nearest, ties to even, within ±127; a row of zeros has scale 0 and codes 0. The value read
//!   is `code · scale`. [`quantize_int8`], [`dequantize_int8`].
//! - **fp8** ([`Storage::Fp8`](crate::Storage::Fp8)): e4m3 as PyTorch's `torch.float8_e4m3fn`
//!   (4 exponent bits of bias 7, 3 mantissa bits, subnormals, no infinities, ±448 the largest
//!   value, NaN `0x7f` / `0xff`), one f32 scale per kv head that the caller sets (vLLM's
//!   `k_scale` / `v_scale`): `code = e4m3(clamp(x / scale, -448, 448))`, rounded to nearest
//!   even. Saturating first is vLLM's rule: PyTorch's cast alone turns values past 464 into
//!   NaN. The value read is `e4m3 · scale`. [`quantize_fp8`], [`dequantize_fp8`].
//!
//! Codes are packed four to a 32-bit word on the device (byte `i % 4` of word `i / 4`,
//! little-endian: a buffer of `i8` or [`E4m3`] as the host lays them out), so head dims must be
//! multiples of 4.
//!
//! ```
//! use wgpu_attention::quant::{dequantize_int8, quantize_int8, E4m3};
//! let (codes, scales) = quantize_int8(&[0.5, -1.0, 0.25, 0.0], 4);
//! assert_eq!(codes, [64, -127, 32, 0]); // 63.5 rounds to the even 64
//! assert_eq!(scales, [1.0 / 127.0]);
//! assert_eq!(dequantize_int8(&codes, &scales, 4)[1], -1.0);
//! assert_eq!(E4m3::from_f32(1000.0).to_f32(), 448.0); // saturated
//! ```

pub(crate) use crate::storage::head_of_row;
pub use crate::storage::{int8_code, int8_scale, E4m3};

/// Quantise rows of `row` values (`x.len()` a multiple of `row`) to int8: the codes, row by
/// row, and one scale per row.
pub fn quantize_int8(x: &[f32], row: usize) -> (Vec<i8>, Vec<f32>) {
    assert!(
        row > 0 && x.len().is_multiple_of(row),
        "quantize_int8: {} values are not rows of {row}",
        x.len()
    );
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / row);
    for r in x.chunks_exact(row) {
        let s = int8_scale(r);
        scales.push(s);
        codes.extend(r.iter().map(|&v| int8_code(v, s)));
    }
    (codes, scales)
}

/// The values of int8 `codes` in rows of `row` with one scale per row: `code · scale`.
pub fn dequantize_int8(codes: &[i8], scales: &[f32], row: usize) -> Vec<f32> {
    assert_eq!(
        codes.len(),
        scales.len() * row,
        "dequantize_int8: codes and scales"
    );
    codes
        .chunks_exact(row)
        .zip(scales)
        .flat_map(|(r, &s)| r.iter().map(move |&c| c as f32 * s))
        .collect()
}

/// Quantise `x` to e4m3 at `scale`: `e4m3(clamp(x / scale, -448, 448))`.
pub fn quantize_fp8(x: &[f32], scale: f32) -> Vec<E4m3> {
    x.iter().map(|&v| E4m3::from_f32(v / scale)).collect()
}

/// The values of e4m3 `codes` at `scale`: `e4m3 · scale`.
pub fn dequantize_fp8(codes: &[E4m3], scale: f32) -> Vec<f32> {
    codes.iter().map(|c| c.to_f32() * scale).collect()
}

/// Quantise a cache of rows of `e` values laid out as `dims` (row-major, without E) with the
/// head dim at `head_axis`, each head at its fp8 scale: the codes, in place of the values.
pub fn quantize_fp8_heads(
    x: &[f32],
    e: usize,
    dims: &[usize],
    head_axis: usize,
    scales: &[f32],
) -> Vec<E4m3> {
    assert_eq!(
        x.len(),
        dims.iter().product::<usize>() * e,
        "quantize_fp8_heads: values and dims"
    );
    assert_eq!(
        scales.len(),
        dims[head_axis],
        "quantize_fp8_heads: one scale per head"
    );
    x.chunks_exact(e)
        .enumerate()
        .flat_map(|(r, row)| quantize_fp8(row, scales[head_of_row(r, dims, head_axis)]))
        .collect()
}

/// The values of an fp8 cache laid out as [`quantize_fp8_heads`] says.
pub fn dequantize_fp8_heads(
    codes: &[E4m3],
    e: usize,
    dims: &[usize],
    head_axis: usize,
    scales: &[f32],
) -> Vec<f32> {
    codes
        .chunks_exact(e)
        .enumerate()
        .flat_map(|(r, row)| dequantize_fp8(row, scales[head_of_row(r, dims, head_axis)]))
        .collect()
}

/// Record the quantisation of `x` `[N, Hkv, E]` (f32, f16 or bf16; host data or a dense GPU
/// buffer; E a multiple of 4) on the GPU into `codes`, a buffer of `N · Hkv · E` codes in
/// `format` laid out as x is (`[N, Hkv, E]`: token-major pages when N = NB · BS), by the rules
/// above: int8 writes each row's scale into `scales` `[N, Hkv]` f32; fp8 reads one scale per
/// kv head from `scales` `[Hkv]`. What a [`KvCache`](crate::KvCache) does as it appends, for
/// pages you fill yourself. Checked before anything is recorded: the format, the shapes, the
/// buffers' sizes and usage (`STORAGE`).
pub fn record_quantize(
    ctx: &crate::device::context::Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &crate::tensor::Tensor<'_>,
    format: crate::storage::Storage,
    codes: &wgpu::Buffer,
    scales: &wgpu::Buffer,
) -> crate::error::Result<()> {
    use crate::error::Error;
    let bad = |reason: String| Err(Error::Quantized { reason });
    if !format.is_quantized() || x.storage().is_quantized() {
        return bad(format!(
            "record_quantize makes int8 or fp8 codes from float data: asked for {format} from {}",
            x.storage()
        ));
    }
    let [n, hkv, e] = x.dims::<3>("x")?;
    if !e.is_multiple_of(4) {
        return bad(format!(
            "the head dim {e} is not a multiple of 4: codes are packed four to a word"
        ));
    }
    let rows = n * hkv;
    let (need_codes, need_scales) = (
        format.bytes(rows * e),
        4 * if format == crate::storage::Storage::Int8 {
            rows
        } else {
            hkv
        } as u64,
    );
    for (name, buf, need) in [("codes", codes, need_codes), ("scales", scales, need_scales)] {
        if buf.size() < need || !buf.usage().contains(wgpu::BufferUsages::STORAGE) {
            return bad(format!(
                "the {name} buffer must hold {need} bytes with STORAGE usage (it has {} bytes, {:?})",
                buf.size(),
                buf.usage()
            ));
        }
    }
    u32::try_from(rows * e).map_err(|_| Error::Quantized {
        reason: format!("{} elements exceed the kernels' u32 indices", rows * e),
    })?;
    let op = crate::device::buffers::Operand::check(ctx, "x", x)?;
    let up = op.upload(ctx, "x");
    let slots: Vec<u32> = (0..n as u32).collect();
    crate::ops::rope::rotate(
        ctx,
        encoder,
        None,
        &vec![0; n],
        Some(crate::ops::rope::Slots {
            slots: &slots,
            head_major_block: 0,
        }),
        vec![crate::ops::rope::Rows {
            dims: [n, hkv, e],
            dest: crate::ops::rope::Dest::Quantized {
                src: (up.binding(), x.storage()),
                cache: (codes.as_entire_buffer_binding(), format),
                scales: scales.as_entire_buffer_binding(),
            },
            rotate: false,
        }],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite code decodes and re-encodes to itself, and every value between two codes
    /// goes to the nearer (ties to the even code), checked against all 254 values.
    #[test]
    fn e4m3_rounds_to_the_nearest_code() {
        let values: Vec<(u8, f32)> = (0..=255u8)
            .map(|c| (c, E4m3(c).to_f32()))
            .filter(|(_, v)| !v.is_nan())
            .collect();
        assert_eq!(values.len(), 254);
        for &(c, v) in &values {
            if v != 0.0 {
                assert_eq!(E4m3::from_f32(v).0, c, "{c:#x} {v}");
            }
        }
        assert_eq!(E4m3(0x7e).to_f32(), 448.0);
        assert_eq!(E4m3(0x01).to_f32(), 2f32.powi(-9));
        let nearest = |x: f32| {
            let mut best: Option<(u8, f32)> = None;
            for &(c, v) in &values {
                let d = (v - x).abs();
                let better = match best {
                    None => true,
                    Some((bc, bd)) => d < bd || (d == bd && c & 1 == 0 && bc & 1 == 1),
                };
                if better && (v != 0.0 || (c & 0x80 != 0) == x.is_sign_negative()) {
                    best = Some((c, d));
                }
            }
            best.unwrap().0
        };
        let mut x = 1.0e-4f32;
        while x < 448.0 {
            for v in [x, -x, x * 1.0625, -x * 1.0625] {
                assert_eq!(E4m3::from_f32(v), E4m3(nearest(v)), "{v}");
            }
            x *= 1.03125;
        }
        // Halfway between 1 and 1.125: the even mantissa (1).
        assert_eq!(E4m3::from_f32(1.0625).to_f32(), 1.0);
        assert_eq!(E4m3::from_f32(1.1875).to_f32(), 1.25);
        assert_eq!(E4m3::from_f32(500.0).to_f32(), 448.0);
        assert_eq!(E4m3::from_f32(-1e9).to_f32(), -448.0);
        assert!(E4m3::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(E4m3::from_f32(-0.0).0, 0x80);
    }

    #[test]
    fn int8_follows_the_rule() {
        let (c, s) = quantize_int8(&[0.0; 8], 4);
        assert_eq!((c, s), (vec![0; 8], vec![0.0, 0.0]));
        let x = [1.0, -2.0, 0.5, 2.0 * 62.5 / 127.0];
        let (c, s) = quantize_int8(&x, 4);
        assert_eq!(s, [2.0 / 127.0]);
        // x / scale: 63.5 (-> 64, even), -127, 31.75 -> 32, 62.5 -> 62 (even).
        assert_eq!(c, [64, -127, 32, 62]);
        let back = dequantize_int8(&c, &s, 4);
        assert_eq!(back[1], -2.0);
        assert!(int8_scale(&[1.0, f32::NAN]).is_nan());
    }

    #[test]
    fn fp8_heads_follow_the_layout() {
        // [2 tokens, 2 heads] rows of 4: head 1's scale is 2.
        let x = [1.0f32; 16];
        let codes = quantize_fp8_heads(&x, 4, &[2, 2], 1, &[1.0, 2.0]);
        let back = dequantize_fp8_heads(&codes, 4, &[2, 2], 1, &[1.0, 2.0]);
        assert_eq!(back, x);
        assert_eq!(codes[4].to_f32(), 0.5);
        assert_eq!(codes[0].to_f32(), 1.0);
    }
}
