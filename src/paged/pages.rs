//! Paged caches as the attention kernels read them: [`Pages`] (K and V caches and their
//! [`PagedLayout`]), [`Sdpa::paged`] (one call over them), and their checks (the caches'
//! shapes and layout, the block table), done when the call is built: the call carries the
//! checked result ([`PagedKv`]) or the error, which [`Sdpa::problem`] returns.

use crate::error::{Error, Result};
use crate::problem::{dims4, Paged, PagedKv};
use crate::sdpa::Sdpa;
use crate::tensor::{Tensor, TensorData};
use crate::view::BIND_ALIGN;

/// Paged K and V caches and the layout of their blocks: what [`Sdpa::paged`] and
/// [`PagedAttention::new`](crate::PagedAttention::new) read. A buffer cannot say how its blocks are laid out, so your own
/// caches name it here; a [`KvCache`](crate::KvCache) hands out its layers' pages with theirs
/// ([`KvCache::pages`](crate::KvCache::pages)), so the two cannot be mismatched.
///
/// ```
/// use ndarray::Array4;
/// use wgpu_attention::{PagedLayout, Pages};
/// // vLLM's caches: 8 blocks of 16 tokens, 2 K/V heads of dim 64.
/// let k = Array4::<f32>::zeros((8, 16, 2, 64));
/// let v = Array4::<f32>::zeros((8, 16, 2, 64));
/// let pages = Pages::new(&k, &v, PagedLayout::TokenMajor);
/// assert_eq!(pages.block_size(), 16);
/// ```
#[derive(Debug, Clone)]
pub struct Pages<'a> {
    pub(crate) k: Tensor<'a>,
    pub(crate) v: Tensor<'a>,
    pub(crate) layout: crate::paged::PagedLayout,
}

impl<'a> Pages<'a> {
    /// The K cache `k` and V cache `v` (host data or dense GPU buffers, any storage format),
    /// laid out as `layout` says: [`PagedLayout::TokenMajor`](crate::PagedLayout::TokenMajor)
    /// `[num_blocks, block_size, Hkv, E]` (vLLM's) or
    /// [`PagedLayout::HeadMajor`](crate::PagedLayout::HeadMajor) `[num_blocks, Hkv,
    /// block_size, E]` (FlashInfer's `HND`, the crate's [`KvCache`](crate::KvCache)).
    pub fn new(
        k: impl Into<Tensor<'a>>,
        v: impl Into<Tensor<'a>>,
        layout: crate::paged::PagedLayout,
    ) -> Self {
        Pages {
            k: k.into(),
            v: v.into(),
            layout,
        }
    }

    /// The layout of the blocks.
    pub fn layout(&self) -> crate::paged::PagedLayout {
        self.layout
    }

    /// The K cache.
    pub fn k(&self) -> &Tensor<'a> {
        &self.k
    }

    /// The V cache.
    pub fn v(&self) -> &Tensor<'a> {
        &self.v
    }

    /// Tokens per block, read from K's shape in the layout (0 when K is not 4-D).
    pub fn block_size(&self) -> usize {
        let i = if self.layout == crate::paged::PagedLayout::HeadMajor {
            2
        } else {
            1
        };
        self.k
            .shape
            .get(i)
            .copied()
            .filter(|_| self.k.shape.len() == 4)
            .unwrap_or(0)
    }
}

/// How a paged cache's blocks are laid out (FlashInfer's `kv_layout`). There is no default:
/// a buffer cannot say how it is laid out, so [`Pages::new`](crate::Pages::new) is told, and
/// a [`KvCache`](crate::KvCache)'s [`pages`](crate::KvCache::pages) carry theirs.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PagedLayout {
    /// `[num_blocks, block_size, Hkv, E]`: a token's heads together (vLLM's cache, FlashInfer's
    /// `NHD`).
    TokenMajor,
    /// `[num_blocks, Hkv, block_size, E]`: each head's keys of a block together (FlashInfer's
    /// `HND`). One head's consecutive keys are `E` elements apart instead of `Hkv · E`, which
    /// reads faster where memory is read by rows (CPU adapters: `paged_d` in
    /// docs/benchmarks.md). [`KvCache`](crate::KvCache)'s pages are laid out so.
    HeadMajor,
}

