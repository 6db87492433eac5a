//! Recording one backward, the part both paths share: every size checked before GPU work,
//! the forward (unless its output and logsumexp are given), the uploads, the statistics
//! (`bwd_prep`), then the path's recorder, dK and dV in their formats, and d(bias).

use crate::device::buffers::{binding, dummy, f32_bytes, fits, output, Operand};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::kernels::backward as kb;
use crate::ops::copy;
use crate::problem::Problem;
use crate::sdpa::bindings::pack_mask;
use crate::sdpa::Path;
use crate::storage::Storage;

use super::io::Io;
use super::plan::{check_workgroups, fused_grids, plan, Plan};
use super::{Backward, GpuGrads};

/// [`Backward::record`].
pub(super) fn record(
    bw: &Backward<'_>,
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
) -> Result<GpuGrads> {
    let p = bw.problem()?;
    let plan = plan(&p, bw.path, &ctx.caps())?;
    // Every input, size and grid checked before any GPU work.
    let inputs = Inputs::check(bw, ctx)?;
    let packed_mask = bw.sdpa.options.mask.as_ref().map(|m| pack_mask(&p, m));
    let sizes = Sizes::new(&p);
    sizes.check(ctx, &p, &plan, packed_mask.as_ref().map(|(w, _)| w.len()))?;

    let forward = match inputs.saved {
        Some(_) => None,
        None => Some(record_forward(bw, ctx, encoder, plan.path())?),
    };
    let [q, k, v, dout] = [
        (inputs.q, "q"),
        (inputs.k, "k"),
        (inputs.v, "v"),
        (inputs.dout, "dout"),
    ]
    .map(|(x, name)| x.upload(ctx, name));
    let bias = inputs.bias.map(|b| b.upload(ctx, "bias"));
    let saved = inputs
        .saved
        .map(|(o, l)| (o.upload(ctx, "output"), l.upload(ctx, "lse")));
    let (o_fmt, o_bind, lse_bind) = match (&saved, &forward) {
        (Some((o, l)), _) => (inputs.saved_format, o.binding(), l.binding()),
        (None, Some(fw)) => (
            fw.problem.storage.out,
            fw.output_binding(),
            fw.lse.as_entire_buffer_binding(),
        ),
        (None, None) => unreachable!("the forward runs when nothing is saved"),
    };
    let dummy = dummy(ctx);
    // The dQ kernel reads a mask_mod's block map as the fused forward does.
    let map = matches!(plan, Plan::Fused(_)) && p.has_mask_mod();
    let (mask_buf, map_at) =
        crate::sdpa::bindings::mask_binding(ctx, encoder, &p, packed_mask.as_ref(), map)?;
    let params = kb::Params::new(&p, packed_mask.as_ref().map(|(_, st)| *st), sizes.dv_off);
    let params = match map_at {
        Some(at) => params.with_mod_map(at, p.q_heads),
        None => params,
    };

    let stats = record_stats(
        ctx,
        encoder,
        (&p, &sizes),
        &params,
        [o_bind, dout.binding(), lse_bind],
        o_fmt,
    )?;
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
    let (dq, dkv) = record_grads(ctx, encoder, (&p, &plan, &sizes), &io, &params)?;
    // dK and dV in k's and v's formats.
    let (kv, dv_at) = (sizes.kv_rows, f32_bytes(sizes.dv_off));
    let dk = convert(ctx, encoder, ("dk", &dkv, 0), kv * p.head_dim, p.storage.k)?;
    let dv = convert(ctx, encoder, ("dv", &dkv, dv_at), kv * p.head_dim_v, p.storage.v)?;
    let [dbias, dsink, dcaptures] = record_extras(ctx, encoder, &p, bw.dbias, (&io, &params))?;
    Ok(GpuGrads {
        dq,
        dk,
        dv,
        dbias,
        dsink,
        dcaptures,
        forward,
        problem: p,
    })
}

