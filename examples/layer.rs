//! The multi-head attention layer with your own weights: the forward pass, its gradients (also
//! accumulated over two micro-batches into your own buffer), and a decode step on cached key/value heads recorded into your own command encoder with the
//! output in your own buffer. Each result is checked against the CPU reference.
//!
//! ```sh
//! cargo run --release --example layer
//! ```

use ndarray::{Array1, Array3, Array4, Dimension, ShapeBuilder};
use wgpu_attention::check::{compare, flash_rule, F32_TOLERANCE};
use wgpu_attention::reference::{self, MhaInputs};
use wgpu_attention::{
    wgpu, Causal, Context, MhaConfig, MhaGradsInto, MhaWeights, MultiHeadAttention, Options, Storage, Tensor,
};

/// Deterministic values in [-0.5, 0.5).
fn noise<D: Dimension>(shape: impl ShapeBuilder<Dim = D>, seed: u64) -> ndarray::Array<f32, D> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    ndarray::Array::from_shape_simple_fn(shape, || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 1000) as f32 / 1000.0 - 0.5
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::new_blocking()?;
    println!("adapter: {}", ctx.describe());

    // 1. Your weights, in PyTorch's nn.Linear layout ([out, in], applied as x Wᵀ + b): here
    // plain ndarrays (MhaWeights::from_safetensors_file reads a PyTorch state dict instead).
    // d_model 64, 4 query heads sharing 2 key/value heads (grouped-query), head dim 16.
    let config = MhaConfig::new(64, 4).kv_heads(2);
    let (e, kv) = (config.d_model, config.num_kv_heads * config.head_dim());
    let weights = MhaWeights {
        config,
        w_q: noise((e, e), 1) * 0.3,
        w_k: noise((kv, e), 2) * 0.3,
        w_v: noise((kv, e), 3) * 0.3,
        w_o: noise((e, e), 4) * 0.3,
        b_q: Some(noise(e, 5)),
        b_k: Some(noise(kv, 6)),
        b_v: Some(noise(kv, 7)),
        b_o: Some(Array1::zeros(e)),
        storage: Storage::F32,
    };
    let layer = MultiHeadAttention::new(&ctx, &weights)?; // uploads the parameters once
    forward_and_backward(&ctx, &layer, &weights)?;
    decode_step(&ctx, &layer, &weights)?;
    println!("check: PASS");
    Ok(())
}

/// 2. and 3.: causal self-attention over 2 sequences of 10 tokens, and its gradients.
fn forward_and_backward(
    ctx: &Context,
    layer: &MultiHeadAttention,
    weights: &MhaWeights,
) -> Result<(), Box<dyn std::error::Error>> {
    let e = weights.config.d_model;
    let opts = Options {
        causal: Causal::TopLeft,
        ..Default::default()
    };

    // 2. Forward: causal self-attention over 2 sequences of 10 tokens.
    let x: Array3<f32> = noise((2, 10, e), 8);
    let y = layer.forward(&x).causal(Causal::TopLeft).run_blocking(ctx)?;
    let inputs = MhaInputs::self_attention(x.view());
    let want = reference::mha(weights, &inputs, &opts)?;
    let r = compare(y.output.iter().copied(), want.out.iter().copied(), F32_TOLERANCE);
    println!("forward  [2, 10, {e}]: {r}");
    if !r.passed() {
        return Err("forward".into());
    }

    // 3. Backward: the gradients of every parameter and input for dL/dY = dy.
    let dy: Array3<f32> = noise((2, 10, e), 9);
    let g = layer
        .forward(&x)
        .causal(Causal::TopLeft)
        .backward(&dy)
        .run_blocking(ctx)?;
    let want = reference::mha_backward(weights, &inputs, &opts, dy.view())?;
    let plain = reference::mha_backward_f32(weights, &inputs, &opts, dy.view())?;
    for (name, got, want, plain) in [
        (
            "dx",
            g.query.as_slice(),
            want.query.as_slice(),
            plain.query.as_slice(),
        ),
        (
            "dW_q",
            g.w_q.as_slice(),
            want.w_q.as_slice(),
            plain.w_q.as_slice(),
        ),
        (
            "dW_k",
            g.w_k.as_slice(),
            want.w_k.as_slice(),
            plain.w_k.as_slice(),
        ),
        (
            "dW_o",
            g.w_o.as_slice(),
            want.w_o.as_slice(),
            plain.w_o.as_slice(),
        ),
    ] {
        let (got, want, plain) = (got.unwrap(), want.unwrap(), plain.unwrap());
        let r = flash_rule(got.iter().copied(), want.iter().copied(), plain.iter().copied());
        println!("backward {name}: {r}");
        if !r.passed() {
            return Err(format!("backward {name}").into());
        }
    }
    let _pytorch_names = g.state_dict(true, ""); // in_proj_weight, in_proj_bias, out_proj.*
    accumulate_gradients(ctx, layer, weights, (&x, &dy))
}