impl PagedLayout {
    /// `[num_blocks, block_size, Hkv, E]` from a cache's shape in this layout.
    pub(crate) fn token_major_dims([a, b, c, d]: [usize; 4], layout: PagedLayout) -> [usize; 4] {
        match layout {
            PagedLayout::TokenMajor => [a, b, c, d],
            PagedLayout::HeadMajor => [a, c, b, d],
        }
    }
}

impl<'a> Sdpa<'a> {
    /// Attention of q over paged KV caches: `pages` holds the K and V caches and names their
    /// layout ([`Pages::new`](crate::Pages::new) for your own buffers,
    /// [`KvCache::pages`](crate::KvCache::pages) for the crate's cache), and key `t` of
    /// sequence `b` is token slot `t % block_size` of block
    /// `block_table[b * max_blocks + t / block_size]`. `block_table` is `[B, max_blocks]`
    /// row-major (B = q's batch, one sequence per batch entry); `seq_lens[b]` is sequence
    /// `b`'s key count, its new queries' own keys included. Entries past a sequence's last
    /// block are never read and may be anything (-1, say).
    ///
    /// q is `[B, Hq, n, E]`: the `n` newest positions of each sequence, so query `i` of
    /// sequence `b` has position `seq_lens[b] - n + i` ([`Causal::BottomRight`](crate::Causal::BottomRight) is causal by
    /// position, and the window, ALiBi and a user function's `q_pos` measure from it). Decode
    /// is `n = 1`; a prefill chunk of the same length for every sequence is larger `n`. Not
    /// causal unless asked: give [`causal`](Sdpa::causal) for a prefill chunk (a
    /// [`KvCache`](crate::KvCache)'s calls are causal by default). Runs on the fused and decode
    /// paths (never [`Path::Unfused`](crate::Path::Unfused), nor the attention weights); every modifier applies.
    ///
    /// Checked before any GPU work, as [`Error::Paged`]: a table whose length is not a
    /// multiple of B, a sequence longer than its table, fewer keys than queries, a used entry
    /// outside the caches, caches of different block counts or sizes, caches given a layout
    /// or strides, and [`kv_lens`](Sdpa::kv_lens) or [`Causal::TopLeft`](crate::Causal::TopLeft) with it.
    ///
    /// ```
    /// use ndarray::Array4;
    /// use wgpu_attention::{Causal, PagedLayout, Pages, Sdpa};
    /// // Two sequences of 5 and 2 keys in caches of 4 blocks of 2 tokens (1 K/V head, head
    /// // dim 8), token-major; one new query each, 2 query heads.
    /// let k = Array4::<f32>::from_elem((4, 2, 1, 8), 0.5);
    /// let v = Array4::<f32>::from_elem((4, 2, 1, 8), 1.0);
    /// let q = Array4::<f32>::from_elem((2, 2, 1, 8), 0.1);
    /// let table = [3, 0, 2, /* sequence 1: */ 1, -1, -1];
    /// let pages = Pages::new(&k, &v, PagedLayout::TokenMajor);
    /// let call = Sdpa::paged(&q, pages, &table, &[5, 2]).causal(Causal::BottomRight);
    /// assert_eq!(call.problem()?.seq_kv, 5);
    /// # Ok::<(), wgpu_attention::Error>(())
    /// ```
    pub fn paged(
        q: impl Into<Tensor<'a>>,
        pages: Pages<'a>,
        block_table: &'a [i32],
        seq_lens: &[usize],
    ) -> Self {
        let Pages { k, v, layout } = pages;
        Sdpa::new(q, k, v).over_pages(block_table, seq_lens, layout)
    }

    /// k and v read as paged caches in `layout` through `block_table` (see [`Sdpa::paged`]).
    pub(crate) fn over_pages(
        mut self,
        block_table: &'a [i32],
        seq_lens: &[usize],
        layout: PagedLayout,
    ) -> Self {
        self.paged = Some(check(&self.q, &self.k, &self.v, block_table, seq_lens, layout));
        self
    }
}

