//! The backward pass of [`Sdpa`]: [`Backward`] (from [`Sdpa::backward`]) computes dQ, dK, dV
//! and d(bias) for an upstream gradient dO, from the forward's output O and logsumexp (the
//! caller's, or a forward it runs itself).
//!
//! | path | kernels (`src/kernels/backward.rs`, `shaders/bwd_*.wgsl`) |
//! |---|---|
//! | [`Path::Fused`] | `bwd_prep` (lse, D), `bwd_dkv` (key-major), `bwd_dq` (query-major), `bwd_dbias` |
//! | [`Path::Unfused`] | `bwd_prep`; per chunk of scores `matmul` (S, dP), `bwd_ds`, `matmul` (dQ, dV, dK); `bwd_dbias` |

use ndarray::{Array3, Array4, ArrayD, IxDyn};

use crate::buffers::{binding, dummy, f32_bytes, fits, output, scratch, Operand};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::forms::Caps;
use crate::kernels::{backward as kb, matmul, permute};
use crate::problem::Problem;
use crate::storage::{Formats, Storage};
use crate::tensor::Tensor;

use super::forward::pack_mask;
use super::plan::ChunkPlan;
use super::{GpuOutput, Path, Sdpa};

/// The backward of one attention call: gradients of a loss with respect to q, k, v and the
/// bias, given the upstream gradient dO `[B, Hq, L, Ev]`. From [`Sdpa::backward`].
///
/// By default it runs the forward first and keeps what the backward needs (O and the
/// logsumexp, returned in [`Grads`]). With [`Backward::saved`] it takes them from the caller
/// instead, as computed elsewhere (a ring of devices passes the global O and logsumexp).
///
/// ```no_run
/// use ndarray::Array4;
/// use wgpu_attention::{Causal, Context, Sdpa};
/// let ctx = Context::new_blocking()?;
/// let q = Array4::<f32>::zeros((1, 8, 128, 64));
/// let (k, v) = (q.clone(), q.clone());
/// let dout = Array4::<f32>::ones((1, 8, 128, 64));
/// let g = Sdpa::new(&q, &k, &v).causal(Causal::TopLeft).backward(&dout).run_blocking(&ctx)?;
/// assert_eq!(g.dk.shape(), &[1, 8, 128, 64]);
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Backward<'a> {
    pub(crate) sdpa: Sdpa<'a>,
    pub(crate) dout: Tensor<'a>,
    pub(crate) saved: Option<(Tensor<'a>, Tensor<'a>)>,
    pub(crate) path: Path,
}

/// Gradients on the host, widened to f32 from their storage formats (exact).
#[derive(Debug, Clone)]
pub struct Grads {
    /// `[B, Hq, L, E]`.
    pub dq: Array4<f32>,
    /// `[B, Hkv, S, E]`, summed over the query heads of each group.
    pub dk: Array4<f32>,
    /// `[B, Hkv, S, Ev]`, summed over the query heads of each group.
    pub dv: Array4<f32>,
    /// In the bias's own shape, summed over its broadcast dimensions; when a bias is given.
    pub dbias: Option<ArrayD<f32>>,
    /// The forward output `[B, Hq, L, Ev]`, when the backward ran the forward itself.
    pub output: Option<Array4<f32>>,
    /// The forward logsumexp `[B, Hq, L]`, when the backward ran the forward itself.
    pub lse: Option<Array3<f32>>,
}

/// Gradients left on the GPU by [`Backward::record`], each in its input's storage format
/// (dQ in q's, dK in k's, dV in v's, d(bias) in the bias's).
#[derive(Debug, Clone)]
pub struct GpuGrads {
    /// dQ `[B, Hq, L, E]`.
    pub dq: wgpu::Buffer,
    /// dK `[B, Hkv, S, E]`.
    pub dk: wgpu::Buffer,
    /// dV `[B, Hkv, S, Ev]`.
    pub dv: wgpu::Buffer,
    /// d(bias) in the bias's shape, when a bias is given.
    pub dbias: Option<wgpu::Buffer>,
    /// The forward's results, when the backward ran the forward itself.
    pub forward: Option<GpuOutput>,
    /// The validated problem.
    pub problem: Problem,
}

