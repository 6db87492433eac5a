//! One device's ring: at step `t` it holds block `(rank - t) mod N`, computes its query chunks
//! against that block's key chunks (one [`Sdpa`] or [`Backward`] call per pair), and passes
//! the block on to the next device while the kernels run.
//!
//! Overlap: each step's kernels are submitted first; the exchange (the block it holds goes
//! to the next device, the one it computes on next arrives from the previous device and is
//! written into the second block buffer) runs on the host while the device computes; then
//! the step waits for its kernels. A block is forwarded from the host copy that arrived (the
//! device never reads a block back); the backward's dK/dV sums travel after their step's
//! kernels, and their exchange runs while the next step's kernels run.

use std::time::{Duration, Instant};

use crate::device::buffers::{f32_bytes, output, storage_init};
use crate::device::context::Context;
use crate::error::Result;
use crate::ops::merge;
use crate::options::Options;
use crate::problem::Causal;
use crate::sdpa::{GpuOutput, Sdpa};
use crate::storage::Storage;
use crate::tensor::{Mask, Tensor};

use super::link::{Link, Tag};
use super::shard::{slice4, sliced_shape, Shard};
use super::{DeviceReport, RingPlan};

/// One device's forward results, per own query chunk: output (rounded to the output's
/// format) `[B, Hq, lc, Ev]`, logsumexp `[B, Hq, lc]`, weights `[B, Hq, lc, S]` when asked.
pub(crate) struct DeviceOutput {
    pub out: Vec<Vec<f32>>,
    pub lse: Vec<Vec<f32>>,
    pub weights: Option<Vec<Vec<f32>>>,
}

/// One device's backward results: dQ of its query chunks, dK and dV of its key chunks (f32,
/// complete), and its shares of d(bias) in the bias's broadcast shape, of d(sink logits) and
/// of the captures' gradients (packed).
pub(crate) struct DeviceGrads {
    pub dq: Vec<Vec<f32>>,
    pub dk: Vec<Vec<f32>>,
    pub dv: Vec<Vec<f32>>,
    pub dbias: Option<Vec<f32>>,
    pub dsink: Option<Vec<f32>>,
    pub dcaptures: Option<Vec<f32>>,
}

/// The buffers of one device's key/value blocks: the one computed on and the one arriving.
struct Blocks {
    cur: wgpu::Buffer,
    next: Option<wgpu::Buffer>,
    /// The host copy of the block in `cur`, forwarded at the next exchange.
    host: Vec<u8>,
}

impl Blocks {
    fn new(ctx: &Context, plan: &RingPlan, own: Vec<u8>) -> Blocks {
        let cap = (0..plan.n).map(|b| plan.block(b).bytes).max().unwrap_or(0);
        let cur = output(ctx, "ring block", cap);
        ctx.queue().write_buffer(&cur, 0, &own);
        Blocks {
            cur,
            next: (plan.n > 1).then(|| output(ctx, "ring block (arriving)", cap)),
            host: own,
        }
    }

    /// Pass the held block on and take the next (block `b - 1`) into the spare buffer; the
    /// write is ordered before the next submission. Returns the bytes sent.
    fn exchange(&mut self, ctx: &Context, plan: &RingPlan, link: &mut dyn Link, b: usize) -> Result<u64> {
        let n = plan.n;
        let len = plan.block((b + n - 1) % n).bytes as usize;
        let got = link.exchange(Tag::Kv, &self.host, len)?;
        ctx.queue()
            .write_buffer(self.next.as_ref().expect("n > 1"), 0, &got);
        let sent = self.host.len() as u64;
        self.host = got;
        Ok(sent)
    }

    fn swap(&mut self) {
        if let Some(next) = self.next.as_mut() {
            std::mem::swap(&mut self.cur, next);
        }
    }
}

