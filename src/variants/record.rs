//! Recording a variant: validation of every stage before any GPU work, then the stages, each
//! on the crate's existing kernels (matmul, SDPA's paths) plus the Nyström pseudo-inverse's two
//! small kernels (`src/kernels/pinv.rs`).

use ndarray::Array2;

use super::{Dims, GpuVariantOutput, Variant, VariantParams};
use crate::device::buffers::{binding, f32_bytes, fits, output, storage_init, Operand};
use crate::device::context::Context;
use crate::error::Result;
use crate::ops::matmul::{self, Matmul};
use crate::ops::{linear, pinv, Mats};
use crate::options::Options;
use crate::sdpa::{Path, Sdpa};
use crate::storage::Storage;
use crate::tensor::Tensor;

/// An SDPA stage's shapes, formats and options, planned with empty host tensors (no GPU work).
struct Stage<'a> {
    q: ([usize; 4], Storage),
    k: ([usize; 4], Storage),
    v: ([usize; 4], Storage),
    options: Options<'a>,
    path: Path,
    weights: bool,
    out: Storage,
}

impl Stage<'_> {
    /// The stage as an [`Sdpa`] over `tensors` (or empty host tensors of the stage's shapes).
    fn sdpa<'t>(&'t self, tensors: Option<[Tensor<'t>; 3]>) -> Sdpa<'t> {
        let empty: &[f32] = &[];
        let [q, k, v] = tensors.unwrap_or_else(|| {
            [self.q, self.k, self.v].map(|(shape, st)| Tensor::from_slice(empty, &shape).with_storage(st))
        });
        let mut s = Sdpa::new(q, k, v)
            .options(self.options.clone())
            .path(self.path)
            .output_storage(self.out);
        if self.weights {
            s = s.return_weights();
        }
        s
    }
}

/// Bahdanau's additive score as a user `score_mod` over `d`: the logit
/// `s + Σₐ uₐ tanh(qa[b, h, i, a] + ka[b, h / group, j, a])` with `s` the bias (q k is 0),
/// the scale folded into u, the projections `qa` and `ka` captures (stand-ins that the
/// recorder fills from the projections' buffers), the shape a capture too, so that one
/// source serves every shape. Its loop ends (a is the capture's value) and it reads only
/// through the clamping capture readers: vouched for, its pipelines run without wgpu's runtime
/// checks on GPUs.
fn additive_score(d: &Dims, u: &ndarray::Array1<f32>) -> crate::user_mod::UserMod<'static> {
    const SOURCE: &str = "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    let hq = u32(dims(0u));
    let l = u32(dims(1u));
    let n = u32(dims(2u));
    let hkv = u32(dims(3u));
    let a = u32(dims(4u));
    let qb = ((b * hq + h) * l + i) * a;
    let kb = ((b * hkv + h / (hq / hkv)) * n + j) * a;
    var t = 0.0;
    for (var x = 0u; x < a; x++) {
        // tanh clamped where it is 1 in f32 (drivers may compute it by overflowing exponentials).
        t += u(x) * tanh(clamp(qa(qb + x) + ka(kb + x), -15.0, 15.0));
    }
    return s + t;
}";
    let dims = [d.hq, d.l, d.s, d.hkv, d.inner].map(|x| x as f32).to_vec();
    crate::user_mod::UserMod::wgsl(SOURCE)
        .capture_owned("qa", vec![0.0; d.batch * d.hq * d.l * d.inner])
        .capture_owned("ka", vec![0.0; d.batch * d.hkv * d.s * d.inner])
        .capture_owned("u", u.iter().map(|x| x * d.scale as f32).collect())
        .capture_owned("dims", dims)
        .vouched()
}

fn params_bytes(params: &VariantParams) -> u64 {
    let n = |a: &Array2<f32>| f32_bytes(a.len());
    match params {
        VariantParams::General { w } => n(w),
        VariantParams::Additive { w_q, w_k, u, b } => {
            n(w_q) + n(w_k) + f32_bytes(u.len() + b.as_ref().map_or(0, |b| b.len()))
        }
        VariantParams::LowRankV { a } => n(a),
        VariantParams::Nystrom { .. } => 0,
        VariantParams::Linformer { e, f } => n(e) + n(f),
    }
}