impl<'a> Sdpa<'a> {
    /// The backward pass of this attention for the upstream gradient `dout` `[B, Hq, L, Ev]`
    /// (host data or a GPU buffer; its format is the one O is stored in).
    pub fn backward(self, dout: impl Into<Tensor<'a>>) -> Backward<'a> {
        Backward {
            sdpa: self,
            dout: dout.into(),
            saved: None,
            path: Path::Auto,
        }
    }
}

/// Where a backward cannot run.
const NO_DECODE: &str =
    "the backward has fused and unfused paths; use Path::Fused, Path::Unfused or Path::Auto";

impl<'a> Backward<'a> {
    /// Use the forward's output `out` `[B, Hq, L, Ev]` (any format) and logsumexp `lse`
    /// `[B, Hq, L]` (f32, natural log, `-inf` on fully masked rows) computed elsewhere,
    /// instead of running the forward.
    pub fn saved(mut self, out: impl Into<Tensor<'a>>, lse: impl Into<Tensor<'a>>) -> Self {
        self.saved = Some((out.into(), lse.into()));
        self
    }

    /// Force the backward's path: [`Path::Fused`] or [`Path::Unfused`] ([`Path::Auto`], the
    /// default, picks fused wherever it runs). The forward, when the backward runs it, takes
    /// the path set on the [`Sdpa`], or, where that is [`Path::Auto`], the backward's path
    /// (each path recomputes the logits with the arithmetic its forward used).
    pub fn path(mut self, path: Path) -> Self {
        self.path = path;
        self
    }

    /// The concrete path of the backward on `ctx`, or why the forced one cannot run.
    pub fn resolved_path(&self, ctx: &Context) -> Result<Path> {
        let p = self.problem()?;
        Ok(plan(&p, self.path, &ctx.caps())?.path())
    }

    /// The validated problem (the backward's formats: q, k, v, bias as given, `out` = dO's).
    /// Checks dO, and the saved output and logsumexp, against it (no GPU work).
    pub fn problem(&self) -> Result<Problem> {
        let p = self.sdpa.problem()?;
        let mut p = p.clone().with_storage(Formats {
            out: self.dout.storage(),
            ..p.storage
        });
        // The output read back is the saved one, when given (else the forward's, whose view
        // the forward problem gave).
        if let Some((o, _)) = &self.saved {
            p.views.out = crate::view::of_tensor("output", o)?;
        }
        p.views.dout = crate::view::of_tensor("dout", &self.dout)?;
        let out = p.out_shape();
        check_shape("dout", &self.dout.shape, &out)?;
        if let Some((o, lse)) = &self.saved {
            check_shape("output", &o.shape, &out)?;
            check_shape("lse", &lse.shape, &[p.batch, p.q_heads, p.seq_q])?;
            if lse.storage() != Storage::F32 {
                return Err(Error::StorageMismatch {
                    tensor: "lse",
                    expected: Storage::F32,
                    actual: lse.storage(),
                    why: "the logsumexp is kept in f32 in every format",
                });
            }
        }
        Ok(p)
    }

