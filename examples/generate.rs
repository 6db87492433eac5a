//! Text generation through the paged KV cache: a small decoder with random weights (2 layers,
//! d_model 256, 8 query heads on 2 K/V heads of dim 32, RoPE, a tanh MLP in plain host code)
//! prefills 4 prompts of different lengths in chunks of up to 8 tokens (a prefill step mixes
//! chunk sizes: one ragged call), then generates 64 tokens for each, the 4 sequences batched
//! (sampled). K is rotated as the cache appends it, q inside the attention kernels. Every
//! step's attention output of every layer is checked against the CPU reference (f64) on the
//! contiguous, rotated keys kept on the host. Prints the generated tokens per second of GPU
//! attention work (append and attention, the host's projections and checks excluded) and the
//! append throughput.
//!
//! ```sh
//! cargo run --release --example generate
//! cargo run --release --example generate -- --kv-int8   # an int8 cache (quantised as it appends)
//! ```
//!
//! With `--kv-int8` the cache holds int8 K and V with a scale per token and head
//! (`wgpu_attention::quant`), and the reference reads the host's keys quantised by the same
//! rule: a code may differ by one where the GPU's f32 rotation meets a rounding tie, so the
//! check's tolerance is 2e-3 there. Prints the cache's bytes either way.

use std::time::{Duration, Instant};

use ndarray::{s, Array2, Array3, Array4, Axis};
use wgpu_attention::check::{compare, Tolerance, F32_TOLERANCE};
use wgpu_attention::{
    reference, Causal, Context, KvCache, KvCacheConfig, Options, Rope, RopeStyle, SeqId, Storage, Tensor,
};

const LAYERS: usize = 2;
const D: usize = 256;
const HQ: usize = 8;
const HKV: usize = 2;
const E: usize = 32;
const VOCAB: usize = 97;
const CHUNK: usize = 8;
const GENERATE: usize = 64;
const PROMPTS: [usize; 4] = [5, 12, 23, 37];

/// Deterministic noise in [-scale, scale).
fn noise(shape: (usize, usize), seed: u64, scale: f32) -> Array2<f32> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    Array2::from_shape_simple_fn(shape, || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x % 2000) as f32 / 1000.0 - 1.0) * scale
    })
}

struct Layer {
    wq: Array2<f32>,
    wk: Array2<f32>,
    wv: Array2<f32>,
    wo: Array2<f32>,
    w1: Array2<f32>,
    w2: Array2<f32>,
}

/// The host's rotated K and V of one sequence in one layer, token-major `[t][Hkv * E]`.
#[derive(Default, Clone)]
struct HostKv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The cache's format: int8 with `--kv-int8`, else f32.
fn kv_format() -> Storage {
    if std::env::args().any(|a| a == "--kv-int8") {
        Storage::Int8
    } else {
        Storage::F32
    }
}

/// A token's rows `[Hkv * E]` as the cache holds them: int8's codes times their scales.
fn held(row: Vec<f32>) -> Vec<f32> {
    match kv_format() {
        Storage::Int8 => {
            let (c, sc) = wgpu_attention::quant::quantize_int8(&row, E);
            wgpu_attention::quant::dequantize_int8(&c, &sc, E)
        }
        _ => row,
    }
}

/// The model: embeddings, layers, RoPE, and its sequences in the cache.
struct Model {
    embed: Array2<f32>,
    unembed: Array2<f32>,
    layers: Vec<Layer>,
    rope: Rope,
    seqs: Vec<SeqId>,
}

impl Model {
    /// Random weights (seeded), and a sequence in `cache` per prompt.
    fn new(rope: Rope, cache: &mut KvCache) -> Model {
        let w = |i: u64, r: usize, c: usize| noise((r, c), 10 + i, 1.0 / (r as f32).sqrt());
        Model {
            embed: noise((VOCAB, D), 1, 1.0),
            unembed: noise((D, VOCAB), 2, 1.0 / (D as f32).sqrt()),
            layers: (0..LAYERS as u64)
                .map(|l| Layer {
                    wq: w(6 * l, D, HQ * E),
                    wk: w(6 * l + 1, D, HKV * E),
                    wv: w(6 * l + 2, D, HKV * E),
                    wo: w(6 * l + 3, HQ * E, D),
                    w1: w(6 * l + 4, D, 2 * D),
                    w2: w(6 * l + 5, 2 * D, D),
                })
                .collect(),
            rope,
            seqs: PROMPTS.iter().map(|_| cache.add_sequence()).collect(),
        }
    }
}

/// The host's copies of every layer's rotated keys and values per sequence, and what the
/// checks against the reference found.
struct Checks {
    host: Vec<Vec<HostKv>>,
    checked: usize,
    worst: f64,
}