/// dQ (in q's format) and dK, dV (f32, in one buffer, dV at `sizes.dv_off`) by the plan's path.
fn record_grads(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    (p, plan, sizes): (&Problem, &Plan, &Sizes),
    io: &Io<'_>,
    params: &kb::Params,
) -> Result<(wgpu::Buffer, wgpu::Buffer)> {
    let dq = output(ctx, "dq", p.storage.q.bytes(sizes.rows * p.head_dim));
    let dkv = output(ctx, "dk and dv", sizes.dkv_bytes);
    match plan {
        Plan::Fused(cfg) => super::fused::record(ctx, encoder, (p, cfg), io, params, [&dkv, &dq])?,
        Plan::Unfused(chunks) => {
            encoder.clear_buffer(&dkv, 0, None);
            super::unfused::record(ctx, encoder, (p, chunks), io, params, [&dkv, &dq], sizes.dv_off)?;
        }
    }
    Ok((dq, dkv))
}

/// The forward, when O and the logsumexp are not given. Under Path::Auto it runs on the
/// backward's path (`path`), so that the backward recomputes each logit with the arithmetic
/// that made the logsumexp (at logits of 1e4, f32 rounding differences between kernels are
/// 1e-3 in P).
fn record_forward(
    bw: &Backward<'_>,
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    path: Path,
) -> Result<crate::sdpa::GpuOutput> {
    if bw.sdpa.path == Path::Auto {
        bw.sdpa.clone().path(path).record(ctx, encoder)
    } else {
        bw.sdpa.record(ctx, encoder)
    }
}

/// The backward's inputs, checked against the device (nothing uploaded yet).
struct Inputs<'t, 'a> {
    q: Operand<'t, 'a>,
    k: Operand<'t, 'a>,
    v: Operand<'t, 'a>,
    dout: Operand<'t, 'a>,
    bias: Option<Operand<'t, 'a>>,
    /// The saved output and logsumexp, and the output's format.
    saved: Option<(Operand<'t, 'a>, Operand<'t, 'a>)>,
    saved_format: Storage,
}

impl<'t, 'a> Inputs<'t, 'a> {
    fn check(bw: &'t Backward<'a>, ctx: &Context) -> Result<Self> {
        // In the order the errors are reported: q, k, v, dO, the bias, the saved tensors.
        let s = &bw.sdpa;
        let q = Operand::check_viewed(ctx, "q", &s.q)?;
        let k = Operand::check_viewed(ctx, "k", &s.k)?;
        let v = Operand::check_viewed(ctx, "v", &s.v)?;
        let dout = Operand::check_viewed(ctx, "dout", &bw.dout)?;
        let bias = s
            .options
            .bias
            .as_ref()
            .map(|b| Operand::check_bias(ctx, b))
            .transpose()?;
        let saved = bw
            .saved
            .as_ref()
            .map(|(o, l)| {
                Ok::<_, Error>((
                    Operand::check_viewed(ctx, "output", o)?,
                    Operand::check(ctx, "lse", l)?,
                ))
            })
            .transpose()?;
        Ok(Inputs {
            q,
            k,
            v,
            dout,
            bias,
            saved,
            saved_format: bw.saved.as_ref().map_or(Storage::F32, |(o, _)| o.storage()),
        })
    }
}

/// The sizes of the backward's buffers.
pub(super) struct Sizes {
    /// Query rows of every head.
    pub(super) rows: usize,
    /// Key rows of every kv head.
    pub(super) kv_rows: usize,
    /// Where dV starts in the f32 dK/dV buffer (elements).
    pub(super) dv_off: usize,
    /// lse and D per query row, then the key lengths.
    pub(super) stats_len: usize,
    pub(super) dkv_bytes: u64,
}

impl Sizes {
    pub(super) fn new(p: &Problem) -> Self {
        let rows = p.batch_heads() * p.seq_q;
        let kv_rows = p.batch * p.kv_heads * p.seq_kv;
        let dv_off = (kv_rows * p.head_dim).next_multiple_of(64);
        Sizes {
            rows,
            kv_rows,
            dv_off,
            stats_len: 2 * rows + crate::kernels::aux::words(p).map_or(p.batch, |w| w.len()),
            dkv_bytes: f32_bytes(dv_off + kv_rows * p.head_dim_v).next_multiple_of(16),
        }
    }