/// The host data and the GPU tensors of one pair call, built from the shard.
struct Pair {
    mask: Option<(Vec<bool>, [usize; 4])>,
    bias: Option<(Vec<f32>, [usize; 4])>,
    lens: Option<Vec<usize>>,
    /// The document ids of the pair's queries and keys.
    docs: Option<crate::problem::DocIds>,
    causal: Causal,
    /// The pair's query chunk and key chunk.
    chunks: (usize, usize),
    shapes: [[usize; 4]; 3],
    k_off: u64,
    v_off: u64,
}

impl Pair {
    fn new(
        plan: &RingPlan,
        shard: &Shard,
        b: usize,
        (i, kc, causal): (usize, usize, Causal),
        own: [usize; 2],
    ) -> Self {
        let p = &plan.p;
        let (lq, k) = (plan.q_range(own[i]).len(), plan.kv_range(kc));
        let part = plan
            .block(b)
            .parts
            .into_iter()
            .find(|x| x.chunk == kc)
            .expect("the block holds the chunk");
        let cut = |shape: [usize; 4]| {
            let rows = [shape[0], shape[1], if shape[2] == 1 { 1 } else { lq }, shape[3]];
            (rows, sliced_shape(shape, lq, k.len()))
        };
        Pair {
            mask: p.mask.zip(shard.mask[i].as_ref()).map(|(m, d)| {
                let (rows, shape) = cut(m.shape);
                (slice4(d, rows, 0..lq, k.clone()), shape)
            }),
            bias: p.bias.zip(shard.bias[i].as_ref()).map(|(bc, d)| {
                let (rows, shape) = cut(bc.shape);
                (slice4(d, rows, 0..lq, k.clone()), shape)
            }),
            lens: p.kv_lens.as_ref().map(|l| {
                l.iter()
                    .map(|&x| (x as usize).saturating_sub(k.start).min(k.len()))
                    .collect()
            }),
            docs: p.doc_ids.as_ref().map(|d| {
                let rows = plan.q_range(own[i]);
                let (l, s) = (p.seq_q, p.seq_kv);
                crate::problem::DocIds {
                    q: (0..p.batch)
                        .flat_map(|b| d.q[b * l..][rows.clone()].to_vec())
                        .collect(),
                    k: (0..p.batch)
                        .flat_map(|b| d.k[b * s..][k.clone()].to_vec())
                        .collect(),
                }
            }),
            causal,
            chunks: (own[i], kc),
            shapes: [
                [p.batch, p.q_heads, lq, p.head_dim],
                [p.batch, p.kv_heads, k.len(), p.head_dim],
                [p.batch, p.kv_heads, k.len(), p.head_dim_v],
            ],
            k_off: part.k_off,
            v_off: part.v_off,
        }
    }

    /// The pair's attention on the device's buffers.
    fn sdpa<'a>(&'a self, plan: &RingPlan, q: &'a wgpu::Buffer, block: &'a wgpu::Buffer) -> Sdpa<'a> {
        let f = plan.p.storage;
        let [qs, ks, vs] = &self.shapes;
        let (qc, kc) = self.chunks;
        let window = plan.pair_window(kc);
        let mut s = Sdpa::new(
            Tensor::from_buffer(q, f.q, qs),
            Tensor::from_buffer(block, f.k, ks).at_offset(self.k_off),
            Tensor::from_buffer(block, f.v, vs).at_offset(self.v_off),
        )
        .options(Options {
            causal: self.causal,
            scale: plan.scale,
            mask: self.mask.as_ref().map(|(d, s)| Mask::from_slice(d, s)),
            bias: self
                .bias
                .as_ref()
                .map(|(d, s)| Tensor::from_slice(d, s).with_storage(f.bias)),
            kv_lens: self.lens.clone(),
            softcap: plan.p.softcap,
            doc_ids: self.docs.clone(),
            // The window's and the sink logits' pair rules: RingPlan::pair_window and
            // pair_sink_logits (as the plans' pair_problem).
            window: window.map(|w| (w.left, w.right)),
            sink_tokens: window.map_or(0, |w| w.sink_tokens),
            alibi: plan.p.alibi.clone(),
            sink_logits: plan.pair_sink_logits(kc),
            user_mod: plan.user_mod.clone(),
        })
        .path(plan.path);
        s.diag_shift = plan.pair_shift(qc, kc);
        s.pos_offset = plan.pair_positions(qc, kc);
        if let Some(bytes) = plan.max_scores_bytes {
            s = s.max_scores_bytes(bytes);
        }
        s
    }
}

