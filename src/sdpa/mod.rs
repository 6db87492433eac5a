//! Scaled dot-product attention: the public entry point [`Sdpa`], its [`Plan`] (path, form,
//! tiles), the recorders of the three paths ([`forward`]) and the logsumexp [`merge`].
//!
//! | path | kernels (`src/kernels/`, `shaders/`) | reference stage (`src/reference/sdpa.rs`) |
//! |---|---|---|
//! | [`Path::Unfused`] | `matmul`, `softmax`, `matmul` | `scores`, `masked_softmax`, `weighted_sum` |
//! | [`Path::Fused`] | `flash` | `sdpa` |
//! | [`Path::Decode`] | `decode`, `merge` | `sdpa` |

use ndarray::{Array3, Array4};

use crate::device::buffers::{binding, f32_bytes, shape_bytes};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::options::Options;
use crate::problem::{PagedKv, Problem};
use crate::storage::{Formats, Storage};
use crate::tensor::Tensor;

pub(crate) mod backward;
pub(crate) mod bindings;
pub(crate) mod forward;
pub(crate) mod merge;
pub(crate) mod plan;
mod prepare;
pub(crate) mod quant;

use plan::{Form, Kernel, Plan, Request};

/// Which implementation runs the attention.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Path {
    /// Let the crate choose: [`Path::Decode`] for at most 16 query rows and at least 512 keys,
    /// else [`Path::Fused`]; [`Path::Unfused`] when the weights are requested or the head dims
    /// exceed what the fused kernel supports.
    #[default]
    Auto,
    /// Three kernels: scores matmul, masked softmax, value weighting. Materialises the score
    /// matrix in chunks that fit the device's binding limit; always works; the only path that
    /// can return the attention weights.
    Unfused,
    /// One FlashAttention-style kernel: K/V tiles streamed through workgroup memory with an
    /// online softmax; memory linear in L and S; every mask inside; causal and key-length tiles
    /// skipped whole. Head dims up to 256. Cannot return the weights.
    Fused,
    /// Split-K for few query rows and long key sequences (KV-cache decoding): the keys are
    /// split across many workgroups, each writing a partial output and logsumexp, then merged
    /// by the logsumexp rule. Every mask inside. Cannot return the weights.
    Decode,
}

impl Path {
    /// Every concrete path, for tests and benchmarks.
    pub const ALL: [Path; 3] = [Path::Unfused, Path::Fused, Path::Decode];

    /// The name used by the CLI.
    pub fn name(self) -> &'static str {
        match self {
            Path::Auto => "auto",
            Path::Unfused => "unfused",
            Path::Fused => "fused",
            Path::Decode => "decode",
        }
    }
}

impl std::str::FromStr for Path {
    type Err = Error;
    /// Parses the names [`Path::name`] gives: `auto`, `unfused`, `fused`, `decode`.
    fn from_str(s: &str) -> Result<Self> {
        std::iter::once(Path::Auto)
            .chain(Path::ALL)
            .find(|p| p.name() == s)
            .ok_or_else(|| Error::UnknownName {
                kind: "path",
                name: s.to_string(),
                expected: "auto, unfused, fused, decode",
            })
    }
}

/// Attention results on the host.
#[derive(Debug, Clone)]
pub struct Output {
    /// `[B, Hq, L, Ev]`, widened to f32 from the output's storage format (exact).
    pub output: Array4<f32>,
    /// Attention weights `[B, Hq, L, S]`, when requested with [`Sdpa::return_weights`].
    pub weights: Option<Array4<f32>>,
    /// Row logsumexp `[B, Hq, L]` (natural log; `-inf` on fully masked rows), when requested
    /// with [`Sdpa::return_lse`].
    pub lse: Option<Array3<f32>>,
}

