//! Paged attention over a ragged batch: queries packed `[T, Hq, E]` with a count per sequence
//! (1 for decode, more for a prefill chunk, mixed in one call), keys read through a block
//! table from paged caches. Each run of consecutive sequences with the same query count is one
//! [`Sdpa::paged`] call reading q and writing the output in place through views of the packed
//! buffers.

use ndarray::{Array2, Array3};

use crate::buffers::{f32_bytes, output};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::options::Options;
use crate::rope::Rope;
use crate::sdpa::{Path, Sdpa};
use crate::tensor::{Tensor, TensorData};

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
/// use wgpu_attention::{Causal, Context, PagedAttention};
/// let ctx = Context::new_blocking()?;
/// // Caches of 4 blocks of 4 tokens, 1 K/V head of dim 8; a prefill chunk of 3 queries for a
/// // 6-key sequence and one decode query for a 2-key sequence: T = 4, 2 query heads.
/// let k = Array4::<f32>::from_elem((4, 4, 1, 8), 0.5);
/// let v = Array4::<f32>::from_elem((4, 4, 1, 8), 1.0);
/// let q = Array3::<f32>::from_elem((4, 2, 8), 0.1);
/// let table = [2, 0, /* */ 3, -1];
/// let out = PagedAttention::new(&q, &[3, 1], &k, &v, &table, &[6, 2])
///     .causal(Causal::BottomRight)
///     .run_blocking(&ctx)?;
/// assert_eq!(out.output.shape(), &[4, 2, 8]);
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PagedAttention<'a> {
    q: Tensor<'a>,
    q_lens: Vec<usize>,
    k: Tensor<'a>,
    v: Tensor<'a>,
    table: &'a [i32],
    seq_lens: Vec<usize>,
    pub(crate) options: Options<'a>,
    rope: Option<Rope>,
    path: Path,
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
    /// The output `[T, Hq, Ev]` in q's storage format.
    pub output: wgpu::Buffer,
    /// Per group of consecutive sequences with the same query count: its first token, its
    /// sequences, the count, and its logsumexp `[sequences, Hq, count]` (f32).
    pub lse: Vec<LseGroup>,
}

/// One group's logsumexp (see [`GpuPagedOutput::lse`]).
#[derive(Debug)]
pub struct LseGroup {
    /// The group's first token in the packed batch.
    pub first_token: usize,
    /// Its sequences and their query count.
    pub sequences: usize,
    /// Queries per sequence.
    pub count: usize,
    /// `[sequences, Hq, count]`, f32.
    pub lse: wgpu::Buffer,
}

impl<'a> PagedAttention<'a> {
    /// Queries `q` `[T, Hq, E]` packed by sequence (`q_lens` per sequence, summing to T) over
    /// caches `k` `[num_blocks, block_size, Hkv, E]` and `v` `[.., Ev]` read through
    /// `block_table` `[B, max_blocks]` (unused entries anything, -1 say) for sequences of
    /// `seq_lens` keys. Host data or GPU buffers; the caches dense.
    pub fn new(
        q: impl Into<Tensor<'a>>,
        q_lens: &[usize],
        k_cache: impl Into<Tensor<'a>>,
        v_cache: impl Into<Tensor<'a>>,
        block_table: &'a [i32],
        seq_lens: &[usize],
    ) -> Self {
        PagedAttention {
            q: q.into(),
            q_lens: q_lens.to_vec(),
            k: k_cache.into(),
            v: v_cache.into(),
            table: block_table,
            seq_lens: seq_lens.to_vec(),
            options: Options::default(),
            rope: None,
            path: Path::Auto,
        }
    }

    option_setters!();

    /// Rotate q by `rope` inside the kernels, each query at its position (the caches hold
    /// rotated keys: see [`Sdpa::rope`]).
    pub fn rope(mut self, rope: Rope) -> Self {
        self.rope = Some(rope);
        self
    }

