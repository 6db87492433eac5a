//! The public entry point, [`Sdpa`], and path selection.

use std::num::NonZeroU64;

use ndarray::{Array3, Array4};
use wgpu::util::DeviceExt;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::kernels::{decode, flash, matmul, softmax, MaskParams};
use crate::problem::{Causal, Problem};
use crate::tensor::{Mask, Tensor, TensorData};

/// Which implementation runs the attention.
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
    /// `[B, Hq, L, Ev]`.
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
    /// Buffer holding the output `[B, Hq, L, Ev]` (the caller's, if one was given).
    pub output: wgpu::Buffer,
    /// Byte offset of the output in [`GpuOutput::output`].
    pub output_offset: u64,
    /// Row logsumexp `[B, Hq, L]`.
    pub lse: wgpu::Buffer,
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
    q: Tensor<'a>,
    k: Tensor<'a>,
    v: Tensor<'a>,
    mask: Option<Mask<'a>>,
    bias: Option<Tensor<'a>>,
    kv_lens: Option<Vec<usize>>,
    causal: Causal,
    scale: Option<f32>,
    path: Path,
    weights: bool,
    lse: bool,
    max_scores_bytes: Option<u64>,
    out_buffer: Option<(&'a wgpu::Buffer, u64)>,
}

impl<'a> Sdpa<'a> {
    /// Attention over q, k, v (host arrays/slices or GPU buffers, see [`Tensor`]).
    pub fn new(q: impl Into<Tensor<'a>>, k: impl Into<Tensor<'a>>, v: impl Into<Tensor<'a>>) -> Self {
        Sdpa {
            q: q.into(),
            k: k.into(),
            v: v.into(),
            mask: None,
            bias: None,
            kv_lens: None,
            causal: Causal::None,
            scale: None,
            path: Path::Auto,
            weights: false,
            lse: false,
            max_scores_bytes: None,
            out_buffer: None,
        }
    }

    /// Causal masking with the given alignment.
    pub fn causal(mut self, causal: Causal) -> Self {
        self.causal = causal;
        self
    }

    /// The softmax scale (default `1/sqrt(E)`; `1.0` gives the unscaled dot product).
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// A boolean mask, true = may attend, broadcastable to `[B, Hq, L, S]`.
    pub fn mask(mut self, mask: impl Into<Mask<'a>>) -> Self {
        self.mask = Some(mask.into());
        self
    }

    /// An additive bias added to the scaled scores, broadcastable to `[B, Hq, L, S]`.
    /// A `-inf` entry masks that key.
    pub fn bias(mut self, bias: impl Into<Tensor<'a>>) -> Self {
        self.bias = Some(bias.into());
        self
    }

