//! Views: where a `[B, H, S, E]` tensor's elements lie in the caller's buffer.
//!
//! A GPU tensor is dense row-major `[B, H, S, E]` unless it is given a [`TensorLayout`], a
//! sequence capacity or explicit strides ([`Tensor::with_layout`](crate::Tensor::with_layout),
//! [`with_seq_capacity`](crate::Tensor::with_seq_capacity),
//! [`with_strides`](crate::Tensor::with_strides)), or starts at a byte offset that is not a
//! multiple of 256. The kernels then read (and write) it in place through a [`View`]: an
//! element offset from the bound range's start and the element strides of B, H and S (the head
//! dim is contiguous). Nothing is copied.

use crate::error::{Error, Result};
use crate::storage::Storage;

/// The memory order of a 4-D tensor whose shape is given as `[B, H, S, E]` (the crate's
/// order for q, k, v and the output).
///
/// A GPU tensor is dense row-major `[B, H, S, E]` unless it is given a layout, a sequence
/// capacity or explicit strides ([`Tensor::with_layout`](crate::Tensor::with_layout),
/// [`Tensor::with_seq_capacity`](crate::Tensor::with_seq_capacity),
/// [`Tensor::with_strides`](crate::Tensor::with_strides)), or starts at a byte offset that is
/// not a multiple of 256. q, k, v and the output of [`Sdpa`](crate::Sdpa) and
/// [`Backward`](crate::Backward) (and its dout and saved output) are then read and written in
/// place: no copy. Views whose offset and strides are multiples of 4 elements keep the
/// kernels' vector loads. See `docs/storage.md` for examples (a `[B, S, H, E]` KV cache, q,
/// k, v packed in one buffer).
///
/// ```
/// use wgpu_attention::TensorLayout;
/// // [B, S, H, E] with 8 heads, 100 rows allocated per head, head dim 64:
/// assert_eq!(TensorLayout::Bshe.strides(8, 100, 64), [100 * 8 * 64, 64, 8 * 64, 1]);
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum TensorLayout {
    /// `[B, H, S, E]` row-major: each head's rows adjacent (PyTorch SDPA's layout).
    #[default]
    Bhse,
    /// `[B, S, H, E]` row-major: each token's heads adjacent (FlashAttention's layout, most LLM
    /// runtimes' KV caches, a projection's output before its transpose).
    Bshe,
}

impl TensorLayout {
    /// The element strides of `[B, H, S, E]` for `heads` heads, `cap` rows per head allocated
    /// (at least S) and head dim `e`.
    pub fn strides(self, heads: usize, cap: usize, e: usize) -> [usize; 4] {
        match self {
            TensorLayout::Bhse => [heads * cap * e, cap * e, e, 1],
            TensorLayout::Bshe => [cap * heads * e, e, heads * e, 1],
        }
    }
}

/// The bytes an offset is split at: bindings start at the largest multiple of this at or
/// below the tensor's offset (WebGPU caps `min_storage_buffer_offset_alignment` at 256, so
/// every device accepts it), the rest becomes the view's element offset.
pub(crate) const BIND_ALIGN: u64 = 256;

/// Where a `[B, H, S, E]` tensor's elements lie from its binding's start: element `(b, h, s, e)`
/// is at `offset + b·strides[0] + h·strides[1] + s·strides[2] + e`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct View {
    /// Element offset from the binding's start.
    pub offset: usize,
    /// Element strides of B, H, S and E (E's is 1).
    pub strides: [usize; 4],
}

impl View {
    /// The dense row-major view of `shape`.
    pub(crate) fn dense(shape: [usize; 4]) -> View {
        View {
            offset: 0,
            strides: TensorLayout::Bhse.strides(shape[1], shape[2], shape[3]),
        }
    }

    /// Whether the kernels can read it as dense rows (no offset, dense strides).
    pub(crate) fn is_dense(&self, shape: [usize; 4]) -> bool {
        *self == View::dense(shape)
    }

