//! Paged attention over a ragged batch: queries packed `[T, Hq, E]` with a count per sequence
//! (1 for decode, more for a prefill chunk, mixed in one call), keys read through a block
//! table from paged caches. Each run of consecutive sequences with the same query count is one
//! [`Sdpa::paged`] call reading q and writing the output in place through views of the packed
//! buffers.
//!
//! Shared prefixes (cascade attention): consecutive sequences whose block tables begin with
//! the same blocks (forked sequences), all of them before every new query, have those keys
//! read once: one call of all their queries over the shared blocks, one over each sequence's
//! own tail, merged by logsumexp.

use ndarray::{Array2, Array3};

use crate::device::buffers::{f32_bytes, output};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::options::Options;
use crate::rope::Rope;
use crate::sdpa::{Path, Sdpa};
use crate::tensor::{Tensor, TensorData};

use super::cascade::{call_lse_scratch, find_shared, place_lse, prefix_splits, Cascade, SharedPrefix};
use super::pages::Pages;

/// Paged attention of a ragged batch (see the module docs of `paged.rs` and `docs/paged.md`).
///
/// Query `i` of sequence `s`, with `n = q_lens[s]` new queries and `l = seq_lens[s]` keys
/// (its new queries' own keys included), has position `l - n + i`; causal
/// ([`Causal::BottomRight`](crate::Causal::BottomRight)) is by position, and so are the window
/// and ALiBi. Every built-in modifier applies (window, sink tokens, sink logits, softcap,
/// ALiBi) as do user functions; boolean masks, biases, document ids and key lengths (which
/// are per batch entry) are refused: give them to [`Sdpa::paged`] per group.
///
/// ```
/// use ndarray::{Array3, Array4};
/// use wgpu_attention::{Causal, Context, PagedAttention, PagedLayout, Pages};
/// let ctx = Context::new_blocking()?;
/// // Caches of 4 blocks of 4 tokens, 1 K/V head of dim 8; a prefill chunk of 3 queries for a
/// // 6-key sequence and one decode query for a 2-key sequence: T = 4, 2 query heads.
/// let k = Array4::<f32>::from_elem((4, 4, 1, 8), 0.5);
/// let v = Array4::<f32>::from_elem((4, 4, 1, 8), 1.0);
/// let q = Array3::<f32>::from_elem((4, 2, 8), 0.1);
/// let table = [2, 0, /* */ 3, -1];
/// let pages = Pages::new(&k, &v, PagedLayout::TokenMajor);
/// let out = PagedAttention::new(&q, &[3, 1], pages, &table, &[6, 2])
///     .causal(Causal::BottomRight)
///     .run_blocking(&ctx)?;
/// assert_eq!(out.output.shape(), &[4, 2, 8]);
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PagedAttention<'a> {
    pub(crate) q: Tensor<'a>,
    pub(crate) q_lens: Vec<usize>,
    pub(crate) k: Tensor<'a>,
    pub(crate) v: Tensor<'a>,
    pub(crate) table: &'a [i32],
    pub(crate) seq_lens: Vec<usize>,
    pub(crate) options: Options<'a>,
    pub(crate) rope: Option<Rope>,
    pub(crate) path: Path,
    pub(crate) shared_prefix: bool,
    pub(crate) prefix_splits: Option<usize>,
    pub(crate) layout: crate::paged::PagedLayout,
    /// The caller's output and logsumexp buffers, if given.
    pub(crate) out: Option<Tensor<'a>>,
    pub(crate) lse_out: Option<Tensor<'a>>,
}

/// A checked batch ([`PagedAttention::check`]): q's `[T, Hq, E]`, Ev, and the groups of
/// consecutive sequences with equal query counts (one call each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Batch {
    pub dims: [usize; 3],
    pub ev: usize,
    pub groups: Vec<Group>,
}

/// Consecutive sequences with the same query count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Group {
    /// The first sequence.
    pub first: usize,
    /// How many sequences.
    pub sequences: usize,
    /// The query count of each.
    pub queries: usize,
}

/// [`PagedAttention::run`]'s results on the host (f32).
#[derive(Debug, Clone)]
pub struct PagedOutput {
    /// `[T, Hq, Ev]`.
    pub output: Array3<f32>,
    /// The logsumexp of each query row `[T, Hq]` (-inf for a row with no allowed key).
    pub lse: Array2<f32>,
}