/// Every check of `var` on `ctx`, then the stage plans (shared by [`record`] and
/// [`device_memory`]).
struct Checked<'a> {
    dims: Dims,
    fmt: [Storage; 3],
    out: Storage,
    /// The inner stages' options: the caller's masks with the variant's resolved scale.
    options: Options<'a>,
    /// The final attention stage.
    main: Stage<'a>,
}

fn check<'a>(var: &Variant<'a>, ctx: &Context) -> Result<Checked<'a>> {
    let d = var.dims()?;
    let options = Options {
        scale: Some(d.scale),
        ..var.options.clone()
    };
    let fmt = [var.q.storage(), var.k.storage(), var.v.storage()];
    crate::sdpa::quant::refuse("the variants", &fmt)?;
    let out = var.out_storage.unwrap_or(fmt[0]);
    let Dims {
        batch: b,
        hq,
        hkv,
        l,
        s,
        e,
        ev,
        ..
    } = d;
    let q_shape = [b, hq, l, e];
    let k_shape = [b, hkv, s, e];
    let v_shape = [b, hkv, s, ev];
    let f32s = Storage::F32;
    check_stage_sizes(var, ctx, &d)?;
    // The exact attention on the inputs as they are; each variant changes what differs.
    let base = Stage {
        q: (q_shape, fmt[0]),
        k: (k_shape, fmt[1]),
        v: (v_shape, fmt[2]),
        options: options.clone(),
        path: var.path,
        weights: var.weights,
        out,
    };
    let main = match var.params {
        VariantParams::General { .. } => Stage {
            q: (q_shape, f32s),
            ..base
        },
        VariantParams::Additive { u, .. } => Stage {
            // The logit is the user score function's alone (q k = 0 with one zero column).
            q: ([b, hq, l, 1], f32s),
            k: ([b, hkv, s, 1], f32s),
            options: Options {
                scale: Some(1.0),
                user_mod: Some(additive_score(&d, u)),
                ..options.clone()
            },
            ..base
        },
        VariantParams::LowRankV { .. } => Stage { out: f32s, ..base },
        VariantParams::Linformer { .. } => {
            let kp = d.inner;
            Stage {
                k: ([b, hkv, kp, e], f32s),
                v: ([b, hkv, kp, ev], f32s),
                weights: false,
                ..base
            }
        }
        VariantParams::Nystrom { .. } => {
            let m = d.inner;
            // The two inner softmax stages.
            for stage in nystrom_stages(&d, fmt, &options) {
                stage.sdpa(None).plan(ctx)?;
            }
            Stage {
                k: ([b, hq, m, e], f32s),
                v: ([b, hq, m, ev], f32s),
                weights: false,
                ..base
            }
        }
    };
    main.sdpa(None).plan(ctx)?;
    Ok(Checked {
        dims: d,
        fmt,
        out,
        options,
        main,
    })
}

/// Check the buffers and product grids of a variant's stages before the attention's own
/// (`d`: its dimensions).
fn check_stage_sizes(var: &Variant<'_>, ctx: &Context, d: &Dims) -> Result<()> {
    let Dims {
        batch: b,
        hq,
        hkv,
        l,
        s,
        e,
        ev,
        inner,
        ..
    } = *d;
    let max = ctx.max_binding();
    let fit = |what: &str, elems: usize| fits(what, f32_bytes(elems), max, "max_storage_buffer_binding_size");
    match var.params {
        VariantParams::General { .. } => {
            fit("q W", b * hq * l * e)?;
            matmul::check_grid(ctx, "q W", l, e, b * hq)
        }
        VariantParams::Additive { .. } => {
            fit("additive query projection", b * hq * l * inner)?;
            fit("additive key projection", b * hkv * s * inner)?;
            matmul::check_grid(ctx, "additive query projection", b * hq * l, inner, 1)?;
            matmul::check_grid(ctx, "additive key projection", b * hkv * s, inner, 1)
        }
        VariantParams::LowRankV { a } => {
            fit("low-rank output", b * hq * l * a.ncols())?;
            matmul::check_grid(ctx, "low-rank output", b * hq * l, a.ncols(), 1)
        }
        VariantParams::Linformer { .. } => {
            fit("projected keys", b * hkv * inner * e)?;
            fit("projected values", b * hkv * inner * ev)?;
            matmul::check_grid(ctx, "Linformer projection", inner, e.max(ev), b * hkv)
        }
        VariantParams::Nystrom { .. } => {
            let m = inner;
            fit("landmark queries", b * hq * m * e)?;
            fit("landmark keys", b * hq * m * e)?;
            fit("Nyström A", b * hq * m * m)?;
            fit("Nyström B' V", b * hq * m * ev)?;
            matmul::check_grid(ctx, "Nyström landmarks", m, e.max(ev).max(m), b * hq)
        }
    }
}