/// 3b. Gradient accumulation on the device: two micro-batches' dW_q summed into your own
/// buffer (an optimizer's gradient), both recorded into your encoder, one submission.
fn accumulate_gradients(
    ctx: &Context,
    layer: &MultiHeadAttention,
    weights: &MhaWeights,
    (x, dy): (&Array3<f32>, &Array3<f32>),
) -> Result<(), Box<dyn std::error::Error>> {
    let e = weights.config.d_model;
    let dw_q = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("your dW_q"),
        size: (e * e * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let (x2, dy2): (Array3<f32>, Array3<f32>) = (noise((2, 10, e), 10), noise((2, 10, e), 11));
    let into = MhaGradsInto {
        w: [Some(&dw_q), None, None, None],
        accumulate: true,
        ..Default::default()
    };
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    encoder.clear_buffer(&dw_q, 0, None);
    for (x, dy) in [(x, dy), (&x2, &dy2)] {
        layer
            .forward(x)
            .causal(Causal::TopLeft)
            .backward(dy)
            .grads_into(into)
            .record(ctx, &mut encoder)?;
    }
    ctx.queue().submit([encoder.finish()]);
    let got = pollster::block_on(ctx.read_f32(&dw_q, 0, (e * e * 4) as u64))?;
    let opts = Options {
        causal: Causal::TopLeft,
        ..Default::default()
    };
    let grad = |x: &Array3<f32>, dy: &Array3<f32>| {
        reference::mha_backward(weights, &MhaInputs::self_attention(x.view()), &opts, dy.view())
    };
    let want = grad(x, dy)?.w_q + grad(&x2, &dy2)?.w_q;
    let r = compare(got.iter().copied(), want.iter().copied(), F32_TOLERANCE);
    println!("dW_q accumulated over two micro-batches (your buffer): {r}");
    if !r.passed() {
        return Err("accumulated dW_q".into());
    }
    Ok(())
}

/// 4. One decode step on cached heads, recorded into your encoder, into your buffer.
fn decode_step(
    ctx: &Context,
    layer: &MultiHeadAttention,
    weights: &MhaWeights,
) -> Result<(), Box<dyn std::error::Error>> {
    let (config, e) = (weights.config, weights.config.d_model);

    // 4. A decode step as a generation loop runs it: the keys and values of the 30 earlier
    // tokens cached as heads [B, G, S, d_k], the new token's query projected, the whole layer
    // recorded into your encoder, the output written into your buffer, your submission.
    let d = config.head_dim();
    let (k_cache, v_cache): (Array4<f32>, Array4<f32>) = (noise((2, 2, 30, d), 10), noise((2, 2, 30, d), 11));
    let token: Array3<f32> = noise((2, 1, e), 12);
    let out = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("my layer output"),
        size: (2 * e * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let scope = ctx.device().push_error_scope(wgpu::ErrorFilter::Validation);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    let gpu = layer
        .forward(&token)
        .key_heads(&k_cache)
        .value_heads(&v_cache)
        .output_into(Tensor::from_buffer(&out, Storage::F32, &[2, 1, e]))
        .record(ctx, &mut encoder)?;
    ctx.queue().submit([encoder.finish()]);
    if let Some(err) = pollster::block_on(scope.pop()) {
        return Err(format!("device error: {err}").into());
    }
    let got = pollster::block_on(ctx.read_f32(&gpu.output, gpu.output_offset, (2 * e * 4) as u64))?;
    let step = MhaInputs {
        key_heads: Some(k_cache.view()),
        value_heads: Some(v_cache.view()),
        ..MhaInputs::self_attention(token.view())
    };
    let want = reference::mha(weights, &step, &Options::default())?;
    let r = compare(got.iter().copied(), want.out.iter().copied(), F32_TOLERANCE);
    println!("decode step on cached heads (recorded, your buffer): {r}");
    if !r.passed() {
        return Err("decode step".into());
    }
    Ok(())
}