/// [`PagedAttention::record`]'s results on the device.
#[derive(Debug)]
pub struct GpuPagedOutput {
    /// The output `[T, Hq, Ev]` in q's storage format (the caller's buffer with
    /// [`PagedAttention::output_into`]).
    pub output: wgpu::Buffer,
    /// Byte offset of the output in [`GpuPagedOutput::output`].
    pub output_offset: u64,
    /// The logsumexp of each query row `[T, Hq]` (f32; -inf for a row with no allowed key).
    pub lse: wgpu::Buffer,
    /// Byte offset of the logsumexp in [`GpuPagedOutput::lse`].
    pub lse_offset: u64,
    /// The shared prefixes read once (see [`PagedAttention::shared_prefix`]).
    pub shared: Vec<SharedPrefix>,
}

impl<'a> PagedAttention<'a> {
    /// Queries `q` `[T, Hq, E]` packed by sequence (`q_lens` per sequence, summing to T) over
    /// the caches `pages` (K `[num_blocks, block_size, Hkv, E]` and V `[.., Ev]` in the
    /// pages' layout) read through `block_table` `[B, max_blocks]` (unused entries anything,
    /// -1 say) for sequences of `seq_lens` keys. Host data or GPU buffers; the caches dense;
    /// q may be a GPU buffer's view with strides `[T, Hq, E]` ([`Tensor::with_strides`] with
    /// three strides, the last 1: the q part of a fused QKV projection). Not causal unless
    /// asked: give [`causal`](PagedAttention::causal) (a [`KvCache`](crate::KvCache)'s calls
    /// are causal by default).
    pub fn new(
        q: impl Into<Tensor<'a>>,
        q_lens: &[usize],
        pages: Pages<'a>,
        block_table: &'a [i32],
        seq_lens: &[usize],
    ) -> Self {
        let Pages { k, v, layout } = pages;
        PagedAttention {
            q: q.into(),
            q_lens: q_lens.to_vec(),
            k,
            v,
            table: block_table,
            seq_lens: seq_lens.to_vec(),
            options: Options::default(),
            rope: None,
            path: Path::Auto,
            shared_prefix: true,
            prefix_splits: None,
            layout,
            out: None,
            lse_out: None,
        }
    }

    /// Write the packed output `[T, Hq, Ev]` (dense, in q's format) into a caller's GPU buffer
    /// ([`Tensor::from_buffer`], `STORAGE` and `COPY_DST` usage, at an offset that is a
    /// multiple of the device's `min_storage_buffer_offset_alignment`). With
    /// [`lse_into`](PagedAttention::lse_into) too, a repeated call allocates nothing but its
    /// new key lengths' constants (see `docs/storage.md`). Checked before any GPU work.
    pub fn output_into(mut self, out: Tensor<'a>) -> Self {
        self.out = Some(out);
        self
    }

    /// Write the logsumexp `[T, Hq]` (f32, dense) into a caller's GPU buffer (as
    /// [`output_into`](PagedAttention::output_into)).
    pub fn lse_into(mut self, lse: Tensor<'a>) -> Self {
        self.lse_out = Some(lse);
        self
    }

