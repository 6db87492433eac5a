//! Recording a variant: validation of every stage before any GPU work, then the stages, each
//! on the crate's existing kernels (matmul, SDPA's paths) plus the Nyström pseudo-inverse's two
//! small kernels (`src/kernels/pinv.rs`).

use ndarray::Array2;

use super::{Dims, GpuVariantOutput, Variant, VariantParams};
use crate::buffers::{binding, f32_bytes, fits, output, storage_init, Operand};
use crate::context::Context;
use crate::error::Result;
use crate::kernels::{flash, matmul as mm, pinv};
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
    /// Bahdanau's additive score (the caller binds u before recording).
    additive: bool,
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
        s.additive = self.additive;
        s
    }
}

fn params_bytes(params: &VariantParams) -> u64 {
    let n = |a: &Array2<f32>| f32_bytes(a.len());
    match params {
        VariantParams::General { w } => n(w),
        VariantParams::Additive { w_q, w_k, b, .. } => {
            // u, and b when given, are uploaded padded.
            n(w_q) + n(w_k) + (1 + b.is_some() as u64) * f32_bytes(padded_u_len(w_q.nrows()))
        }
        VariantParams::LowRankV { a } => n(a),
        VariantParams::Nystrom { .. } => 0,
        VariantParams::Linformer { e, f } => n(e) + n(f),
    }
}