    /// Per-batch key lengths (padding): batch `b` attends keys `j < kv_lens[b]` only.
    pub fn kv_lens(mut self, lens: &[usize]) -> Self {
        self.kv_lens = Some(lens.to_vec());
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

    /// Write the output into a caller's buffer (needs `STORAGE`; `COPY_SRC` to read it back
    /// with [`run`](Sdpa::run)) at byte `offset`.
    pub fn output_buffer(mut self, buffer: &'a wgpu::Buffer, offset: u64) -> Self {
        self.out_buffer = Some((buffer, offset));
        self
    }

    /// Validate shapes and options into a [`Problem`] (no GPU work).
    pub fn problem(&self) -> Result<Problem> {
        let mut p = Problem::new(&self.q.shape, &self.k.shape, &self.v.shape)?
            .with_scale(self.scale)?
            .with_causal(self.causal);
        if let Some(m) = &self.mask {
            p = p.with_mask(&m.shape)?;
            check_len("mask", &m.shape, m.data.len())?;
        }
        if let Some(b) = &self.bias {
            p = p.with_bias(&b.shape)?;
        }
        if let Some(l) = &self.kv_lens {
            p = p.with_kv_lens(l)?;
        }
        Ok(p)
    }

    /// The concrete path that runs this problem on `ctx` ([`Path::Auto`] resolved), or why
    /// a forced path cannot run it.
    pub fn resolved_path(&self, ctx: &Context) -> Result<Path> {
        let p = self.problem()?;
        self.resolve(ctx, &p)
    }

    fn resolve(&self, ctx: &Context, p: &Problem) -> Result<Path> {
        let fused_ok = flash::Config::new(p, ctx.limits(), ctx.is_cpu(), ctx.fixed_subgroup_size()).is_some();
        let decode_ok = p.seq_q <= decode::MAX_ROWS && p.seq_kv >= decode::MIN_KEYS;
        match self.path {
            Path::Auto if !self.weights && decode_ok => Ok(Path::Decode),
            Path::Auto if !self.weights && fused_ok => Ok(Path::Fused),
            Path::Decode if self.weights => Err(Error::Unsupported {
                path: "decode",
                reason: "it never materialises the attention weights; use Path::Unfused or Path::Auto".into(),
            }),
            Path::Auto => Ok(Path::Unfused),
            Path::Fused if self.weights => Err(Error::Unsupported {
                path: "fused",
                reason: "it never materialises the attention weights; use Path::Unfused or Path::Auto".into(),
            }),
            Path::Fused if !fused_ok => Err(Error::Unsupported {
                path: "fused",
                reason: format!(
                    "head dims E = {}, Ev = {} exceed 256 (or the device lacks 64 invocations / 2 KiB of \
                     workgroup memory); Path::Auto falls back to Path::Unfused",
                    p.head_dim, p.head_dim_v
                ),
            }),
            other => Ok(other),
        }
    }

    /// Bytes of GPU memory one call uses: q, k, v, masks, output and logsumexp, plus the path's
    /// temporaries (the unfused path's score chunk and weights, the decode path's partials).
    /// The fused path's total is linear in L and S.
    pub fn device_memory(&self, ctx: &Context) -> Result<u64> {
        let p = self.problem()?;
        let path = self.resolve(ctx, &p)?;
        let bytes = |shape: &[usize]| shape.iter().product::<usize>() as u64 * 4;
        let mut total = bytes(&p.q_shape())
            + bytes(&p.k_shape())
            + bytes(&p.v_shape())
            + bytes(&p.out_shape())
            + bytes(&[p.batch_heads(), p.seq_q]);
        if let Some(m) = p.mask {
            let [b, h, l, _] = m.shape;
            total += bytes(&[b, h, l, p.seq_kv.div_ceil(32)]);
        }
        if let Some(b) = p.bias {
            total += bytes(&b.shape);
        }
        if p.kv_lens.is_some() {
            total += bytes(&[p.batch]);
        }
        match path {
            Path::Unfused => {
                let max_binding = ctx.max_binding();
                let budget = self.max_scores_bytes.unwrap_or(max_binding).min(max_binding);
                let plan = ChunkPlan::new(&p, budget, ctx.limits())?;
                total += bytes(&[plan.heads, plan.rows, p.seq_kv]);
                if self.weights {
                    total += bytes(&p.score_shape());
                }
            }
            Path::Decode => {
                let (_, splits) = decode::split(&p);
                total += bytes(&[splits, p.batch_heads() * p.seq_q, p.head_dim_v + 1]);
            }
            Path::Fused | Path::Auto => {}
        }
        Ok(total)
    }

    /// Run on the GPU and read the results back.
    pub async fn run(&self, ctx: &Context) -> Result<Output> {
        let gpu = ctx
            .scoped(|| {
                let mut encoder = ctx
                    .device()
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                        label: Some("wgpu-attention sdpa"),
                    });
                let out = self.record(ctx, &mut encoder)?;
                ctx.queue().submit([encoder.finish()]);
                Ok(out)
            })
            .await?;
        let p = &gpu.problem;
        let out_len = p.out_shape().iter().product::<usize>() as u64 * 4;
        let output = ctx.read_f32(&gpu.output, gpu.output_offset, out_len).await?;
        let output = Array4::from_shape_vec(p.out_shape(), output).expect("output length");
        let lse = if self.lse {
            let v = ctx
                .read_f32(&gpu.lse, 0, (p.batch_heads() * p.seq_q) as u64 * 4)
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
    /// it is submitted) and record every dispatch into `encoder`. Nothing is submitted; the
    /// results are in the returned buffers after the caller submits the encoder.
    pub fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<GpuOutput> {
        let p = self.problem()?;
        let path = self.resolve(ctx, &p)?;
        let limits = ctx.limits();
        let max_binding = ctx.max_binding();
        let device = ctx.device();

        // Validate every size against the device before creating anything.
        let q = Operand::check(ctx, "q", &self.q)?;
        let k = Operand::check(ctx, "k", &self.k)?;
        let v = Operand::check(ctx, "v", &self.v)?;
        let bias = self
            .bias
            .as_ref()
            .map(|b| Operand::check(ctx, "bias", b))
            .transpose()?;
        let out_bytes = p.out_shape().iter().product::<usize>() as u64 * 4;
        fits(
            "output",
            out_bytes,
            max_binding,
            "max_storage_buffer_binding_size",
        )?;
        if let Some((buf, off)) = self.out_buffer {
            check_gpu_buffer(ctx, "output", buf, off, out_bytes)?;
        }
        let weights_bytes = (p.batch_heads() * p.seq_q * p.seq_kv) as u64 * 4;
        if self.weights {
            fits(
                "attention weights",
                weights_bytes,
                limits.max_buffer_size,
                "max_buffer_size",
            )?;
        }
        let packed_mask = self.mask.as_ref().map(|m| pack_mask(&p, m));
        if let Some((words, _)) = &packed_mask {
            fits(
                "packed mask",
                words.len() as u64 * 4,
                max_binding,
                "max_storage_buffer_binding_size",
            )?;
        }
        let plan = match path {
            Path::Unfused => Some(ChunkPlan::new(
                &p,
                self.max_scores_bytes.unwrap_or(max_binding).min(max_binding),
                limits,
            )?),
            _ => None,
        };

        // Buffers.
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        let q = q.upload(ctx, "q");
        let k = k.upload(ctx, "k");
        let v = v.upload(ctx, "v");
        let bias = bias.map(|b| b.upload(ctx, "bias"));
        let storage_init = |label: &str, contents: &[u8]| {
            device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: wgpu::BufferUsages::STORAGE,
            })
        };
        let dummy = storage_init("wgpu-attention dummy", &[0u8; 16]);
        let mask_buf = packed_mask
            .as_ref()
            .map(|(w, _)| storage_init("mask", bytemuck::cast_slice(w)));
        let lens_buf = p
            .kv_lens
            .as_ref()
            .map(|l| storage_init("kv_lens", bytemuck::cast_slice(l)));
        let (out_buf, out_off) = match self.out_buffer {
            Some((b, off)) => (b.clone(), off),
            None => (
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("output"),
                    size: out_bytes,
                    usage,
                    mapped_at_creation: false,
                }),
                0,
            ),
        };
        let lse_buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("lse"),
            size: (p.batch_heads() * p.seq_q) as u64 * 4,
            usage,
            mapped_at_creation: false,
        });
        let weights_buf = self.weights.then(|| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("weights"),
                size: weights_bytes,
                usage,
                mapped_at_creation: false,
            })
        });

        let io = Io {
            q: q.binding(),
            k: k.binding(),
            v: v.binding(),
            bias: bias.as_ref().map(|b| b.binding()),
            mask: mask_buf.as_ref().map(|b| (b, packed_mask.as_ref().unwrap().1)),
            lens: lens_buf.as_ref(),
            out: binding(&out_buf, out_off, out_bytes),
            lse: &lse_buf,
            weights: weights_buf.as_ref(),
            dummy: &dummy,
        };
        match (path, plan) {
            (Path::Unfused, Some(plan)) => record_unfused(ctx, encoder, &p, &plan, &io)?,
            (Path::Decode, _) => record_decode(ctx, encoder, &p, &io)?,
            _ => record_fused(ctx, encoder, &p, &io)?,
        }
        Ok(GpuOutput {
            output: out_buf,
            output_offset: out_off,
            lse: lse_buf,
            weights: weights_buf,
            problem: p,
        })
    }
}