    /// The output `[T, Hq, Ev]` and logsumexp `[T, Hq]` buffers and byte offsets: the caller's
    /// ([`check_outputs`](PagedAttention::check_outputs) first), else new ones.
    #[allow(clippy::type_complexity)]
    pub(crate) fn output_buffers(
        &self,
        ctx: &Context,
        [t, hq, ev]: [usize; 3],
    ) -> ((wgpu::Buffer, u64), (wgpu::Buffer, u64)) {
        let given = |x: &Option<Tensor<'a>>, label: &str, bytes: u64| match x.as_ref().map(|x| &x.data) {
            Some(TensorData::Gpu { buffer, offset, .. }) => ((*buffer).clone(), *offset),
            _ => (output(ctx, label, bytes.next_multiple_of(16)), 0),
        };
        (
            given(&self.out, "paged output", self.q.storage().bytes(t * hq * ev)),
            given(&self.lse_out, "paged lse", f32_bytes(t * hq)),
        )
    }

    /// The caller's output and logsumexp, checked (shape, format, dense, a GPU buffer, no
    /// overlap with the inputs or each other) before any GPU work.
    pub(crate) fn check_outputs(&self, ctx: &Context, [t, hq, ev]: [usize; 3]) -> Result<()> {
        for (name, x, shape, st) in [
            ("output", &self.out, vec![t, hq, ev], self.q.storage()),
            ("lse", &self.lse_out, vec![t, hq], crate::storage::Storage::F32),
        ] {
            let Some(x) = x else { continue };
            let bad = |reason: &str| {
                Err(Error::BadBuffer {
                    tensor: name,
                    reason: reason.into(),
                })
            };
            if !matches!(x.data, TensorData::Gpu { .. }) {
                return bad("a paged call writes into a GPU buffer (Tensor::from_buffer), not host data");
            }
            if x.view.is_set() {
                return bad("a paged call writes it dense (packed by token): no layout, capacity or strides");
            }
            if x.shape != shape {
                return Err(Error::ShapeMismatch {
                    tensor: name,
                    expected: shape,
                    actual: x.shape.clone(),
                });
            }
            if x.storage() != st {
                return Err(Error::StorageMismatch {
                    tensor: name,
                    expected: st,
                    actual: x.storage(),
                    why: "a paged call's output is in q's format, its logsumexp f32",
                });
            }
            crate::device::buffers::Operand::check(ctx, name, x)?;
            let TensorData::Gpu { buffer, .. } = &x.data else {
                unreachable!("checked")
            };
            if !buffer.usage().contains(wgpu::BufferUsages::COPY_DST) {
                return bad("the buffer needs COPY_DST usage (the logsumexp rows are copied into place)");
            }
        }
        let outputs: Vec<(&'static str, &Tensor)> =
            [("output", self.out.as_ref()), ("lse", self.lse_out.as_ref())]
                .into_iter()
                .filter_map(|(n, x)| x.map(|x| (n, x)))
                .collect();
        crate::device::buffers::check_aliasing(&outputs, &[("q", &self.q), ("k", &self.k), ("v", &self.v)])
    }

    /// The caches' block size.
    pub(crate) fn block_size(&self) -> usize {
        self.k.shape[if self.layout == crate::paged::PagedLayout::HeadMajor {
            2
        } else {
            1
        }]
    }

    option_setters!();

    /// Rotate q by `rope` inside the kernels, each query at its position (the caches hold
    /// rotated keys: see [`Sdpa::rope`]).
    pub fn rope(mut self, rope: Rope) -> Self {
        self.rope = Some(rope);
        self
    }

    /// Force the path of every group's call ([`Path::Fused`] or [`Path::Decode`]; default
    /// [`Path::Auto`]). A shared prefix's call over all its queries keeps [`Path::Auto`].
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }

    /// Read shared prefixes once (default true): consecutive sequences whose block tables
    /// begin with the same blocks (forks of one sequence), at least [`MIN_SHARED_KEYS`](crate::MIN_SHARED_KEYS) keys
    /// of them before each sequence's first new query, are attended in two calls (all their
    /// queries over the shared keys, each sequence over its own tail) merged by logsumexp,
    /// which reads the shared keys once instead of once per sequence. The result is the same
    /// attention (rounding aside). Not with a window, ALiBi or a user function (whose
    /// positions the split would change): those calls read every sequence's keys.
    pub fn shared_prefix(mut self, on: bool) -> Self {
        self.shared_prefix = on;
        self
    }

    /// How many runs of whole blocks a shared prefix's keys are read in: the call over all
    /// its queries takes each run as a batch entry (its queries repeated), and the runs are
    /// merged by logsumexp with the tails. More runs give a GPU more workgroups to fill its
    /// compute units with (64 forks of 32 heads make only 32 query tiles). Default: 1 on CPU
    /// adapters, else enough for 512 workgroups with at least 256 keys per run. Clamped so
    /// that each run has at least as many keys as the prefix has queries.
    ///
    /// ```
    /// use ndarray::{Array3, Array4};
    /// use wgpu_attention::{Causal, Context, PagedAttention, PagedLayout, Pages};
    /// let ctx = Context::new_blocking()?;
    /// // Two forks of a 512-token prompt (blocks 0-31 of 16 tokens) with one block each of
    /// // their own (32, 33), decoding one query each: the prompt is read once, in 4 runs.
    /// let k = Array4::<f32>::zeros((34, 16, 2, 64));
    /// let v = Array4::<f32>::zeros((34, 16, 2, 64));
    /// let q = Array3::<f32>::zeros((2, 8, 64));
    /// let mut table: Vec<i32> = (0..32).chain([32]).collect();
    /// table.extend((0..32).chain([33]));
    /// let pages = Pages::new(&k, &v, PagedLayout::TokenMajor);
    /// let call = PagedAttention::new(&q, &[1, 1], pages, &table, &[520, 516])
    ///     .causal(Causal::BottomRight)
    ///     .shared_prefix_splits(4);
    /// assert_eq!(call.shared_prefixes()?[0].keys, 512);
    /// let out = call.run_blocking(&ctx)?;
    /// assert_eq!(out.output.shape(), &[2, 8, 64]);
    /// # Ok::<(), wgpu_attention::Error>(())
    /// ```
    pub fn shared_prefix_splits(mut self, runs: usize) -> Self {
        self.prefix_splits = Some(runs);
        self
    }

    /// The shared prefixes that [`record`](PagedAttention::record) reads once (empty when
    /// [`shared_prefix`](PagedAttention::shared_prefix) is off or none qualifies). Checks the
    /// batch first.
    pub fn shared_prefixes(&self) -> Result<Vec<SharedPrefix>> {
        self.check()?;
        Ok(self.shared_of_checked())
    }

    /// [`shared_prefixes`](PagedAttention::shared_prefixes) of a checked batch.
    fn shared_of_checked(&self) -> Vec<SharedPrefix> {
        let o = &self.options;
        if !self.shared_prefix || o.window.is_some() || o.alibi.is_some() || o.user_mod.is_some() {
            return Vec::new();
        }
        find_shared(self.table, &self.seq_lens, &self.q_lens, self.block_size())
    }

    /// Check everything that needs no device: shapes, counts, the table. The checked batch,
    /// taken once per call by [`run`](PagedAttention::run), [`record`](PagedAttention::record)
    /// and [`validate`](PagedAttention::validate).
    pub(crate) fn check(&self) -> Result<Batch> {
        let bad = |reason: String| Err(Error::Paged { reason });
        let q: [usize; 3] = self.q.shape.as_slice().try_into().map_err(|_| Error::WrongRank {
            tensor: "q",
            expected: 3,
            actual: self.q.shape.len(),
            shape: self.q.shape.clone(),
        })?;
        self.q_strides(q)?;
        let [nb, bs, _, _] = crate::paged::PagedLayout::token_major_dims(
            crate::problem::dims4("k", &self.k.shape)?,
            self.layout,
        );
        let ev = crate::problem::dims4("v", &self.v.shape)?[3];
        let o = &self.options;
        if o.mask.is_some() || o.bias.is_some() || o.doc_ids.is_some() || o.kv_lens.is_some() {
            return bad(
                "boolean masks, biases, document ids and key lengths are per batch entry: give them to Sdpa::paged, one call per group of equal query counts"
                    .into(),
            );
        }
        let b = self.seq_lens.len();
        if self.q_lens.len() != b {
            return bad(format!(
                "{} query counts for {b} sequence lengths",
                self.q_lens.len()
            ));
        }
        if let Some(s) = self.q_lens.iter().position(|&n| n == 0) {
            return bad(format!(
                "sequence {s} has no query: every sequence of the batch needs at least one"
            ));
        }
        let total: usize = self.q_lens.iter().sum();
        if total != q[0] {
            return bad(format!(
                "the query counts sum to {total}, q holds {} tokens ([T, Hq, E])",
                q[0]
            ));
        }
        crate::paged::check_block_table(self.table, &self.seq_lens, &self.q_lens, nb, bs)?;
        let mut groups = Vec::new();
        let mut s = 0;
        while s < b {
            let n = self.q_lens[s];
            let e = (s..b).find(|&x| self.q_lens[x] != n).unwrap_or(b);
            groups.push(Group {
                first: s,
                sequences: e - s,
                queries: n,
            });
            s = e;
        }
        Ok(Batch { dims: q, ev, groups })
    }

    /// q's element strides of T and Hq (E's is 1), or the typed error naming q
    /// ([`crate::tensor::packed_rows`]).
    pub(crate) fn q_strides(&self, dims: [usize; 3]) -> Result<[usize; 2]> {
        crate::tensor::packed_rows("q", &self.q, dims)
    }

    /// Check everything before any GPU work, as [`record`](PagedAttention::record) and
    /// [`run`](PagedAttention::run) do: the batch, the table, and each group's call (shapes,
    /// modifiers, RoPE).
    pub fn validate(&self) -> Result<()> {
        self.validate_groups(&self.check()?)
    }

    /// Each group's call of the checked `batch` (shapes, modifiers, RoPE).
    fn validate_groups(&self, batch: &Batch) -> Result<()> {
        let [_, hq, e] = batch.dims;
        let max_blocks = self.table.len() / self.seq_lens.len();
        for g in &batch.groups {
            let (s0, nseq, n) = (g.first, g.sequences, g.queries);
            // q's shape alone: the problem reads no data (no host copy of q's size).
            let mut call = Sdpa::new(
                Tensor::from_slice::<f32>(&[], &[nseq, hq, n, e]),
                self.k.clone(),
                self.v.clone(),
            )
            .options(self.options.clone())
            .over_pages(
                &self.table[s0 * max_blocks..(s0 + nseq) * max_blocks],
                &self.seq_lens[s0..s0 + nseq],
                self.layout,
            );
            if let Some(r) = self.rope {
                call = call.rope(r);
            }
            call.problem()?;
        }
        Ok(())
    }

    /// Record every group's call into `encoder`: the output `[T, Hq, Ev]` in q's format and
    /// the logsumexp `[T, Hq]`. Everything is checked before anything is recorded.
    pub fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<GpuPagedOutput> {
        self.record_checked(ctx, encoder, &self.check()?)
    }

    /// [`record`](PagedAttention::record) of the checked `batch`.
    fn record_checked(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        batch: &Batch,
    ) -> Result<GpuPagedOutput> {
        let ([t, hq, e], ev) = (batch.dims, batch.ev);
        let [mut ts, mut hs] = self.q_strides([t, hq, e])?;
        self.check_outputs(ctx, [t, hq, ev])?;
        let shared = self.shared_of_checked();
        let st = self.q.storage();
        let first_token = self.first_tokens();
        self.rope.map(|r| r.rotated_dims(e)).transpose()?;
        // q in a buffer (the calls read views of it).
        let owned;
        let (mut qbuf, mut qoff) = match &self.q.data {
            TensorData::Gpu { buffer, offset, .. } => (*buffer, *offset),
            TensorData::Host(d) => {
                owned = crate::device::buffers::init(
                    ctx,
                    "paged q",
                    &st.encode(&d.to_f32()),
                    wgpu::BufferUsages::STORAGE,
                );
                (&owned, 0)
            }
        };
        // A shared prefix's call does not see each query's position: q is rotated first (a
        // copy), and no call rotates it again.
        let rotated = (self.rope.is_some() && !shared.is_empty())
            .then(|| output(ctx, "paged q rotated", st.bytes(t * hq * e).next_multiple_of(16)));
        let rope = match &rotated {
            Some(buf) => {
                (qbuf, qoff, ts, hs) = (buf, 0, hq * e, e);
                None
            }
            None => self.rope,
        };
        let ((out, out_off), (lse, lse_off)) = self.output_buffers(ctx, [t, hq, ev]);
        let cascades = self.cascade_scratch(ctx, &shared, &first_token, [hq, ev]);
        let call_lse = call_lse_scratch(ctx, &cascades, [t, hq]);
        let in_shared = self.in_shared(&cascades);
        // The calls, each with where its logsumexp goes: (buffer, first row, [seqs, Hq, n]).
        // Queries from `token` as `[nseq, Hq, n, E]`: consecutive sequences, or (`repeat`) the
        // same n tokens nseq times (a shared prefix's key splits).
        let q_at = |token: usize, nseq: usize, n: usize, repeat: bool| {
            Tensor::from_buffer(qbuf, st, &[nseq, hq, n, e])
                .at_offset(qoff + st.bytes(token * ts))
                .with_strides(&[if repeat { 0 } else { n * ts }, hs, ts, 1])
        };
        let mut calls = self.alone_calls(
            &q_at,
            &in_shared,
            &first_token,
            (&out, out_off, st),
            (&lse, lse_off),
            rope,
            [hq, ev],
        );
        for c in &cascades {
            calls.extend(self.cascade_calls(&q_at, c, &first_token, [hq, ev]));
        }
        // Each call's logsumexp into the pooled scratch, placed by rows after it.
        let calls: Vec<Call> = calls
            .into_iter()
            .map(|c| Call {
                sdpa: c.sdpa.lse_into(Tensor::from_buffer(
                    &call_lse,
                    crate::storage::Storage::F32,
                    &c.dims,
                )),
                ..c
            })
            .collect();
        // Everything checked before anything is recorded, each call planned once.
        let planned = plan_calls(ctx, &calls)?;
        if let (Some(buf), Some(r)) = (&rotated, &self.rope) {
            self.rotate_q(ctx, encoder, buf, r, [t, hq, e])?;
        }
        for (c, (p, plan)) in calls.iter().zip(planned) {
            let g = crate::sdpa::forward::record_planned(&c.sdpa, ctx, encoder, p, plan)?;
            place_lse(ctx, encoder, &g.lse, c.dims, c.lse_dst, c.row)?;
        }
        for c in &cascades {
            c.merge(ctx, encoder, (&out, out_off, st), (&lse, lse_off), [hq, ev])?;
        }
        Ok(GpuPagedOutput {
            output: out,
            output_offset: out_off,
            lse,
            lse_offset: lse_off,
            shared,
        })
    }

    /// Each sequence's first query among the T.
    fn first_tokens(&self) -> Vec<usize> {
        self.q_lens
            .iter()
            .scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n)))
            .collect()
    }

    /// Whether each sequence is read in one of `cascades`' calls.
    fn in_shared(&self, cascades: &[Cascade]) -> Vec<bool> {
        let mut in_shared = vec![false; self.seq_lens.len()];
        for c in cascades {
            in_shared[c.share.first..c.share.first + c.share.sequences].fill(true);
        }
        in_shared
    }

    /// Run on `ctx` and read the output `[T, Hq, Ev]` and logsumexp `[T, Hq]` back (f32).
    pub async fn run(&self, ctx: &Context) -> Result<PagedOutput> {
        let batch = self.check()?;
        self.validate_groups(&batch)?;
        let ([t, hq, _], ev) = (batch.dims, batch.ev);
        let st = self.q.storage();
        let gpu = ctx
            .submit("wgpu-attention paged", |enc| {
                self.record_checked(ctx, enc, &batch)
            })
            .await?;
        let out = ctx
            .read_as_f32(&gpu.output, gpu.output_offset, t * hq * ev, st)
            .await?;
        let lse = ctx.read_f32(&gpu.lse, gpu.lse_offset, f32_bytes(t * hq)).await?;
        let lse = Array2::from_shape_vec((t, hq), lse).expect("lse length");
        Ok(PagedOutput {
            output: Array3::from_shape_vec((t, hq, ev), out).expect("output length"),
            lse,
        })
    }

    /// Blocking version of [`run`](PagedAttention::run).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run_blocking(&self, ctx: &Context) -> Result<PagedOutput> {
        pollster::block_on(self.run(ctx))
    }
}

