//! Typed GPU ops: the one floor between the entry points (`Sdpa`'s unfused path, `Backward`,
//! the layer, the variants, the ring) and the kernels that are not attention kernels.
//!
//! An op takes its operands as GPU tensors ([`Mats`]: a binding, its storage format, the shape
//! of each matrix and where every slice lies) and computes its kernel's params from them,
//! checking shapes and bounds before anything is recorded: no caller above this floor fills a
//! kernel's `Params`. A check that fails here is a bug of the caller inside the crate (the
//! public entry points validate the user's input first) and comes back as
//! [`Error::Internal`](crate::Error::Internal), never as a wrong answer or a device error.

pub(crate) mod copy;
pub(crate) mod linear;
pub(crate) mod matmul;
pub(crate) mod merge;
pub(crate) mod pinv;
pub(crate) mod rope;

use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::view::View;

/// A batch of row-major matrices on the device: a binding, its storage format, and where the
/// matrices lie in it ([`Slices`]).
#[derive(Clone, Debug)]
pub(crate) struct Mats<'a> {
    pub(crate) binding: wgpu::BufferBinding<'a>,
    pub(crate) storage: Storage,
    pub(crate) at: Slices,
}

/// Where a batch of `rows × cols` row-major matrices lies, read (or written) by an op over its
/// slices `g = first, first + 1, ..`: slice `g` is head `g % heads` of batch `g / heads`, for
/// the op's `heads` (an operand shared by a group of heads, the keys of grouped-query
/// attention, reads head `(g % heads) / group`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slices {
    /// Rows and columns of each matrix.
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Element offset of slice 0's first element from the binding's start.
    pub(crate) offset: usize,
    /// Elements between rows (columns are contiguous).
    pub(crate) row_stride: usize,
    pub(crate) slicing: Slicing,
    /// The operand's slice that the op's first slice reads.
    pub(crate) first: usize,
}

/// How an operand's matrices follow each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slicing {
    /// One after the other, `stride` elements apart, whatever the heads (0: one matrix that
    /// every slice reads).
    Contiguous { stride: usize },
    /// Head `h` of batch `b` at `b · batch + h · head` (a view of a `[B, H, S, E]` tensor:
    /// `[B, S, H, E]` and the like).
    Strided { batch: usize, head: usize },
}

impl<'a> Mats<'a> {
    /// Dense slices of `rows × cols`, one after the other from the binding's start.
    pub(crate) fn dense(
        binding: wgpu::BufferBinding<'a>,
        storage: Storage,
        rows: usize,
        cols: usize,
    ) -> Self {
        Mats {
            binding,
            storage,
            at: Slices {
                rows,
                cols,
                offset: 0,
                row_stride: cols,
                slicing: Slicing::Contiguous { stride: rows * cols },
                first: 0,
            },
        }
    }

    /// One dense `rows × cols` matrix that every slice reads (a weight).
    pub(crate) fn shared(
        binding: wgpu::BufferBinding<'a>,
        storage: Storage,
        rows: usize,
        cols: usize,
    ) -> Self {
        let mut m = Mats::dense(binding, storage, rows, cols);
        m.at.slicing = Slicing::Contiguous { stride: 0 };
        m
    }

    /// Rows `row0 .. row0 + rows` (columns `0 .. cols`) of every head of a `[B, H, S, E]`
    /// tensor read through `view`: the op's heads must be the tensor's (or, for a grouped
    /// operand, its heads times the group).
    pub(crate) fn view(
        binding: wgpu::BufferBinding<'a>,
        storage: Storage,
        view: View,
        row0: usize,
        [rows, cols]: [usize; 2],
    ) -> Self {
        let [batch, head, row, _] = view.strides;
        Mats {
            binding,
            storage,
            at: Slices {
                rows,
                cols,
                offset: view.offset + row0 * row,
                row_stride: row,
                slicing: Slicing::Strided { batch, head },
                first: 0,
            },
        }
    }

    /// The op's first slice reads this operand's slice `first` (the op covers a window of a
    /// whole tensor; a scratch holding just the window's slices starts at 0).
    pub(crate) fn starting_at(mut self, first: usize) -> Self {
        self.at.first = first;
        self
    }

    /// Check that the op's `count` slices lie inside the binding, for an op over `heads` heads
    /// sharing this operand by groups of `group` (`name` names it in the error), and that every
    /// element they reach has a u32 index (the kernels' indices are u32).
    fn check_bounds(&self, name: &str, count: usize, heads: usize, group: usize) -> Result<()> {
        let reach = self.at.reach(count, heads, group);
        let held = held(&self.binding, self.storage);
        if reach > held || reach as u64 > 1 << 32 {
            return Err(Error::Internal(format!(
                "{name}: {count} slices of {} x {} from slice {} reach element {reach}, its binding \
                 holds {held} ({} bytes each)",
                self.at.rows,
                self.at.cols,
                self.at.first,
                self.storage.element_bytes()
            )));
        }
        Ok(())
    }
}

/// Elements of `storage` that `b` holds.
fn held(b: &wgpu::BufferBinding<'_>, storage: Storage) -> usize {
    let bytes = match b.size {
        Some(size) => size.get(),
        None => b.buffer.size() - b.offset,
    };
    (bytes / storage.element_bytes()) as usize
}

/// A size or index as a kernel's u32 param, or the internal error naming `op` when it does
/// not fit.
fn u32_param(op: &str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::Internal(format!("{op}: {x} does not fit a u32 param")))
}

