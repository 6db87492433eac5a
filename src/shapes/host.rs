//! The calls of a token-by-token generation loop whose host cost (the time `record` takes on
//! the CPU) is measured: by `wgpu-attention bench --host`, `examples/host_cost.rs` and the
//! criterion group `host`. Every input lives in GPU buffers made once; only what a real loop
//! changes changes between calls (the key lengths grow).
//!
//! - [`HostCall::Decode`]: q `[4, 32, 1, 128]` f32 over K/V `[4, 8, 4096, 128]` f16 read in place
//!   from `[B, S, H, E]` buffers ([`crate::TensorLayout::Bshe`]), bottom-right causal with key
//!   lengths, the output and logsumexp into the caller's buffers.
//! - [`HostCall::Chunk`]: the same with 16 queries.
//! - [`HostCall::Paged`]: a [`crate::PagedAttention`] of 4 sequences, `q_lens` `[16, 1, 1,
//!   1]`, Hq 8, Hkv 2, E 64, blocks of 16, about 500 keys each, f16, the output and logsumexp
//!   into the caller's buffers.
//! - [`HostCall::KvStep`]: one token step of 4 sequences on a 32-layer [`crate::KvCache`] of
//!   that shape (a reserve, then per layer an append of K/V from a GPU buffer and an attention
//!   into the caller's buffers); its time is per layer.
//! - [`DecodeStep`] (`decode_step_32l`): one token step of 4 sequences over a 32-layer
//!   `KvCache` at 4096 positions, Llama-3-8B's attention (Hq 32, Hkv 8, E 128, f16, blocks of
//!   16): a reserve, then per layer an append and an attention into the caller's buffers, no
//!   readback. Each step first truncates the sequences back to 4095 keys
//!   ([`crate::KvCache::truncate`]), so every step reads 4096.

use std::time::Instant;

use wgpu::util::DeviceExt;

use crate::device::context::Context;
use crate::error::Result;
use crate::paged::KvCache;
use crate::paged::KvCacheConfig;
use crate::paged::PagedAttention;
use crate::paged::SeqId;
use crate::problem::Causal;
use crate::sdpa::Sdpa;
use crate::storage::Storage;
use crate::tensor::Tensor;
use crate::view::TensorLayout;

/// One of the measured calls (see the module docs).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCall {
    /// Decode, one query row per sequence.
    Decode,
    /// A prefill chunk of 16 queries per sequence.
    Chunk,
    /// A ragged paged batch.
    Paged,
    /// A `KvCache` token step over 32 layers (per layer).
    KvStep,
}

impl HostCall {
    /// Every call, in the order reported.
    pub const ALL: [HostCall; 4] = [
        HostCall::Decode,
        HostCall::Chunk,
        HostCall::Paged,
        HostCall::KvStep,
    ];

    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            HostCall::Decode => "decode_record",
            HostCall::Chunk => "chunk16_record",
            HostCall::Paged => "paged_record",
            HostCall::KvStep => "kv_step_per_layer",
        }
    }
}

fn buffer(ctx: &Context, label: &str, bytes: usize) -> wgpu::Buffer {
    // Small values (0.01): any content serves for timing the host.
    let words = vec![0x211e_211eu32; bytes.div_ceil(4)];
    ctx.device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytemuck::cast_slice(&words),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        })
}

/// The buffers of every measured call, made once.
pub struct HostBench {
    q: wgpu::Buffer,
    kv: [wgpu::Buffer; 2],
    out: wgpu::Buffer,
    lse: wgpu::Buffer,
    paged_q: wgpu::Buffer,
    pages: [wgpu::Buffer; 2],
    table: Vec<i32>,
    cache: KvCache,
    seqs: Vec<SeqId>,
    new_kv: wgpu::Buffer,
    step_q: wgpu::Buffer,
    calls: usize,
}

/// Sequences, K/V heads, head dim and layers of the paged calls.
const PAGED: [usize; 4] = [4, 2, 64, 32];

impl HostBench {
    /// Allocate every call's buffers on `ctx` (about 140 MB).
    pub fn new(ctx: &Context) -> Result<HostBench> {
        let [nseq, hkv, e, layers] = PAGED;
        let blocks = nseq * 34;
        // Prompts of about 500 keys.
        let (cache, seqs) = prefilled_cache(ctx, [nseq, hkv, e, layers], blocks + nseq * 8, 500)?;
        let max_blocks = 34;
        let table: Vec<i32> = (0..nseq * max_blocks).map(|i| i as i32).collect();
        Ok(HostBench {
            q: buffer(ctx, "q", 4 * 32 * 16 * 128 * 4),
            kv: [0, 1].map(|_| buffer(ctx, "kv", 4 * 4096 * 8 * 128 * 2)),
            out: buffer(ctx, "out", 4 * 32 * 16 * 128 * 4),
            lse: buffer(ctx, "lse", 4 * 32 * 16 * 4),
            paged_q: buffer(ctx, "paged q", 19 * 8 * e * 2),
            pages: [0, 1].map(|_| buffer(ctx, "pages", blocks * 16 * hkv * e * 2)),
            table,
            cache,
            seqs,
            new_kv: buffer(ctx, "new kv", nseq * hkv * e * 2),
            step_q: buffer(ctx, "step q", nseq * 8 * e * 2),
            calls: 0,
        })
    }