impl PagedAttention<'_> {
    /// Record q `[T, Hq, E]` copied into `buf` and rotated there by `r`, each token at its
    /// position.
    pub(crate) fn rotate_q(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        buf: &wgpu::Buffer,
        r: &Rope,
        [t, hq, e]: [usize; 3],
    ) -> Result<()> {
        let st = self.q.storage();
        let [ts, hs] = self.q_strides([t, hq, e])?;
        match crate::tensor::rows_view(&self.q, [t, hq, e], [ts, hs]) {
            // q's rows copied dense from wherever they lie in its buffer.
            Some(viewed) => {
                crate::ops::copy::gather_rows(
                    ctx,
                    encoder,
                    "q",
                    &viewed,
                    (buf.as_entire_buffer_binding(), st),
                )?;
            }
            None => {
                let op = crate::device::buffers::Operand::check(ctx, "q", &self.q)?;
                let up = op.upload(ctx, "paged q");
                crate::ops::copy::convert(
                    ctx,
                    encoder,
                    (up.binding(), st),
                    (buf.as_entire_buffer_binding(), st),
                    t * hq * e,
                )?;
            }
        }
        let positions: Vec<usize> = self
            .q_lens
            .iter()
            .zip(&self.seq_lens)
            .flat_map(|(&n, &l)| l - n..l)
            .collect();
        r.record(
            ctx,
            encoder,
            &Tensor::from_buffer(buf, st, &[t, hq, e]),
            &positions,
        )
    }
}