    /// One past the largest element index of `shape` through the view.
    pub(crate) fn extent(&self, shape: [usize; 4]) -> usize {
        self.offset
            + shape
                .iter()
                .zip(self.strides)
                .map(|(&d, s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }

    /// Whether the offset and the B, H, S strides are multiples of `n` (vector loads of `n`).
    pub(crate) fn aligned(&self, n: usize) -> bool {
        self.offset.is_multiple_of(n) && self.strides[..3].iter().all(|s| s.is_multiple_of(n))
    }

    /// Whether two different indices of `shape` can reach one element (an output written
    /// through such a view would race with itself). Sorted by stride, every stride must step
    /// past everything the smaller ones reach.
    pub(crate) fn overlaps(&self, shape: [usize; 4]) -> bool {
        let mut dims: Vec<(usize, usize)> = shape
            .iter()
            .zip(self.strides)
            .filter(|(&d, _)| d > 1)
            .map(|(&d, s)| (s, d))
            .collect();
        dims.sort();
        let mut reach = 0; // the largest index offset the smaller strides reach
        for (s, d) in dims {
            if s <= reach || s == 0 {
                return true;
            }
            reach += (d - 1) * s;
        }
        false
    }
}

/// The views of an attention call's tensors; `None` is dense.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct Views {
    pub q: Option<View>,
    pub k: Option<View>,
    pub v: Option<View>,
    /// The output (the backward: the saved output).
    pub out: Option<View>,
    /// The backward's output gradient.
    pub dout: Option<View>,
    /// The additive bias, in its broadcast shape `[B|1, H|1, L|1, S|1]` (strides of broadcast
    /// dimensions 0): read through `p.m` by the masks code, with no effect on the kernels'
    /// specialisation.
    pub bias: Option<View>,
    /// k and v are paged caches of blocks of this many tokens, read through a block table
    /// ([`crate::problem::Paged`]; their views hold the caches' element offsets and the head
    /// and token strides).
    pub paged: Option<usize>,
    /// q is rotated as it is read (RoPE): the rotated dims and whether the pairs are
    /// half-split (else interleaved); the angles are auxiliary words from `p.m.rope_off`.
    pub q_rope: Option<(usize, bool)>,
}

impl Views {
    /// Whether every view present has its offset and strides multiples of `n`.
    pub(crate) fn aligned(&self, n: usize) -> bool {
        [self.q, self.k, self.v, self.out, self.dout]
            .iter()
            .flatten()
            .all(|v| v.aligned(n))
    }
}

/// How a tensor asked to be laid out (resolved against its shape by [`resolve`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct ViewSpec {
    pub layout: Option<TensorLayout>,
    pub capacity: Option<usize>,
    pub strides: Option<Vec<usize>>,
}

impl ViewSpec {
    /// Whether anything but the dense layout was asked for.
    pub(crate) fn is_set(&self) -> bool {
        *self != ViewSpec::default()
    }
}

/// The view of tensor `name` of `shape` at byte `offset` in `storage`, or `None` when it is
/// dense from a 256-aligned offset (bound as before). Errors name the tensor.
pub(crate) fn resolve(
    name: &'static str,
    spec: &ViewSpec,
    shape: &[usize],
    offset: u64,
    storage: Storage,
) -> Result<Option<View>> {
    let bad = |reason: String| Error::BadBuffer { tensor: name, reason };
    let elem = storage.element_bytes();
    let rem = offset % BIND_ALIGN;
    if !spec.is_set() && rem == 0 {
        return Ok(None);
    }
    let shape: [usize; 4] = shape.try_into().map_err(|_| Error::WrongRank {
        tensor: name,
        expected: 4,
        actual: shape.len(),
        shape: shape.to_vec(),
    })?;
    if shape.contains(&0) {
        return Err(Error::ZeroSized {
            tensor: name,
            shape: shape.to_vec(),
        });
    }
    if !rem.is_multiple_of(elem) {
        return Err(bad(format!(
            "offset {offset} is not a multiple of the {}-byte element of the declared format {}",
            elem,
            storage.name()
        )));
    }
    let strides = match (&spec.strides, spec.layout, spec.capacity) {
        (Some(_), Some(_), _) | (Some(_), _, Some(_)) => return Err(bad(
            "with_strides gives every stride; it cannot be combined with with_layout or with_seq_capacity"
                .into(),
        )),
        (Some(s), None, None) => {
            let s: [usize; 4] = s.as_slice().try_into().map_err(|_| {
                bad(format!(
                    "with_strides needs 4 strides (B, H, S, E) for shape {shape:?}, got {s:?}"
                ))
            })?;
            if s[3] != 1 {
                return Err(bad(format!(
                    "strides {s:?}: the head dim must be contiguous (its stride 1); rows of a head dim may be anywhere"
                )));
            }
            s
        }
        (None, layout, cap) => {
            let cap = cap.unwrap_or(shape[2]);
            if cap < shape[2] {
                return Err(bad(format!(
                    "sequence capacity {cap} is smaller than the shape's sequence length {} (shape {shape:?})",
                    shape[2]
                )));
            }
            layout.unwrap_or_default().strides(shape[1], cap, shape[3])
        }
    };
    Ok(Some(View {
        offset: (rem / elem) as usize,
        strides,
    }))
}