/// Attention results left on the GPU by [`Sdpa::record`].
#[derive(Debug, Clone)]
pub struct GpuOutput {
    /// Buffer holding the output `[B, Hq, L, Ev]` (the caller's, if one was given, laid out as
    /// its tensor says: a layout or strides put the elements where they say).
    pub output: wgpu::Buffer,
    /// Byte offset of the output in [`GpuOutput::output`].
    pub output_offset: u64,
    /// Row logsumexp `[B, Hq, L]` (f32; the caller's buffer with [`Sdpa::lse_into`]). Always
    /// written: every path's kernels produce it on the way (4 bytes a row);
    /// [`Sdpa::return_lse`] only decides whether `run` reads it back.
    pub lse: wgpu::Buffer,
    /// Byte offset of the logsumexp in [`GpuOutput::lse`].
    pub lse_offset: u64,
    /// Attention weights `[B, Hq, L, S]`, when requested.
    pub weights: Option<wgpu::Buffer>,
    /// The validated problem.
    pub problem: Problem,
}

/// Scaled dot-product attention, `softmax(scale · Q Kᵀ + bias, masks) V`, PyTorch semantics.
///
/// q `[B, Hq, L, E]`, k `[B, Hkv, S, E]`, v `[B, Hkv, S, Ev]`; output `[B, Hq, L, Ev]`.
/// Build it, then [`run`](Sdpa::run) (async), [`run_blocking`](Sdpa::run_blocking), or
/// [`record`](Sdpa::record) into your own command encoder.
///
/// ```no_run
/// use ndarray::Array4;
/// use wgpu_attention::{Causal, Context, Sdpa};
/// let ctx = Context::new_blocking()?;
/// let q = Array4::<f32>::zeros((1, 8, 128, 64));
/// let k = Array4::<f32>::zeros((1, 8, 128, 64));
/// let v = Array4::<f32>::zeros((1, 8, 128, 64));
/// let out = Sdpa::new(&q, &k, &v).causal(Causal::TopLeft).run_blocking(&ctx)?;
/// assert_eq!(out.output.shape(), &[1, 8, 128, 64]);
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Sdpa<'a> {
    pub(crate) q: Tensor<'a>,
    pub(crate) k: Tensor<'a>,
    pub(crate) v: Tensor<'a>,
    pub(crate) options: Options<'a>,
    pub(crate) path: Path,
    pub(crate) weights: bool,
    pub(crate) lse: bool,
    pub(crate) max_scores_bytes: Option<u64>,
    /// The caller's output tensor (a GPU buffer), if any.
    pub(crate) out: Option<Tensor<'a>>,
    /// The caller's logsumexp tensor (a GPU buffer), if any.
    pub(crate) lse_out: Option<Tensor<'a>>,
    pub(crate) out_storage: Option<Storage>,
    /// User captures whose values a GPU buffer holds (capture index, f32 buffer with
    /// `COPY_SRC` of at least the capture's length): copied into the capture table when the
    /// call is recorded, after the stand-in values the user function was given (the attention
    /// variants' additive score reads its projections so).
    pub(crate) capture_buffers: Vec<(usize, &'a wgpu::Buffer)>,
    /// [`Problem`]'s `diag_shift` (a ring pair's; 0 else).
    pub(crate) diag_shift: i64,
    /// [`Problem`]'s `pos_offset` (a ring pair's chunk starts; [0, 0] else).
    pub(crate) pos_offset: [usize; 2],
    /// k and v are paged caches ([`Sdpa::paged`]), as checked when the call was built.
    pub(crate) paged: Option<Result<PagedKv>>,
    /// RoPE applied to q as the kernels read it ([`Sdpa::rope`]).
    pub(crate) rope: Option<crate::rope::Rope>,
}

impl<'a> Sdpa<'a> {
    /// Attention over q, k, v (host arrays/slices or GPU buffers, see [`Tensor`]).
    pub fn new(q: impl Into<Tensor<'a>>, k: impl Into<Tensor<'a>>, v: impl Into<Tensor<'a>>) -> Self {
        Sdpa {
            q: q.into(),
            k: k.into(),
            v: v.into(),
            options: Options::default(),
            path: Path::Auto,
            weights: false,
            lse: false,
            max_scores_bytes: None,
            out: None,
            lse_out: None,
            out_storage: None,
            capture_buffers: Vec::new(),
            diag_shift: 0,
            pos_offset: [0, 0],
            paged: None,
            rope: None,
        }
    }

    option_setters!();

