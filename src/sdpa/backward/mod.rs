//! The backward pass of [`Sdpa`]: [`Backward`] (from [`Sdpa::backward`]) computes dQ, dK, dV
//! and d(bias) for an upstream gradient dO, from the forward's output O and logsumexp (the
//! caller's, or a forward it runs itself).
//!
//! | path | kernels (`src/kernels/backward.rs`, `shaders/bwd_*.wgsl`) |
//! |---|---|
//! | [`Path::Fused`] | `bwd_prep` (lse, D), `bwd_dkv` (key-major), `bwd_dq` (query-major), `bwd_dbias` |
//! | [`Path::Unfused`] | `bwd_prep`; per chunk of scores `matmul` (S, dP), `bwd_ds`, `matmul` (dQ, dV, dK); `bwd_dbias` |

//!
//! Laid out like the forward: the API here, the plan in `plan.rs` (pure), the recording
//! shared by both paths in `record.rs`, one recorder per path (`fused.rs`, `unfused.rs`).

mod fused;
mod io;
mod plan;
mod record;
#[cfg(test)]
mod stage_tests;
mod unfused;

use ndarray::{Array3, Array4, ArrayD, IxDyn};

use crate::device::buffers::f32_bytes;
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::storage::{Formats, Storage};
use crate::tensor::Tensor;

use super::{Form, GpuOutput, Path, Sdpa};
pub(crate) use plan::plan;

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
    /// Whether d(bias) is computed where a bias is given ([`Backward::without_dbias`]).
    pub(crate) dbias: bool,
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
    /// d(sink logits) `[Hq]`, when sink logits are given.
    pub dsink: Option<ndarray::Array1<f32>>,
    /// The gradients of the user functions' captures, flat, in the order they were captured,
    /// when the source defines `score_mod_dcapture` (see [`UserMod`](crate::UserMod)).
    pub dcaptures: Option<Vec<ndarray::Array1<f32>>>,
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
    /// d(sink logits) `[Hq]` in f32, when sink logits are given.
    pub dsink: Option<wgpu::Buffer>,
    /// The captures' gradients in f32, packed in the order they were captured, when the
    /// source defines `score_mod_dcapture`.
    pub dcaptures: Option<wgpu::Buffer>,
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
            dbias: true,
        }
    }
}

impl<'a> Backward<'a> {
    /// Use the forward's output `out` `[B, Hq, L, Ev]` (any format) and logsumexp `lse`
    /// `[B, Hq, L]` (f32, natural log, `-inf` on fully masked rows) computed elsewhere,
    /// instead of running the forward.
    pub fn saved(mut self, out: impl Into<Tensor<'a>>, lse: impl Into<Tensor<'a>>) -> Self {
        self.saved = Some((out.into(), lse.into()));
        self
    }

    /// No d(bias): the bias is a constant (a mask made additive, a bias that needs no
    /// gradient). Its kernel is a pass over every logit, the costliest part of a backward on
    /// some devices; without it [`GpuGrads::dbias`] and [`Grads::dbias`] are `None`.
    pub fn without_dbias(mut self) -> Self {
        self.dbias = false;
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

    /// The form the backward's kernels run in on `ctx`: [`Form::Backward`] on the fused path,
    /// [`Form::Unfused`] (the matmul's form) on the unfused one; or why the forced path or a
    /// form pinned by [`Context::with_forms`] cannot run.
    pub fn form(&self, ctx: &Context) -> Result<Form> {
        let p = self.problem()?;
        Ok(plan(&p, self.path, &ctx.caps())?.form())
    }

    /// The validated problem (the backward's formats: q, k, v, bias as given, `out` = dO's).
    /// Checks dO, and the saved output and logsumexp, against it (no GPU work).
    pub fn problem(&self) -> Result<Problem> {
        let p = self.sdpa.problem()?;
        if let Some(u) = &p.user_fns {
            u.check_backward()?;
        }
        crate::sdpa::quant::refuse("the backward", &[p.storage.k, p.storage.v, self.dout.storage()])?;
        if p.paged.is_some() || p.rope.is_some() {
            return Err(Error::Unsupported {
                path: "backward",
                reason: "paged K/V caches and RoPE on q are forward-only (inference); give the backward contiguous, rotated q and k".into(),
            });
        }
        let mut p = p.clone().with_storage(Formats {
            out: self.dout.storage(),
            ..p.storage
        });
        // The output read back is the saved one, when given (else the forward's, whose view
        // the forward problem gave).
        if let Some((o, _)) = &self.saved {
            p.views.out = crate::tensor::of_tensor("output", o)?;
        }
        p.views.dout = crate::tensor::of_tensor("dout", &self.dout)?;
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
        let dsink = match &g.dsink {
            Some(buf) => Some(ndarray::Array1::from(
                ctx.read_as_f32(buf, 0, p.q_heads, Storage::F32).await?,
            )),
            None => None,
        };
        let dcaptures = match (&g.dcaptures, &p.user_fns) {
            (Some(buf), Some(u)) => {
                let all = ctx.read_as_f32(buf, 0, u.capture_len(), Storage::F32).await?;
                Some(u.split(&all))
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
            dsink,
            dcaptures,
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
    /// backward into `encoder`. Nothing is submitted (but a `mask_mod`'s block map, as
    /// [`Sdpa::record`] says).
    pub fn record(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<GpuGrads> {
        record::record(self, ctx, encoder)
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