    /// Run on the GPU and read the gradients back.
    pub async fn run(&self, ctx: &Context) -> Result<Grads> {
        let g = ctx
            .submit("wgpu-attention sdpa backward", |encoder| {
                self.record(ctx, encoder)
            })
            .await?;
        let p = &g.problem;
        let f = p.storage;
        let read4 = |buf: &wgpu::Buffer, shape: [usize; 4], s: Storage| {
            let buf = buf.clone();
            async move {
                let v = ctx.read_as_f32(&buf, 0, shape.iter().product(), s).await?;
                Ok::<_, Error>(Array4::from_shape_vec(shape, v).expect("gradient length"))
            }
        };
        let dq = read4(&g.dq, p.q_shape(), f.q).await?;
        let dk = read4(&g.dk, p.k_shape(), f.k).await?;
        let dv = read4(&g.dv, p.v_shape(), f.v).await?;
        let dbias = match (&g.dbias, &self.sdpa.options.bias) {
            (Some(buf), Some(b)) => {
                let n = b.shape.iter().product();
                let v = ctx.read_as_f32(buf, 0, n, f.bias).await?;
                Some(ArrayD::from_shape_vec(IxDyn(&b.shape), v).expect("dbias length"))
            }
            _ => None,
        };
        let (output, lse) = match &g.forward {
            Some(fw) => {
                let fp = &fw.problem;
                // At the forward's offset, through its view (an output_into buffer).
                let o = super::read_output(ctx, fw).await?;
                let l = ctx
                    .read_f32(&fw.lse, 0, f32_bytes(fp.batch_heads() * fp.seq_q))
                    .await?;
                let l = Array3::from_shape_vec((fp.batch, fp.q_heads, fp.seq_q), l).expect("lse length");
                (Some(o), Some(l))
            }
            None => (None, None),
        };
        Ok(Grads {
            dq,
            dk,
            dv,
            dbias,
            output,
            lse,
        })
    }

    /// Blocking version of [`run`](Backward::run).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run_blocking(&self, ctx: &Context) -> Result<Grads> {
        pollster::block_on(self.run(ctx))
    }