fn main() -> Res<()> {
    let ctx = Context::new_blocking()?;
    println!("adapter: {}", ctx.describe());
    let rope = Rope {
        style: RopeStyle::HalfSplit,
        theta: 10000.0,
        dim: None,
    };
    let mut cache = KvCache::new(
        &ctx,
        KvCacheConfig {
            layers: LAYERS,
            kv_heads: HKV,
            head_dim: E,
            head_dim_v: E,
            block_size: 16,
            num_blocks: 64,
            storage: kv_format(),
            v_storage: None,
            rope: Some(rope),
        },
    )?;
    println!(
        "cache: {}, {} bytes per token per layer (scales included), {} KiB on the device",
        kv_format(),
        cache.bytes_per_token(),
        cache.memory_bytes() / 1024
    );
    let model = Model::new(rope, &mut cache);
    let prompts: Vec<Vec<usize>> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|t| (t * 7 + i * 13) % VOCAB).collect())
        .collect();
    let mut checks = Checks {
        host: vec![vec![HostKv::default(); PROMPTS.len()]; LAYERS],
        checked: 0,
        worst: 0.0,
    };
    let mut fed = vec![0usize; PROMPTS.len()];
    let mut generated: Vec<Vec<usize>> = vec![Vec::new(); PROMPTS.len()];
    let mut gpu_time = Duration::ZERO;

    // Prefill in chunks: every prompt with tokens left contributes up to CHUNK of them.
    let mut last = vec![0usize; PROMPTS.len()];
    let mut prefill_steps = 0;
    while fed.iter().zip(&prompts).any(|(f, p)| f < &p.len()) {
        let batch: Vec<(usize, Vec<usize>)> = (0..PROMPTS.len())
            .filter(|&s| fed[s] < prompts[s].len())
            .map(|s| {
                let n = CHUNK.min(prompts[s].len() - fed[s]);
                (s, prompts[s][fed[s]..fed[s] + n].to_vec())
            })
            .collect();
        let next = step(&ctx, &model, &mut cache, &mut checks, &batch, &mut gpu_time)?;
        for ((s, toks), tok) in batch.iter().zip(next) {
            fed[*s] += toks.len();
            last[*s] = tok;
        }
        prefill_steps += 1;
    }
    let prefill_time = gpu_time;
    // Generate, the 4 sequences batched, one token each per step.
    for _ in 0..GENERATE {
        let batch: Vec<(usize, Vec<usize>)> = (0..PROMPTS.len()).map(|s| (s, vec![last[s]])).collect();
        let next = step(&ctx, &model, &mut cache, &mut checks, &batch, &mut gpu_time)?;
        for (s, tok) in next.into_iter().enumerate() {
            generated[s].push(tok);
            last[s] = tok;
        }
    }
    let decode_time = gpu_time - prefill_time;
    for (s, g) in generated.iter().enumerate() {
        println!("sequence {s} (prompt {} tokens): {:?} ...", PROMPTS[s], &g[..12]);
    }
    let new_tokens = GENERATE * PROMPTS.len();
    println!(
        "prefill: {} tokens in {prefill_steps} ragged steps; decode: {new_tokens} tokens in {GENERATE} batched steps, {:.1} tokens/s of GPU attention work ({:.2} ms per step, {LAYERS} layers)",
        PROMPTS.iter().sum::<usize>(),
        new_tokens as f64 / decode_time.as_secs_f64(),
        decode_time.as_secs_f64() * 1e3 / GENERATE as f64,
    );
    println!(
        "checked {} attention outputs against the CPU reference: worst abs error {:.2e}",
        checks.checked, checks.worst
    );
    for s in &model.seqs {
        cache.free_sequence(*s)?;
    }
    assert_eq!(cache.free_blocks(), 64, "every block back on the free list");
    append_throughput(&ctx, &mut cache)?;
    gpu_loop(&ctx, &mut cache)?;
    Ok(())
}