/// Timings, bytes sent and memory of one device's steps.
struct Clock {
    compute: Duration,
    exchange: Duration,
    wait: Duration,
    sent: u64,
    base: Option<u64>,
    peak: Option<u64>,
}

impl Clock {
    fn new(ctx: &Context) -> Clock {
        Clock {
            compute: Duration::ZERO,
            exchange: Duration::ZERO,
            wait: Duration::ZERO,
            sent: 0,
            base: ctx.buffer_memory(),
            peak: ctx.buffer_memory().map(|_| 0),
        }
    }

    /// The rest of a step whose kernels are submitted: wait for them first when not
    /// overlapping; pass the held block on and take the next (before the last step); wait for
    /// the kernels; then the block that arrived is the one to compute on.
    #[allow(clippy::too_many_arguments)] // the step's parts, each distinct
    fn finish_step(
        &mut self,
        ctx: &Context,
        plan: &RingPlan,
        blocks: &mut Blocks,
        link: &mut dyn Link,
        (t, b): (usize, usize),
        overlap: bool,
    ) -> Result<()> {
        self.sample(ctx);
        if !overlap {
            Self::time(&mut self.compute, || ctx.wait())?;
        }
        if t + 1 < plan.n {
            self.sent += Self::time(&mut self.exchange, || blocks.exchange(ctx, plan, link, b))?;
        }
        Self::time(&mut self.wait, || ctx.wait())?;
        self.sample(ctx);
        blocks.swap();
        Ok(())
    }

    /// Sample the device's buffer memory.
    fn sample(&mut self, ctx: &Context) {
        if let (Some(peak), Some(now), Some(base)) = (&mut self.peak, ctx.buffer_memory(), self.base) {
            *peak = (*peak).max(now.saturating_sub(base));
        }
    }

    fn time<T>(d: &mut Duration, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let r = f();
        *d += t.elapsed();
        r
    }

    fn report(&self, plan: &RingPlan, rank: usize, peak: u64, started: Instant) -> DeviceReport {
        let own = plan.chunks(rank);
        DeviceReport {
            rank,
            rows: own.iter().map(|&c| plan.q_range(c).len()).sum(),
            work: plan
                .steps(rank)
                .iter()
                .flat_map(|(_, pairs)| pairs.iter().map(|&(i, kc, _)| plan.pair_work(own[i], kc)))
                .sum(),
            bytes_sent: self.sent,
            peak_memory: peak,
            measured_memory: self.peak,
            total: started.elapsed(),
            compute: self.compute + self.wait,
            exchange: self.exchange,
            wait_after_exchange: self.wait,
        }
    }
}

/// The f32 running output and logsumexp of one query chunk: slot 0 of `parts`/`lses` holds
/// the sum so far, slot 1 the pair just computed; `merge` combines them into `out`/`lse`,
/// which are copied back to slot 0.
struct Acc {
    rows: usize,
    parts: wgpu::Buffer,
    lses: wgpu::Buffer,
    out: wgpu::Buffer,
    lse: wgpu::Buffer,
    started: bool,
}

impl Acc {
    fn new(ctx: &Context, rows: usize, ev: usize) -> Acc {
        Acc {
            rows,
            parts: output(ctx, "ring partial outputs", f32_bytes(2 * rows * ev)),
            lses: output(ctx, "ring partial lse", f32_bytes(2 * rows)),
            out: output(ctx, "ring merged output", f32_bytes(rows * ev)),
            lse: output(ctx, "ring merged lse", f32_bytes(rows)),
            started: false,
        }
    }

