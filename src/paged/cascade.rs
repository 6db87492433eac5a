//! Shared prefixes (cascade attention): consecutive sequences whose block tables begin with
//! the same blocks have those keys read once, by one call of all their queries over the
//! shared blocks split in runs, one call over each sequence's own tail, and a logsumexp merge.

use crate::device::buffers::{f32_bytes, output};
use crate::device::context::Context;
use crate::error::Result;

/// The fewest shared keys for which the cascade is used: below, the extra calls and the merge
/// cost more than the keys read again.
pub const MIN_SHARED_KEYS: usize = 256;

/// Consecutive sequences of a batch whose block tables begin with the same blocks, read once
/// for all of them (see [`PagedAttention::shared_prefix`](crate::PagedAttention::shared_prefix)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPrefix {
    /// The first sequence.
    pub first: usize,
    /// How many sequences share it.
    pub sequences: usize,
    /// The shared keys (whole blocks).
    pub keys: usize,
}

/// A shared prefix's scratch (see [`PagedAttention::record`]).
pub(super) struct Cascade {
    pub(super) share: SharedPrefix,
    /// Its queries, and the first one's token.
    pub(super) tokens: usize,
    pub(super) token0: usize,
    /// The runs the shared keys are read in (one call, a batch entry each: enough workgroups
    /// for a GPU), their tables `[splits, blocks per run]` and keys.
    pub(super) splits: usize,
    pub(super) prefix_table: Vec<i32>,
    pub(super) prefix_lens: Vec<usize>,
    /// `[splits + 1, tokens · Hq, Ev]` (f32): over each run of the shared keys, over each tail.
    pub(super) parts: wgpu::Buffer,
    /// `[splits + 1, tokens · Hq]`.
    pub(super) lses: wgpu::Buffer,
    /// The merged `[tokens · Hq]`.
    pub(super) merged: wgpu::Buffer,
    /// The tables past the shared blocks `[sequences, max_blocks - shared blocks]`, and the
    /// sequences' keys there.
    pub(super) tails: Vec<i32>,
    pub(super) tail_lens: Vec<usize>,
}

impl Cascade {
    /// Record the merge of the parts (the runs', the tails') into rows `(token, head)` of the packed output
    /// `out` (in its format) and of the logsumexp `lse` `[T, Hq]`.
    pub(super) fn merge(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        (out, out_off, st): (&wgpu::Buffer, u64, crate::storage::Storage),
        (lse, lse_off): (&wgpu::Buffer, u64),
        [hq, ev]: [usize; 2],
    ) -> Result<()> {
        let rows = self.tokens * hq;
        crate::ops::merge::record(
            ctx,
            encoder,
            &crate::ops::merge::Parts {
                outputs: self.parts.as_entire_buffer_binding(),
                storage: crate::storage::Storage::F32,
                lses: self.lses.as_entire_buffer_binding(),
                splits: self.splits + 1,
            },
            &crate::ops::merge::Merged {
                output: out.as_entire_buffer_binding(),
                storage: st,
                // Rows (token, head) of the packed output.
                view: Some((
                    crate::view::View {
                        offset: (out_off / st.element_bytes()) as usize + self.token0 * hq * ev,
                        strides: [rows * ev, hq * ev, ev, 1],
                    },
                    [self.tokens, hq],
                )),
                lse: self.merged.as_entire_buffer_binding(),
            },
            [rows, ev],
        )?;
        encoder.copy_buffer_to_buffer(
            &self.merged,
            0,
            lse,
            lse_off + f32_bytes(self.token0 * hq),
            f32_bytes(rows),
        );
        Ok(())
    }
}

/// Each call's logsumexp `[seqs, Hq, n]`, before it is placed by rows (token, head): one
/// pooled scratch the calls use in turn, as large as the largest (a shared prefix's call over
/// its runs may exceed the batch's `T · Hq` rows).
pub(super) fn call_lse_scratch(ctx: &Context, cascades: &[Cascade], [t, hq]: [usize; 2]) -> wgpu::Buffer {
    let rows = cascades
        .iter()
        .map(|c| (c.splits * c.tokens * hq).max(c.tokens * hq))
        .fold(t * hq, usize::max);
    ctx.cache().scratch("paged call lse", f32_bytes(rows), || {
        output(ctx, "paged call lse", f32_bytes(rows))
    })
}