/// One step: `batch` = (sequence index, its new tokens). Returns the next token of each.
fn step(
    ctx: &Context,
    model: &Model,
    cache: &mut KvCache,
    checks: &mut Checks,
    batch: &[(usize, Vec<usize>)],
    gpu_time: &mut Duration,
) -> Res<Vec<usize>> {
    let tokens: Vec<usize> = batch.iter().flat_map(|(_, t)| t.iter().copied()).collect();
    let t = tokens.len();
    let mut x = Array2::<f32>::zeros((t, D));
    for (i, &tok) in tokens.iter().enumerate() {
        x.row_mut(i).assign(&model.embed.row(tok));
    }
    let plan: Vec<(SeqId, usize)> = batch
        .iter()
        .map(|(s, toks)| (model.seqs[*s], toks.len()))
        .collect();
    let st = cache.reserve(&plan)?;
    for (l, layer) in model.layers.iter().enumerate() {
        let q = x.dot(&layer.wq).into_shape_with_order((t, HQ, E))?;
        let k = x.dot(&layer.wk).into_shape_with_order((t, HKV, E))?;
        let v = x.dot(&layer.wv).into_shape_with_order((t, HKV, E))?;
        let started = Instant::now();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        cache.append(ctx, &mut enc, &st, l, &Tensor::from(&k), &Tensor::from(&v))?;
        ctx.queue().submit([enc.finish()]);
        let out = cache
            .ragged_attention(&st, l, Tensor::from(&q))?
            .run_blocking(ctx)?;
        *gpu_time += started.elapsed();
        // The host's copy of the rotated keys, and the reference per sequence.
        let mut kr = k.clone();
        model.rope.apply(kr.view_mut(), st.positions())?;
        checks.layer(model, l, batch, (&q, &kr, &v), &out.output)?;
        // Output projection, residual, MLP (host).
        let attn: Array2<f32> = out.output.into_shape_with_order((t, HQ * E))?;
        x = &x + &attn.dot(&layer.wo);
        let hidden = x.dot(&layer.w1).mapv(f32::tanh);
        x = &x + &hidden.dot(&layer.w2);
    }
    Ok(sample(model, checks, batch, &x))
}

impl Checks {
    /// Layer `l`'s new keys `kr` (rotated) and values `v` kept, and its attention output `got`
    /// `[T, Hq, E]` checked against the reference per sequence.
    fn layer(
        &mut self,
        model: &Model,
        l: usize,
        batch: &[(usize, Vec<usize>)],
        (q, kr, v): (&Array3<f32>, &Array3<f32>, &Array3<f32>),
        got: &Array3<f32>,
    ) -> Res<()> {
        let mut at = 0;
        for (s, toks) in batch {
            let n = toks.len();
            let h = &mut self.host[l][*s];
            for i in at..at + n {
                h.k.push(held(kr.slice(s![i, .., ..]).iter().copied().collect()));
                h.v.push(held(v.slice(s![i, .., ..]).iter().copied().collect()));
            }
            let len = h.k.len();
            let kc = Array4::from_shape_fn((1, HKV, len, E), |(_, hh, j, d)| h.k[j][hh * E + d]);
            let vc = Array4::from_shape_fn((1, HKV, len, E), |(_, hh, j, d)| h.v[j][hh * E + d]);
            let mut qs = q.slice(s![at..at + n, .., ..]).to_owned();
            let pos: Vec<usize> = (len - n..len).collect();
            model.rope.apply(qs.view_mut(), &pos)?;
            let qs = qs.permuted_axes([1, 0, 2]).insert_axis(Axis(0));
            let opts = Options {
                causal: Causal::BottomRight,
                ..Options::default()
            };
            let want = reference::sdpa(qs.view(), kc.view(), vc.view(), &opts)?;
            let got = got.slice(s![at..at + n, .., ..]).permuted_axes([1, 0, 2]);
            let tol = match kv_format() {
                Storage::Int8 => Tolerance {
                    atol: 2e-3,
                    rtol: 1e-2,
                },
                _ => F32_TOLERANCE,
            };
            let r = compare(got.iter().copied(), want.out.iter().copied(), tol);
            assert!(r.passed(), "layer {l} sequence {s}: {r}");
            self.worst = self.worst.max(r.max_abs_err);
            self.checked += 1;
            at += n;
        }
        Ok(())
    }
}

/// The next token of each sequence's last position, sampled (Gumbel-max with seeded noise:
/// random weights' greedy choice settles on one token).
fn sample(model: &Model, checks: &Checks, batch: &[(usize, Vec<usize>)], x: &Array2<f32>) -> Vec<usize> {
    let logits = x.dot(&model.unembed);
    let mut next = Vec::new();
    let mut at = 0;
    for (s, toks) in batch {
        at += toks.len();
        // Logits at unit spread (temperature 1 on a standardised row).
        let row = logits.row(at - 1);
        let row = &row / row.std(0.0).max(1e-6);
        let noise = noise(
            (1, VOCAB),
            (*s as u64) << 32 | checks.host[0][*s].k.len() as u64,
            1.0,
        );
        let gumbel = |a: usize| -(-((noise[[0, a]] + 1.0) / 2.0).max(1e-6).ln()).ln();
        let best = (0..VOCAB)
            .max_by(|&a, &b| (row[a] + gumbel(a)).total_cmp(&(row[b] + gumbel(b))))
            .unwrap_or(0);
        next.push(best);
    }
    next
}