    /// Record the merge of a pair's result into the running one.
    fn add(
        &mut self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        g: &GpuOutput,
        ev: usize,
    ) -> Result<()> {
        let (o_bytes, l_bytes) = (f32_bytes(self.rows * ev), f32_bytes(self.rows));
        let slot = if self.started { 1 } else { 0 };
        encoder.copy_buffer_to_buffer(&g.output, g.output_offset, &self.parts, slot * o_bytes, o_bytes);
        encoder.copy_buffer_to_buffer(&g.lse, 0, &self.lses, slot * l_bytes, l_bytes);
        if self.started {
            merge::record(
                ctx,
                encoder,
                &merge::Parts {
                    outputs: self.parts.as_entire_buffer_binding(),
                    storage: Storage::F32,
                    lses: self.lses.as_entire_buffer_binding(),
                    splits: 2,
                },
                &merge::Merged {
                    output: self.out.as_entire_buffer_binding(),
                    storage: Storage::F32,
                    view: None,
                    lse: self.lse.as_entire_buffer_binding(),
                },
                [self.rows, ev],
            )?;
            encoder.copy_buffer_to_buffer(&self.out, 0, &self.parts, 0, o_bytes);
            encoder.copy_buffer_to_buffer(&self.lse, 0, &self.lses, 0, l_bytes);
        }
        self.started = true;
        Ok(())
    }
}

fn block_on<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    pollster::block_on(f)
}

/// The query chunks' buffers (none for an empty chunk).
fn upload_q(ctx: &Context, plan: &RingPlan, shard: &Shard) -> Vec<Option<wgpu::Buffer>> {
    shard
        .q
        .iter()
        .map(|q| (!q.is_empty()).then(|| storage_init(ctx, "ring q", &plan.p.storage.q.encode(q))))
        .collect()
}

/// One device's ring forward.
pub(crate) fn forward(
    ctx: &Context,
    plan: &RingPlan,
    shard: Shard,
    link: &mut dyn Link,
    overlap: bool,
) -> Result<(DeviceOutput, DeviceReport)> {
    let rank = link.rank();
    let started = Instant::now();
    let peak = plan.check_device(ctx, rank)?;
    let p = &plan.p;
    let ev = p.head_dim_v;
    let own = plan.chunks(rank);
    let mut clock = Clock::new(ctx);
    let qbufs = upload_q(ctx, plan, &shard);
    let mut accs: Vec<Acc> = own
        .iter()
        .map(|&c| Acc::new(ctx, p.batch_heads() * plan.q_range(c).len().max(1), ev))
        .collect();
    let mut blocks = Blocks::new(ctx, plan, shard.block.clone());
    // Weights: each pair's, and its logsumexp, to rescale by the global one at the end.
    let mut pair_weights: Vec<PairWeights> = vec![];
    for (t, (b, pairs)) in plan.steps(rank).into_iter().enumerate() {
        let calls: Vec<Pair> = pairs
            .iter()
            .map(|&x| Pair::new(plan, &shard, b, x, own))
            .collect();
        let keep = Clock::time(&mut clock.compute, || {
            block_on(ctx.submit("wgpu-attention ring step", |encoder| {
                let mut keep = vec![];
                for (call, &(i, kc, _)) in calls.iter().zip(&pairs) {
                    let q = qbufs[i].as_ref().expect("a pair's query chunk is not empty");
                    let mut sdpa = call.sdpa(plan, q, &blocks.cur).output_storage(Storage::F32);
                    if plan.weights {
                        sdpa = sdpa.return_weights();
                    }
                    let g = sdpa.record(ctx, encoder)?;
                    accs[i].add(ctx, encoder, &g, ev)?;
                    if plan.weights {
                        keep.push((i, kc, g));
                    }
                }
                Ok(keep)
            }))
        })?;
        clock.finish_step(ctx, plan, &mut blocks, link, (t, b), overlap)?;
        for (i, kc, g) in keep {
            let w = g.weights.as_ref().expect("requested");
            let rows = accs[i].rows;
            let wv = block_on(ctx.read_f32(w, 0, w.size()))?;
            let lv = block_on(ctx.read_f32(&g.lse, 0, f32_bytes(rows)))?;
            pair_weights.push(PairWeights {
                chunk: i,
                kv_chunk: kc,
                weights: wv,
                lse: lv,
            });
        }
    }
    // The running sums are the results: read them back, rounded to the output's format.
    let mut out = vec![];
    let mut lse = vec![];
    for (i, acc) in accs.iter().enumerate() {
        let lq = plan.q_range(own[i]).len();
        let rows = p.batch_heads() * lq;
        if lq == 0 || !acc.started {
            // No key reached these rows (every pair hidden): zero output, empty logsumexp.
            out.push(vec![0.0; rows * ev]);
            lse.push(vec![f32::NEG_INFINITY; rows]);
            continue;
        }
        let o = block_on(ctx.read_f32(&acc.parts, 0, f32_bytes(rows * ev)))?;
        out.push(o.into_iter().map(|x| plan.out_storage.round(x)).collect());
        lse.push(block_on(ctx.read_f32(&acc.lses, 0, f32_bytes(rows)))?);
    }
    let weights = plan
        .weights
        .then(|| rescale_weights(plan, &own, &pair_weights, &lse));
    Ok((
        DeviceOutput { out, lse, weights },
        clock.report(plan, rank, peak, started),
    ))
}

