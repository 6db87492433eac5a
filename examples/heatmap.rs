//! A toy sentence through causal multi-head self-attention, with the attention weights drawn as
//! a heatmap (one panel per head; rows = queries, columns = keys, both in sentence order).
//! `cargo run --release --example heatmap [-- OUT.png]` (default `docs/heatmap.png`).
//!
//! The layer is randomly initialised (PyTorch's Xavier scheme, fixed seed) and the word
//! embeddings are fixed pseudo-random vectors plus sinusoidal positions, so the pattern shows the
//! mechanics, not meaning: the causal triangle, and the repeated word "the" (tokens 0 and 4)
//! drawing similar attention.
use ndarray::{Array3, Axis};
use rand::{Rng, SeedableRng};
use wgpu_attention::{heatmap, Causal, Context, MhaConfig, MhaWeights, MultiHeadAttention, NeedWeights};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "docs/heatmap.png".into());
    let sentence = ["the", "cat", "sat", "on", "the", "mat"];
    let d_model = 32;
    let ctx = Context::new_blocking()?;
    println!("adapter: {}", ctx.describe());

    // One embedding per distinct word (seeded by the word), plus sinusoidal positions.
    let mut x = Array3::<f32>::zeros((1, sentence.len(), d_model));
    for (t, word) in sentence.iter().enumerate() {
        let seed = word
            .bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for d in 0..d_model {
            let angle = t as f32 / 10_000f32.powf((d - d % 2) as f32 / d_model as f32);
            let pos = if d % 2 == 0 { angle.sin() } else { angle.cos() };
            x[[0, t, d]] = rng.random_range(-1.0f32..1.0) * 2.0 + 0.5 * pos;
        }
    }

    let weights = MhaWeights::xavier_uniform(MhaConfig::new(d_model, 4), 42)?;
    let layer = MultiHeadAttention::new(&ctx, &weights)?;
    let r = layer
        .forward(&x)
        .causal(Causal::TopLeft)
        .need_weights(NeedWeights::PerHead)
        .run_blocking(&ctx)?;
    let w = r.weights.expect("per-head weights").index_axis_move(Axis(0), 0); // [H, L, S]
    for (h, head) in w.outer_iter().enumerate() {
        println!("head {h}:");
        for (i, row) in head.outer_iter().enumerate() {
            let cells: Vec<String> = row.iter().map(|p| format!("{p:.2}")).collect();
            println!("  {:>4} | {}", sentence[i], cells.join(" "));
        }
    }
    heatmap::Heatmap::new(w.view())
        .cell(24)
        .tokens(&sentence)
        .write(&out)?;
    println!("wrote {out} (tokens: {})", sentence.join(" "));
    Ok(())
}