/// Append throughput: 1024 tokens (8 sequences of 128) into both layers, timed to
/// completion; the first of three rounds compiles the kernel and is not counted.
fn append_throughput(ctx: &Context, cache: &mut KvCache) -> Res<()> {
    let kv = Array3::<f32>::from_elem((1024, HKV, E), 0.25);
    let mut rates = Vec::new();
    for round in 0..3 {
        let big: Vec<SeqId> = (0..8).map(|_| cache.add_sequence()).collect();
        let plan: Vec<(SeqId, usize)> = big.iter().map(|&s| (s, 128)).collect();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let st = cache.reserve(&plan)?;
        let started = Instant::now();
        for l in 0..LAYERS {
            cache.append(ctx, &mut enc, &st, l, &Tensor::from(&kv), &Tensor::from(&kv))?;
        }
        ctx.queue().submit([enc.finish()]);
        ctx.device()
            .poll(wgpu_attention::wgpu::PollType::wait_indefinitely())?;
        if round > 0 {
            rates.push(1024.0 / started.elapsed().as_secs_f64());
        }
        for s in &big {
            cache.free_sequence(*s)?;
        }
    }
    println!(
        "append: {:.0} tokens/s ({LAYERS} layers, K rotated, 1024 tokens per call)",
        rates.iter().sum::<f64>() / rates.len().max(1) as f64
    );
    Ok(())
}

/// The decode loop as it runs when the model lives on the GPU: 4 sequences of a 64-token
/// prompt, 64 steps of one token each, every layer's append and attention recorded from and
/// into GPU buffers (the projections' stand-ins), the outputs into the caller's buffers.
/// Timed twice: with the last layer's output read back every step (a host-side sampler), and
/// with no readback until the end (a GPU sampler: the host only records and submits).
fn gpu_loop(ctx: &Context, cache: &mut KvCache) -> Result<(), Box<dyn std::error::Error>> {
    use wgpu_attention::wgpu;
    let buf = |elems: usize| {
        let b = ctx.device().create_buffer(&wgpu::BufferDescriptor {
            label: Some("gpu loop"),
            size: (elems * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        ctx.queue()
            .write_buffer(&b, 0, bytemuck::cast_slice(&vec![0.1f32; elems]));
        b
    };
    let (kv, q, out, lse) = (buf(4 * HKV * E), buf(4 * HQ * E), buf(4 * HQ * E), buf(4 * HQ));
    for readback in [true, false] {
        let seqs: Vec<SeqId> = (0..4).map(|_| cache.add_sequence()).collect();
        let prompt: Vec<(SeqId, usize)> = seqs.iter().map(|&s| (s, 64)).collect();
        let step = cache.reserve(&prompt)?;
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let big = Array3::<f32>::from_elem((256, HKV, E), 0.1);
        for l in 0..LAYERS {
            cache.append(ctx, &mut enc, &step, l, &Tensor::from(&big), &Tensor::from(&big))?;
        }
        ctx.queue().submit([enc.finish()]);
        ctx.device().poll(wgpu::PollType::wait_indefinitely())?;
        let started = Instant::now();
        let steps = 64;
        for _ in 0..steps {
            let step = cache.reserve(&seqs.iter().map(|&s| (s, 1)).collect::<Vec<_>>())?;
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            for l in 0..LAYERS {
                let t = Tensor::from_buffer(&kv, Storage::F32, &[4, HKV, E]);
                cache.append(ctx, &mut enc, &step, l, &t, &t)?;
                cache
                    .attention(&step, l, Tensor::from_buffer(&q, Storage::F32, &[4, HQ, 1, E]))?
                    .output_into(Tensor::from_buffer(&out, Storage::F32, &[4, HQ, 1, E]))
                    .lse_into(Tensor::from_buffer(&lse, Storage::F32, &[4, HQ, 1]))
                    .record(ctx, &mut enc)?;
            }
            ctx.queue().submit([enc.finish()]);
            if readback {
                pollster::block_on(ctx.read_f32(&out, 0, out.size()))?;
            }
        }
        ctx.device().poll(wgpu::PollType::wait_indefinitely())?;
        let secs = started.elapsed().as_secs_f64();
        println!(
            "GPU-resident decode loop, {}: {:.0} tokens/s ({steps} steps of 4 sequences, {LAYERS} layers, 64 to 128 keys)",
            if readback { "output read back every step" } else { "no readback until the end" },
            4.0 * steps as f64 / secs
        );
        for s in seqs {
            cache.free_sequence(s)?;
        }
    }
    Ok(())
}