/// One device's ring backward (the output and logsumexp of its rows are in the shard).
pub(crate) fn backward(
    ctx: &Context,
    plan: &RingPlan,
    shard: Shard,
    link: &mut dyn Link,
    overlap: bool,
) -> Result<(DeviceGrads, DeviceReport)> {
    let (rank, n) = (link.rank(), plan.n);
    let started = Instant::now();
    let peak = plan.check_device(ctx, rank)?;
    let p = &plan.p;
    let e = p.head_dim;
    let own = plan.chunks(rank);
    let mut clock = Clock::new(ctx);
    let qbufs = upload_q(ctx, plan, &shard);
    let dbufs = upload_saved(ctx, plan, &shard, &own);
    let mut dq: Vec<Vec<f32>> = own
        .iter()
        .map(|&c| vec![0.0; p.batch_heads() * plan.q_range(c).len() * e])
        .collect();
    let mut dbias = p.bias.map(|bc| vec![0.0f32; bc.len()]);
    let [mut dsink, mut dcaptures] = plan.extra_grad_lens().map(|n| n.map(|n| vec![0.0f32; n]));
    let mut blocks = Blocks::new(ctx, plan, shard.block.clone());
    // The dK/dV sums of the block being computed on (zero at the first step: it starts here).
    let mut sums: Vec<f32> = vec![0.0; plan.grads_len(rank)];
    for (t, (b, pairs)) in plan.steps(rank).into_iter().enumerate() {
        let calls: Vec<Pair> = pairs
            .iter()
            .map(|&x| Pair::new(plan, &shard, b, x, own))
            .collect();
        let grads = Clock::time(&mut clock.compute, || {
            let saved = (&qbufs[..], &dbufs[..], &own[..]);
            block_on(record_backward_step(
                ctx,
                plan,
                &calls,
                &pairs,
                saved,
                &blocks.cur,
            ))
        })?;
        clock.finish_step(ctx, plan, &mut blocks, link, (t, b), overlap)?;
        // Sum the pairs' gradients: dQ here, dK/dV into the block's travelling sums.
        let layout = plan.grads_layout(b);
        Clock::time(&mut clock.compute, || {
            grads.iter().zip(&pairs).try_for_each(|(g, &(i, kc, _))| {
                let at = layout.iter().find(|x| x.chunk == kc).expect("in block");
                let acc = GradSums {
                    dq: &mut dq[i],
                    sums: &mut sums,
                    dbias: dbias.as_mut(),
                    dsink: dsink.as_mut(),
                    dcaptures: dcaptures.as_mut(),
                };
                add_pair(
                    ctx,
                    plan,
                    g,
                    (at.dk, at.dv),
                    acc,
                    [plan.q_range(own[i]).start, plan.kv_range(kc).start],
                )
            })
        })?;
        // The block's sums go on with it; the next block's arrive (at the last step: this
        // device's own block, complete).
        if n > 1 {
            let next = (b + n - 1) % n;
            let bytes = bytemuck::cast_slice::<f32, u8>(&sums).to_vec();
            let got = Clock::time(&mut clock.exchange, || {
                link.exchange(Tag::Grads, &bytes, plan.grads_len(next) * 4)
            })?;
            clock.sent += bytes.len() as u64;
            sums = Storage::F32.decode(&got, plan.grads_len(next));
        }
    }
    // `sums` is this device's block: per chunk dK then dV.
    let layout = plan.grads_layout(rank);
    let dk = layout.iter().map(|x| sums[x.dk..x.dv].to_vec()).collect();
    let dv = layout.iter().map(|x| sums[x.dv..x.end].to_vec()).collect();
    Ok((
        DeviceGrads {
            dq,
            dk,
            dv,
            dbias,
            dsink,
            dcaptures,
        },
        clock.report(plan, rank, peak, started),
    ))
}

