//! The error an 8-bit KV cache adds to attention, by format and head dim: attention over
//! N(0, 1) q, k and v against attention over the values an int8 or fp8 cache holds for the
//! same k and v (both by the f64 CPU reference, so the figures are the formats' own, not a
//! kernel's). fp8's scales are each head's largest |x| / 448 (vLLM's calibration).
//!
//! ```text
//! cargo run --release --example kv8_error
//! ```
//!
//! Prints, per format and E: the largest absolute error of the output, the relative error
//! (‖error‖₂ / ‖output‖₂), and the K and V values' own largest error over their largest |x|.

use ndarray::Array4;
use rand::{rngs::StdRng, Rng, SeedableRng};
use wgpu_attention::quant;
use wgpu_attention::{reference, Options, Storage};

fn normal(r: &mut StdRng, shape: (usize, usize, usize, usize)) -> Array4<f32> {
    // Box-Muller: N(0, 1) from two uniforms.
    Array4::from_shape_simple_fn(shape, || {
        let (u, v): (f64, f64) = (r.random::<f64>().max(1e-300), r.random());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    })
}

/// x (`[B, Hkv, S, E]`) as the cache in `s` holds it.
fn held(x: &Array4<f32>, s: Storage) -> Array4<f32> {
    let (b, h, n, e) = x.dim();
    let flat = x.as_slice().expect("standard layout");
    let v = match s {
        Storage::Int8 => {
            let (c, sc) = quant::quantize_int8(flat, e);
            quant::dequantize_int8(&c, &sc, e)
        }
        _ => {
            let mut scales = vec![0f32; h];
            for (r, row) in flat.chunks_exact(e).enumerate() {
                let hd = (r / n) % h;
                scales[hd] = row.iter().fold(scales[hd], |m, v| m.max(v.abs()));
            }
            let scales: Vec<f32> = scales.iter().map(|a| a / 448.0).collect();
            let c = quant::quantize_fp8_heads(flat, e, &[b, h, n], 1, &scales);
            quant::dequantize_fp8_heads(&c, e, &[b, h, n], 1, &scales)
        }
    };
    Array4::from_shape_vec((b, h, n, e), v).expect("shape")
}

fn main() -> Result<(), wgpu_attention::Error> {
    let (b, hq, hkv, l, s) = (2, 8, 2, 16, 1024);
    println!("attention over N(0,1) q, k, v: B {b}, Hq {hq}, Hkv {hkv}, L {l}, S {s}, causal bottom-right");
    println!("format  E    out max abs err  out rel err (L2)  k err / max|k|  v err / max|v|");
    for e in [64, 128] {
        let mut r = StdRng::seed_from_u64(e as u64);
        let (q, k, v) = (
            normal(&mut r, (b, hq, l, e)),
            normal(&mut r, (b, hkv, s, e)),
            normal(&mut r, (b, hkv, s, e)),
        );
        let opts = Options {
            causal: wgpu_attention::Causal::BottomRight,
            ..Default::default()
        };
        let exact = reference::sdpa(q.view(), k.view(), v.view(), &opts)?;
        for st in [Storage::Int8, Storage::Fp8] {
            let (kq, vq) = (held(&k, st), held(&v, st));
            let got = reference::sdpa(q.view(), kq.view(), vq.view(), &opts)?;
            let (mut max_abs, mut num, mut den) = (0f64, 0f64, 0f64);
            for (a, x) in got.out.iter().zip(exact.out.iter()) {
                max_abs = max_abs.max((a - x).abs());
                num += (a - x) * (a - x);
                den += x * x;
            }
            let rel = |a: &Array4<f32>, b: &Array4<f32>| {
                let m = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs() / m)
                    .fold(0f32, f32::max)
            };
            println!(
                "{:<6}  {e:<3}  {max_abs:>15.3e}  {:>16.3e}  {:>13.3e}  {:>13.3e}",
                st.name(),
                (num / den).sqrt(),
                rel(&kq, &k),
                rel(&vq, &v)
            );
        }
    }
    Ok(())
}
