//! The unfused backward's recorder: per chunk of scores, the matmul op and `bwd_ds`.

use crate::device::buffers::{binding, f32_bytes, scratch};
use crate::device::context::Context;
use crate::error::Result;
use crate::kernels::backward as kb;
use crate::ops::matmul::Matmul;
use crate::ops::Mats;
use crate::problem::Problem;
use crate::sdpa::plan::ChunkPlan;
use crate::storage::Storage;
use crate::view::View;

use super::io::Io;

/// The unfused backward: per chunk of scores, S = scale·Q Kᵀ and dP = dO Vᵀ (matmuls), then P,
/// dS and their group-transposes (`bwd_ds`), then dQ = scale·dS K, dV += Pᵀ dO and
/// dK += scale·dSᵀ Q (matmuls; dK and dV accumulate in f32 across chunks).
pub(super) fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    (p, chunks): (&Problem, &ChunkPlan),
    io: &Io<'_>,
    params: &kb::Params,
    [dkv, dq]: [&wgpu::Buffer; 2],
    dv_off: usize,
) -> Result<()> {
    let bytes = f32_bytes(chunks.heads * chunks.rows * p.seq_kv);
    let [sc, dp, pt, dst] =
        ["scores", "dP and dS", "P transposed", "dS transposed"].map(|n| scratch(ctx, n, bytes));
    let kv_rows = p.batch * p.kv_heads * p.seq_kv;
    let run = Unfused {
        ctx,
        p,
        io,
        params,
        scratch: Scratch { sc, dp, pt, dst },
        dq,
        dk: binding(dkv, 0, f32_bytes(kv_rows * p.head_dim)),
        dv: binding(dkv, f32_bytes(dv_off), f32_bytes(kv_rows * p.head_dim_v)),
        ds_prelude: kb::ds_prelude(
            p.mask.is_some(),
            p.bias.is_some(),
            crate::kernels::Mods::of(p, &ctx.tuning()),
            p.storage.bias,
        ),
    };
    let bh = p.batch_heads();
    for z0 in (0..bh).step_by(chunks.heads) {
        for i0 in (0..p.seq_q).step_by(chunks.rows) {
            let c = Chunk {
                z0,
                nz: chunks.heads.min(bh - z0),
                i0,
                lc: chunks.rows.min(p.seq_q - i0),
            };
            run.chunk(encoder, &c)?;
        }
    }
    Ok(())
}

/// Every key row (`[S, cols]`) of the heads from `z0` of K or V (`x`, format `fx`, view `v`).
fn keys<'b>(x: &wgpu::BufferBinding<'b>, fx: Storage, v: View, dims: [usize; 2], z0: usize) -> Mats<'b> {
    Mats::view(x.clone(), fx, v, 0, dims).starting_at(z0)
}

/// The score-sized scratch buffers of one chunk (f32).
struct Scratch {
    /// S, then P.
    sc: wgpu::Buffer,
    /// dP, then dS.
    dp: wgpu::Buffer,
    /// Pᵀ and dSᵀ, by groups of query heads.
    pt: wgpu::Buffer,
    dst: wgpu::Buffer,
}

/// One chunk: rows `i0 .. i0 + lc` of heads `z0 .. z0 + nz` (over every batch's heads).
struct Chunk {
    z0: usize,
    nz: usize,
    i0: usize,
    lc: usize,
}

/// What every chunk records with.
struct Unfused<'r> {
    ctx: &'r Context,
    p: &'r Problem,
    io: &'r Io<'r>,
    params: &'r kb::Params,
    scratch: Scratch,
    dq: &'r wgpu::Buffer,
    /// dK and dV (f32, accumulated over chunks).
    dk: wgpu::BufferBinding<'r>,
    dv: wgpu::BufferBinding<'r>,
    ds_prelude: crate::kernels::consts::Prelude,
}