    /// Record one `call` into `encoder` (a `KvStep`: its 32 layers), the key lengths moved on
    /// from the last call. Returns the host seconds `record` took and the calls it counts
    /// (32 for a `KvStep`, else 1).
    pub fn record(
        &mut self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        call: HostCall,
    ) -> Result<(f64, usize)> {
        self.calls += 1;
        let grow = self.calls % 64;
        match call {
            HostCall::Decode | HostCall::Chunk => {
                let l = if call == HostCall::Decode { 1 } else { 16 };
                let lens: Vec<usize> = (0..4).map(|b| 4000 + b * 8 + grow % 32).collect();
                let t0 = Instant::now();
                let kv = |i: usize| {
                    Tensor::from_buffer(&self.kv[i], Storage::F16, &[4, 8, 4096, 128])
                        .with_layout(TensorLayout::Bshe)
                };
                Sdpa::new(
                    Tensor::from_buffer(&self.q, Storage::F32, &[4, 32, l, 128]),
                    kv(0),
                    kv(1),
                )
                .causal(Causal::BottomRight)
                .kv_lens(&lens)
                .output_into(Tensor::from_buffer(&self.out, Storage::F32, &[4, 32, l, 128]))
                .lse_into(Tensor::from_buffer(&self.lse, Storage::F32, &[4, 32, l]))
                .record(ctx, encoder)?;
                Ok((t0.elapsed().as_secs_f64(), 1))
            }
            HostCall::Paged => {
                let [nseq, hkv, e, _] = PAGED;
                let lens: Vec<usize> = (0..nseq).map(|s| 480 + s * 5 + grow % 32).collect();
                let t0 = Instant::now();
                let pages = crate::paged::Pages::new(
                    Tensor::from_buffer(&self.pages[0], Storage::F16, &[nseq * 34, 16, hkv, e]),
                    Tensor::from_buffer(&self.pages[1], Storage::F16, &[nseq * 34, 16, hkv, e]),
                    crate::paged::PagedLayout::TokenMajor,
                );
                PagedAttention::new(
                    Tensor::from_buffer(&self.paged_q, Storage::F16, &[19, 8, e]),
                    &[16, 1, 1, 1],
                    pages,
                    &self.table,
                    &lens,
                )
                .causal(Causal::BottomRight)
                .output_into(Tensor::from_buffer(&self.out, Storage::F16, &[19, 8, e]))
                .lse_into(Tensor::from_buffer(&self.lse, Storage::F32, &[19, 8]))
                .record(ctx, encoder)?;
                Ok((t0.elapsed().as_secs_f64(), 1))
            }
            HostCall::KvStep => {
                let [nseq, hkv, e, layers] = PAGED;
                let t0 = Instant::now();
                // Keep the sequences short of the cache's end: free and re-add them now and then.
                if self.cache.free_blocks() < nseq {
                    for s in std::mem::take(&mut self.seqs) {
                        self.cache.free_sequence(s)?;
                    }
                    self.seqs = (0..nseq).map(|_| self.cache.add_sequence()).collect();
                }
                let step = self
                    .cache
                    .reserve(&self.seqs.iter().map(|&s| (s, 1)).collect::<Vec<_>>())?;
                let kv = Tensor::from_buffer(&self.new_kv, Storage::F16, &[nseq, hkv, e]);
                for l in 0..layers {
                    self.cache.append(ctx, encoder, &step, l, &kv, &kv)?;
                    self.cache
                        .attention(
                            &step,
                            l,
                            Tensor::from_buffer(&self.step_q, Storage::F16, &[nseq, 8, 1, e]),
                        )?
                        .output_into(Tensor::from_buffer(&self.out, Storage::F16, &[nseq, 8, 1, e]))
                        .lse_into(Tensor::from_buffer(&self.lse, Storage::F32, &[nseq, 8, 1]))
                        .record(ctx, encoder)?;
                }
                Ok((t0.elapsed().as_secs_f64(), layers))
            }
        }
    }
}

/// The median host µs per call of `call` over `n` calls after `warm`, recorded 8 to an
/// encoder that is then dropped unsubmitted (the device polled, which frees what it held): the
/// host's cost alone, with no GPU work running
/// beside it (a CPU adapter would share the cores).
pub fn median_us(ctx: &Context, bench: &mut HostBench, call: HostCall, warm: usize, n: usize) -> Result<f64> {
    median_us_of(ctx, warm, n, |enc| bench.record(ctx, enc, call))
}