/// A stride or offset as the kernels' u32 param. Only valid for an operand that passed
/// [`Mats::check_bounds`]: every element it reaches is below 2³², so a stride past u32 is only
/// ever multiplied by 0 (a size-1 dimension, or slices that stay in one batch) and its
/// wrapped low bits never reach an index (WGSL's u32 arithmetic wraps too).
pub(crate) fn param(x: usize) -> u32 {
    x as u32
}

impl Slices {
    /// The batch and head strides for an op whose slices cover `own_heads` heads of this
    /// operand per batch (the op's heads, or its heads over the group).
    pub(crate) fn strides(&self, own_heads: usize) -> [usize; 2] {
        match self.slicing {
            Slicing::Contiguous { stride } => [stride * own_heads, stride],
            Slicing::Strided { batch, head } => [batch, head],
        }
    }

    /// One past the largest element index that `count` slices from `first` reach, for an op
    /// over `heads` heads sharing this operand by groups of `group` (0 when nothing is read).
    pub(crate) fn reach(&self, count: usize, heads: usize, group: usize) -> usize {
        if self.rows == 0 || self.cols == 0 || count == 0 {
            return 0;
        }
        let [batch, head] = self.strides(heads / group);
        let base = |g: usize| (g / heads) * batch + ((g % heads) / group) * head;
        // Bases grow with the batch and, within one, with the head: the largest is the last
        // slice's or the last head's of the batch before it.
        let (lo, hi) = (self.first, self.first + count - 1);
        let before = (hi - hi % heads).checked_sub(1).filter(|&g| g >= lo);
        let top = before.map_or(base(hi), |g| base(g).max(base(hi)));
        top + self.offset + (self.rows - 1) * self.row_stride + self.cols
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(view: View, row0: usize, rows: usize, cols: usize) -> Slices {
        let [batch, head, row, _] = view.strides;
        Slices {
            rows,
            cols,
            offset: view.offset + row0 * row,
            row_stride: row,
            slicing: Slicing::Strided { batch, head },
            first: 0,
        }
    }

    /// The largest element index plus one, by visiting every element.
    fn brute(s: &Slices, count: usize, heads: usize, group: usize) -> usize {
        let [batch, head] = s.strides(heads / group);
        (s.first..s.first + count)
            .flat_map(|g| {
                let base = (g / heads) * batch + ((g % heads) / group) * head + s.offset;
                (0..s.rows).flat_map(move |r| (0..s.cols).map(move |c| base + r * s.row_stride + c + 1))
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn reach_is_the_largest_element_touched() {
        let dense = View::dense([2, 3, 5, 8]);
        // [B, S, H, E] with a capacity of 7 rows, and a view whose head stride exceeds its
        // batch stride (the last head of an earlier batch lies furthest).
        let bshe = View {
            offset: 3,
            strides: crate::view::TensorLayout::Bshe.strides(3, 7, 8),
        };
        let odd = View {
            offset: 0,
            strides: [8, 100, 16, 1],
        };
        for v in [dense, bshe, odd] {
            for (row0, rows) in [(0, 5), (2, 3)] {
                for first in [0, 1, 2, 4] {
                    for count in [1, 2, 3, 4] {
                        for (heads, group) in [(3, 1), (6, 2), (3, 3)] {
                            let s = Slices {
                                first,
                                ..at(v, row0, rows, 8)
                            };
                            assert_eq!(
                                s.reach(count, heads, group),
                                brute(&s, count, heads, group),
                                "{v:?} rows {row0}+{rows} slices {first}+{count} heads {heads}/{group}"
                            );
                        }
                    }
                }
            }
        }
        // Dense slices and a shared matrix.
        let d = Slices {
            rows: 5,
            cols: 8,
            offset: 0,
            row_stride: 8,
            slicing: Slicing::Contiguous { stride: 40 },
            first: 2,
        };
        assert_eq!(d.reach(3, 1, 1), 5 * 40);
        assert_eq!(d.reach(3, 4, 2), brute(&d, 3, 4, 2));
        let w = Slices {
            slicing: Slicing::Contiguous { stride: 0 },
            ..d
        };
        assert_eq!(w.reach(1000, 7, 1), 40);
        assert_eq!(w.reach(0, 7, 1), 0);
    }

    /// A chunk of scores whose batch stride (its slice size times the heads) passes 2^32
    /// while the chunk stays inside one batch: the u32 params wrap, the kernel's wrapping u32
    /// arithmetic still lands on every slice's true offset.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn strides_past_u32_wrap_to_the_true_offsets() {
        let (rows, cols, heads) = (1 << 14, 1 << 14, 16);
        let chunk = Slices {
            rows,
            cols,
            offset: 0,
            row_stride: cols,
            slicing: Slicing::Contiguous { stride: rows * cols },
            first: 0,
        };
        let count = 15; // fewer slices than heads: one batch
        assert!(chunk.reach(count, heads, 1) <= 1 << 32);
        let [batch, head] = chunk.strides(heads);
        assert!(batch >= 1 << 32);
        for g in 0..count {
            let wgsl = ((g / heads) as u32)
                .wrapping_mul(param(batch))
                .wrapping_add(((g % heads) as u32).wrapping_mul(param(head)));
            assert_eq!(wgsl as usize, g * rows * cols, "slice {g}");
        }
        // A view whose size-1 batch has a stride past u32.
        let one = Slices {
            slicing: Slicing::Strided {
                batch: 5 << 32,
                head: 64,
            },
            ..at(View::dense([1, 4, 8, 8]), 0, 8, 8)
        };
        assert_eq!(one.reach(4, 4, 1), 4 * 64);
        for g in 0..4usize {
            let wgsl = ((g / 4) as u32).wrapping_mul(param(5 << 32)) + (g % 4) as u32 * 64;
            assert_eq!(wgsl as usize, g * 64);
        }
    }
}