    /// Upload host inputs and record the forward (unless [`saved`](Backward::saved)) and the
    /// backward into `encoder`. Nothing is submitted.
    pub fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<GpuGrads> {
        let p = self.problem()?;
        let plan = plan(&p, self.path, &ctx.caps())?;
        let max_binding = ctx.max_binding();
        let limit = "max_storage_buffer_binding_size";
        let f = p.storage;
        // Validate every size before any GPU work.
        let q = Operand::check_viewed(ctx, "q", &self.sdpa.q)?;
        let k = Operand::check_viewed(ctx, "k", &self.sdpa.k)?;
        let v = Operand::check_viewed(ctx, "v", &self.sdpa.v)?;
        let dout = Operand::check_viewed(ctx, "dout", &self.dout)?;
        let bias = self
            .sdpa
            .options
            .bias
            .as_ref()
            .map(|b| Operand::check_bias(ctx, b))
            .transpose()?;
        let saved = self
            .saved
            .as_ref()
            .map(|(o, l)| {
                Ok::<_, Error>((
                    Operand::check_viewed(ctx, "output", o)?,
                    Operand::check(ctx, "lse", l)?,
                ))
            })
            .transpose()?;
        let rows = p.batch_heads() * p.seq_q;
        let kv_rows = p.batch * p.kv_heads * p.seq_kv;
        let dv_off = (kv_rows * p.head_dim).next_multiple_of(64);
        let stats_len = 2 * rows + p.batch;
        fits("backward statistics", f32_bytes(stats_len), max_binding, limit)?;
        fits("dq", f.q.bytes(rows * p.head_dim), max_binding, limit)?;
        let dkv_bytes = f32_bytes(dv_off + kv_rows * p.head_dim_v).next_multiple_of(16);
        fits("dk and dv (f32)", dkv_bytes, max_binding, limit)?;
        let packed_mask = self.sdpa.options.mask.as_ref().map(|m| pack_mask(&p, m));
        if let Some((words, _)) = &packed_mask {
            fits("packed mask", f32_bytes(words.len()), max_binding, limit)?;
        }
        if let Plan::Unfused(c) = &plan {
            let chunk = f32_bytes(c.heads * c.rows * p.seq_kv);
            fits("scores chunk", chunk, max_binding, limit)?;
        }
        // Every grid: the row and bias kernels' (64 invocations each) and the fused kernels'.
        let grids = match &plan {
            Plan::Fused(cfg) => fused_grids(&p, cfg),
            Plan::Unfused(_) => [(0, 0); 2],
        };
        for n in [rows.div_ceil(64), p.bias.map_or(0, |b| b.len()).div_ceil(64)]
            .into_iter()
            .chain(grids.map(|(_, total)| total))
        {
            check_workgroups(ctx, n)?;
        }

        // The forward, when O and the logsumexp are not given.
        // Under Path::Auto the forward runs on the backward's path, so that the backward
        // recomputes each logit with the arithmetic that made the logsumexp (at logits of
        // 1e4, f32 rounding differences between kernels are 1e-3 in P).
        let forward = match &saved {
            Some(_) => None,
            None if self.sdpa.path == Path::Auto => {
                Some(self.sdpa.clone().path(plan.path()).record(ctx, encoder)?)
            }
            None => Some(self.sdpa.record(ctx, encoder)?),
        };
        let q = q.upload(ctx, "q");
        let k = k.upload(ctx, "k");
        let v = v.upload(ctx, "v");
        let dout = dout.upload(ctx, "dout");
        let bias = bias.map(|b| b.upload(ctx, "bias"));
        let saved = saved.map(|(o, l)| (o.upload(ctx, "output"), l.upload(ctx, "lse")));
        let (o_fmt, o_bind, lse_bind) = match (&saved, &forward) {
            (Some((o, l)), _) => (self.saved.as_ref().unwrap().0.storage(), o.binding(), l.binding()),
            (None, Some(fw)) => (
                fw.problem.storage.out,
                fw.output_binding(),
                fw.lse.as_entire_buffer_binding(),
            ),
            (None, None) => unreachable!("the forward runs when nothing is saved"),
        };
        let dummy = dummy(ctx);
        let mask_buf = packed_mask
            .as_ref()
            .map(|(w, _)| crate::buffers::storage_init(ctx, "mask", bytemuck::cast_slice(w)));
        let mut params = kb::Params::new(&p, packed_mask.as_ref().map(|(_, st)| *st));
        params.dv_off = dv_off as u32;

        // Statistics: lse and D by the prep kernel, then the key lengths (written by the host).
        let stats = output(ctx, "backward statistics", f32_bytes(stats_len));
        if let Some(lens) = &p.kv_lens {
            ctx.queue()
                .write_buffer(&stats, f32_bytes(2 * rows), bytemuck::cast_slice(lens));
        }
        kb::record(
            ctx,
            encoder,
            &kb::PREP,
            &kb::prep_prelude(o_fmt, f.out, &p.views),
            &[o_bind, dout.binding(), lse_bind, stats.as_entire_buffer_binding()],
            &kb::Params {
                total: rows as u32,
                ..params
            },
            rows.div_ceil(64) as u32,
        )?;

        let dq = output(ctx, "dq", f.q.bytes(rows * p.head_dim));
        let io = Io {
            mask: mask_buf.as_ref().unwrap_or(&dummy).as_entire_buffer_binding(),
            bias: bias
                .as_ref()
                .map_or(dummy.as_entire_buffer_binding(), |b| b.binding()),
            q: q.binding(),
            k: k.binding(),
            v: v.binding(),
            dout: dout.binding(),
            stats: stats.as_entire_buffer_binding(),
        };
        // dK and dV in f32, in one buffer, dV at dv_off.
        let dkv = output(ctx, "dk and dv", dkv_bytes);
        match &plan {
            Plan::Fused(cfg) => {
                let [(k_tiles, dkv_total), (q_tiles, dq_total)] = grids;
                for (spec, prelude, out, tiles, total) in [
                    (&kb::DKV, cfg.dkv_prelude(), &dkv, k_tiles, dkv_total),
                    (&kb::DQ, cfg.dq_prelude(), &dq, q_tiles, dq_total),
                ] {
                    kb::record(
                        ctx,
                        encoder,
                        spec,
                        &prelude,
                        &io.with_out(out.as_entire_buffer_binding()),
                        &kb::Params {
                            tiles: tiles as u32,
                            total: total as u32,
                            ..params
                        },
                        total as u32,
                    )?;
                }
            }
            Plan::Unfused(chunks) => {
                encoder.clear_buffer(&dkv, 0, None);
                record_unfused(ctx, encoder, &p, chunks, &io, &params, &dq, &dkv, dv_off, &dummy)?;
            }
        }
        // dK and dV in k's and v's formats.
        let dk = convert(ctx, encoder, "dk", &dkv, 0, kv_rows * p.head_dim, f.k)?;
        let dv = convert(
            ctx,
            encoder,
            "dv",
            &dkv,
            f32_bytes(dv_off),
            kv_rows * p.head_dim_v,
            f.v,
        )?;
        let dbias = p
            .bias
            .map(|bc| {
                let n = bc.len();
                let buf = output(ctx, "dbias", f.bias.bytes(n));
                kb::record(
                    ctx,
                    encoder,
                    &kb::DBIAS,
                    &kb::dbias_prelude(&p),
                    &io.with_out(buf.as_entire_buffer_binding()),
                    &kb::Params {
                        total: n as u32,
                        ..params
                    },
                    n.div_ceil(64) as u32,
                )?;
                Ok::<_, Error>(buf)
            })
            .transpose()?;
        Ok(GpuGrads {
            dq,
            dk,
            dv,
            dbias,
            forward,
            problem: p,
        })
    }
}

