//! The checks of 8-bit K and V caches ([`crate::quant`]) in one attention call, before any GPU
//! work: formats only where the kernels dequantise (K and V), scales present exactly where
//! they are needed and in the shape the format says, head dims that are whole words of codes,
//! and views whose rows the scales' index rule finds.

use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::storage::Storage;
use crate::tensor::{Tensor, TensorData};
use crate::view::View;

fn bad<T>(reason: String) -> Result<T> {
    Err(Error::Quantized { reason })
}

/// Check an attention call's tensors: `q`, the output's and the bias's formats, and K and V
/// with their scales (`k_view`, `v_view`: their views, paged or not; `paged`: read through a
/// block table).
pub(crate) fn check(p: &Problem, k: &Tensor, v: &Tensor) -> Result<()> {
    let f = p.storage;
    for (name, s) in [("q", f.q), ("the output", f.out), ("the bias", f.bias)] {
        if s.is_quantized() {
            return bad(format!(
                "{name} is {s}: only K and V caches may be 8-bit (q, the output and the bias take f32, f16 or bf16)"
            ));
        }
    }
    let paged = p.paged.is_some();
    check_one("k", k, p.views.k, p.head_dim, p.kv_heads, paged)?;
    check_one("v", v, p.views.v, p.head_dim_v, p.kv_heads, paged)
}

/// Only the forward's fused and decode kernels read 8-bit caches: `what` refuses them.
pub(crate) fn refuse(what: &str, formats: &[Storage]) -> Result<()> {
    match formats.iter().find(|s| s.is_quantized()) {
        Some(s) => bad(format!(
            "{what} does not read {s} caches: 8-bit K/V are read by the forward's fused and decode kernels only"
        )),
        None => Ok(()),
    }
}

fn check_one(name: &str, t: &Tensor, view: Option<View>, e: usize, hkv: usize, paged: bool) -> Result<()> {
    let s = t.storage();
    let Some(scales) = t.scales() else {
        return match s.is_quantized() {
            true => bad(format!(
                "the {name} cache is {s} but has no scales: give them with Tensor::with_scales"
            )),
            false => Ok(()),
        };
    };
    if !s.is_quantized() {
        return bad(format!(
            "the {name} cache is {s}, which has no scales: with_scales is for int8 and fp8 caches"
        ));
    }
    if scales.storage() != Storage::F32 || scales.view.is_set() || scales.scales.is_some() {
        return bad(format!(
            "the {name} cache's scales must be dense f32 (got {}{})",
            scales.storage(),
            if scales.view.is_set() { " with a view" } else { "" }
        ));
    }
    if let Some(m) = scales.misuse.or(t.misuse) {
        return bad(format!("the {name} cache's scales: {m}"));
    }
    if !e.is_multiple_of(4) {
        return bad(format!(
            "the {name} cache's head dim {e} is not a multiple of 4: codes are packed four to a 32-bit word"
        ));
    }
    let rows = &t.shape[..t.shape.len().saturating_sub(1)];
    let want: Vec<usize> = match s {
        Storage::Int8 => rows.to_vec(),
        _ => vec![hkv],
    };
    if scales.shape != want {
        return bad(format!(
            "the {name} cache's {s} scales have shape {:?}, expected {want:?} ({})",
            scales.shape,
            match s {
                Storage::Int8 => "one per row of E codes: the cache's shape without E",
                _ => "one per kv head",
            }
        ));
    }
    if let Some(r) = host_values(scales).and_then(|x| x.iter().find(|x| !x.is_finite() || **x < 0.0).copied())
    {
        return bad(format!(
            "the {name} cache's scales hold {r}: scales are finite and not negative"
        ));
    }
    match (view, paged) {
        (Some(v), false) => check_view(name, t, scales, v, e, hkv, s),
        (Some(v), true) if v.offset != 0 => bad(format!(
            "the {name} cache starts {} elements past a 256-byte boundary: 8-bit caches start at their binding (an offset that is a multiple of 256 bytes)",
            v.offset
        )),
        _ => Ok(()),
    }
}

fn host_values<'t>(t: &'t Tensor) -> Option<std::borrow::Cow<'t, [f32]>> {
    t.host_f32()
}

/// A cache read through a view (a layout, capacity or strides): its rows start at multiples of
/// E from its binding, the scales (a GPU buffer, laid out as the cache's rows) reach its last
/// row, and for fp8 the head of a row is `(row / head stride) % Hkv`.
fn check_view(
    name: &str,
    t: &Tensor,
    scales: &Tensor,
    v: View,
    e: usize,
    hkv: usize,
    s: Storage,
) -> Result<()> {
    let [sb, sh, ss, _] = v.strides;
    let [b, h, n, _] = [t.shape[0], t.shape[1], t.shape[2], t.shape[3]];
    if v.offset != 0 || [sb, sh, ss].iter().any(|x| !x.is_multiple_of(e)) {
        return bad(format!(
            "the {name} cache's view (offset {}, strides {:?}) does not start its rows at multiples of E = {e} from a 256-byte boundary, where its scales' rows are found",
            v.offset, v.strides
        ));
    }
    match s {
        Storage::Int8 => {
            let TensorData::Gpu { buffer, offset, .. } = &scales.data else {
                return bad(format!(
                    "the {name} cache is read through a view: its int8 scales must be a GPU buffer laid out as its rows are (host scales are dense)"
                ));
            };
            let last = ((b - 1) * sb + (h - 1) * sh + (n - 1) * ss) / e;
            let need = 4 * (last as u64 + 1);
            if buffer.size() < offset + need {
                return bad(format!(
                    "the {name} cache's scales buffer holds {} bytes from offset {offset}; its view's rows need {need}",
                    buffer.size().saturating_sub(*offset)
                ));
            }
            Ok(())
        }
        _ => {
            let block = hkv * sh;
            let heads_ok = sh > 0
                && (b == 1 || sb.is_multiple_of(block))
                && (n == 1 || ss.is_multiple_of(block) || ss * (n - 1) + e <= sh);
            match heads_ok {
                true => Ok(()),
                false => bad(format!(
                    "the {name} cache's strides {:?} do not keep each kv head's rows in one place: fp8 scales are found by head",
                    v.strides
                )),
            }
        }
    }
}