/// The view of a bias of `shape` (rank 1 to 4, broadcastable to the scores `[B, Hq, L, S]`) at
/// byte `offset`: `None` when it is dense from a 256-aligned offset. Explicit strides
/// ([`Tensor::with_strides`](crate::Tensor::with_strides), one per dimension of the shape,
/// any values: a bias of a KV cache's capacity, a transposed one) and any element offset;
/// layouts and capacities describe `[B, H, S, E]` tensors and are refused. The view is 4-D
/// (the shape left-padded with ones), with stride 0 on every dimension of size 1.
pub(crate) fn resolve_bias(
    spec: &ViewSpec,
    shape: &[usize],
    offset: u64,
    storage: Storage,
) -> Result<Option<View>> {
    let bad = |reason: String| Error::BadBuffer {
        tensor: "bias",
        reason,
    };
    let elem = storage.element_bytes();
    let rem = offset % BIND_ALIGN;
    if !spec.is_set() && rem == 0 {
        return Ok(None);
    }
    if spec.layout.is_some() || spec.capacity.is_some() {
        return Err(bad(
            "with_layout and with_seq_capacity describe [B, H, S, E] tensors; give a bias in a larger buffer its strides with with_strides (one per dimension of its shape)"
                .into(),
        ));
    }
    if shape.is_empty() || shape.len() > 4 || shape.contains(&0) {
        return Ok(None); // the shape's own check reports it
    }
    if !rem.is_multiple_of(elem) {
        return Err(bad(format!(
            "offset {offset} is not a multiple of the {}-byte element of the declared format {}",
            elem,
            storage.name()
        )));
    }
    let given: Vec<usize> = match &spec.strides {
        Some(st) if st.len() != shape.len() => {
            return Err(bad(format!(
                "with_strides needs one stride per dimension of the bias's shape {shape:?}, got {st:?}"
            )))
        }
        Some(st) => st.clone(),
        None => {
            let mut dense = vec![1usize; shape.len()];
            for d in (0..shape.len().saturating_sub(1)).rev() {
                dense[d] = dense[d + 1] * shape[d + 1];
            }
            dense
        }
    };
    let shape4 = pad4(shape);
    let mut strides = [0usize; 4];
    strides[4 - shape.len()..].copy_from_slice(&given);
    for d in 0..4 {
        if shape4[d] == 1 {
            strides[d] = 0;
        }
    }
    Ok(Some(View {
        offset: (rem / elem) as usize,
        strides,
    }))
}

/// `shape` (rank 0 to 4) left-padded with ones to 4-D: how a mask or bias broadcasts against
/// the scores `[B, Hq, L, S]`.
pub(crate) fn pad4(shape: &[usize]) -> [usize; 4] {
    let mut s = [1usize; 4];
    s[4 - shape.len()..].copy_from_slice(shape);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_and_extents() {
        let shape = [2, 3, 5, 4];
        let bshe = TensorLayout::Bshe.strides(3, 5, 4);
        assert_eq!(bshe, [60, 4, 12, 1]);
        let v = View {
            offset: 0,
            strides: bshe,
        };
        assert_eq!(v.extent(shape), 120);
        assert!(!v.overlaps(shape));
        assert!(!v.is_dense(shape));
        // A capacity of 8 rows per head: the extent ends at the last used row.
        let cap = View {
            offset: 0,
            strides: TensorLayout::Bhse.strides(3, 8, 4),
        };
        assert_eq!(cap.extent(shape), 96 + 2 * 32 + 4 * 4 + 4);
        assert!(View::dense(shape).is_dense(shape));
    }

    #[test]
    fn overlap_is_found() {
        let shape = [1, 2, 4, 4];
        // Heads two rows apart overlap rows 2 and 3 of head 0.
        let v = View {
            offset: 0,
            strides: [32, 8, 4, 1],
        };
        assert!(v.overlaps(shape));
        // A broadcast (stride 0) output overlaps.
        assert!(View {
            offset: 0,
            strides: [0, 16, 4, 1]
        }
        .overlaps([2, 2, 4, 4]));
        // Rows closer than the head dim overlap.
        assert!(View {
            offset: 0,
            strides: [32, 16, 3, 1]
        }
        .overlaps(shape));
        // A size-1 dim's stride does not matter.
        assert!(!View {
            offset: 0,
            strides: [0, 16, 4, 1]
        }
        .overlaps(shape));
    }

    #[test]
    fn resolve_checks() {
        let spec = ViewSpec::default();
        assert_eq!(
            resolve("q", &spec, &[1, 2, 3, 4], 512, Storage::F32).unwrap(),
            None
        );
        let v = resolve("q", &spec, &[1, 2, 3, 4], 260, Storage::F32)
            .unwrap()
            .unwrap();
        assert_eq!(v.offset, 1);
        assert!(resolve("q", &spec, &[1, 2, 3, 4], 258, Storage::F32).is_err());
        assert_eq!(
            resolve("q", &spec, &[1, 2, 3, 4], 258, Storage::F16)
                .unwrap()
                .unwrap()
                .offset,
            1
        );
        let strides = ViewSpec {
            strides: Some(vec![24, 12, 4, 2]),
            ..Default::default()
        };
        assert!(resolve("q", &strides, &[1, 2, 3, 4], 0, Storage::F32).is_err());
        let small = ViewSpec {
            capacity: Some(2),
            ..Default::default()
        };
        assert!(resolve("k", &small, &[1, 2, 3, 4], 0, Storage::F32).is_err());
        assert!(matches!(
            resolve("k", &small, &[2, 3, 4], 0, Storage::F32),
            Err(Error::WrongRank { .. })
        ));
    }
}
