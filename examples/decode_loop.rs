//! A token-by-token decode loop on a KV cache held in your own GPU buffers: K and V of
//! capacity `CAP` positions laid out `[1, CAP, Hkv, E]` (each token's heads adjacent, as most
//! LLM runtimes keep them: one write appends a token; read in place through
//! `TensorLayout::Bshe`, no copy), GQA (8 query heads on 2 key/value heads), each
//! step appending one position and attending over the cache with `kv_lens` = the filled length
//! and bottom-right causal (aligned to that length, FlashAttention's rule: query `i` of the `L`
//! new rows sees keys `j <= i + len - L`), so the shapes never change and the kernels,
//! prepared before the loop, never recompile. Every step is checked
//! against the CPU reference on the filled part of the cache.
//!
//! ```sh
//! cargo run --release --example decode_loop
//! ```

use ndarray::{s, Array4};
use wgpu_attention::check::{compare, F32_TOLERANCE};
use wgpu_attention::{reference, wgpu, Causal, Context, Options, Sdpa, Storage, Tensor, TensorLayout};

const CAP: usize = 640;
const HQ: usize = 8;
const HKV: usize = 2;
const E: usize = 64;
const PREFILL: usize = 500;
const STEPS: usize = 24;

fn noise(shape: (usize, usize, usize, usize), seed: u64) -> Array4<f32> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    Array4::from_shape_simple_fn(shape, || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 2000) as f32 / 1000.0 - 1.0
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::new_blocking()?;
    println!("adapter: {}", ctx.describe());
    let (device, queue) = (ctx.device(), ctx.queue());
    // The whole sequence's K and V (what a model would produce step by step).
    let k_all = noise((1, HKV, CAP, E), 1);
    let v_all = noise((1, HKV, CAP, E), 2);
    let cache = |label| {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (HKV * CAP * E * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    };
    let (kc, vc) = (cache("k cache"), cache("v cache"));
    // Append positions [from, to): one write of `[to - from, Hkv, E]` f32 each for K and V.
    let append = |from: usize, to: usize| {
        let at = (from * HKV * E * 4) as u64;
        let rows = |a: &Array4<f32>| {
            // [Hkv, n, E] -> [n, Hkv, E]
            a.slice(s![0, .., from..to, ..])
                .permuted_axes([1, 0, 2])
                .iter()
                .copied()
                .collect::<Vec<f32>>()
        };
        queue.write_buffer(&kc, at, bytemuck::cast_slice(&rows(&k_all)));
        queue.write_buffer(&vc, at, bytemuck::cast_slice(&rows(&v_all)));
    };
    // The cache as a [1, Hkv, CAP, E] tensor whose buffer holds [1, CAP, Hkv, E].
    let cached =
        |buf| Tensor::from_buffer(buf, Storage::F32, &[1, HKV, CAP, E]).with_layout(TensorLayout::Bshe);
    let attend = |q: &Array4<f32>, len: usize| -> Result<f64, Box<dyn std::error::Error>> {
        let call = Sdpa::new(q, cached(&kc), cached(&vc))
            .causal(Causal::BottomRight)
            .kv_lens(&[len]);
        let t = std::time::Instant::now();
        let got = call.run_blocking(&ctx)?;
        let gpu = t.elapsed().as_secs_f64();
        let want = reference::sdpa(
            q.view(),
            k_all.slice(s![.., .., ..len, ..]),
            v_all.slice(s![.., .., ..len, ..]),
            &Options {
                causal: Causal::BottomRight,
                ..Default::default()
            },
        )?;
        let r = compare(
            got.output.iter().copied(),
            want.out.iter().copied(),
            F32_TOLERANCE,
        );
        if !r.passed() {
            return Err(format!("length {len}: {r}").into());
        }
        Ok(gpu)
    };

    // Prepare the prefill's and the steps' kernels before the loop (the shapes are fixed:
    // the cache's capacity; only kv_lens changes).
    let t = std::time::Instant::now();
    let prefill_q = noise((1, HQ, PREFILL, E), 3);
    let step_q = noise((1, HQ, 1, E), 4);
    let mut forms = 0;
    for q in [&prefill_q, &step_q] {
        forms += Sdpa::new(q, cached(&kc), cached(&vc))
            .causal(Causal::BottomRight)
            .kv_lens(&[CAP])
            .prepare_blocking(&ctx, CAP..=CAP)?;
    }
    println!(
        "prepared {forms} kernel forms in {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );

    append(0, PREFILL);
    attend(&prefill_q, PREFILL)?;
    println!("prefill of {PREFILL} tokens: checked");
    let mut slowest = 0f64;
    for step in 0..STEPS {
        let len = PREFILL + step + 1;
        append(len - 1, len);
        let q = noise((1, HQ, 1, E), 100 + step as u64);
        slowest = slowest.max(attend(&q, len)?);
    }
    println!(
        "{STEPS} decode steps (lengths {}..={}), each checked; slowest step {:.1} ms (the call, with its upload and readback)",
        PREFILL + 1,
        PREFILL + STEPS,
        slowest * 1e3
    );
    println!("check: PASS");
    Ok(())
}