    /// Check every buffer (and the packed mask's `mask_words`) against the device's binding
    /// limit, and every grid against its workgroup limit.
    fn check(&self, ctx: &Context, p: &Problem, plan: &Plan, mask_words: Option<usize>) -> Result<()> {
        let max = ctx.max_binding();
        let fit = |what: &str, bytes: u64| fits(what, bytes, max, "max_storage_buffer_binding_size");
        fit("backward statistics", f32_bytes(self.stats_len))?;
        fit("dq", p.storage.q.bytes(self.rows * p.head_dim))?;
        fit("dk and dv (f32)", self.dkv_bytes)?;
        if let Some(words) = mask_words {
            fit("packed mask", f32_bytes(words))?;
        }
        if matches!(plan, Plan::Fused(_)) && p.has_mask_mod() {
            crate::sdpa::bindings::fit_mod_map(ctx, p, mask_words.unwrap_or(0))?;
        }
        let dcap = dcap_workgroups(p, max);
        if dcap > 0 {
            let n = p.capture_len();
            fit("capture gradient partials", f32_bytes(dcap * n))?;
        }
        if let Plan::Unfused(c) = plan {
            fit("scores chunk", f32_bytes(c.heads * c.rows * p.seq_kv))?;
        }
        // Every grid: the row and bias kernels' (64 invocations each) and the fused kernels'.
        let grids = match plan {
            Plan::Fused(cfg) => fused_grids(p, cfg),
            Plan::Unfused(_) => [(0, 0); 2],
        };
        let caps = p.capture_len();
        [
            self.rows.div_ceil(64),
            p.bias.map_or(0, |b| b.len()).div_ceil(64),
            caps.div_ceil(64),
        ]
        .into_iter()
        .chain(grids.map(|(_, total)| total))
        .try_for_each(|n| check_workgroups(ctx, n))
    }
}