impl Unfused<'_> {
    fn chunk(&self, encoder: &mut wgpu::CommandEncoder, c: &Chunk) -> Result<()> {
        let (p, io, f) = (self.p, self.io, self.p.storage);
        let [qv, kv, vv, _, gv] = p.views_or_dense();
        let (e, ev, s) = (p.head_dim, p.head_dim_v, p.seq_kv);
        let all_keys = |x, fx, v, cols| keys(x, fx, v, [s, cols], c.z0);
        // S = scale·Q Kᵀ and dP = dO Vᵀ for the chunk's rows.
        let q_rows = Mats::view(io.q.clone(), f.q, qv, c.i0, [c.lc, e]).starting_at(c.z0);
        self.scores(
            encoder,
            c,
            [q_rows, all_keys(&io.k, f.k, kv, e)],
            &self.scratch.sc,
            p.scale,
        )?;
        let g_rows = Mats::view(io.dout.clone(), f.out, gv, c.i0, [c.lc, ev]).starting_at(c.z0);
        self.scores(
            encoder,
            c,
            [g_rows, all_keys(&io.v, f.v, vv, ev)],
            &self.scratch.dp,
            1.0,
        )?;
        let grouped = self.grouped(c);
        self.ds(encoder, c, grouped.unwrap_or(1))?;
        // dQ rows = scale · dS K.
        let dq_all = View::dense([p.batch, p.q_heads, p.seq_q, e]);
        Matmul::new(
            self.chunk_scores(&self.scratch.dp, c, c.lc),
            all_keys(&io.k, f.k, kv, e),
            Mats::view(self.dq.as_entire_buffer_binding(), f.q, dq_all, c.i0, [c.lc, e]).starting_at(c.z0),
        )
        .alpha(p.scale)
        .slices(c.nz)
        .heads(p.q_heads, p.group())
        .record(self.ctx, encoder)?;
        // dV += Pᵀ dO and dK += scale · dSᵀ Q.
        let sums = [
            (&self.scratch.pt, (&io.dout, f.out, gv), (&self.dv, ev, 1.0)),
            (&self.scratch.dst, (&io.q, f.q, qv), (&self.dk, e, p.scale)),
        ];
        for (a, b, (sum, d, alpha)) in sums {
            self.sum(encoder, c, grouped, (a, b), (sum.clone(), d), alpha)?;
        }
        Ok(())
    }

    /// The chunk's scores in `buf` as `nz` matrices of `rows` rows and S columns (or their
    /// transposes, S rows of `rows`, read back as such by the caller's shapes).
    fn chunk_scores<'b>(&self, buf: &'b wgpu::Buffer, c: &Chunk, rows: usize) -> Mats<'b> {
        let bytes = f32_bytes(c.nz * c.lc * self.p.seq_kv);
        Mats::dense(binding(buf, 0, bytes), Storage::F32, rows, self.p.seq_kv)
    }

    /// `out = alpha · A Bᵀ` over the chunk's heads: the rows of A (Q or dO) against every key
    /// row of B (K or V).
    fn scores(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        c: &Chunk,
        [a, b]: [Mats<'_>; 2],
        out: &wgpu::Buffer,
        alpha: f32,
    ) -> Result<()> {
        let p = self.p;
        Matmul::new(a, b, self.chunk_scores(out, c, c.lc))
            .trans_b(true)
            .alpha(alpha)
            .slices(c.nz)
            .heads(p.q_heads, p.group())
            .record(self.ctx, encoder)
    }

    /// The group width of the transposes where the chunk holds whole groups of whole heads
    /// (one product per kv head of the chunk), else None (one head at a time, a product per
    /// head). Only dense q and dO stack the heads of a group as rows of one matrix.
    fn grouped(&self, c: &Chunk) -> Option<usize> {
        let p = self.p;
        let whole = c.lc == p.seq_q
            && c.nz.is_multiple_of(p.group())
            && p.views.q.is_none()
            && p.views.dout.is_none();
        whole.then_some(p.group())
    }

    /// P, dS and their transposes (by groups of `gw` heads) from S and dP, by `bwd_ds`.
    fn ds(&self, encoder: &mut wgpu::CommandEncoder, c: &Chunk, gw: usize) -> Result<()> {
        let total = c.nz * c.lc * self.p.seq_kv;
        let bytes = f32_bytes(total);
        let Scratch { sc, dp, pt, dst } = &self.scratch;
        kb::record(
            self.ctx,
            encoder,
            &kb::DS,
            &self.ds_prelude,
            &[
                self.io.mask.clone(),
                self.io.bias.clone(),
                binding(sc, 0, bytes),
                binding(dp, 0, bytes),
                binding(pt, 0, bytes),
                binding(dst, 0, bytes),
                self.io.stats.clone(),
            ],
            &self.params.chunk([c.z0, c.i0, c.lc, gw], total),
            total.div_ceil(64) as u32,
            crate::kernels::Checks::of(self.p),
        )
    }

    /// `sum += alpha · Aᵀ B` for the transposed chunk A (Pᵀ or dSᵀ) and the query-side B (dO or
    /// Q: its binding, format and view), `d` columns: one batched product over the chunk's kv
    /// heads (each with its group's query heads' rows stacked), or one product per head with
    /// the chunk's rows (heads of one group would race on their kv head's sum).
    fn sum(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        c: &Chunk,
        grouped: Option<usize>,
        (a, (b, fb, bv)): (&wgpu::Buffer, (&wgpu::BufferBinding<'_>, Storage, View)),
        (sum, d): (wgpu::BufferBinding<'_>, usize),
        alpha: f32,
    ) -> Result<()> {
        let (p, s) = (self.p, self.p.seq_kv);
        if let Some(gw) = grouped {
            let kv0 = c.z0 / gw;
            return Matmul::new(
                Mats::dense(
                    binding(a, 0, f32_bytes(c.nz * c.lc * s)),
                    Storage::F32,
                    s,
                    gw * c.lc,
                ),
                Mats::dense(b.clone(), fb, gw * c.lc, d).starting_at(kv0),
                Mats::dense(sum, Storage::F32, s, d).starting_at(kv0),
            )
            .alpha(alpha)
            .slices(c.nz / gw)
            .accumulate(true)
            .record(self.ctx, encoder);
        }
        (0..c.nz).try_for_each(|zl| {
            let z = c.z0 + zl;
            Matmul::new(
                Mats::dense(binding(a, 0, f32_bytes(c.nz * c.lc * s)), Storage::F32, s, c.lc).starting_at(zl),
                Mats::view(b.clone(), fb, bv, c.i0, [c.lc, d]).starting_at(z),
                Mats::dense(sum.clone(), Storage::F32, s, d).starting_at(z / p.group()),
            )
            .alpha(alpha)
            .heads(p.q_heads, 1)
            .accumulate(true)
            .record(self.ctx, encoder)
        })
    }
}