/// [`Sdpa::paged`]'s checks of q `[B, Hq, n, E]`, the caches in `layout`, the table and the
/// key lengths (those of the call's options are [`Sdpa::problem`]'s).
fn check(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    table: &[i32],
    lens: &[usize],
    layout: PagedLayout,
) -> Result<PagedKv> {
    let bad = |reason: String| Err(Error::Paged { reason });
    let [b, _, n, _] = dims4("q", &q.shape)?;
    let [nb, bs, hkv, e] = PagedLayout::token_major_dims(dims4("k", &k.shape)?, layout);
    let [vnb, vbs, vh, ev] = PagedLayout::token_major_dims(dims4("v", &v.shape)?, layout);
    if (vnb, vbs, vh) != (nb, bs, hkv) {
        return bad(format!(
            "the v cache {:?} must have the k cache's blocks, block size and heads ({nb}, {bs}, {hkv}, Ev in the {layout:?} layout)",
            v.shape
        ));
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.view.is_set() {
            return bad(format!(
                "the {name} cache is read as dense [num_blocks, block_size, Hkv, E]: no layout, capacity or strides"
            ));
        }
    }
    if lens.len() != b {
        return bad(format!(
            "seq_lens has {} lengths for q's batch of {b} sequences",
            lens.len()
        ));
    }
    let (max_blocks, clean) = check_block_table(table, lens, &vec![n; b], nb, bs)?;
    // The caches' element offsets (a binding starts at a 256-byte boundary), for the kernels'
    // alignment checks.
    let off = |t: &Tensor| match &t.data {
        TensorData::Gpu { offset, storage, .. } => ((offset % BIND_ALIGN) / storage.element_bytes()) as usize,
        TensorData::Host(_) => 0,
    };
    let paged = Paged {
        block_size: bs,
        num_blocks: nb,
        max_blocks,
        table: clean,
        head_major: layout == PagedLayout::HeadMajor,
    };
    Ok(PagedKv::new(paged, lens.to_vec(), [hkv, e, ev], [off(k), off(v)]))
}

/// A block table `[B, max_blocks]` for sequences of `lens` keys with `q_lens` new queries
/// each, over caches of `nb` blocks of `bs` tokens: its row length and the table with the
/// entries past each sequence's blocks zeroed ([`Error::Paged`] for a table that is not a
/// positive multiple of B, a sequence longer than its row, fewer keys than queries, a used
/// entry outside the caches).
pub(crate) fn check_block_table(
    table: &[i32],
    lens: &[usize],
    q_lens: &[usize],
    nb: usize,
    bs: usize,
) -> Result<(usize, Vec<u32>)> {
    let bad = |reason: String| Err(Error::Paged { reason });
    let b = lens.len();
    if b == 0 || table.is_empty() || !table.len().is_multiple_of(b) {
        return bad(format!(
            "the block table has {} entries, not a positive multiple of the {b} sequences ([B, max_blocks])",
            table.len()
        ));
    }
    let max_blocks = table.len() / b;
    let mut clean = vec![0u32; table.len()];
    for (s, (&len, &n)) in lens.iter().zip(q_lens).enumerate() {
        if len > max_blocks * bs {
            return bad(format!(
                "sequence {s} has {len} keys, more than its table's {max_blocks} blocks of {bs} hold"
            ));
        }
        if len < n {
            return bad(format!(
                "sequence {s} has {len} keys, fewer than its {n} new queries (their own keys count)"
            ));
        }
        for t in 0..len.div_ceil(bs) {
            let entry = table[s * max_blocks + t];
            if entry < 0 || entry as usize >= nb {
                return bad(format!(
                    "block_table[{s}, {t}] = {entry} is not a block of the caches (0..{nb})"
                ));
            }
            clean[s * max_blocks + t] = entry as u32;
        }
    }
    Ok((max_blocks, clean))
}
