//! Binding 0 of the attention kernels, which the forward and the backward both bind: the
//! packed boolean mask and the mask_mod block map after it. (Binding 2, the auxiliary words,
//! is laid out and written by `crate::kernels::aux`.)

use crate::device::buffers::{f32_bytes, fits, storage_init};
use crate::device::context::Context;
use crate::error::Result;
use crate::problem::Problem;
use crate::tensor::Mask;

/// Check that `mask_words` of packed mask and the mask_mod block map of `p` fit one binding.
pub(crate) fn fit_mod_map(ctx: &Context, p: &Problem, mask_words: usize) -> Result<()> {
    let bytes = f32_bytes(mask_words.next_multiple_of(4)) + crate::kernels::mod_map::bytes(p);
    fits(
        "mask and mask_mod block map",
        bytes,
        ctx.max_binding(),
        "max_storage_buffer_binding_size",
    )
}

/// Binding 0 of the attention kernels (forward and backward): the packed boolean mask (if any)
/// and, with `map` (the fused path with a mask_mod), the mask_mod block map after it (cached:
/// built on the first call), with the word where the map starts.
pub(crate) fn mask_binding(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    packed: Option<&(Vec<u32>, [u32; 3])>,
    map: bool,
) -> Result<(Option<wgpu::Buffer>, Option<usize>)> {
    if !map {
        let mask = packed.map(|(w, _)| storage_init(ctx, "mask", bytemuck::cast_slice(w)));
        return Ok((mask, None));
    }
    let map = crate::kernels::mod_map::get(ctx, p)?;
    let Some((words, _)) = packed else {
        return Ok((Some(map), Some(0)));
    };
    // The mask's words, then the map, in one buffer (16-byte aligned for the copy).
    let at = words.len().next_multiple_of(4);
    let mut both = words.clone();
    both.resize(at + (map.size() / 4) as usize, 0);
    let buf = storage_init(ctx, "mask and mask_mod block map", bytemuck::cast_slice(&both));
    encoder.copy_buffer_to_buffer(&map, 0, &buf, f32_bytes(at), map.size());
    Ok((Some(buf), Some(at)))
}

/// Pack a boolean mask into bits: `[Bm, Hm, Lm, ceil(S/32)]` u32 words (S always expanded),
/// returning the words and the word strides (b, h, l), 0 on broadcast dimensions.
pub(crate) fn pack_mask(p: &Problem, m: &Mask) -> (Vec<u32>, [u32; 3]) {
    let bc = p.mask.expect("mask validated");
    let [bm, hm, lm, sm] = bc.shape;
    let s = p.seq_kv;
    let words = s.div_ceil(32);
    let mut out = vec![0u32; bm * hm * lm * words];
    for r in 0..bm * hm * lm {
        for j in 0..s {
            let allowed = if sm == 1 { m.data[r] } else { m.data[r * s + j] };
            if allowed {
                out[r * words + j / 32] |= 1 << (j % 32);
            }
        }
    }
    let stride = |dim: usize, dense: usize| if dim == 1 { 0 } else { dense as u32 };
    let strides = [
        stride(bm, hm * lm * words),
        stride(hm, lm * words),
        stride(lm, words),
    ];
    (out, strides)
}