fn check_shape(tensor: &'static str, actual: &[usize], expected: &[usize]) -> Result<()> {
    if actual != expected {
        return Err(Error::ShapeMismatch {
            tensor,
            expected: expected.to_vec(),
            actual: actual.to_vec(),
        });
    }
    Ok(())
}

/// The fused kernels' (tiles per head, workgroups): dK/dV over key tiles of every kv head,
/// dQ over query tiles of every query head.
fn fused_grids(p: &Problem, cfg: &kb::Config) -> [(usize, usize); 2] {
    let k_tiles = p.seq_kv.div_ceil((cfg.wg * cfg.rk) as usize);
    let q_tiles = p.seq_q.div_ceil((cfg.wg * cfg.rq) as usize);
    [
        (k_tiles, k_tiles * p.batch * p.kv_heads),
        (q_tiles, q_tiles * p.batch_heads()),
    ]
}

fn check_workgroups(ctx: &Context, n: usize) -> Result<()> {
    let max = ctx.limits().max_compute_workgroups_per_dimension as u64;
    fits(
        "backward workgroups",
        n as u64,
        max * max,
        "max_compute_workgroups_per_dimension (squared)",
    )
}

/// The backward's plan.
#[derive(Debug, Clone)]
pub(crate) enum Plan {
    Fused(Box<kb::Config>),
    Unfused(ChunkPlan),
}

impl Plan {
    fn path(&self) -> Path {
        match self {
            Plan::Fused(_) => Path::Fused,
            Plan::Unfused(_) => Path::Unfused,
        }
    }
}

pub(crate) fn plan(p: &Problem, path: Path, caps: &Caps) -> Result<Plan> {
    let fused = kb::Config::new(p, caps);
    match path {
        Path::Auto if fused.is_ok() => Ok(Plan::Fused(Box::new(fused.expect("checked")))),
        Path::Fused => Ok(Plan::Fused(Box::new(fused.map_err(|reason| {
            Error::Unsupported {
                path: "fused",
                reason: format!("{reason}; Path::Auto falls back to Path::Unfused"),
            }
        })?))),
        Path::Auto | Path::Unfused => {
            // Four score-sized chunks (S, dP/dS, Pᵀ, dSᵀ), each within a binding; whole
            // groups of query heads where they fit, so that one product sums a group.
            let mut c = ChunkPlan::new(p, caps.max_binding, caps)?;
            let g = p.group();
            if c.rows == p.seq_q && c.heads >= g {
                c.heads -= c.heads % g;
            }
            Ok(Plan::Unfused(c))
        }
        Path::Decode => Err(Error::Unsupported {
            path: "decode",
            reason: NO_DECODE.into(),
        }),
    }
}

/// What the gradient kernels bind: mask, bias, q, k, v, dout, stats.
struct Io<'b> {
    mask: wgpu::BufferBinding<'b>,
    bias: wgpu::BufferBinding<'b>,
    q: wgpu::BufferBinding<'b>,
    k: wgpu::BufferBinding<'b>,
    v: wgpu::BufferBinding<'b>,
    dout: wgpu::BufferBinding<'b>,
    stats: wgpu::BufferBinding<'b>,
}