/// u (and b) as uploaded: zero-padded to a multiple of 64 and at least the fused kernel's
/// uniform array ([`flash::ADDITIVE_U_BYTES`]).
fn padded_u_len(a: usize) -> usize {
    a.next_multiple_of(64).max((flash::ADDITIVE_U_BYTES / 4) as usize)
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
    let out = var.out_storage.unwrap_or(fmt[0]);
    let (b, hq, hkv, l, s, e, ev) = (d.batch, d.hq, d.hkv, d.l, d.s, d.e, d.ev);
    let q_shape = [b, hq, l, e];
    let k_shape = [b, hkv, s, e];
    let v_shape = [b, hkv, s, ev];
    let f32s = Storage::F32;
    let max = ctx.max_binding();
    let fit = |what: &str, elems: usize| fits(what, f32_bytes(elems), max, "max_storage_buffer_binding_size");
    let main = match var.params {
        VariantParams::General { .. } => {
            fit("q W", b * hq * l * e)?;
            mm::check_grid(ctx, "q W", l, e)?;
            Stage {
                q: (q_shape, f32s),
                k: (k_shape, fmt[1]),
                v: (v_shape, fmt[2]),
                options: options.clone(),
                path: var.path,
                weights: var.weights,
                out,
                additive: false,
            }
        }
        VariantParams::Additive { .. } => {
            let a = d.inner;
            fit("additive query projection", b * hq * l * a)?;
            fit("additive key projection", b * hkv * s * a)?;
            mm::check_grid(ctx, "additive query projection", b * hq * l, a)?;
            mm::check_grid(ctx, "additive key projection", b * hkv * s, a)?;
            Stage {
                q: ([b, hq, l, a], f32s),
                k: ([b, hkv, s, a], f32s),
                v: (v_shape, fmt[2]),
                // The scale is folded into u.
                options: Options {
                    scale: Some(1.0),
                    ..options.clone()
                },
                path: var.path,
                weights: var.weights,
                out,
                additive: true,
            }
        }
        VariantParams::LowRankV { a } => {
            fit("low-rank output", b * hq * l * a.ncols())?;
            mm::check_grid(ctx, "low-rank output", b * hq * l, a.ncols())?;
            Stage {
                q: (q_shape, fmt[0]),
                k: (k_shape, fmt[1]),
                v: (v_shape, fmt[2]),
                options: options.clone(),
                path: var.path,
                weights: var.weights,
                out: f32s,
                additive: false,
            }
        }
        VariantParams::Linformer { .. } => {
            let kp = d.inner;
            fit("projected keys", b * hkv * kp * e)?;
            fit("projected values", b * hkv * kp * ev)?;
            mm::check_grid(ctx, "Linformer projection", kp, e.max(ev))?;
            Stage {
                q: (q_shape, fmt[0]),
                k: ([b, hkv, kp, e], f32s),
                v: ([b, hkv, kp, ev], f32s),
                options: options.clone(),
                path: var.path,
                weights: false,
                out,
                additive: false,
            }
        }
        VariantParams::Nystrom { .. } => {
            let m = d.inner;
            fit("landmark queries", b * hq * m * e)?;
            fit("landmark keys", b * hq * m * e)?;
            fit("Nyström A", b * hq * m * m)?;
            fit("Nyström B' V", b * hq * m * ev)?;
            mm::check_grid(ctx, "Nyström landmarks", m, e.max(ev).max(m))?;
            // The two inner softmax stages.
            for stage in nystrom_stages(&d, fmt, &options) {
                stage.sdpa(None).plan(ctx)?;
            }
            Stage {
                q: (q_shape, fmt[0]),
                k: ([b, hq, m, e], f32s),
                v: ([b, hq, m, ev], f32s),
                options: options.clone(),
                path: var.path,
                weights: false,
                out,
                additive: false,
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

/// Nyström's inner softmax stages: A = softmax(s Q̃ K̃ᵀ) (the weights of an unfused call) and
/// B'V = softmax(s Q̃ Kᵀ) V.
fn nystrom_stages<'a>(d: &Dims, fmt: [Storage; 3], options: &Options<'a>) -> [Stage<'a>; 2] {
    let (b, hq, m, e) = (d.batch, d.hq, d.inner, d.e);
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
            additive: false,
        },
        Stage {
            q: ([b, hq, m, e], f32s),
            k: ([b, d.hkv, d.s, e], fmt[1]),
            v: ([b, d.hkv, d.s, d.ev], fmt[2]),
            options: options.clone(),
            path: Path::Auto,
            weights: false,
            out: f32s,
            additive: false,
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
    let q = Operand::check(ctx, "q", &var.q)?;
    let k = Operand::check(ctx, "k", &var.k)?;
    let v = Operand::check(ctx, "v", &var.v)?;
    let d = c.dims;
    let (b, hq, hkv, l, s, e, ev) = (d.batch, d.hq, d.hkv, d.l, d.s, d.e, d.ev);
    let [fq, fk, fv] = c.fmt;
    let f32s = Storage::F32;
    let dummy = crate::buffers::dummy(ctx);
    let upload = |label: &str, data: &[f32]| storage_init(ctx, label, bytemuck::cast_slice(data));
    let matrix = |label: &str, a: &Array2<f32>| {
        upload(label, &a.as_standard_layout().iter().copied().collect::<Vec<_>>())
    };
    let scratch = |label: &str, elems: usize| output(ctx, label, f32_bytes(elems.max(1)));
    let finish = |gpu: crate::sdpa::GpuOutput| GpuVariantOutput {
        output: gpu.output,
        shape: d.out_shape(),
        storage: c.out,
        weights: gpu.weights,
    };
    match var.params {
        VariantParams::General { w } => {
            let (q_up, w_buf) = (q.upload(ctx, "q"), matrix("w", w));
            let qw = scratch("q W", b * hq * l * e);
            // Q' = Q W: every (batch, head) slice of Q times the shared W.
            mm::Matmul {
                a: q_up.binding(),
                b: w_buf.as_entire_buffer_binding(),
                bias: None,
                c: binding(&qw, 0, f32_bytes(b * hq * l * e)),
                params: mm::Params {
                    b_batch: 0,
                    ..mm::Params::dense(l as u32, e as u32, e as u32, false, 1.0)
                },
                batch: (b * hq) as u32,
                trans_b: false,
                formats: [fq, f32s, f32s, f32s],
                accumulate: false,
                additive: false,
            }
            .record(ctx, encoder, &dummy)?;
            let qw_t = Tensor::from_buffer(&qw, crate::Storage::F32, &[b, hq, l, e]);
            let gpu = c
                .main
                .sdpa(Some([qw_t, var.k.clone(), var.v.clone()]))
                .record(ctx, encoder)?;
            Ok(finish(gpu))
        }
        VariantParams::Additive { w_q, w_k, u, b: bias } => {
            let a = d.inner;
            let (q_up, k_up) = (q.upload(ctx, "q"), k.upload(ctx, "k"));
            let (wq_buf, wk_buf) = (matrix("w_q", w_q), matrix("w_k", w_k));
            let padded = |x: Option<&ndarray::Array1<f32>>, factor: f32| {
                let mut p = vec![0f32; padded_u_len(a)];
                if let Some(x) = x {
                    for (dst, src) in p.iter_mut().zip(x) {
                        *dst = src * factor;
                    }
                }
                p
            };
            // The scale is folded into u; u is bound as a uniform (fused) or storage (unfused).
            let u_buf = crate::buffers::init(
                ctx,
                "u",
                bytemuck::cast_slice(&padded(Some(u), d.scale as f32)),
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::UNIFORM,
            );
            let b_buf = bias.as_ref().map(|x| upload("b", &padded(Some(x), 1.0)));
            let qa = scratch("W_q q + b", b * hq * l * a);
            let ka = scratch("W_k k", b * hkv * s * a);
            for (x, w, out, rows, fx, bias) in [
                (q_up.binding(), &wq_buf, &qa, b * hq * l, fq, b_buf.as_ref()),
                (k_up.binding(), &wk_buf, &ka, b * hkv * s, fk, None),
            ] {
                crate::mha::project(ctx, encoder, (x, fx), (w, bias), out, [rows, a, e], f32s, &dummy)?;
            }
            let tensors = [
                Tensor::from_buffer(&qa, crate::Storage::F32, &[b, hq, l, a]),
                Tensor::from_buffer(&ka, crate::Storage::F32, &[b, hkv, s, a]),
                var.v.clone(),
            ];
            let mut sdpa = c.main.sdpa(Some(tensors));
            sdpa.additive_u = Some(&u_buf);
            let gpu = sdpa.record(ctx, encoder)?;
            Ok(finish(gpu))
        }
        VariantParams::LowRankV { a } => {
            let gpu = c
                .main
                .sdpa(Some([var.q.clone(), var.k.clone(), var.v.clone()]))
                .record(ctx, encoder)?;
            let (r, ev_out) = (ev, a.ncols());
            let a_buf = matrix("a", a);
            let out_bytes = c.out.bytes(b * hq * l * ev_out);
            let out = output(ctx, "output", out_bytes);
            // (P U) A: one product over every row of every head.
            mm::Matmul {
                a: binding(&gpu.output, 0, f32_bytes(b * hq * l * r)),
                b: a_buf.as_entire_buffer_binding(),
                bias: None,
                c: binding(&out, 0, out_bytes),
                params: mm::Params::dense((b * hq * l) as u32, ev_out as u32, r as u32, false, 1.0),
                batch: 1,
                trans_b: false,
                formats: [f32s, f32s, f32s, c.out],
                accumulate: false,
                additive: false,
            }
            .record(ctx, encoder, &dummy)?;
            Ok(GpuVariantOutput {
                output: out,
                shape: d.out_shape(),
                storage: c.out,
                weights: gpu.weights,
            })
        }
        VariantParams::Linformer { e: ep, f: fp } => {
            let kp = d.inner;
            let (k_up, v_up) = (k.upload(ctx, "k"), v.upload(ctx, "v"));
            let (e_buf, f_buf) = (matrix("e", ep), matrix("f", fp));
            let kk = scratch("E_p K", b * hkv * kp * e);
            let vv = scratch("F_p V", b * hkv * kp * ev);
            for (proj, x, fx, out, n) in [(&e_buf, &k_up, fk, &kk, e), (&f_buf, &v_up, fv, &vv, ev)] {
                seq_project(
                    ctx,
                    encoder,
                    proj,
                    x.binding(),
                    fx,
                    out,
                    [kp, n, s],
                    [b * hkv, 1],
                    &dummy,
                )?;
            }
            let tensors = [
                var.q.clone(),
                Tensor::from_buffer(&kk, crate::Storage::F32, &[b, hkv, kp, e]),
                Tensor::from_buffer(&vv, crate::Storage::F32, &[b, hkv, kp, ev]),
            ];
            let gpu = c.main.sdpa(Some(tensors)).record(ctx, encoder)?;
            Ok(finish(gpu))
        }
        VariantParams::Nystrom { .. } => {
            let m = d.inner;
            let bh = b * hq;
            let (q_up, k_up) = (q.upload(ctx, "q"), k.upload(ctx, "k"));
            let ml = matrix("query segments", &VariantParams::segment_means(m, l));
            let ms = matrix("key segments", &VariantParams::segment_means(m, s));
            let qt = scratch("landmark queries", bh * m * e);
            let kt = scratch("landmark keys", bh * m * e);
            seq_project(
                ctx,
                encoder,
                &ml,
                q_up.binding(),
                fq,
                &qt,
                [m, e, l],
                [bh, 1],
                &dummy,
            )?;
            // One landmark-key slice per query head (grouped-query heads share their kv head's).
            seq_project(
                ctx,
                encoder,
                &ms,
                k_up.binding(),
                fk,
                &kt,
                [m, e, s],
                [bh, hq / hkv],
                &dummy,
            )?;
            let lm_shape = [b, hq, m, e];
            let [a_stage, bv_stage] = nystrom_stages(&d, c.fmt, &c.options);
            let a_out = a_stage
                .sdpa(Some([
                    Tensor::from_buffer(&qt, crate::Storage::F32, &lm_shape),
                    Tensor::from_buffer(&kt, crate::Storage::F32, &lm_shape),
                    Tensor::from_buffer(&kt, crate::Storage::F32, &lm_shape),
                ]))
                .record(ctx, encoder)?;
            let a_mat = a_out.weights.expect("A's stage returns its weights");
            let bv = bv_stage
                .sdpa(Some([
                    Tensor::from_buffer(&qt, crate::Storage::F32, &lm_shape),
                    k_up.tensor(&[b, hkv, s, e], fk),
                    var.v.clone(),
                ]))
                .record(ctx, encoder)?;
            // Z ≈ pinv(A): Z0 = Aᵀ / (‖A‖₁ ‖A‖∞), then Z ← ¼ Z (13I − AZ (15I − AZ (7I − AZ))).
            let mm_elems = bh * m * m;
            fn whole(buf: &wgpu::Buffer) -> wgpu::BufferBinding<'_> {
                buf.as_entire_buffer_binding()
            }
            let mat = whole;
            let mut z = scratch("Z", mm_elems);
            let mut z_next = scratch("Z next", mm_elems);
            let (az, t, u) = (
                scratch("A Z", mm_elems),
                scratch("T", mm_elems),
                scratch("U", mm_elems),
            );
            pinv::record_init(ctx, encoder, mat(&a_mat), mat(&z), m, bh)?;
            let product = |enc: &mut wgpu::CommandEncoder,
                           x: &wgpu::Buffer,
                           y: &wgpu::Buffer,
                           out: &wgpu::Buffer,
                           alpha: f32| {
                mm::Matmul {
                    a: mat(x),
                    b: mat(y),
                    bias: None,
                    c: mat(out),
                    params: mm::Params::dense(m as u32, m as u32, m as u32, false, alpha),
                    batch: bh as u32,
                    trans_b: false,
                    formats: [f32s; 4],
                    accumulate: false,
                    additive: false,
                }
                .record(ctx, enc, &dummy)
            };
            for _ in 0..var.pinv_iters {
                product(encoder, &a_mat, &z, &az, 1.0)?;
                pinv::record_eye_minus(ctx, encoder, [mat(&az), mat(&t)], m, bh, 7.0)?;
                product(encoder, &az, &t, &u, 1.0)?;
                pinv::record_eye_minus(ctx, encoder, [mat(&u), mat(&t)], m, bh, 15.0)?;
                product(encoder, &az, &t, &u, 1.0)?;
                pinv::record_eye_minus(ctx, encoder, [mat(&u), mat(&t)], m, bh, 13.0)?;
                product(encoder, &z, &t, &z_next, 0.25)?;
                std::mem::swap(&mut z, &mut z_next);
            }
            // W = Z (B'V), then out = softmax(s Q K̃ᵀ) W.
            let w = scratch("Z B'V", bh * m * ev);
            mm::Matmul {
                a: mat(&z),
                b: binding(&bv.output, 0, f32_bytes(bh * m * ev)),
                bias: None,
                c: binding(&w, 0, f32_bytes(bh * m * ev)),
                params: mm::Params::dense(m as u32, ev as u32, m as u32, false, 1.0),
                batch: bh as u32,
                trans_b: false,
                formats: [f32s; 4],
                accumulate: false,
                additive: false,
            }
            .record(ctx, encoder, &dummy)?;
            let gpu = c
                .main
                .sdpa(Some([
                    q_up.tensor(&[b, hq, l, e], fq),
                    Tensor::from_buffer(&kt, crate::Storage::F32, &lm_shape),
                    Tensor::from_buffer(&w, crate::Storage::F32, &[b, hq, m, ev]),
                ]))
                .record(ctx, encoder)?;
            Ok(finish(gpu))
        }
    }
}

/// Record `out[z] = P · X[z]` along the sequence: P `[rows, len]` (f32, shared), X slices
/// `[len, n]` in format `fx`, `mnk = [rows, n, len]`; `[batch, group]`: `batch` output slices,
/// slice z reading X slice `z / group` (grouped-query heads sharing a kv head).
#[allow(clippy::too_many_arguments)] // each is a distinct operand
fn seq_project(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &wgpu::Buffer,
    x: wgpu::BufferBinding<'_>,
    fx: Storage,
    out: &wgpu::Buffer,
    [rows, n, len]: [usize; 3],
    [batch, group]: [usize; 2],
    dummy: &wgpu::Buffer,
) -> Result<()> {
    let f32s = Storage::F32;
    mm::Matmul {
        a: p.as_entire_buffer_binding(),
        b: x,
        bias: None,
        c: binding(out, 0, f32_bytes(batch * rows * n)),
        params: mm::Params {
            a_batch: 0,
            // Slice z reads X slice z / group: heads = group, so (z / heads) (heads / group) = z / group.
            heads: group as u32,
            group: group as u32,
            ..mm::Params::dense(rows as u32, n as u32, len as u32, false, 1.0)
        }
        .split_heads(),
        batch: batch as u32,
        trans_b: false,
        formats: [f32s, fx, f32s, f32s],
        accumulate: false,
        additive: false,
    }
    .record(ctx, encoder, dummy)
}