impl PagedAttention<'_> {
    /// Each shared prefix's scratch: its runs' tables, the partial results (f32, rows (token,
    /// head)) over each run and over the tails, their logsumexps, the merged logsumexp, and the
    /// tails of its tables.
    fn cascade_scratch(
        &self,
        ctx: &Context,
        shared: &[SharedPrefix],
        first_token: &[usize],
        [hq, ev]: [usize; 2],
    ) -> Vec<Cascade> {
        let max_blocks = self.table.len() / self.seq_lens.len();
        let bs = self.block_size();
        let caps = ctx.caps();
        shared
            .iter()
            .map(|sh| {
                let seqs = sh.first..sh.first + sh.sequences;
                let tokens: usize = self.q_lens[seqs.clone()].iter().sum();
                let rows = tokens * hq;
                let blocks = sh.keys / bs;
                // The shared keys in `splits` runs of whole blocks (sizes differing by at most
                // one block), one call's batch entries.
                let splits = prefix_splits(self.prefix_splits, &caps, [hq, tokens, blocks, bs]);
                let block_ids = &self.table[sh.first * max_blocks..sh.first * max_blocks + blocks];
                let per = blocks.div_ceil(splits);
                let mut prefix_table = vec![-1; splits * per];
                let mut prefix_lens = Vec::with_capacity(splits);
                let mut at = 0;
                for x in 0..splits {
                    let n = blocks / splits + usize::from(x < blocks % splits);
                    prefix_table[x * per..x * per + n].copy_from_slice(&block_ids[at..at + n]);
                    prefix_lens.push(n * bs);
                    at += n;
                }
                Cascade {
                    share: *sh,
                    tokens,
                    token0: first_token[sh.first],
                    splits,
                    prefix_table,
                    prefix_lens,
                    parts: output(ctx, "cascade parts", f32_bytes((splits + 1) * rows * ev)),
                    lses: output(ctx, "cascade lse parts", f32_bytes((splits + 1) * rows)),
                    merged: output(ctx, "cascade lse", f32_bytes(rows)),
                    tails: seqs
                        .clone()
                        .flat_map(|s| {
                            self.table[s * max_blocks + blocks..(s + 1) * max_blocks]
                                .iter()
                                .copied()
                        })
                        .collect(),
                    tail_lens: seqs.map(|s| self.seq_lens[s] - sh.keys).collect(),
                }
            })
            .collect()
    }
}

