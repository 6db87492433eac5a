//! Recording one attention call: validating sizes against the device, uploading the inputs
//! and recording the kernels of the planned path (unfused, fused or decode).

use crate::device::buffers::{binding, dummy, f32_bytes, fits, output, scratch, storage_init, Operand};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::kernels::{decode, flash, softmax, Masks, TensorViews};
use crate::ops::matmul::Matmul;
use crate::ops::{merge, Mats};
use crate::problem::Problem;
use crate::sdpa::bindings::{fit_mod_map, mask_binding, pack_mask};
use crate::storage::Storage;

use super::plan::{ChunkPlan, Kernel, Plan};
use super::{GpuOutput, Sdpa};

/// [`Sdpa::record`]: plan once, validate every size against the device, upload, record.
pub(crate) fn record(sdpa: &Sdpa, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<GpuOutput> {
    let p = sdpa.problem()?;
    let plan = Plan::new(&p, &sdpa.request(), &ctx.caps())?;
    record_planned(sdpa, ctx, encoder, p, plan)
}

/// [`record`] with the problem and plan made already (by a caller that checked every call of
/// a batch before recording any: `PagedAttention`).
pub(crate) fn record_planned(
    sdpa: &Sdpa,
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: Problem,
    plan: Plan,
) -> Result<GpuOutput> {
    let max_binding = ctx.max_binding();
    let binding_limit = "max_storage_buffer_binding_size";

    // Validate every size against the device before creating anything.
    let q = Operand::check_viewed(ctx, "q", &sdpa.q)?;
    let k = Operand::check_viewed(ctx, "k", &sdpa.k)?;
    let v = Operand::check_viewed(ctx, "v", &sdpa.v)?;
    let scales = scale_operands(ctx, sdpa)?;
    let bias = sdpa
        .options
        .bias
        .as_ref()
        .map(|b| Operand::check_bias(ctx, b))
        .transpose()?;
    let out_bytes = p.storage.out.bytes(p.out_shape().iter().product());
    fits("output", out_bytes, max_binding, binding_limit)?;
    let out_op = sdpa
        .out
        .as_ref()
        .map(|t| Operand::check_viewed(ctx, "output", t))
        .transpose()?;
    if let Some(t) = &sdpa.lse_out {
        Operand::check(ctx, "lse", t)?;
    }
    let weights_bytes = f32_bytes(p.batch_heads() * p.seq_q * p.seq_kv);
    if sdpa.weights {
        fits(
            "attention weights",
            weights_bytes,
            ctx.limits().max_buffer_size,
            "max_buffer_size",
        )?;
    }
    let (packed_mask, mod_map) = masks_fit(sdpa, ctx, &p, &plan)?;

    // Buffers.
    let q = q.upload(ctx, "q");
    let k = k.upload(ctx, "k");
    let v = v.upload(ctx, "v");
    let scales: Vec<_> = scales.into_iter().map(|s| s.upload(ctx, "scales")).collect();
    let bias = bias.map(|b| b.upload(ctx, "bias"));
    let dummy = dummy(ctx);
    let lens_buf = aux_buffer(sdpa, ctx, &p);
    copy_capture_buffers(encoder, &p, &sdpa.capture_buffers, lens_buf.as_ref())?;
    let (mask_buf, map_at) = mask_binding(ctx, encoder, &p, packed_mask.as_ref(), mod_map)?;
    let out_up = out_op.as_ref().map(|o| o.upload(ctx, "output"));
    let (out_buf, out_off) = match sdpa.out_buffer() {
        Some((b, off)) => (b.clone(), off),
        None => (output(ctx, "output", out_bytes), 0),
    };
    let lse_bytes = f32_bytes(p.batch_heads() * p.seq_q);
    let (lse_buf, lse_off) = match sdpa.lse_out.as_ref().map(|t| &t.data) {
        Some(crate::tensor::TensorData::Gpu { buffer, offset, .. }) => ((*buffer).clone(), *offset),
        _ => (output(ctx, "lse", lse_bytes), 0),
    };
    let weights_buf = sdpa.weights.then(|| output(ctx, "weights", weights_bytes));

    let io = Io {
        q: q.binding(),
        k: k.binding(),
        v: v.binding(),
        scales: scales
            .iter()
            .map(|s| scales_binding(s, ctx.max_binding()))
            .collect(),
        bias: bias.as_ref().map(|b| b.binding()),
        mask: mask_buf
            .as_ref()
            .map(|b| (b, packed_mask.as_ref().map_or([0; 3], |(_, st)| *st))),
        map_at,
        lens: lens_buf.as_ref(),
        out: out_up
            .as_ref()
            .map_or_else(|| binding(&out_buf, 0, out_bytes), |u| u.binding()),
        lse: binding(&lse_buf, lse_off, lse_bytes),
        weights: weights_buf.as_ref(),
        dummy: &dummy,
    };
    match &plan.kernel {
        Kernel::Unfused(chunks) => record_unfused(ctx, encoder, &p, chunks, &io)?,
        Kernel::Fused(cfg) => record_fused(ctx, encoder, &p, cfg, &io)?,
        Kernel::Decode(cfg) => record_decode(ctx, encoder, &p, cfg, &io)?,
    }
    Ok(GpuOutput {
        output: out_buf,
        output_offset: out_off,
        lse: lse_buf,
        lse_offset: lse_off,
        weights: weights_buf,
        problem: p,
    })
}

/// A scales tensor's binding: a caller's buffer from its offset to its end (a cache read
/// through a view finds its rows' scales past the shape's count: `quant::check` checked that
/// the buffer reaches them; at most `max` bytes, the device's binding limit), host scales as
/// uploaded.
fn scales_binding<'b>(s: &'b crate::device::buffers::Uploaded<'_>, max: u64) -> wgpu::BufferBinding<'b> {
    match s {
        crate::device::buffers::Uploaded::Borrowed(b, off, _) => {
            binding(b, *off, (b.size() - off).min(max) & !3)
        }
        owned => owned.binding(),
    }
}

/// An 8-bit K's scales, then an 8-bit V's, checked against the device: what the kernels bind
/// after their own bindings.
fn scale_operands<'t, 'a>(ctx: &Context, sdpa: &'t Sdpa<'a>) -> Result<Vec<Operand<'t, 'a>>> {
    [("k scales", &sdpa.k), ("v scales", &sdpa.v)]
        .into_iter()
        .filter_map(|(name, t)| t.scales().map(|s| Operand::check(ctx, name, s)))
        .collect()
}

/// The packed boolean mask (its words and strides) and whether the fused kernel reads a
/// mask_mod's block map (cached, after the packed mask if any), both checked against the
/// device's binding size.
#[allow(clippy::type_complexity)]
fn masks_fit(
    sdpa: &Sdpa,
    ctx: &Context,
    p: &Problem,
    plan: &Plan,
) -> Result<(Option<(Vec<u32>, [u32; 3])>, bool)> {
    let packed_mask = sdpa.options.mask.as_ref().map(|m| pack_mask(p, m));
    if let Some((words, _)) = &packed_mask {
        fits(
            "packed mask",
            f32_bytes(words.len()),
            ctx.max_binding(),
            "max_storage_buffer_binding_size",
        )?;
    }
    let mod_map = matches!(plan.kernel, Kernel::Fused(_)) && p.has_mask_mod();
    if mod_map {
        fit_mod_map(ctx, p, packed_mask.as_ref().map_or(0, |(w, _)| w.len()))?;
    }
    Ok((packed_mask, mod_map))
}

/// The auxiliary words' buffer (binding 2), if the problem has any: constant (cached by its
/// bytes) unless capture values are copied into it.
fn aux_buffer(sdpa: &Sdpa, ctx: &Context, p: &Problem) -> Option<wgpu::Buffer> {
    crate::kernels::aux::words(p).map(|w| match sdpa.capture_buffers.is_empty() {
        true => crate::device::buffers::constant(
            ctx,
            "kv_lens",
            bytemuck::cast_slice(&w),
            wgpu::BufferUsages::STORAGE,
        ),
        false => storage_init(ctx, "kv_lens", bytemuck::cast_slice(&w)),
    })
}

/// Copy the captures whose values GPU buffers hold ([`Sdpa::capture_buffers`]) into their
/// places in the auxiliary buffer `aux` (where [`crate::kernels::aux::words`] put stand-ins).
fn copy_capture_buffers(
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    buffers: &[(usize, &wgpu::Buffer)],
    aux: Option<&wgpu::Buffer>,
) -> Result<()> {
    if buffers.is_empty() {
        return Ok(());
    }
    let (Some(u), Some(aux)) = (&p.user_fns, aux) else {
        return Err(Error::Internal("capture buffers without user functions".into()));
    };
    for &(k, src) in buffers {
        if k >= u.captures.len() {
            return Err(Error::Internal(format!("capture buffer for capture {k}")));
        }
        let (at, len) = u.capture_span(k, crate::kernels::aux::aux_tail(p));
        if src.size() < f32_bytes(len) {
            return Err(Error::Internal(format!(
                "capture buffer {k} is smaller than its capture"
            )));
        }
        encoder.copy_buffer_to_buffer(src, 0, aux, f32_bytes(at), f32_bytes(len));
    }
    Ok(())
}

/// Everything bound by the kernels of one attention call.
struct Io<'b> {
    q: wgpu::BufferBinding<'b>,
    k: wgpu::BufferBinding<'b>,
    v: wgpu::BufferBinding<'b>,
    /// An 8-bit K's scales, then an 8-bit V's (bound after the kernels' own bindings).
    scales: Vec<wgpu::BufferBinding<'b>>,
    bias: Option<wgpu::BufferBinding<'b>>,
    mask: Option<(&'b wgpu::Buffer, [u32; 3])>,
    lens: Option<&'b wgpu::Buffer>,
    out: wgpu::BufferBinding<'b>,
    lse: wgpu::BufferBinding<'b>,
    weights: Option<&'b wgpu::Buffer>,
    dummy: &'b wgpu::Buffer,
    /// Where the mask_mod block map starts in binding 0 (words), when the kernels read one.
    map_at: Option<usize>,
}

impl<'b> Io<'b> {
    /// The mask, bias and key-length bindings (bindings 0-2 of every masked kernel), with the
    /// dummy buffer where one is absent.
    fn mask_bindings(&self) -> [wgpu::BufferBinding<'b>; 3] {
        [
            self.mask
                .map_or(self.dummy, |(b, _)| b)
                .as_entire_buffer_binding(),
            self.bias.clone().unwrap_or(self.dummy.as_entire_buffer_binding()),
            self.lens.unwrap_or(self.dummy).as_entire_buffer_binding(),
        ]
    }

    /// [`Io::mask_bindings`], then q, k, v, then the two outputs `a` and `b`, then an 8-bit
    /// cache's scales: the bindings of the fused and decode kernels.
    fn attention(
        &self,
        a: wgpu::BufferBinding<'b>,
        b: wgpu::BufferBinding<'b>,
    ) -> Vec<wgpu::BufferBinding<'b>> {
        let [mask, bias, lens] = self.mask_bindings();
        let mut all = vec![
            mask,
            bias,
            lens,
            self.q.clone(),
            self.k.clone(),
            self.v.clone(),
            a,
            b,
        ];
        all.extend(self.scales.iter().cloned());
        all
    }

    /// The kernels' masks for `p`.
    fn masks(&self, p: &Problem) -> Masks {
        let m = Masks::new(p, self.mask.map(|(_, st)| st));
        match self.map_at {
            Some(word) => m.with_mod_map(word, p.q_heads),
            None => m,
        }
    }
}