/// A backward step's pairs (`calls` of `pairs`) recorded and submitted: their gradients.
/// `saved`: each own chunk's q, its dO with the saved output and logsumexp, and the chunks.
#[allow(clippy::type_complexity)]
async fn record_backward_step(
    ctx: &Context,
    plan: &RingPlan,
    calls: &[Pair],
    pairs: &[(usize, usize, crate::problem::Causal)],
    (qbufs, dbufs, own): (&[Option<wgpu::Buffer>], &[Option<[wgpu::Buffer; 3]>], &[usize]),
    block: &wgpu::Buffer,
) -> Result<Vec<crate::sdpa::backward::GpuGrads>> {
    let p = &plan.p;
    let ev = p.head_dim_v;
    ctx.submit("wgpu-attention ring backward step", |encoder| {
        let mut out = vec![];
        for (call, &(i, _, _)) in calls.iter().zip(pairs) {
            let q = qbufs[i].as_ref().expect("a pair's query chunk is not empty");
            let [d, o, l] = dbufs[i].as_ref().expect("not empty");
            let lq = plan.q_range(own[i]).len();
            let rows = [p.batch, p.q_heads, lq];
            let sdpa = call.sdpa(plan, q, block);
            let bw = sdpa
                .backward(Tensor::from_buffer(
                    d,
                    p.storage.out,
                    &[p.batch, p.q_heads, lq, ev],
                ))
                .saved(
                    Tensor::from_buffer(o, Storage::F32, &[p.batch, p.q_heads, lq, ev]),
                    Tensor::from_buffer(l, Storage::F32, &rows),
                )
                .path(plan.path);
            out.push(bw.record(ctx, encoder)?);
        }
        Ok(out)
    })
    .await
}

/// dO, and the saved output and logsumexp, of the own chunks' rows (None for an empty chunk).
fn upload_saved(
    ctx: &Context,
    plan: &RingPlan,
    shard: &Shard,
    own: &[usize],
) -> Vec<Option<[wgpu::Buffer; 3]>> {
    own.iter()
        .enumerate()
        .map(|(i, &c)| {
            (!plan.q_range(c).is_empty()).then(|| {
                let (o, l) = &shard.saved[i];
                [
                    storage_init(ctx, "ring dout", &plan.p.storage.out.encode(&shard.dout[i])),
                    storage_init(ctx, "ring saved output", &Storage::F32.encode(o)),
                    storage_init(ctx, "ring saved lse", &Storage::F32.encode(l)),
                ]
            })
        })
        .collect()
}