/// Nyström's inner softmax stages: A = softmax(s Q̃ K̃ᵀ) (the weights of an unfused call) and
/// B'V = softmax(s Q̃ Kᵀ) V.
fn nystrom_stages<'a>(d: &Dims, fmt: [Storage; 3], options: &Options<'a>) -> [Stage<'a>; 2] {
    let Dims {
        batch: b,
        hq,
        inner: m,
        e,
        ..
    } = *d;
    let f32s = Storage::F32;
    [
        Stage {
            q: ([b, hq, m, e], f32s),
            k: ([b, hq, m, e], f32s),
            v: ([b, hq, m, e], f32s),
            options: options.clone(),
            path: Path::Unfused,
            weights: true,
            out: f32s,
        },
        Stage {
            q: ([b, hq, m, e], f32s),
            k: ([b, d.hkv, d.s, e], fmt[1]),
            v: ([b, d.hkv, d.s, d.ev], fmt[2]),
            options: options.clone(),
            path: Path::Auto,
            weights: false,
            out: f32s,
        },
    ]
}

/// [`Variant::device_memory`]: the inputs, the parameters, every intermediate and the stages'
/// own buffers ([`Sdpa::device_memory`]).
pub(super) fn device_memory(var: &Variant, ctx: &Context) -> Result<u64> {
    let c = check(var, ctx)?;
    let d = &c.dims;
    let bytes = |st: Storage, shape: &[usize]| st.bytes(shape.iter().product());
    // The main stage counts its own q, k, v (intermediates or the inputs), masks, output, lse.
    let main = c.main.sdpa(None).device_memory(ctx)?;
    let (b, hq, m) = (d.batch, d.hq, d.inner);
    let extra = match var.params {
        // The main stage's q is q W; the input q is extra.
        VariantParams::General { .. } => bytes(c.fmt[0], &[b, hq, d.l, d.e]),
        VariantParams::Additive { .. } => {
            bytes(c.fmt[0], &[b, hq, d.l, d.e]) + bytes(c.fmt[1], &[b, d.hkv, d.s, d.e])
        }
        VariantParams::LowRankV { .. } => bytes(c.out, &d.out_shape()),
        VariantParams::Linformer { .. } => {
            bytes(c.fmt[1], &[b, d.hkv, d.s, d.e]) + bytes(c.fmt[2], &[b, d.hkv, d.s, d.ev])
        }
        VariantParams::Nystrom { .. } => {
            // A's stage counts Q̃ and K̃ (twice: as its keys and values), B'V's stage Q̃ again,
            // the main stage K̃ once: drop the repeats. Then the segment-mean matrices and the
            // pseudo-inverse's five m × m buffers.
            let [a_stage, bv_stage] = nystrom_stages(d, c.fmt, &c.options);
            let a_mem = a_stage.sdpa(None).device_memory(ctx)?;
            let bv_mem = bv_stage.sdpa(None).device_memory(ctx)?;
            let landmarks = f32_bytes(b * hq * m * d.e);
            a_mem + bv_mem - 3 * landmarks + f32_bytes(m * (d.l + d.s)) + 5 * f32_bytes(b * hq * m * m)
        }
    };
    Ok(main + extra + params_bytes(var.params))
}