fn check_len(tensor: &'static str, shape: &[usize], actual: usize) -> Result<()> {
    let expected: usize = shape.iter().product();
    if expected != actual {
        return Err(Error::DataLength {
            tensor,
            shape: shape.to_vec(),
            expected,
            actual,
        });
    }
    Ok(())
}

pub(crate) fn fits(what: &str, bytes: u64, limit: u64, limit_name: &'static str) -> Result<()> {
    if bytes > limit {
        return Err(Error::TooLargeForDevice {
            what: what.to_string(),
            bytes,
            limit_name,
            limit,
            hint: "",
        });
    }
    Ok(())
}

fn check_gpu_buffer(
    ctx: &Context,
    tensor: &'static str,
    buf: &wgpu::Buffer,
    offset: u64,
    bytes: u64,
) -> Result<()> {
    let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
    let bad = |reason: String| Err(Error::BadBuffer { tensor, reason });
    if !buf.usage().contains(wgpu::BufferUsages::STORAGE) {
        return bad(format!("usage {:?} lacks STORAGE", buf.usage()));
    }
    if !offset.is_multiple_of(align) {
        return bad(format!(
            "offset {offset} is not a multiple of min_storage_buffer_offset_alignment ({align})"
        ));
    }
    if offset.checked_add(bytes).is_none_or(|end| end > buf.size()) {
        return bad(format!(
            "needs {bytes} bytes at offset {offset}, buffer has {}",
            buf.size()
        ));
    }
    Ok(())
}

