//! What each device of the ring holds on the host before it starts: its query chunks (and
//! their rows of the mask, bias, upstream gradient and saved output), and its key/value block
//! encoded as it travels.

use std::borrow::Cow;
use std::ops::Range;

use ndarray::{s, ArrayView4};

use super::RingPlan;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The ring's inputs on the host, widened to f32 (exact) from their storage formats.
pub(crate) struct Global<'x> {
    pub q: Cow<'x, [f32]>,
    pub k: Cow<'x, [f32]>,
    pub v: Cow<'x, [f32]>,
    pub mask: Option<&'x [bool]>,
    pub bias: Option<Cow<'x, [f32]>>,
    /// The backward's upstream gradient, when there is one.
    pub dout: Option<Cow<'x, [f32]>>,
    /// The forward's output and logsumexp, when the backward is given them.
    pub saved: Option<Saved<'x>>,
}

/// The forward's output and logsumexp on the host.
pub(crate) type Saved<'x> = (Cow<'x, [f32]>, Cow<'x, [f32]>);

/// Host data of a tensor, or the ring's typed error for a GPU buffer.
pub(crate) fn host<'t>(n: usize, name: &'static str, t: &'t Tensor<'_>) -> Result<Cow<'t, [f32]>> {
    let d = t.host_f32().ok_or_else(|| Error::Ring {
        devices: n,
        reason: format!("{name}: the ring shards host data; a GPU buffer lives on one device"),
    })?;
    crate::tensor::check_len(name, &t.shape, d.len())?;
    Ok(d)
}

/// The elements of a row-major `[a, b, c, d]` array (dims of size 1 broadcast) in `rows` of
/// dim 2 and `cols` of dim 3; a broadcast dim (size 1) is kept whole.
pub(crate) fn slice4<T: Copy>(
    data: &[T],
    shape: [usize; 4],
    rows: Range<usize>,
    cols: Range<usize>,
) -> Vec<T> {
    let a = ArrayView4::from_shape(shape, data).expect("length checked");
    let r = if shape[2] == 1 { 0..1 } else { rows };
    let c = if shape[3] == 1 { 0..1 } else { cols };
    a.slice(s![.., .., r, c]).iter().copied().collect()
}

/// The shape [`slice4`] gives.
pub(crate) fn sliced_shape(shape: [usize; 4], rows: usize, cols: usize) -> [usize; 4] {
    [
        shape[0],
        shape[1],
        if shape[2] == 1 { 1 } else { rows },
        if shape[3] == 1 { 1 } else { cols },
    ]
}

/// One device's part of the inputs.
pub(crate) struct Shard {
    /// Per own query chunk (in [`RingPlan::chunks`] order): q `[B, Hq, lc, E]`.
    pub q: Vec<Vec<f32>>,
    /// Its rows of the mask `[Bm, Hm, lc|1, Sm]`, when there is a mask.
    pub mask: Vec<Option<Vec<bool>>>,
    /// Its rows of the bias, when there is a bias.
    pub bias: Vec<Option<Vec<f32>>>,
    /// Its rows of dO (backward).
    pub dout: Vec<Vec<f32>>,
    /// Its rows of the saved output and logsumexp (backward).
    pub saved: Vec<(Vec<f32>, Vec<f32>)>,
    /// Its key/value block, encoded as it travels.
    pub block: Vec<u8>,
}

impl Shard {
    /// Device `rank`'s shard of `g`.
    pub(crate) fn new(plan: &RingPlan, rank: usize, g: &Global<'_>) -> Shard {
        let p = &plan.p;
        let (b, hq, hkv) = (p.batch, p.q_heads, p.kv_heads);
        let (l, s) = (p.seq_q, p.seq_kv);
        let (e, ev) = (p.head_dim, p.head_dim_v);
        let chunks = plan.chunks(rank);
        let rows = |data: &[f32], heads: usize, len: usize, dim: usize, r: Range<usize>| {
            slice4(data, [b, heads, len, dim], r, 0..dim)
        };
        let qr: Vec<Range<usize>> = chunks.iter().map(|&c| plan.q_range(c)).collect();
        Shard {
            q: qr.iter().map(|r| rows(&g.q, hq, l, e, r.clone())).collect(),
            mask: qr
                .iter()
                .map(|r| {
                    let shape = p.mask?.shape;
                    Some(slice4(g.mask?, shape, r.clone(), 0..shape[3]))
                })
                .collect(),
            bias: qr
                .iter()
                .map(|r| {
                    let shape = p.bias?.shape;
                    Some(slice4(g.bias.as_deref()?, shape, r.clone(), 0..shape[3]))
                })
                .collect(),
            dout: match &g.dout {
                Some(d) => qr.iter().map(|r| rows(d, hq, l, ev, r.clone())).collect(),
                None => vec![],
            },
            saved: match &g.saved {
                Some((o, lse)) => qr
                    .iter()
                    .map(|r| (rows(o, hq, l, ev, r.clone()), rows(lse, hq, l, 1, r.clone())))
                    .collect(),
                None => vec![],
            },
            block: encode_block(plan, rank, |c| {
                let r = plan.kv_range(c);
                (rows(&g.k, hkv, s, e, r.clone()), rows(&g.v, hkv, s, ev, r))
            }),
        }
    }
}

/// Block `block` laid out as [`RingPlan::block`] says, each part in its storage format, from
/// `kv(chunk) = (k, v)` (f32).
pub(crate) fn encode_block(
    plan: &RingPlan,
    block: usize,
    kv: impl Fn(usize) -> (Vec<f32>, Vec<f32>),
) -> Vec<u8> {
    let layout = plan.block(block);
    let mut bytes = vec![0u8; layout.bytes as usize];
    let f = plan.p.storage;
    for part in &layout.parts {
        let (k, v) = kv(part.chunk);
        let (kb, vb) = (f.k.encode(&k), f.v.encode(&v));
        bytes[part.k_off as usize..part.k_off as usize + kb.len()].copy_from_slice(&kb);
        bytes[part.v_off as usize..part.v_off as usize + vb.len()].copy_from_slice(&vb);
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice4_keeps_broadcast_dims_whole() {
        let data: Vec<u32> = (0..2 * 3 * 4).collect();
        // [1, 2, 3, 4]: rows 1..3, cols 2..4.
        let got = slice4(&data, [1, 2, 3, 4], 1..3, 2..4);
        assert_eq!(got, vec![6, 7, 10, 11, 18, 19, 22, 23]);
        assert_eq!(sliced_shape([1, 2, 3, 4], 2, 2), [1, 2, 2, 2]);
        // A row-broadcast [1, 1, 1, 4] keeps its single row.
        let got = slice4(&data[..4], [1, 1, 1, 4], 5..9, 1..3);
        assert_eq!(got, vec![1, 2]);
        assert_eq!(sliced_shape([1, 1, 1, 4], 4, 2), [1, 1, 1, 2]);
    }
}