fn record_unfused(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    chunks: &ChunkPlan,
    io: &Io,
) -> Result<()> {
    let bh = p.batch_heads();
    let scores = output(
        ctx,
        "scores chunk",
        f32_bytes(chunks.heads * chunks.rows * p.seq_kv),
    );
    let masks = io.masks(p);
    let [qv, kv, vv, ov, _] = p.views_or_dense();
    for z0 in (0..bh).step_by(chunks.heads) {
        let nz = chunks.heads.min(bh - z0);
        for i0 in (0..p.seq_q).step_by(chunks.rows) {
            let lc = chunks.rows.min(p.seq_q - i0);
            let chunk_bytes = f32_bytes(nz * lc * p.seq_kv);
            let sc = binding(&scores, 0, chunk_bytes);
            // 1. scores = scale * Q K^T: rows i0.. of each head's Q,
            // that head's K (GQA)
            let qk = Matmul::new(
                Mats::view(io.q.clone(), p.storage.q, qv, i0, [lc, p.head_dim]).starting_at(z0),
                Mats::view(io.k.clone(), p.storage.k, kv, 0, [p.seq_kv, p.head_dim]).starting_at(z0),
                Mats::dense(sc.clone(), Storage::F32, lc, p.seq_kv),
            )
            .trans_b(true)
            .alpha(p.scale)
            .slices(nz)
            .heads(p.q_heads, p.group());
            qk.record(ctx, encoder)?;
            // 2. masked softmax in place, logsumexp out
            let [mask, bias, lens] = io.mask_bindings();
            let chunk = softmax::Chunk {
                z0,
                heads: nz,
                i0,
                rows: lc,
            };
            let bindings = [mask, bias, lens, sc.clone(), io.lse.clone()];
            softmax::record(ctx, encoder, (p, masks), bindings, chunk)?;
            // 3. the weights, if asked for: this chunk is one contiguous block of [BH, L, S]
            if let Some(w) = io.weights {
                let dst = f32_bytes((z0 * p.seq_q + i0) * p.seq_kv);
                encoder.copy_buffer_to_buffer(&scores, 0, w, dst, chunk_bytes);
            }
            // 4. O = P V into rows i0.. of each head's output
            Matmul::new(
                Mats::dense(sc, Storage::F32, lc, p.seq_kv),
                Mats::view(io.v.clone(), p.storage.v, vv, 0, [p.seq_kv, p.head_dim_v]).starting_at(z0),
                Mats::view(io.out.clone(), p.storage.out, ov, i0, [lc, p.head_dim_v]).starting_at(z0),
            )
            .slices(nz)
            .heads(p.q_heads, p.group())
            .record(ctx, encoder)?;
        }
    }
    Ok(())
}