    /// Rotate q by `rope` (RoPE) as the attention kernels read it: q holds un-rotated
    /// vectors, and the keys are expected rotated already (a [`KvCache`](crate::KvCache)
    /// rotates K as it appends; [`Rope::record`](crate::Rope::record) rotates a buffer). Query
    /// `i` of batch `b` is at position `kv_lens[b] - L + i` (a paged call's sequence lengths;
    /// `S - L + i` without key lengths): each batch's newest query is its last key's position.
    /// The angles are computed on the host in f64. Fused and decode paths only ([`Path::Unfused`]
    /// and the attention weights are refused), and not the backward.
    pub fn rope(mut self, rope: crate::rope::Rope) -> Self {
        self.rope = Some(rope);
        self
    }

    /// Force a path (default [`Path::Auto`]).
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }

    /// Also return the attention weights `[B, Hq, L, S]`.
    pub fn return_weights(mut self) -> Self {
        self.weights = true;
        self
    }

    /// Also return the per-row logsumexp `[B, Hq, L]`.
    pub fn return_lse(mut self) -> Self {
        self.lse = true;
        self
    }

    /// Cap the bytes of score matrix materialised at once by the unfused path (default: the
    /// device's largest storage binding). Smaller values trade speed for memory.
    pub fn max_scores_bytes(mut self, bytes: u64) -> Self {
        self.max_scores_bytes = Some(bytes);
        self
    }

    /// Write the output into a caller's GPU buffer: `out` is a
    /// [`Tensor::from_buffer`] of the output's shape `[B, Hq, L, Ev]` whose declared format is
    /// the output's format (so f16 inputs with an f32 buffer say so: no format is assumed).
    /// The buffer needs `STORAGE` (and `COPY_SRC` to read it back with [`run`](Sdpa::run)).
    /// Checked before any GPU work: host data, another shape, a format other than
    /// [`output_storage`](Sdpa::output_storage)'s, or a buffer too small are typed errors.
    pub fn output_into(mut self, out: Tensor<'a>) -> Self {
        self.out = Some(out);
        self
    }

    /// Write the row logsumexp `[B, Hq, L]` (f32, dense) into a caller's GPU buffer
    /// ([`Tensor::from_buffer`], `STORAGE` usage, at an offset that is a multiple of the
    /// device's `min_storage_buffer_offset_alignment`). With [`output_into`](Sdpa::output_into)
    /// too, a repeated call allocates nothing (see [`Context::set_cache_limits`]). Checked
    /// before any GPU work like the output.
    ///
    /// ```no_run
    /// # use wgpu_attention::{wgpu, Causal, Context, Sdpa, Storage, Tensor};
    /// # fn f(ctx: &Context, q: &wgpu::Buffer, k: &wgpu::Buffer, v: &wgpu::Buffer, out: &wgpu::Buffer, lse: &wgpu::Buffer, lens: &[usize]) -> Result<(), wgpu_attention::Error> {
    /// // One decode step of 4 sequences: everything in your buffers, nothing allocated.
    /// let mut encoder = ctx.device().create_command_encoder(&Default::default());
    /// Sdpa::new(
    ///     Tensor::from_buffer(q, Storage::F32, &[4, 8, 1, 64]),
    ///     Tensor::from_buffer(k, Storage::F32, &[4, 2, 4096, 64]),
    ///     Tensor::from_buffer(v, Storage::F32, &[4, 2, 4096, 64]),
    /// )
    /// .causal(Causal::BottomRight)
    /// .kv_lens(lens)
    /// .output_into(Tensor::from_buffer(out, Storage::F32, &[4, 8, 1, 64]))
    /// .lse_into(Tensor::from_buffer(lse, Storage::F32, &[4, 8, 1]))
    /// .record(ctx, &mut encoder)?;
    /// ctx.queue().submit([encoder.finish()]);
    /// # Ok(()) }
    /// ```
    ///
    /// [`Context::set_cache_limits`]: crate::Context::set_cache_limits
    pub fn lse_into(mut self, lse: Tensor<'a>) -> Self {
        self.lse_out = Some(lse);
        self
    }

    /// The caller's output buffer and byte offset, if one was given (validated by
    /// [`Sdpa::problem`]).
    pub(crate) fn out_buffer(&self) -> Option<(&'a wgpu::Buffer, u64)> {
        match self.out.as_ref().map(|t| &t.data) {
            Some(crate::tensor::TensorData::Gpu { buffer, offset, .. }) => Some((*buffer, *offset)),
            _ => None,
        }
    }

    /// The output's storage format (default: q's, or the format of the
    /// [`output_into`](Sdpa::output_into) tensor); host results are widened to f32 (exactly) on
    /// readback.
    pub fn output_storage(mut self, storage: Storage) -> Self {
        self.out_storage = Some(storage);
        self
    }

    /// Validate shapes and options into a [`Problem`] (no GPU work).
    pub fn problem(&self) -> Result<Problem> {
        let paged = self.paged.clone().transpose()?;
        let p = self.shaped(paged.as_ref())?;
        let out = self.check_outputs(&p)?;
        let mut p = p.with_storage(Formats {
            q: self.q.storage(),
            k: self.k.storage(),
            v: self.v.storage(),
            bias: self.options.bias.as_ref().map_or(Storage::F32, |b| b.storage()),
            out,
        });
        p.diag_shift = self.diag_shift;
        p.pos_offset = self.pos_offset;
        p.views = self.views(paged.as_ref())?;
        p.paged = paged.map(|pg| pg.paged);
        quant::check(&p, &self.k, &self.v)?;
        if let Some(rope) = self.rope {
            let d = rope.rotated_dims(p.head_dim)?;
            p.rope = Some((rope, d));
            p.views.q_rope = Some((d, rope.style == crate::rope::RopeStyle::HalfSplit));
        }
        Ok(p)
    }

    /// The options' problem over q, k and v's shapes (a paged call's logical ones).
    fn shaped(&self, paged: Option<&PagedKv>) -> Result<Problem> {
        let Some(pg) = paged else {
            return self.options.problem(&self.q.shape, &self.k.shape, &self.v.shape);
        };
        let bad = |reason: &str| {
            Err(Error::Paged {
                reason: reason.into(),
            })
        };
        if self.options.kv_lens.is_some() {
            return bad("seq_lens are the key lengths: do not also give kv_lens");
        }
        if self.options.causal == crate::problem::Causal::TopLeft {
            return bad(
                "queries are each sequence's newest positions: causal is Causal::BottomRight (by position)",
            );
        }
        let mut options = self.options.clone();
        options.kv_lens = Some(pg.lens.clone());
        options.problem(&self.q.shape, &pg.k_shape, &pg.v_shape)
    }

    /// The caller's output and logsumexp tensors checked against `p` (GPU buffers, shapes,
    /// formats, no overlap with an input): the output's format.
    fn check_outputs(&self, p: &Problem) -> Result<Storage> {
        let mut out = self.out_storage.unwrap_or(self.q.storage());
        if let Some(t) = &self.out {
            if !matches!(t.data, crate::tensor::TensorData::Gpu { .. }) {
                return Err(Error::BadBuffer {
                    tensor: "output",
                    reason: "output_into takes a GPU buffer (Tensor::from_buffer), not host data".into(),
                });
            }
            if t.shape != p.out_shape() {
                return Err(Error::ShapeMismatch {
                    tensor: "output",
                    expected: p.out_shape().to_vec(),
                    actual: t.shape.clone(),
                });
            }
            match self.out_storage {
                Some(s) if s != t.storage() => {
                    return Err(Error::StorageMismatch {
                        tensor: "output",
                        expected: s,
                        actual: t.storage(),
                        why: "output_storage and the output_into buffer's declared format must agree",
                    })
                }
                _ => out = t.storage(),
            }
        }
        if let Some(t) = &self.lse_out {
            check_lse(t, [p.batch, p.q_heads, p.seq_q])?;
        }
        let outputs: Vec<(&'static str, &Tensor)> =
            [("output", self.out.as_ref()), ("lse", self.lse_out.as_ref())]
                .into_iter()
                .filter_map(|(n, t)| t.map(|t| (n, t)))
                .collect();
        if !outputs.is_empty() {
            let mut inputs = vec![("q", &self.q), ("k", &self.k), ("v", &self.v)];
            if let Some(b) = &self.options.bias {
                inputs.push(("bias", b));
            }
            crate::device::buffers::check_aliasing(&outputs, &inputs)?;
        }
        Ok(out)
    }

    /// Where q, k, v, the output and the bias lie in their buffers (a paged call's caches as
    /// their checks found them).
    fn views(&self, paged: Option<&PagedKv>) -> Result<crate::view::Views> {
        let mut views = crate::view::Views {
            q: crate::tensor::of_tensor("q", &self.q)?,
            k: crate::tensor::of_tensor("k", &self.k)?,
            v: crate::tensor::of_tensor("v", &self.v)?,
            out: self
                .out
                .as_ref()
                .map(|t| crate::tensor::of_output("output", t))
                .transpose()?
                .flatten(),
            dout: None,
            bias: self
                .options
                .bias
                .as_ref()
                .map(crate::tensor::of_bias)
                .transpose()?
                .flatten(),
            paged: paged.map(|pg| pg.paged.block_size),
            q_rope: None,
        };
        if let Some(pg) = paged {
            [views.k, views.v] = pg.views.map(Some);
        }
        Ok(views)
    }

    /// The plan of this call on `ctx`: the concrete path ([`Path::Auto`] resolved), the form
    /// of its kernel and its tiles; or why a forced path (or a pinned form) cannot run it.
    pub fn plan(&self, ctx: &Context) -> Result<Plan> {
        let p = self.problem()?;
        Plan::new(&p, &self.request(), &ctx.caps())
    }

    /// The concrete path that runs this problem on `ctx` ([`Path::Auto`] resolved), or why
    /// a forced path cannot run it. Shorthand for `plan(ctx)?.path()`.
    pub fn resolved_path(&self, ctx: &Context) -> Result<Path> {
        Ok(self.plan(ctx)?.path())
    }

    pub(crate) fn request(&self) -> Request {
        Request {
            path: self.path,
            weights: self.weights,
            max_scores_bytes: self.max_scores_bytes,
        }
    }

    /// Bytes of GPU memory one call uses: q, k, v, masks, output and logsumexp, plus the path's
    /// temporaries (the unfused path's score chunk and weights, the decode path's partials).
    /// The fused path's total is linear in L and S.
    pub fn device_memory(&self, ctx: &Context) -> Result<u64> {
        let p = self.problem()?;
        let plan = Plan::new(&p, &self.request(), &ctx.caps())?;
        Ok(memory_of(&p, &plan, self.weights))
    }

    /// Run on the GPU and read the results back.
    pub async fn run(&self, ctx: &Context) -> Result<Output> {
        let gpu = ctx
            .submit("wgpu-attention sdpa", |encoder| self.record(ctx, encoder))
            .await?;
        let p = &gpu.problem;
        let output = read_output(ctx, &gpu).await?;
        let lse = if self.lse {
            let v = ctx
                .read_f32(&gpu.lse, gpu.lse_offset, f32_bytes(p.batch_heads() * p.seq_q))
                .await?;
            Some(Array3::from_shape_vec((p.batch, p.q_heads, p.seq_q), v).expect("lse length"))
        } else {
            None
        };
        let weights = match &gpu.weights {
            Some(w) => {
                let v = ctx.read_f32(w, 0, w.size()).await?;
                Some(Array4::from_shape_vec(p.score_shape(), v).expect("weights length"))
            }
            None => None,
        };
        Ok(Output { output, weights, lse })
    }

    /// Blocking version of [`run`](Sdpa::run).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run_blocking(&self, ctx: &Context) -> Result<Output> {
        pollster::block_on(self.run(ctx))
    }

    /// Upload host inputs (with `queue.write_buffer`, ordered before the encoder's commands once
    /// it is submitted) and record every dispatch into `encoder`. Nothing of the call is
    /// submitted (the one exception: the first fused call with a user `mask_mod` on a new
    /// source, captures or shape submits the pass that builds its block map, which the context
    /// then caches; it is ordered before your encoder); the results are in the returned
    /// buffers after the caller submits the encoder.
    pub fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<GpuOutput> {
        forward::record(self, ctx, encoder)
    }
}