/// The statistics (lse and D per query row by `bwd_prep`, from O, dO and the forward's
/// logsumexp: `rows` = `[o, dout, lse]` with O in `o_fmt`), then the key lengths (written by
/// the host).
pub(super) fn record_stats(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    (p, sizes): (&Problem, &Sizes),
    params: &kb::Params,
    [o, dout, lse]: [wgpu::BufferBinding<'_>; 3],
    o_fmt: Storage,
) -> Result<wgpu::Buffer> {
    let stats = output(ctx, "backward statistics", f32_bytes(sizes.stats_len));
    if let Some(words) = crate::kernels::aux::words(p) {
        ctx.queue()
            .write_buffer(&stats, f32_bytes(2 * sizes.rows), bytemuck::cast_slice(&words));
    }
    kb::record(
        ctx,
        encoder,
        &kb::PREP,
        &kb::prep_prelude(o_fmt, p.storage.out, &p.views),
        &[o, dout, lse, stats.as_entire_buffer_binding()],
        &params.over(sizes.rows),
        sizes.rows.div_ceil(64) as u32,
        crate::kernels::Checks::of(p),
    )?;
    Ok(stats)
}

/// Record d(bias), d(sink logits) and the captures' gradients, where the problem has them.
fn record_extras(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    want_dbias: bool,
    (io, params): (&Io<'_>, &kb::Params),
) -> Result<[Option<wgpu::Buffer>; 3]> {
    let dbias = p
        .bias
        .filter(|_| want_dbias)
        .map(|bc| record_dbias(ctx, encoder, p, bc.len(), (io, params)))
        .transpose()?;
    let dsink = p
        .sink_logits
        .as_ref()
        .map(|sk| record_dsink(ctx, encoder, sk.len(), io.stats.buffer, params))
        .transpose()?;
    Ok([dbias, dsink, record_dcap(ctx, encoder, p, (io, params))?])
}

/// Record d(bias) (`n` elements of the bias's broadcast shape, in its format) by `bwd_dbias`.
pub(super) fn record_dbias(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    n: usize,
    (io, params): (&Io<'_>, &kb::Params),
) -> Result<wgpu::Buffer> {
    let buf = output(ctx, "dbias", p.storage.bias.bytes(n));
    kb::record(
        ctx,
        encoder,
        &kb::DBIAS,
        &kb::dbias_prelude(p, &ctx.tuning()),
        &io.with_out(buf.as_entire_buffer_binding()),
        &params.over(n),
        n.div_ceil(64) as u32,
        crate::kernels::Checks::of(p),
    )?;
    Ok(buf)
}

/// Record d(sink logits) (`heads` of them, f32) by `bwd_dsink` from the statistics.
pub(super) fn record_dsink(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    heads: usize,
    stats: &wgpu::Buffer,
    params: &kb::Params,
) -> Result<wgpu::Buffer> {
    let buf = output(ctx, "dsink", f32_bytes(heads));
    kb::record(
        ctx,
        encoder,
        &kb::DSINK,
        &Default::default(),
        &[stats.as_entire_buffer_binding(), buf.as_entire_buffer_binding()],
        params,
        heads as u32,
        crate::kernels::Checks::Kernel,
    )?;
    Ok(buf)
}

/// The most bytes of per-workgroup partial sums the capture gradients take.
const DCAP_PARTIALS: u64 = 64 << 20;

/// The capture-gradient kernel's workgroups for `p` (each owns a slice of partial sums of
/// every capture element): one per chunk of 64 keys of a score row, at most 1024 and as many
/// slices as fit [`DCAP_PARTIALS`] and the binding limit `max_binding`; 0 without a
/// `score_mod_dcapture`.
pub(super) fn dcap_workgroups(p: &Problem, max_binding: u64) -> usize {
    let Some(u) = p.user_fns.as_ref().filter(|u| u.dcapture) else {
        return 0;
    };
    let chunks = p.batch_heads() * p.seq_q * p.seq_kv.div_ceil(64);
    let fit = DCAP_PARTIALS.min(max_binding) / f32_bytes(u.capture_len()).max(4);
    chunks.min(1024).min(fit as usize).max(1)
}

/// Record the captures' gradients (f32, packed in the captures' order) by `bwd_dcap` and
/// `bwd_dcap_sum`, when the source defines `score_mod_dcapture`.
pub(super) fn record_dcap(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    (io, params): (&Io<'_>, &kb::Params),
) -> Result<Option<wgpu::Buffer>> {
    let Some(prelude) = kb::dcap_prelude(p, &ctx.tuning()) else {
        return Ok(None);
    };
    let w = dcap_workgroups(p, ctx.max_binding());
    let n = p.capture_len();
    let partials = output(ctx, "capture gradient partials", f32_bytes(w * n));
    kb::record(
        ctx,
        encoder,
        &kb::DCAP,
        &prelude,
        &io.with_out(partials.as_entire_buffer_binding()),
        &params.over(w),
        w as u32,
        crate::kernels::Checks::of(p),
    )?;
    let buf = output(ctx, "dcaptures", f32_bytes(n));
    kb::record(
        ctx,
        encoder,
        &kb::DCAP_SUM,
        &Default::default(),
        &[
            partials.as_entire_buffer_binding(),
            buf.as_entire_buffer_binding(),
        ],
        &params.over(w),
        n.div_ceil(64) as u32,
        crate::kernels::Checks::of(p),
    )?;
    Ok(Some(buf))
}

/// `elems` f32 values at byte `offset` of `src` as a new buffer in format `to` (a copy for f32).
fn convert(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    (label, src, offset): (&str, &wgpu::Buffer, u64),
    elems: usize,
    to: Storage,
) -> Result<wgpu::Buffer> {
    let dst = output(ctx, label, to.bytes(elems));
    if to == Storage::F32 {
        encoder.copy_buffer_to_buffer(src, offset, &dst, 0, f32_bytes(elems));
    } else {
        copy::convert(
            ctx,
            encoder,
            (binding(src, offset, f32_bytes(elems)), Storage::F32),
            (dst.as_entire_buffer_binding(), to),
            elems,
        )?;
    }
    Ok(dst)
}