pub(crate) fn binding(buf: &wgpu::Buffer, offset: u64, bytes: u64) -> wgpu::BufferBinding<'_> {
    wgpu::BufferBinding {
        buffer: buf,
        offset,
        size: NonZeroU64::new(bytes),
    }
}

/// A validated input, before upload.
pub(crate) struct Operand<'t, 'a> {
    tensor: &'t Tensor<'a>,
    bytes: u64,
}

/// An input on the GPU: our upload, or the caller's buffer.
pub(crate) enum Uploaded<'a> {
    Owned(wgpu::Buffer, u64),
    Borrowed(&'a wgpu::Buffer, u64, u64),
}

impl<'t, 'a> Operand<'t, 'a> {
    pub(crate) fn check(ctx: &Context, name: &'static str, t: &'t Tensor<'a>) -> Result<Self> {
        let elems: usize = t.shape.iter().product();
        let bytes = elems as u64 * 4;
        match &t.data {
            TensorData::Host(d) => check_len(name, &t.shape, d.len())?,
            TensorData::Gpu { buffer, offset } => check_gpu_buffer(ctx, name, buffer, *offset, bytes)?,
        }
        fits(name, bytes, ctx.max_binding(), "max_storage_buffer_binding_size")?;
        Ok(Operand { tensor: t, bytes })
    }

    pub(crate) fn upload(&self, ctx: &Context, label: &str) -> Uploaded<'a> {
        match &self.tensor.data {
            TensorData::Host(d) => Uploaded::Owned(
                ctx.device()
                    .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                        label: Some(label),
                        contents: bytemuck::cast_slice(d),
                        usage: wgpu::BufferUsages::STORAGE,
                    }),
                self.bytes,
            ),
            TensorData::Gpu { buffer, offset } => Uploaded::Borrowed(buffer, *offset, self.bytes),
        }
    }
}

impl Uploaded<'_> {
    pub(crate) fn binding(&self) -> wgpu::BufferBinding<'_> {
        match self {
            Uploaded::Owned(b, bytes) => binding(b, 0, *bytes),
            Uploaded::Borrowed(b, off, bytes) => binding(b, *off, *bytes),
        }
    }
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

/// Everything bound by the kernels of one attention call.
struct Io<'b> {
    q: wgpu::BufferBinding<'b>,
    k: wgpu::BufferBinding<'b>,
    v: wgpu::BufferBinding<'b>,
    bias: Option<wgpu::BufferBinding<'b>>,
    mask: Option<(&'b wgpu::Buffer, [u32; 3])>,
    lens: Option<&'b wgpu::Buffer>,
    out: wgpu::BufferBinding<'b>,
    lse: &'b wgpu::Buffer,
    weights: Option<&'b wgpu::Buffer>,
    dummy: &'b wgpu::Buffer,
}

impl<'b> Io<'b> {
    /// The mask, bias and key-length bindings, with the dummy buffer where one is absent.
    fn mask_bindings(&self) -> [wgpu::BufferBinding<'b>; 3] {
        [
            self.mask
                .map_or(self.dummy, |(b, _)| b)
                .as_entire_buffer_binding(),
            self.bias.clone().unwrap_or(self.dummy.as_entire_buffer_binding()),
            self.lens.unwrap_or(self.dummy).as_entire_buffer_binding(),
        ]
    }

    /// q, k, v, then [`Io::mask_bindings`]: the inputs of the fused and decode kernels.
    fn inputs(&self) -> [wgpu::BufferBinding<'b>; 6] {
        let [mask, bias, lens] = self.mask_bindings();
        [self.q.clone(), self.k.clone(), self.v.clone(), mask, bias, lens]
    }