impl<'b> Io<'b> {
    /// The bindings of a gradient kernel writing `out`.
    fn with_out<'c>(&self, out: wgpu::BufferBinding<'c>) -> Vec<wgpu::BufferBinding<'c>>
    where
        'b: 'c,
    {
        vec![
            self.mask.clone(),
            self.bias.clone(),
            self.q.clone(),
            self.k.clone(),
            self.v.clone(),
            self.dout.clone(),
            self.stats.clone(),
            out,
        ]
    }
}

/// `elems` f32 values at byte `offset` of `src` as a new buffer in format `to` (a copy for f32).
fn convert(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    label: &str,
    src: &wgpu::Buffer,
    offset: u64,
    elems: usize,
    to: Storage,
) -> Result<wgpu::Buffer> {
    let dst = output(ctx, label, to.bytes(elems));
    if to == Storage::F32 {
        encoder.copy_buffer_to_buffer(src, offset, &dst, 0, f32_bytes(elems));
    } else {
        permute::record(
            ctx,
            encoder,
            binding(src, offset, f32_bytes(elems)),
            dst.as_entire_buffer_binding(),
            [1, 1, 1, elems],
            [0, 0, 0, 1],
            (Storage::F32, to),
        )?;
    }
    Ok(dst)
}

/// The unfused backward: per chunk of scores, S = scale·Q Kᵀ and dP = dO Vᵀ (matmuls), then P,
/// dS and their group-transposes (`bwd_ds`), then dQ = scale·dS K, dV += Pᵀ dO and
/// dK += scale·dSᵀ Q (matmuls; dK and dV accumulate in f32 across chunks).
#[allow(clippy::too_many_arguments)] // the pieces of one recorded backward
fn record_unfused(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    chunks: &ChunkPlan,
    io: &Io,
    params: &kb::Params,
    dq: &wgpu::Buffer,
    dkv: &wgpu::Buffer,
    dv_off: usize,
    dummy: &wgpu::Buffer,
) -> Result<()> {
    let (l, s, e, ev) = (
        p.seq_q as u32,
        p.seq_kv as u32,
        p.head_dim as u32,
        p.head_dim_v as u32,
    );
    let f = p.storage;
    let bh = p.batch_heads();
    let (heads, group) = (p.q_heads as u32, p.group() as u32);
    let chunk = f32_bytes(chunks.heads * chunks.rows * p.seq_kv);
    let [sc, dp, pt, dst] =
        ["scores", "dP and dS", "P transposed", "dS transposed"].map(|n| scratch(ctx, n, chunk));
    let kv_rows = p.batch * p.kv_heads * p.seq_kv;
    let dk_bind = || binding(dkv, 0, f32_bytes(kv_rows * p.head_dim));
    let dv_bind = || binding(dkv, f32_bytes(dv_off), f32_bytes(kv_rows * p.head_dim_v));
    let prelude = kb::ds_prelude(p.mask.is_some(), p.bias.is_some(), f.bias);
    let [qv, kv, vv, _, gv] = p.views_or_dense();
    for z0 in (0..bh).step_by(chunks.heads) {
        let nz = chunks.heads.min(bh - z0);
        for i0 in (0..p.seq_q).step_by(chunks.rows) {
            let lc = chunks.rows.min(p.seq_q - i0);
            let bytes = f32_bytes(nz * lc * p.seq_kv);
            let (z0u, i0u, lcu, nzu) = (z0 as u32, i0 as u32, lc as u32, nz as u32);
            // S = scale·Q Kᵀ and dP = dO Vᵀ for rows i0.. of heads z0..
            for (a, b, c, d, fa, fb, alpha, av, bv) in [
                (&io.q, &io.k, &sc, e, f.q, f.k, p.scale, qv, kv),
                (&io.dout, &io.v, &dp, ev, f.out, f.v, 1.0, gv, vv),
            ] {
                matmul::Matmul {
                    a: a.clone(),
                    b: b.clone(),
                    bias: None,
                    c: binding(c, 0, bytes),
                    params: matmul::Params {
                        heads,
                        group,
                        a_z0: z0u,
                        b_z0: z0u,
                        ..matmul::Params::dense(lcu, s, d, true, alpha)
                    }
                    .split_heads()
                    .a_view(av, i0)
                    .b_view(bv, 0),
                    batch: nzu,
                    trans_b: true,
                    formats: [fa, fb, Storage::F32, Storage::F32],
                    accumulate: false,
                    additive: false,
                }
                .record(ctx, encoder, dummy)?;
            }
            // The group width of the transposes: whole groups of whole heads (one product per
            // kv head of the chunk), else one head (a product per head).
            // (Only dense q and dO stack the heads of a group as rows of one matrix.)
            let grouped = lc == p.seq_q
                && nz.is_multiple_of(p.group())
                && p.views.q.is_none()
                && p.views.dout.is_none();
            let gw = if grouped { p.group() } else { 1 };
            let total = nz * lc * p.seq_kv;
            kb::record(
                ctx,
                encoder,
                &kb::DS,
                &prelude,
                &[
                    io.mask.clone(),
                    io.bias.clone(),
                    binding(&sc, 0, bytes),
                    binding(&dp, 0, bytes),
                    binding(&pt, 0, bytes),
                    binding(&dst, 0, bytes),
                    io.stats.clone(),
                ],
                &kb::Params {
                    total: total as u32,
                    z0: z0u,
                    i0: i0u,
                    lc: lcu,
                    gw: gw as u32,
                    ..*params
                },
                total.div_ceil(64) as u32,
            )?;
            // dQ rows = scale · dS K.
            matmul::Matmul {
                a: binding(&dp, 0, bytes),
                b: io.k.clone(),
                bias: None,
                c: dq.as_entire_buffer_binding(),
                params: matmul::Params {
                    heads,
                    group,
                    b_z0: z0u,
                    c_z0: z0u,
                    c_batch: l * e,
                    c_off: i0u * e,
                    ..matmul::Params::dense(lcu, e, s, false, p.scale)
                }
                .split_heads()
                .b_view(kv, 0),
                batch: nzu,
                trans_b: false,
                formats: [Storage::F32, f.k, Storage::F32, f.q],
                accumulate: false,
                additive: false,
            }
            .record(ctx, encoder, dummy)?;
            // dV += Pᵀ dO and dK += scale · dSᵀ Q: one batched product over the chunk's kv
            // heads (each with its gw query heads stacked), or one product per head with the
            // rows of this chunk (heads of one group would race on their kv head's sum).
            let gwu = gw as u32;
            let slices: Vec<(u32, u32)> = if grouped {
                vec![(0, nzu / gwu)]
            } else {
                (0..nzu).map(|zl| (zl, 1)).collect()
            };
            for (a, b, c, d, fb, alpha, bv) in [
                (&pt, &io.dout, dv_bind(), ev, f.out, 1.0, gv),
                (&dst, &io.q, dk_bind(), e, f.q, p.scale, qv),
            ] {
                for &(zl, batch) in &slices {
                    let z = z0u + zl;
                    let params = matmul::Params {
                        a_z0: zl,
                        b_z0: z / gwu,
                        b_batch: gwu * l * d,
                        b_off: i0u * d,
                        c_z0: z / group,
                        c_batch: s * d,
                        ..matmul::Params::dense(s, d, gwu * lcu, false, alpha)
                    };
                    // Through a view: one head (gw = 1) of rows i0.. of query head z.
                    let params = if grouped {
                        params
                    } else {
                        matmul::Params { heads, ..params }.split_heads().b_view(bv, i0)
                    };
                    matmul::Matmul {
                        a: binding(a, 0, bytes),
                        b: b.clone(),
                        bias: None,
                        c: c.clone(),
                        params,
                        batch,
                        trans_b: false,
                        formats: [Storage::F32, fb, Storage::F32, Storage::F32],
                        accumulate: true,
                        additive: false,
                    }
                    .record(ctx, encoder, dummy)?;
                }
            }
        }
    }
    Ok(())
}