/// [`median_us`] of any recorder returning `(host seconds, calls counted)`.
pub fn median_us_of(
    ctx: &Context,
    warm: usize,
    n: usize,
    mut record: impl FnMut(&mut wgpu::CommandEncoder) -> Result<(f64, usize)>,
) -> Result<f64> {
    let mut times = Vec::with_capacity(n);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    for i in 0..warm + n {
        let (s, calls) = record(&mut enc)?;
        if i >= warm {
            times.push(s * 1e6 / calls as f64);
        }
        if (i + 1) % 8 == 0 {
            enc = ctx.device().create_command_encoder(&Default::default());
            // wgpu frees what dropped encoders held when the device is polled, as a loop's
            // submits and waits would.
            let _ = ctx.device().poll(wgpu::PollType::Poll);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// An f16 `KvCache` of `layers` layers (`hkv` heads of `e`, blocks of 16, `num_blocks` of
/// them) holding `nseq` sequences of `prompt` keys each, written and waited for before
/// anything is timed (a CPU adapter runs them on the cores the timing shares).
fn prefilled_cache(
    ctx: &Context,
    [nseq, hkv, e, layers]: [usize; 4],
    num_blocks: usize,
    prompt: usize,
) -> Result<(KvCache, Vec<SeqId>)> {
    let mut cache = KvCache::new(
        ctx,
        KvCacheConfig {
            layers,
            kv_heads: hkv,
            head_dim: e,
            head_dim_v: e,
            block_size: 16,
            num_blocks,
            storage: Storage::F16,
            v_storage: None,
            rope: None,
        },
    )?;
    let seqs: Vec<SeqId> = (0..nseq).map(|_| cache.add_sequence()).collect();
    let kv = buffer(ctx, "prompt kv", 2 * prompt * nseq * hkv * e);
    let step = cache.reserve(&seqs.iter().map(|&s| (s, prompt)).collect::<Vec<_>>())?;
    let t = Tensor::from_buffer(&kv, Storage::F16, &[prompt * nseq, hkv, e]);
    for l in 0..layers {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        cache.append(ctx, &mut enc, &step, l, &t, &t)?;
        ctx.queue().submit([enc.finish()]);
    }
    ctx.device()
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| crate::error::Error::Validation(format!("poll: {e}")))?;
    Ok((cache, seqs))
}

/// `decode_step_32l` (see the module docs): a 32-layer cache of 4 sequences at 4095 keys, and
/// the step's inputs and outputs in GPU buffers made once (about 2.2 GB).
pub struct DecodeStep {
    cache: KvCache,
    seqs: Vec<SeqId>,
    new_kv: wgpu::Buffer,
    q: wgpu::Buffer,
    out: wgpu::Buffer,
    lse: wgpu::Buffer,
}

impl DecodeStep {
    /// The name in reports.
    pub const NAME: &'static str = "decode_step_32l";
    /// Sequences, query heads, K/V heads, head dim, layers, and keys each step reads.
    pub const DIMS: [usize; 6] = [4, 32, 8, 128, 32, 4096];

    /// Make the cache and fill it: every layer's 4 x 4095 prompt keys appended and waited for.
    pub fn new(ctx: &Context) -> Result<DecodeStep> {
        let [nseq, hq, hkv, e, layers, keys] = Self::DIMS;
        let (cache, seqs) = prefilled_cache(ctx, [nseq, hkv, e, layers], nseq * keys.div_ceil(16), keys - 1)?;
        Ok(DecodeStep {
            cache,
            seqs,
            new_kv: buffer(ctx, "new kv", 2 * nseq * hkv * e),
            q: buffer(ctx, "step q", 2 * nseq * hq * e),
            out: buffer(ctx, "step out", 2 * nseq * hq * e),
            lse: buffer(ctx, "step lse", 4 * nseq * hq),
        })
    }

    /// The attention FLOPs of one step (4 x 32 heads x 4096 keys x 128, two matmuls).
    pub fn flops() -> f64 {
        let [nseq, hq, _, e, layers, keys] = Self::DIMS;
        (4 * nseq * hq * keys * e * layers) as f64
    }

    /// Record one step into `encoder`; returns the host seconds it took (the rollback to 4095
    /// keys included) and the layers.
    pub fn record(&mut self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<(f64, usize)> {
        let [nseq, hq, hkv, e, layers, keys] = Self::DIMS;
        let t0 = Instant::now();
        for &s in &self.seqs {
            self.cache.truncate(s, keys - 1)?;
        }
        let step = self
            .cache
            .reserve(&self.seqs.iter().map(|&s| (s, 1)).collect::<Vec<_>>())?;
        let kv = Tensor::from_buffer(&self.new_kv, Storage::F16, &[nseq, hkv, e]);
        for l in 0..layers {
            self.cache.append(ctx, encoder, &step, l, &kv, &kv)?;
            self.cache
                .attention(
                    &step,
                    l,
                    Tensor::from_buffer(&self.q, Storage::F16, &[nseq, hq, 1, e]),
                )?
                .output_into(Tensor::from_buffer(&self.out, Storage::F16, &[nseq, hq, 1, e]))
                .lse_into(Tensor::from_buffer(&self.lse, Storage::F32, &[nseq, hq, 1]))
                .record(ctx, encoder)?;
        }
        Ok((t0.elapsed().as_secs_f64(), layers))
    }
}