impl GpuOutput {
    /// The bytes of [`GpuOutput::output`] the output occupies: from its offset over its
    /// elements, or, written through a view, from the 256-aligned byte below the offset over
    /// the elements the view reaches (where the call bound it). With the view, or the dense one.
    fn output_range(&self) -> (u64, usize, crate::view::View) {
        let p = &self.problem;
        let shape = p.out_shape();
        match p.views.out {
            None => (
                self.output_offset,
                shape.iter().product(),
                crate::view::View::dense(shape),
            ),
            Some(view) => (
                self.output_offset - self.output_offset % crate::view::BIND_ALIGN,
                view.extent(shape),
                view,
            ),
        }
    }

    /// The output bound as the call bound it (for a later stage: the backward's).
    pub(crate) fn output_binding(&self) -> wgpu::BufferBinding<'_> {
        let (start, elems, _) = self.output_range();
        binding(&self.output, start, self.problem.storage.out.bytes(elems))
    }
}

/// The output of a recorded call read back `[B, Hq, L, Ev]` (through its view, when it was
/// written through one) and widened to f32.
pub(crate) async fn read_output(ctx: &Context, gpu: &GpuOutput) -> Result<Array4<f32>> {
    let (start, elems, view) = gpu.output_range();
    let all = ctx
        .read_as_f32(&gpu.output, start, elems, gpu.problem.storage.out)
        .await?;
    let [sb, sh, ss, _] = view.strides;
    Ok(Array4::from_shape_fn(gpu.problem.out_shape(), |(b, h, i, e)| {
        all[view.offset + b * sb + h * sh + i * ss + e]
    }))
}