/// [`Variant::record`].
pub(super) fn record(
    var: &Variant,
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
) -> Result<GpuVariantOutput> {
    let c = check(var, ctx)?;
    let r = Rec {
        ctx,
        var,
        q: Operand::check(ctx, "q", &var.q)?,
        k: Operand::check(ctx, "k", &var.k)?,
        v: Operand::check(ctx, "v", &var.v)?,
        c,
    };
    match var.params {
        VariantParams::General { w } => r.general(encoder, w),
        VariantParams::Additive { w_q, w_k, b, .. } => r.additive(encoder, [w_q, w_k], b.as_ref()),
        VariantParams::LowRankV { a } => r.low_rank_v(encoder, a),
        VariantParams::Linformer { e, f } => r.linformer(encoder, [e, f]),
        VariantParams::Nystrom { .. } => r.nystrom(encoder),
    }
}

/// One variant's recording: its inputs checked, its stages planned.
struct Rec<'r, 'a> {
    ctx: &'r Context,
    var: &'r Variant<'a>,
    q: Operand<'r, 'a>,
    k: Operand<'r, 'a>,
    v: Operand<'r, 'a>,
    c: Checked<'a>,
}

impl Rec<'_, '_> {
    /// A host matrix uploaded (f32, row-major).
    fn matrix(&self, label: &str, a: &Array2<f32>) -> wgpu::Buffer {
        let data: Vec<f32> = a.as_standard_layout().iter().copied().collect();
        storage_init(self.ctx, label, bytemuck::cast_slice(&data))
    }

    /// An f32 scratch buffer of `elems`.
    fn scratch(&self, label: &str, elems: usize) -> wgpu::Buffer {
        output(self.ctx, label, f32_bytes(elems.max(1)))
    }

    /// The variant's output from its final stage's.
    fn finish(&self, gpu: crate::sdpa::GpuOutput) -> GpuVariantOutput {
        GpuVariantOutput {
            output: gpu.output,
            shape: self.c.dims.out_shape(),
            storage: self.c.out,
            weights: gpu.weights,
        }
    }