/// Each call's problem and plan: every call checked before anything is recorded.
fn plan_calls(
    ctx: &Context,
    calls: &[Call],
) -> Result<Vec<(crate::problem::Problem, crate::sdpa::plan::Plan)>> {
    let caps = ctx.caps();
    calls
        .iter()
        .map(|c| {
            let p = c.sdpa.problem()?;
            let plan = crate::sdpa::plan::Plan::new(&p, &c.sdpa.request(), &caps)?;
            Ok((p, plan))
        })
        .collect()
}

/// A call of [`PagedAttention::record`] and where its logsumexp `[seqs, Hq, n]` goes: the
/// buffer, its first row `(token, head)`, and the dims.
struct Call<'b> {
    sdpa: Sdpa<'b>,
    /// The buffer and byte offset of the packed logsumexp `[T', Hq]` it goes into.
    lse_dst: (&'b wgpu::Buffer, u64),
    /// Its first row `(token, head)` there.
    row: usize,
    /// Its logsumexp's dims `[seqs, Hq, n]`.
    dims: [usize; 3],
}

impl<'a> PagedAttention<'a> {
    /// The calls of the sequences read alone (not `in_shared`): runs of equal query counts,
    /// writing the packed output `out` and logsumexp `lse` in place.
    #[allow(clippy::too_many_arguments)]
    fn alone_calls<'b>(
        &'b self,
        q_at: &impl Fn(usize, usize, usize, bool) -> Tensor<'b>,
        in_shared: &[bool],
        first_token: &[usize],
        (out, out_off, st): (&'b wgpu::Buffer, u64, crate::storage::Storage),
        lse: (&'b wgpu::Buffer, u64),
        rope: Option<Rope>,
        [hq, ev]: [usize; 2],
    ) -> Vec<Call<'b>> {
        let b = self.seq_lens.len();
        let max_blocks = self.table.len() / b;
        let mut calls = Vec::new();
        // Sequences read alone: runs of equal query counts.
        let mut s = 0;
        while s < b {
            if in_shared[s] {
                s += 1;
                continue;
            }
            let n = self.q_lens[s];
            let end = (s..b).find(|&x| in_shared[x] || self.q_lens[x] != n).unwrap_or(b);
            let nseq = end - s;
            let token = first_token[s];
            let o = Tensor::from_buffer(out, st, &[nseq, hq, n, ev])
                .at_offset(out_off + st.element_bytes() * (token * hq * ev) as u64)
                .with_strides(&[n * hq * ev, ev, hq * ev, 1]);
            let call = Sdpa::new(q_at(token, nseq, n, false), self.k.clone(), self.v.clone())
                .options(self.options.clone())
                .over_pages(
                    &self.table[s * max_blocks..end * max_blocks],
                    &self.seq_lens[s..end],
                    self.layout,
                )
                .path(self.path)
                .output_into(o);
            let call = match rope {
                Some(r) => call.rope(r),
                None => call,
            };
            calls.push(Call {
                sdpa: call,
                lse_dst: lse,
                row: token * hq,
                dims: [nseq, hq, n],
            });
            s = end;
        }
        calls
    }