    /// The kernels' mask parameters for `p`.
    fn mask_params(&self, p: &Problem) -> MaskParams {
        MaskParams::new(p, self.mask.map(|(_, st)| st))
    }
}

/// How the unfused path splits the score matrix `[B·Hq, L, S]` so one chunk fits a binding:
/// whole heads at a time when `L·S` fits, else row blocks of one head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkPlan {
    /// Batch-heads per chunk.
    pub heads: usize,
    /// Query rows per chunk (`L` unless `heads == 1`).
    pub rows: usize,
}

impl ChunkPlan {
    pub(crate) fn new(p: &Problem, budget_bytes: u64, limits: &wgpu::Limits) -> Result<Self> {
        let max_grid = limits.max_compute_workgroups_per_dimension as usize;
        let tile = matmul::TILE as usize;
        let budget = (budget_bytes / 4) as usize;
        let (l, s) = (p.seq_q, p.seq_kv);
        if s > max_grid * tile {
            return Err(Error::TooLargeForDevice {
                what: format!("key length S = {s}"),
                bytes: s as u64 * 4,
                limit_name: "max_compute_workgroups_per_dimension",
                limit: (max_grid * tile) as u64 * 4,
                hint: " (S may be at most 64 x max_compute_workgroups_per_dimension)",
            });
        }
        if s > budget {
            return Err(Error::TooLargeForDevice {
                what: format!("one row of scores (S = {s})"),
                bytes: s as u64 * 4,
                limit_name: "max_storage_buffer_binding_size",
                limit: budget_bytes,
                hint: "; even the smallest chunk of the unfused path does not fit",
            });
        }
        let max_rows = (max_grid * tile).min(l);
        if l * s <= budget && l <= max_rows {
            let heads = (budget / (l * s)).min(p.batch_heads()).min(max_grid);
            Ok(ChunkPlan { heads, rows: l })
        } else {
            Ok(ChunkPlan {
                heads: 1,
                rows: (budget / s).min(max_rows),
            })
        }
    }
}

fn record_unfused(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    plan: &ChunkPlan,
    io: &Io,
) -> Result<()> {
    let (l, s, e, ev) = (
        p.seq_q as u32,
        p.seq_kv as u32,
        p.head_dim as u32,
        p.head_dim_v as u32,
    );
    let bh = p.batch_heads();
    let scores_elems = plan.heads * plan.rows * p.seq_kv;
    let scores = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("scores chunk"),
        size: scores_elems as u64 * 4,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let masks = io.mask_params(p);
    for z0 in (0..bh).step_by(plan.heads) {
        let nz = plan.heads.min(bh - z0);
        for i0 in (0..p.seq_q).step_by(plan.rows) {
            let lc = plan.rows.min(p.seq_q - i0);
            let chunk_bytes = (nz * lc * p.seq_kv) as u64 * 4;
            let sc = binding(&scores, 0, chunk_bytes);
            // 1. scores = scale * Q K^T
            matmul::Matmul {
                a: io.q.clone(),
                b: io.k.clone(),
                bias: None,
                c: sc.clone(),
                params: matmul::Params {
                    m: lc as u32,
                    n: s,
                    k: e,
                    heads: p.q_heads as u32,
                    group: p.group() as u32,
                    a_z0: z0 as u32,
                    b_z0: z0 as u32,
                    c_z0: 0,
                    a_batch: l * e,
                    a_row: e,
                    a_off: i0 as u32 * e,
                    b_batch: s * e,
                    b_row: e,
                    c_batch: lc as u32 * s,
                    c_row: s,
                    c_off: 0,
                    alpha: p.scale,
                    _pad: [0; 3],
                },
                batch: nz as u32,
                trans_b: true,
            }
            .record(ctx, encoder, io.dummy)?;
            // 2. masked softmax in place, logsumexp out
            let [mask, bias, lens] = io.mask_bindings();
            softmax::record(
                ctx,
                encoder,
                [sc.clone(), mask, bias, lens, io.lse.as_entire_buffer_binding()],
                &softmax::Params {
                    rows: lc as u32,
                    total: (nz * lc) as u32,
                    s,
                    l,
                    z0: z0 as u32,
                    i0: i0 as u32,
                    heads: p.q_heads as u32,
                    masks,
                    _pad0: 0,
                },
            )?;
            // 3. the weights, if asked for: this chunk is one contiguous block of [BH, L, S]
            if let Some(w) = io.weights {
                let dst = ((z0 * p.seq_q + i0) * p.seq_kv) as u64 * 4;
                encoder.copy_buffer_to_buffer(&scores, 0, w, dst, chunk_bytes);
            }
            // 4. O = P V
            matmul::Matmul {
                a: sc,
                b: io.v.clone(),
                bias: None,
                c: io.out.clone(),
                params: matmul::Params {
                    m: lc as u32,
                    n: ev,
                    k: s,
                    heads: p.q_heads as u32,
                    group: p.group() as u32,
                    a_z0: 0,
                    b_z0: z0 as u32,
                    c_z0: z0 as u32,
                    a_batch: lc as u32 * s,
                    a_row: s,
                    a_off: 0,
                    b_batch: s * ev,
                    b_row: ev,
                    c_batch: l * ev,
                    c_row: ev,
                    c_off: i0 as u32 * ev,
                    alpha: 1.0,
                    _pad: [0; 3],
                },
                batch: nz as u32,
                trans_b: false,
            }
            .record(ctx, encoder, io.dummy)?;
        }
    }
    Ok(())
}