/// Every pair's weights rescaled by the global logsumexp of its rows (`lse`, per own chunk),
/// into each own chunk's `[B·Hq, rows, S]` weights.
fn rescale_weights(
    plan: &RingPlan,
    own: &[usize],
    pair_weights: &[PairWeights],
    lse: &[Vec<f32>],
) -> Vec<Vec<f32>> {
    let (p, s) = (&plan.p, plan.p.seq_kv);
    let mut w: Vec<Vec<f32>> = own
        .iter()
        .map(|&c| vec![0.0; p.batch_heads() * plan.q_range(c).len() * s])
        .collect();
    for pw in pair_weights {
        let (i, wv) = (pw.chunk, &pw.weights);
        let k = plan.kv_range(pw.kv_chunk);
        let sk = k.len();
        for (row, (&lp, &lg)) in pw.lse.iter().zip(&lse[i]).enumerate() {
            // Rows no key reached are zero in both.
            let f = if lg == f32::NEG_INFINITY {
                0.0
            } else {
                (lp - lg).exp()
            };
            for (j, &x) in wv[row * sk..(row + 1) * sk].iter().enumerate() {
                w[i][row * s + k.start + j] = x * f;
            }
        }
    }
    w
}

/// A pair's attention weights and logsumexp, kept to rescale by the global logsumexp at the
/// end: the own query chunk's index, the key chunk.
struct PairWeights {
    chunk: usize,
    kv_chunk: usize,
    weights: Vec<f32>,
    lse: Vec<f32>,
}

/// Where a pair's gradients are summed: its query chunk's dQ, the block's dK/dV sums, d(bias),
/// d(sink logits) (from the pairs with the first key chunk) and the captures' gradients.
struct GradSums<'s> {
    dq: &'s mut [f32],
    sums: &'s mut [f32],
    dbias: Option<&'s mut Vec<f32>>,
    dsink: Option<&'s mut Vec<f32>>,
    dcaptures: Option<&'s mut Vec<f32>>,
}

/// Read a pair's gradients `g` back and add them: dQ, dK at `k_at` and dV at `v_at` of the
/// block's sums, d(bias) at the pair's rows and keys (`[q0, k0]`, global).
fn add_pair(
    ctx: &Context,
    plan: &RingPlan,
    g: &crate::sdpa::backward::GpuGrads,
    (k_at, v_at): (usize, usize),
    acc: GradSums<'_>,
    [q0, k0]: [usize; 2],
) -> Result<()> {
    let (gp, f) = (&g.problem, plan.p.storage);
    let (e, ev) = (gp.head_dim, gp.head_dim_v);
    let add = |acc: &mut [f32], x: Vec<f32>| acc.iter_mut().zip(x).for_each(|(a, x)| *a += x);
    let rows_q = gp.batch_heads() * gp.seq_q;
    add(acc.dq, block_on(ctx.read_as_f32(&g.dq, 0, rows_q * e, f.q))?);
    let kv_rows = gp.batch * gp.kv_heads * gp.seq_kv;
    add(
        &mut acc.sums[k_at..k_at + kv_rows * e],
        block_on(ctx.read_as_f32(&g.dk, 0, kv_rows * e, f.k))?,
    );
    add(
        &mut acc.sums[v_at..v_at + kv_rows * ev],
        block_on(ctx.read_as_f32(&g.dv, 0, kv_rows * ev, f.v))?,
    );
    if let (Some(db), Some(buf), Some(bc)) = (acc.dbias, g.dbias.as_ref(), gp.bias) {
        let part = block_on(ctx.read_as_f32(buf, 0, bc.len(), f.bias))?;
        add_bias(db, plan.p.bias.expect("bias").shape, &part, bc.shape, q0, k0);
    }
    // f32 sums of the pairs' shares, in the pairs' order.
    for (acc, buf) in [(acc.dsink, &g.dsink), (acc.dcaptures, &g.dcaptures)] {
        if let (Some(acc), Some(buf)) = (acc, buf) {
            let n = acc.len();
            add(
                acc,
                block_on(ctx.read_as_f32(buf, 0, n, crate::storage::Storage::F32))?,
            );
        }
    }
    Ok(())
}