    /// The final attention stage on `tensors` (q, k, v).
    fn main(&self, encoder: &mut wgpu::CommandEncoder, tensors: [Tensor<'_>; 3]) -> Result<GpuVariantOutput> {
        let gpu = self.c.main.sdpa(Some(tensors)).record(self.ctx, encoder)?;
        Ok(self.finish(gpu))
    }

    /// `softmax(s (Q W) Kᵀ) V`.
    fn general(&self, encoder: &mut wgpu::CommandEncoder, w: &Array2<f32>) -> Result<GpuVariantOutput> {
        let (ctx, d, f32s) = (self.ctx, self.c.dims, Storage::F32);
        let (bh, l, e) = (d.batch * d.hq, d.l, d.e);
        let (q_up, w_buf) = (self.q.upload(ctx, "q"), self.matrix("w", w));
        let qw = self.scratch("q W", bh * l * e);
        // Q' = Q W: every (batch, head) slice of Q times the shared W.
        Matmul::new(
            Mats::dense(q_up.binding(), self.c.fmt[0], l, e),
            Mats::shared(w_buf.as_entire_buffer_binding(), f32s, e, e),
            Mats::dense(binding(&qw, 0, f32_bytes(bh * l * e)), f32s, l, e),
        )
        .slices(bh)
        .record(ctx, encoder)?;
        let qw_t = Tensor::from_buffer(&qw, f32s, &[d.batch, d.hq, l, e]);
        self.main(encoder, [qw_t, self.var.k.clone(), self.var.v.clone()])
    }

    /// Bahdanau's `softmax(s uᵀ tanh(W_q q + b + W_k k)) V`: the projections by the linear
    /// op, the score by a user `score_mod` ([`additive_score`]) reading them as captures that
    /// the projections' buffers fill on the GPU.
    fn additive(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        [w_q, w_k]: [&Array2<f32>; 2],
        bias: Option<&ndarray::Array1<f32>>,
    ) -> Result<GpuVariantOutput> {
        let (ctx, d, f32s) = (self.ctx, self.c.dims, Storage::F32);
        let Dims {
            batch: b,
            hq,
            hkv,
            l,
            s,
            e,
            inner: a,
            ..
        } = d;
        let (q_up, k_up) = (self.q.upload(ctx, "q"), self.k.upload(ctx, "k"));
        let (wq_buf, wk_buf) = (self.matrix("w_q", w_q), self.matrix("w_k", w_k));
        let b_buf = bias.map(|x| storage_init(ctx, "b", bytemuck::cast_slice(&x.to_vec())));
        let qa = self.scratch("W_q q + b", b * hq * l * a);
        let ka = self.scratch("W_k k", b * hkv * s * a);
        let weights = |w, b| linear::Weights { w, b, storage: f32s };
        linear::record(
            ctx,
            encoder,
            (q_up.binding(), self.c.fmt[0]),
            weights(&wq_buf, b_buf.as_ref()),
            binding(&qa, 0, f32_bytes(b * hq * l * a)),
            [b * hq * l, a, e],
        )?;
        linear::record(
            ctx,
            encoder,
            (k_up.binding(), self.c.fmt[1]),
            weights(&wk_buf, None),
            binding(&ka, 0, f32_bytes(b * hkv * s * a)),
            [b * hkv * s, a, e],
        )?;
        // q k = 0: one zero column each; the score function gives the whole logit.
        let (zq, zk) = (vec![0f32; b * hq * l], vec![0f32; b * hkv * s]);
        let tensors = [
            Tensor::from_slice(&zq, &[b, hq, l, 1]),
            Tensor::from_slice(&zk, &[b, hkv, s, 1]),
            self.var.v.clone(),
        ];
        let mut sdpa = self.c.main.sdpa(Some(tensors));
        sdpa.capture_buffers = vec![(0, &qa), (1, &ka)];
        let gpu = sdpa.record(ctx, encoder)?;
        Ok(self.finish(gpu))
    }

    /// `(softmax(s Q Kᵀ) V) A`: the attention, then one product over every row of every head.
    fn low_rank_v(&self, encoder: &mut wgpu::CommandEncoder, a: &Array2<f32>) -> Result<GpuVariantOutput> {
        let (ctx, d) = (self.ctx, self.c.dims);
        let (f32s, out_fmt) = (Storage::F32, self.c.out);
        let var = self.var;
        let gpu = self
            .c
            .main
            .sdpa(Some([var.q.clone(), var.k.clone(), var.v.clone()]))
            .record(ctx, encoder)?;
        let (rows, r, ev_out) = (d.batch * d.hq * d.l, d.ev, a.ncols());
        let a_buf = self.matrix("a", a);
        let out_bytes = out_fmt.bytes(rows * ev_out);
        let out = output(ctx, "output", out_bytes);
        Matmul::new(
            Mats::dense(binding(&gpu.output, 0, f32_bytes(rows * r)), f32s, rows, r),
            Mats::dense(a_buf.as_entire_buffer_binding(), f32s, r, ev_out),
            Mats::dense(binding(&out, 0, out_bytes), out_fmt, rows, ev_out),
        )
        .record(ctx, encoder)?;
        Ok(GpuVariantOutput {
            output: out,
            shape: d.out_shape(),
            storage: out_fmt,
            weights: gpu.weights,
        })
    }

    /// Linformer's `softmax(s Q (E K)ᵀ) (F V)`: the sequence projections, then attention.
    fn linformer(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        [ep, fp]: [&Array2<f32>; 2],
    ) -> Result<GpuVariantOutput> {
        let (ctx, d, f32s) = (self.ctx, self.c.dims, Storage::F32);
        let Dims {
            s, e, ev, inner: kp, ..
        } = d;
        let bk = d.batch * d.hkv;
        let (k_up, v_up) = (self.k.upload(ctx, "k"), self.v.upload(ctx, "v"));
        let (e_buf, f_buf) = (self.matrix("e", ep), self.matrix("f", fp));
        let kk = self.scratch("E_p K", bk * kp * e);
        let vv = self.scratch("F_p V", bk * kp * ev);
        let [_, fk, fv] = self.c.fmt;
        seq_project(
            ctx,
            encoder,
            &e_buf,
            (k_up.binding(), fk),
            &kk,
            [kp, e, s],
            [bk, 1],
        )?;
        seq_project(
            ctx,
            encoder,
            &f_buf,
            (v_up.binding(), fv),
            &vv,
            [kp, ev, s],
            [bk, 1],
        )?;
        self.main(
            encoder,
            [
                self.var.q.clone(),
                Tensor::from_buffer(&kk, f32s, &[d.batch, d.hkv, kp, e]),
                Tensor::from_buffer(&vv, f32s, &[d.batch, d.hkv, kp, ev]),
            ],
        )
    }

    /// Nyströmformer's `softmax(s Q K̃ᵀ) · pinv(softmax(s Q̃ K̃ᵀ)) · softmax(s Q̃ Kᵀ) V`, the
    /// landmarks Q̃ and K̃ segment means of Q and K.
    fn nystrom(&self, encoder: &mut wgpu::CommandEncoder) -> Result<GpuVariantOutput> {
        let (ctx, d, f32s) = (self.ctx, self.c.dims, Storage::F32);
        let Dims {
            batch: b,
            hq,
            hkv,
            l,
            s,
            e,
            ev,
            inner: m,
            ..
        } = d;
        let bh = b * hq;
        let [fq, fk, _] = self.c.fmt;
        let (q_up, k_up) = (self.q.upload(ctx, "q"), self.k.upload(ctx, "k"));
        let ml = self.matrix("query segments", &VariantParams::segment_means(m, l));
        let ms = self.matrix("key segments", &VariantParams::segment_means(m, s));
        let qt = self.scratch("landmark queries", bh * m * e);
        let kt = self.scratch("landmark keys", bh * m * e);
        seq_project(ctx, encoder, &ml, (q_up.binding(), fq), &qt, [m, e, l], [bh, 1])?;
        // One landmark-key slice per query head (grouped-query heads share their kv head's).
        seq_project(
            ctx,
            encoder,
            &ms,
            (k_up.binding(), fk),
            &kt,
            [m, e, s],
            [bh, hq / hkv],
        )?;
        let lm_shape = [b, hq, m, e];
        let landmarks = |buf| Tensor::from_buffer(buf, f32s, &lm_shape);
        let [a_stage, bv_stage] = nystrom_stages(&d, self.c.fmt, &self.c.options);
        let a_out = a_stage
            .sdpa(Some([landmarks(&qt), landmarks(&kt), landmarks(&kt)]))
            .record(ctx, encoder)?;
        let a_mat = a_out.weights.expect("A's stage returns its weights");
        let bv = bv_stage
            .sdpa(Some([
                landmarks(&qt),
                k_up.tensor(&[b, hkv, s, e], fk),
                self.var.v.clone(),
            ]))
            .record(ctx, encoder)?;
        // Z ≈ pinv(A) by Newton–Schulz.
        let z = pinv::record(ctx, encoder, &a_mat, [bh, m], self.var.pinv_iters)?;
        // W = Z (B'V), then out = softmax(s Q K̃ᵀ) W.
        let w = self.scratch("Z B'V", bh * m * ev);
        Matmul::new(
            Mats::dense(z.as_entire_buffer_binding(), f32s, m, m),
            Mats::dense(binding(&bv.output, 0, f32_bytes(bh * m * ev)), f32s, m, ev),
            Mats::dense(binding(&w, 0, f32_bytes(bh * m * ev)), f32s, m, ev),
        )
        .slices(bh)
        .record(ctx, encoder)?;
        self.main(
            encoder,
            [
                q_up.tensor(&[b, hq, l, e], fq),
                landmarks(&kt),
                Tensor::from_buffer(&w, f32s, &[b, hq, m, ev]),
            ],
        )
    }
}

/// Record `out[z] = P · X[z / group]` along the sequence: P `[rows, len]` (f32, shared), X
/// slices `[len, n]` in their format, `[rows, n, len]` = `dims`; `[batch, group]`: `batch`
/// output slices, slice z reading X slice `z / group` (grouped-query heads sharing a kv head).
fn seq_project(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &wgpu::Buffer,
    (x, fx): (wgpu::BufferBinding<'_>, Storage),
    out: &wgpu::Buffer,
    [rows, n, len]: [usize; 3],
    [batch, group]: [usize; 2],
) -> Result<()> {
    let f32s = Storage::F32;
    // Heads = group: slice z is head z % group of batch z / group, and every head of a batch
    // reads X's batch z / group.
    Matmul::new(
        Mats::shared(p.as_entire_buffer_binding(), f32s, rows, len),
        Mats::dense(x, fx, len, n),
        Mats::dense(binding(out, 0, f32_bytes(batch * rows * n)), f32s, rows, n),
    )
    .slices(batch)
    .heads(group, group)
    .record(ctx, encoder)
}