fn record_fused(ctx: &Context, encoder: &mut wgpu::CommandEncoder, p: &Problem, io: &Io) -> Result<()> {
    let cfg = flash::Config::new(p, ctx.limits(), ctx.is_cpu(), ctx.fixed_subgroup_size())
        .expect("resolve() checked the fused config")
        .for_now(ctx);
    let q_tiles = (p.seq_q as u32).div_ceil(cfg.rows());
    let total = q_tiles as u64 * p.batch_heads() as u64;
    let max = ctx.limits().max_compute_workgroups_per_dimension as u64;
    if total > max * max {
        return Err(Error::TooLargeForDevice {
            what: format!("fused dispatch of {total} workgroups"),
            bytes: 0,
            limit_name: "max_compute_workgroups_per_dimension",
            limit: max,
            hint: " (squared)",
        });
    }
    let [q, k, v, mask, bias, lens] = io.inputs();
    flash::record(
        ctx,
        encoder,
        &cfg,
        [
            q,
            k,
            v,
            mask,
            bias,
            lens,
            io.out.clone(),
            io.lse.as_entire_buffer_binding(),
        ],
        &flash::Params {
            l: p.seq_q as u32,
            s: p.seq_kv as u32,
            e: p.head_dim as u32,
            ev: p.head_dim_v as u32,
            heads: p.q_heads as u32,
            group: p.group() as u32,
            q_tiles,
            total: total as u32,
            scale: p.scale,
            masks: io.mask_params(p),
            _pad: [0; 3],
        },
    )
}