    /// Force the path of every group's call ([`Path::Fused`] or [`Path::Decode`]; default
    /// [`Path::Auto`]).
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }

    /// Check everything that needs no device: shapes, counts, the table. Returns `[T, Hq,
    /// E]`, Ev and the groups `(first sequence, sequences, count)`.
    #[allow(clippy::type_complexity)]
    fn check(&self) -> Result<([usize; 3], usize, Vec<(usize, usize, usize)>)> {
        let bad = |reason: String| Err(Error::Paged { reason });
        let q: [usize; 3] = self.q.shape.as_slice().try_into().map_err(|_| Error::WrongRank {
            tensor: "q",
            expected: 3,
            actual: self.q.shape.len(),
            shape: self.q.shape.clone(),
        })?;
        let [nb, bs, _, _] = crate::problem::dims4("k", &self.k.shape)?;
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
        crate::sdpa::check_block_table(self.table, &self.seq_lens, &self.q_lens, nb, bs)?;
        let mut groups = Vec::new();
        let mut s = 0;
        while s < b {
            let n = self.q_lens[s];
            let e = (s..b).find(|&x| self.q_lens[x] != n).unwrap_or(b);
            groups.push((s, e - s, n));
            s = e;
        }
        Ok((q, ev, groups))
    }

    /// Check everything before any GPU work, as [`record`](PagedAttention::record) and
    /// [`run`](PagedAttention::run) do: the batch, the table, and each group's call (shapes,
    /// modifiers, RoPE).
    pub fn validate(&self) -> Result<()> {
        let ([_, hq, e], _, groups) = self.check()?;
        let max_blocks = self.table.len() / self.seq_lens.len();
        for &(s0, nseq, n) in &groups {
            let zeros = vec![0f32; nseq * hq * n * e];
            let mut call = Sdpa::new(
                Tensor::from_slice(&zeros, &[nseq, hq, n, e]),
                self.k.clone(),
                self.v.clone(),
            )
            .options(self.options.clone())
            .paged(
                &self.table[s0 * max_blocks..(s0 + nseq) * max_blocks],
                &self.seq_lens[s0..s0 + nseq],
            );
            if let Some(r) = self.rope {
                call = call.rope(r);
            }
            call.problem()?;
        }
        Ok(())
    }

    /// Record every group's call into `encoder`: the output `[T, Hq, Ev]` in q's format and
    /// each group's logsumexp. Everything is checked before anything is recorded.
    pub fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<GpuPagedOutput> {
        let ([t, hq, e], ev, groups) = self.check()?;
        let st = self.q.storage();
        let max_blocks = self.table.len() / self.seq_lens.len();
        // q in a buffer (the groups read views of it).
        let owned;
        let (qbuf, qoff) = match &self.q.data {
            TensorData::Gpu { buffer, offset, .. } => (*buffer, *offset),
            TensorData::Host(d) => {
                owned = crate::buffers::init(
                    ctx,
                    "paged q",
                    &st.encode(&d.to_f32()),
                    wgpu::BufferUsages::STORAGE,
                );
                (&owned, 0)
            }
        };
        let out = output(ctx, "paged output", st.bytes(t * hq * ev).next_multiple_of(16));
        // Every group's call checked before any is recorded.
        let mut calls = Vec::new();
        let mut token = 0;
        for &(s0, nseq, n) in &groups {
            let q = Tensor::from_buffer(qbuf, st, &[nseq, hq, n, e])
                .at_offset(qoff + st.bytes(token * hq * e))
                .with_strides(&[n * hq * e, e, hq * e, 1]);
            let o = Tensor::from_buffer(&out, st, &[nseq, hq, n, ev])
                .at_offset(st.bytes(token * hq * ev))
                .with_strides(&[n * hq * ev, ev, hq * ev, 1]);
            let mut call = Sdpa::new(q, self.k.clone(), self.v.clone())
                .options(self.options.clone())
                .paged(
                    &self.table[s0 * max_blocks..(s0 + nseq) * max_blocks],
                    &self.seq_lens[s0..s0 + nseq],
                )
                .path(self.path)
                .output_into(o);
            if let Some(r) = self.rope {
                call = call.rope(r);
            }
            call.plan(ctx)?;
            calls.push((token, nseq, n, call));
            token += nseq * n;
        }
        let mut lse = Vec::new();
        for (first_token, sequences, count, call) in calls {
            let g = call.record(ctx, encoder)?;
            lse.push(LseGroup {
                first_token,
                sequences,
                count,
                lse: g.lse,
            });
        }
        Ok(GpuPagedOutput { output: out, lse })
    }

    /// Run on `ctx` and read the output `[T, Hq, Ev]` and logsumexp `[T, Hq]` back (f32).
    pub async fn run(&self, ctx: &Context) -> Result<PagedOutput> {
        self.validate()?;
        let ([t, hq, _], ev, _) = self.check()?;
        let st = self.q.storage();
        let gpu = ctx
            .submit("wgpu-attention paged", |enc| self.record(ctx, enc))
            .await?;
        let out = ctx.read_as_f32(&gpu.output, 0, t * hq * ev, st).await?;
        let mut lse = Array2::<f32>::zeros((t, hq));
        for g in &gpu.lse {
            let v = ctx
                .read_f32(&g.lse, 0, f32_bytes(g.sequences * hq * g.count))
                .await?;
            for s in 0..g.sequences {
                for h in 0..hq {
                    for i in 0..g.count {
                        lse[[g.first_token + s * g.count + i, h]] = v[(s * hq + h) * g.count + i];
                    }
                }
            }
        }
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

    /// The CPU reference (f64) of this call on host data: [`reference::sdpa_paged`](crate::reference::sdpa_paged)
    /// per sequence, packed like the GPU's output.
    pub fn reference(&self) -> Result<PagedOutput> {
        self.validate()?;
        let ([t, hq, e], ev, _) = self.check()?;
        let host = |x: &Tensor, name: &'static str| -> Result<Vec<f32>> {
            x.host_f32().map(|d| d.into_owned()).ok_or(Error::BadBuffer {
                tensor: name,
                reason: "the CPU reference reads host data, not a GPU buffer".into(),
            })
        };
        let (q, k, v) = (host(&self.q, "q")?, host(&self.k, "k")?, host(&self.v, "v")?);
        let array = |x: &Tensor, d: Vec<f32>, name: &'static str| -> Result<ndarray::Array4<f32>> {
            let shape: [usize; 4] = x.shape.as_slice().try_into().expect("checked");
            let n = d.len();
            ndarray::Array4::from_shape_vec(shape, d).map_err(|_| Error::DataLength {
                tensor: name,
                shape: x.shape.clone(),
                expected: x.shape.iter().product(),
                actual: n,
            })
        };
        let (k, v) = (array(&self.k, k, "k")?, array(&self.v, v, "v")?);
        if q.len() != t * hq * e {
            return Err(Error::DataLength {
                tensor: "q",
                shape: self.q.shape.clone(),
                expected: t * hq * e,
                actual: q.len(),
            });
        }
        let mut out = Array3::<f32>::zeros((t, hq, ev));
        let mut lse = Array2::<f32>::zeros((t, hq));
        let max_blocks = self.table.len() / self.seq_lens.len();
        let mut token = 0;
        for (s, (&n, &len)) in self.q_lens.iter().zip(&self.seq_lens).enumerate() {
            let mut qs = ndarray::Array4::<f32>::zeros((1, hq, n, e));
            for i in 0..n {
                for h in 0..hq {
                    for d in 0..e {
                        qs[[0, h, i, d]] = q[((token + i) * hq + h) * e + d];
                    }
                }
            }
            if let Some(r) = &self.rope {
                // The caches hold rotated keys; rotate q at its positions.
                let mut rows = qs
                    .slice(ndarray::s![0, .., .., ..])
                    .permuted_axes([1, 0, 2])
                    .to_owned();
                let pos: Vec<usize> = (0..n).map(|i| len - n + i).collect();
                r.apply(rows.view_mut(), &pos)?;
                qs.slice_mut(ndarray::s![0, .., .., ..])
                    .assign(&rows.permuted_axes([1, 0, 2]));
            }
            let r = crate::reference::sdpa_paged(
                qs.view(),
                k.view(),
                v.view(),
                &self.table[s * max_blocks..(s + 1) * max_blocks],
                &[len],
                &self.options,
            )?;
            for i in 0..n {
                for h in 0..hq {
                    for d in 0..ev {
                        out[[token + i, h, d]] = r.out[[0, h, i, d]] as f32;
                    }
                    lse[[token + i, h]] = r.lse[[0, h, i]] as f32;
                }
            }
            token += n;
        }
        Ok(PagedOutput { output: out, lse })
    }
}