/// The caller's logsumexp tensor `t`: a dense f32 GPU buffer of shape `want` `[B, Hq, L]`.
fn check_lse(t: &Tensor, want: [usize; 3]) -> Result<()> {
    let bad = |reason: &str| {
        Err(Error::BadBuffer {
            tensor: "lse",
            reason: reason.into(),
        })
    };
    if !matches!(t.data, crate::tensor::TensorData::Gpu { .. }) {
        return bad("lse_into takes a GPU buffer (Tensor::from_buffer), not host data");
    }
    if t.view.is_set() {
        return bad("the logsumexp is written dense [B, Hq, L]: no layout, capacity or strides");
    }
    if t.shape != want {
        return Err(Error::ShapeMismatch {
            tensor: "lse",
            expected: want.to_vec(),
            actual: t.shape.clone(),
        });
    }
    if t.storage() != Storage::F32 {
        return Err(Error::StorageMismatch {
            tensor: "lse",
            expected: Storage::F32,
            actual: t.storage(),
            why: "the logsumexp is f32",
        });
    }
    Ok(())
}

/// [`Sdpa::device_memory`] of a planned problem.
pub(crate) fn memory_of(p: &Problem, plan: &Plan, weights: bool) -> u64 {
    let bytes = shape_bytes;
    let fmt = |s: Storage, shape: &[usize]| s.bytes(shape.iter().product());
    let f = p.storage;
    let mut total = fmt(f.q, &p.q_shape())
        + fmt(f.k, &p.k_shape())
        + fmt(f.v, &p.v_shape())
        + fmt(f.out, &p.out_shape())
        + bytes(&[p.batch_heads(), p.seq_q]);
    if let Some(m) = p.mask {
        let [b, h, l, _] = m.shape;
        total += bytes(&[b, h, l, p.seq_kv.div_ceil(32)]);
    }
    if let Some(b) = p.bias {
        total += fmt(f.bias, &b.shape);
    }
    if p.kv_lens.is_some() {
        total += bytes(&[p.batch]);
    }
    match &plan.kernel {
        Kernel::Unfused(chunks) => {
            total += bytes(&[chunks.heads, chunks.rows, p.seq_kv]);
            if weights {
                total += bytes(&p.score_shape());
            }
        }
        Kernel::Decode(c) => {
            total += bytes(&[c.splits, p.batch_heads() * p.seq_q, p.head_dim_v + 1]);
        }
        Kernel::Fused(_) => {}
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path parses from its own name (the CLI once mapped "decode" to auto).
    #[test]
    fn every_path_parses_from_its_name() {
        for path in std::iter::once(Path::Auto).chain(Path::ALL) {
            assert_eq!(path.name().parse::<Path>(), Ok(path));
        }
        assert!(matches!(
            "flash".parse::<Path>(),
            Err(Error::UnknownName { kind: "path", .. })
        ));
    }
}