fn record_fused(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    cfg: &flash::Config,
    io: &Io,
) -> Result<()> {
    let cfg = cfg.clone().for_now(ctx);
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
    let buffers = io.attention(io.out.clone(), io.lse.clone());
    flash::record(
        ctx,
        encoder,
        &cfg,
        &buffers,
        &flash::Params {
            m: io.masks(p),
            x: TensorViews::new(p),
            l: p.seq_q as u32,
            s: p.seq_kv as u32,
            e: p.head_dim as u32,
            ev: p.head_dim_v as u32,
            heads: p.q_heads as u32,
            group: p.group() as u32,
            q_tiles,
            total: total as u32,
            scale: p.scale,
            ..Default::default()
        },
    )
}

fn record_decode(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    p: &Problem,
    cfg: &decode::Config,
    io: &Io,
) -> Result<()> {
    let rows = p.batch_heads() * p.seq_q;
    let part_bytes = f32_bytes(cfg.splits * rows * p.head_dim_v);
    fits(
        "decode partial outputs",
        part_bytes,
        ctx.max_binding(),
        "max_storage_buffer_binding_size",
    )?;
    let total = cfg.splits as u64 * rows as u64;
    let max = ctx.limits().max_compute_workgroups_per_dimension as u64;
    fits(
        "decode workgroups",
        total,
        max * max,
        "max_compute_workgroups_per_dimension (squared)",
    )?;
    // Pooled by size: a repeated call allocates nothing (see `device/cache.rs`).
    let pooled =
        |label: &'static str, bytes: u64| ctx.cache().scratch(label, bytes, || scratch(ctx, label, bytes));
    let part_out = pooled("decode partial outputs", part_bytes);
    let part_lse = pooled("decode partial lse", f32_bytes(cfg.splits * rows));
    decode::record_decode(
        ctx,
        encoder,
        cfg,
        io.attention(
            part_out.as_entire_buffer_binding(),
            part_lse.as_entire_buffer_binding(),
        ),
        &decode::Params {
            m: io.masks(p),
            x: TensorViews::new(p),
            l: p.seq_q as u32,
            s: p.seq_kv as u32,
            e: p.head_dim as u32,
            ev: p.head_dim_v as u32,
            heads: p.q_heads as u32,
            group: p.group() as u32,
            splits: cfg.splits as u32,
            total: total as u32,
            scale: p.scale,
            chunk: cfg.chunk as u32,
            ..Default::default()
        },
    )?;
    merge::record(
        ctx,
        encoder,
        &merge::Parts {
            outputs: part_out.as_entire_buffer_binding(),
            storage: Storage::F32,
            lses: part_lse.as_entire_buffer_binding(),
            splits: cfg.splits,
        },
        &merge::Merged {
            output: io.out.clone(),
            storage: p.storage.out,
            view: p.views.out.map(|v| (v, [p.q_heads, p.seq_q])),
            lse: io.lse.clone(),
        },
        [rows, p.head_dim_v],
    )
}