    /// A shared prefix's calls: all its queries over each run of the shared keys, then each
    /// sequence over its tail (runs of equal query counts), into the parts of its scratch.
    fn cascade_calls<'b>(
        &'b self,
        q_at: &impl Fn(usize, usize, usize, bool) -> Tensor<'b>,
        c: &'b Cascade,
        first_token: &[usize],
        [hq, ev]: [usize; 2],
    ) -> Vec<Call<'b>> {
        let max_blocks = self.table.len() / self.seq_lens.len();
        let bs = self.block_size();
        let mut calls = Vec::new();
        let (first, keys, tokens) = (c.share.first, c.share.keys, c.tokens);
        let rows = tokens * hq;
        let splits = c.splits;
        // Every query over each run of the shared keys (a batch entry per run, the queries
        // repeated): no causal mask (each query is past them all), no sink logits (counted
        // once, with the tails).
        let mut prefix = self.options.clone();
        prefix.causal = crate::problem::Causal::None;
        prefix.sink_tokens = 0;
        prefix.sink_logits = None;
        let o = Tensor::from_buffer(&c.parts, crate::storage::Storage::F32, &[splits, hq, tokens, ev])
            .with_strides(&[rows * ev, ev, hq * ev, 1]);
        let call = Sdpa::new(
            q_at(c.token0, splits, tokens, true),
            self.k.clone(),
            self.v.clone(),
        )
        .options(prefix)
        .over_pages(&c.prefix_table, &c.prefix_lens, self.layout)
        .output_into(o);
        calls.push(Call {
            sdpa: call,
            lse_dst: (&c.lses, 0),
            row: 0,
            dims: [splits, hq, tokens],
        });
        debug_assert_eq!(c.prefix_lens.iter().sum::<usize>(), keys);
        // Each sequence over its tail, by runs of equal query counts (the sink logits here).
        let mut tail = self.options.clone();
        tail.sink_tokens = 0;
        let tail_blocks = max_blocks - keys / bs;
        let mut s = 0;
        while s < c.share.sequences {
            let n = self.q_lens[first + s];
            let end = (s..c.share.sequences)
                .find(|&x| self.q_lens[first + x] != n)
                .unwrap_or(c.share.sequences);
            let nseq = end - s;
            let token = first_token[first + s];
            let row = (token - c.token0) * hq;
            let o = Tensor::from_buffer(&c.parts, crate::storage::Storage::F32, &[nseq, hq, n, ev])
                .at_offset(f32_bytes((splits * rows + row) * ev))
                .with_strides(&[n * hq * ev, ev, hq * ev, 1]);
            let call = Sdpa::new(q_at(token, nseq, n, false), self.k.clone(), self.v.clone())
                .options(tail.clone())
                .over_pages(
                    &c.tails[s * tail_blocks..end * tail_blocks],
                    &c.tail_lens[s..end],
                    self.layout,
                )
                .path(self.path)
                .output_into(o);
            calls.push(Call {
                sdpa: call,
                lse_dst: (&c.lses, 0),
                row: splits * rows + row,
                dims: [nseq, hq, n],
            });
            s = end;
        }
        calls
    }
}