fn record_decode(ctx: &Context, encoder: &mut wgpu::CommandEncoder, p: &Problem, io: &Io) -> Result<()> {
    let (chunk, splits) = decode::split(p);
    let rows = p.batch_heads() * p.seq_q;
    let part_bytes = (splits * rows * p.head_dim_v) as u64 * 4;
    fits(
        "decode partial outputs",
        part_bytes,
        ctx.max_binding(),
        "max_storage_buffer_binding_size",
    )?;
    let total = splits as u64 * rows as u64;
    let max = ctx.limits().max_compute_workgroups_per_dimension as u64;
    fits(
        "decode workgroups",
        total,
        max * max,
        "max_compute_workgroups_per_dimension (squared)",
    )?;
    let device = ctx.device();
    let part = |label: &str, bytes: u64| {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let part_out = part("decode partial outputs", part_bytes);
    let part_lse = part("decode partial lse", (splits * rows) as u64 * 4);
    let [q, k, v, mask, bias, lens] = io.inputs();
    decode::record_decode(
        ctx,
        encoder,
        p,
        [
            q,
            k,
            v,
            mask,
            bias,
            lens,
            part_out.as_entire_buffer_binding(),
            part_lse.as_entire_buffer_binding(),
        ],
        &decode::Params {
            l: p.seq_q as u32,
            s: p.seq_kv as u32,
            e: p.head_dim as u32,
            ev: p.head_dim_v as u32,
            heads: p.q_heads as u32,
            group: p.group() as u32,
            splits: splits as u32,
            total: total as u32,
            scale: p.scale,
            masks: io.mask_params(p),
            chunk: chunk as u32,
            _pad: [0; 2],
        },
    )?;
    decode::record_merge(
        ctx,
        encoder,
        [
            part_out.as_entire_buffer_binding(),
            part_lse.as_entire_buffer_binding(),
            io.out.clone(),
            io.lse.as_entire_buffer_binding(),
        ],
        &decode::MergeParams {
            rows: rows as u32,
            splits: splits as u32,
            ev: p.head_dim_v as u32,
            _pad: 0,
        },
    )
}

/// Combine two partial attention results computed over disjoint key sets (the rule behind
/// split-K decoding, sequence-parallel and ring attention):
/// `lse = logaddexp(lse1, lse2)`, `o = (e^{lse1} o1 + e^{lse2} o2) / e^{lse}`.
/// o `[B, H, L, Ev]`, lse `[B, H, L]`; a part with `lse = -inf` (no allowed key) contributes
/// nothing, and two empty parts give 0 and `-inf`. Runs on the GPU.
pub async fn merge(
    ctx: &Context,
    o1: &Array4<f32>,
    lse1: &Array3<f32>,
    o2: &Array4<f32>,
    lse2: &Array3<f32>,
) -> Result<(Array4<f32>, Array3<f32>)> {
    let shape = o1.shape().to_vec();
    if shape.contains(&0) {
        return Err(Error::ZeroSized { tensor: "o1", shape });
    }
    let (b, h, l, ev) = o1.dim();
    for (name, s) in [("o2", o2.shape())] {
        if s != shape.as_slice() {
            return Err(Error::ShapeMismatch {
                tensor: name,
                expected: shape.clone(),
                actual: s.to_vec(),
            });
        }
    }
    for (name, s) in [("lse1", lse1.shape()), ("lse2", lse2.shape())] {
        if s != [b, h, l] {
            return Err(Error::ShapeMismatch {
                tensor: name,
                expected: vec![b, h, l],
                actual: s.to_vec(),
            });
        }
    }
    let rows = b * h * l;
    let out_bytes = (rows * ev) as u64 * 4;
    fits(
        "merge inputs",
        2 * out_bytes,
        ctx.max_binding(),
        "max_storage_buffer_binding_size",
    )?;
    let parts: Vec<f32> = o1.iter().chain(o2.iter()).copied().collect();
    let lses: Vec<f32> = lse1.iter().chain(lse2.iter()).copied().collect();
    let device = ctx.device();
    let (out, lse) = ctx
        .scoped(|| {
            let init = |label: &str, data: &[f32]| {
                device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: bytemuck::cast_slice(data),
                    usage: wgpu::BufferUsages::STORAGE,
                })
            };
            let out_buf = |label: &str, bytes: u64| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: bytes,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                })
            };
            let (po, pl) = (init("merge parts", &parts), init("merge lse parts", &lses));
            let (out, lse) = (
                out_buf("merged output", out_bytes),
                out_buf("merged lse", rows as u64 * 4),
            );
            let mut encoder =
                device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("merge") });
            decode::record_merge(
                ctx,
                &mut encoder,
                [
                    po.as_entire_buffer_binding(),
                    pl.as_entire_buffer_binding(),
                    out.as_entire_buffer_binding(),
                    lse.as_entire_buffer_binding(),
                ],
                &decode::MergeParams {
                    rows: rows as u32,
                    splits: 2,
                    ev: ev as u32,
                    _pad: 0,
                },
            )?;
            ctx.queue().submit([encoder.finish()]);
            Ok((out, lse))
        })
        .await?;
    let o = ctx.read_f32(&out, 0, out_bytes).await?;
    let s = ctx.read_f32(&lse, 0, rows as u64 * 4).await?;
    Ok((
        Array4::from_shape_vec((b, h, l, ev), o).expect("merged output length"),
        Array3::from_shape_vec((b, h, l), s).expect("merged lse length"),
    ))
}

/// Blocking version of [`merge`].
#[cfg(not(target_arch = "wasm32"))]
pub fn merge_blocking(
    ctx: &Context,
    o1: &Array4<f32>,
    lse1: &Array3<f32>,
    o2: &Array4<f32>,
    lse2: &Array3<f32>,
) -> Result<(Array4<f32>, Array3<f32>)> {
    pollster::block_on(merge(ctx, o1, lse1, o2, lse2))
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