/// Add a pair's d(bias) (broadcast shape `part_shape`, its rows from `q0`, keys from `k0` of
/// the global ones where not broadcast) into the global d(bias) of broadcast shape `shape`.
fn add_bias(acc: &mut [f32], shape: [usize; 4], part: &[f32], part_shape: [usize; 4], q0: usize, k0: usize) {
    let [a, b, c, d] = part_shape;
    let (r0, c0) = (
        if shape[2] == 1 { 0 } else { q0 },
        if shape[3] == 1 { 0 } else { k0 },
    );
    for i0 in 0..a {
        for i1 in 0..b {
            for i2 in 0..c {
                let src = ((i0 * b + i1) * c + i2) * d;
                let dst = ((i0 * shape[1] + i1) * shape[2] + r0 + i2) * shape[3] + c0;
                for j in 0..d {
                    acc[dst + j] += part[src + j];
                }
            }
        }
    }
}

impl DeviceOutput {
    /// Every value in one vector (to send it to the rank that assembles the output).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn flatten(&self) -> Vec<f32> {
        let w = self.weights.iter().flatten();
        self.out
            .iter()
            .chain(&self.lse)
            .chain(w)
            .flatten()
            .copied()
            .collect()
    }

    /// [`DeviceOutput::flatten`] undone, for device `rank` of `plan`.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn unflatten(plan: &RingPlan, rank: usize, data: &[f32]) -> DeviceOutput {
        let p = &plan.p;
        let rows = plan.q_rows(rank);
        let mut at = 0;
        let mut take = |n: usize| {
            at += n;
            data[at - n..at].to_vec()
        };
        let out = rows.iter().map(|&r| take(r * p.head_dim_v)).collect();
        let lse = rows.iter().map(|&r| take(r)).collect();
        let weights = plan
            .weights
            .then(|| rows.iter().map(|&r| take(r * p.seq_kv)).collect());
        DeviceOutput { out, lse, weights }
    }

    /// The values [`DeviceOutput::flatten`] gives for device `rank` of `plan`.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn len(plan: &RingPlan, rank: usize) -> usize {
        let p = &plan.p;
        let rows: usize = plan.q_rows(rank).iter().sum();
        rows * (p.head_dim_v + 1 + if plan.weights { p.seq_kv } else { 0 })
    }
}

impl DeviceGrads {
    /// Every value in one vector.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn flatten(&self) -> Vec<f32> {
        let b = self.dbias.iter().chain(&self.dsink).chain(&self.dcaptures);
        self.dq
            .iter()
            .chain(&self.dk)
            .chain(&self.dv)
            .chain(b)
            .flatten()
            .copied()
            .collect()
    }

    /// [`DeviceGrads::flatten`] undone, for device `rank` of `plan`.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn unflatten(plan: &RingPlan, rank: usize, data: &[f32]) -> DeviceGrads {
        let p = &plan.p;
        let q_rows = plan.q_rows(rank);
        let kv_rows = plan.kv_rows(rank);
        let mut at = 0;
        let mut take = |n: usize| {
            at += n;
            data[at - n..at].to_vec()
        };
        DeviceGrads {
            dq: q_rows.iter().map(|&r| take(r * p.head_dim)).collect(),
            dk: kv_rows.iter().map(|&r| take(r * p.head_dim)).collect(),
            dv: kv_rows.iter().map(|&r| take(r * p.head_dim_v)).collect(),
            dbias: p.bias.map(|b| take(b.len())),
            dsink: plan.extra_grad_lens()[0].map(&mut take),
            dcaptures: plan.extra_grad_lens()[1].map(&mut take),
        }
    }

    /// The values [`DeviceGrads::flatten`] gives for device `rank` of `plan`.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn len(plan: &RingPlan, rank: usize) -> usize {
        let p = &plan.p;
        let q: usize = plan.q_rows(rank).iter().sum();
        let kv: usize = plan.kv_rows(rank).iter().sum();
        let [sinks, caps] = plan.extra_grad_lens().map(|n| n.unwrap_or(0));
        q * p.head_dim + kv * (p.head_dim + p.head_dim_v) + p.bias.map_or(0, |b| b.len()) + sinks + caps
    }
}