/// Workgroups a shared prefix's call aims for on a GPU (its queries' tiles times the runs its
/// keys are split into).
pub(super) const PREFIX_TARGET_WORKGROUPS: usize = 512;
/// Keys per run of a shared prefix at least.
pub(super) const PREFIX_MIN_KEYS: usize = 256;

/// How many runs a shared prefix of `keys` keys is read in by `tokens` queries of `hq` heads:
/// `asked` ([`PagedAttention::shared_prefix_splits`]) or the knob `cascade_splits`
/// (src/forms/tune.rs), else one on CPU adapters (their few cores are busy with one) and enough for
/// the fused kernel's query tiles (64 rows) to make [`PREFIX_TARGET_WORKGROUPS`] workgroups
/// on GPUs.
pub(super) fn prefix_splits(
    asked: Option<usize>,
    caps: &crate::forms::Caps,
    [hq, tokens, blocks, bs]: [usize; 4],
) -> usize {
    // The most runs of `blocks` blocks (sizes differing by at most one) with `min` keys in
    // each.
    let most = |min: usize| (blocks / min.div_ceil(bs).max(1)).max(1);
    // Each run has at least as many keys as queries (a paged call's sequence has no more
    // queries than keys).
    if let Some(k) = asked.or(caps.tuning.cascade_splits.map(|k| k as usize)) {
        return k.clamp(1, most(tokens));
    }
    if caps.cpu {
        return 1;
    }
    (PREFIX_TARGET_WORKGROUPS / (hq * tokens.div_ceil(64)).max(1)).clamp(1, most(PREFIX_MIN_KEYS.max(tokens)))
}

/// Copy a call's logsumexp `[seqs, Hq, n]` into rows `(token, head)` of `dst` from row `row`.
pub(super) fn place_lse(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    src: &wgpu::Buffer,
    [nseq, hq, n]: [usize; 3],
    (dst, dst_off): (&wgpu::Buffer, u64),
    row: usize,
) -> Result<()> {
    let bytes = f32_bytes(nseq * hq * n);
    if n == 1 || hq == 1 {
        encoder.copy_buffer_to_buffer(src, 0, dst, dst_off + f32_bytes(row), bytes);
        return Ok(());
    }
    let rows = ctx
        .cache()
        .scratch("paged lse rows", bytes, || output(ctx, "paged lse rows", bytes));
    crate::ops::copy::record(
        ctx,
        encoder,
        &crate::ops::copy::Strided::new(
            (src.as_entire_buffer_binding(), crate::storage::Storage::F32),
            [hq * n, 1, n, 0],
        ),
        (rows.as_entire_buffer_binding(), crate::storage::Storage::F32),
        [nseq, n, hq, 1],
    )?;
    encoder.copy_buffer_to_buffer(&rows, 0, dst, dst_off + f32_bytes(row), bytes);
    Ok(())
}

/// The runs of consecutive sequences whose tables begin with the same blocks, at least
/// [`MIN_SHARED_KEYS`] keys of whole blocks before each one's first new query, with no more
/// queries than shared keys (the call over them reads like a prefill chunk).
pub(super) fn find_shared(
    table: &[i32],
    seq_lens: &[usize],
    q_lens: &[usize],
    bs: usize,
) -> Vec<SharedPrefix> {
    let b = seq_lens.len();
    let mb = table.len() / b;
    let row = |s: usize| &table[s * mb..(s + 1) * mb];
    // Whole blocks before sequence s's first new query.
    let before = |s: usize| (seq_lens[s] - q_lens[s]) / bs;
    let mut found = Vec::new();
    let mut s = 0;
    while s < b {
        let mut blocks = before(s);
        let mut tokens = q_lens[s];
        let mut end = s + 1;
        while end < b {
            let limit = blocks.min(before(end));
            let common = (0..limit).find(|&i| row(s)[i] != row(end)[i]).unwrap_or(limit);
            if common * bs < MIN_SHARED_KEYS || tokens + q_lens[end] > common * bs {
                break;
            }
            blocks = common;
            tokens += q_lens[end];
            end += 1;
        }
        if end - s >= 2 {
            found.push(SharedPrefix {
                first: s,
                sequences: end - s,
                keys: blocks * bs,
            });
        }
        s = end;
    }
    found
}
