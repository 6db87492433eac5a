//! From burn: burn's tensors on this crate's device, attention with the crate's options on them
//! (no copies), and gradients through burn's autodiff.
//!
//! ```sh
//! cargo run --release -p wgpu-attention-burn --example from_burn
//! ```

use burn::tensor::{Distribution, Tensor};
use wgpu_attention_burn::{attention, device_on, new_context, Attention, Causal};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 1. One device: burn's wgpu runtime on the crate's context (or `new_device()` the other
    //    way round: burn makes the device, the crate adopts it).
    //    The context's device has every feature of its adapter, which burn compiles for.
    let ctx = new_context()?;
    let device = device_on(&ctx)?;
    println!("adapter: {}", ctx.describe());

    // 2. burn's attention call, swapped: same arguments, same semantics (mask true = masked,
    //    is_causal bottom-right), and k, v may have fewer heads than q.
    let normal = Distribution::Normal(0.0, 1.0);
    let q = Tensor::<4>::random([2, 8, 100, 64], normal, &device);
    let k = Tensor::<4>::random([2, 2, 300, 64], normal, &device);
    let v = Tensor::<4>::random([2, 2, 300, 64], normal, &device);
    let opts = burn::tensor::ops::AttentionModuleOptions {
        is_causal: true,
        softcap: Some(50.0),
        scale: None,
    };
    let out = attention(q.clone(), k.clone(), v.clone(), None, None, opts)?;
    println!("attention: {:?} -> {:?}", q.dims(), out.dims());

    // 3. The crate's own options: a sliding window with sinks, ALiBi, key lengths.
    let slopes = wgpu_attention_burn::wgpu_attention::alibi_slopes(8);
    let out = Attention::new()
        .causal(Causal::BottomRight)
        .window(127, 0)
        .sink_tokens(4)
        .alibi(&slopes)
        .kv_lens(&[300, 250])
        .forward(q, k, v)?;
    println!("window + sinks + ALiBi + key lengths: {:?}", out.dims());

    // 4. Gradients: on an autodiff device the call is one node of burn's graph, its backward
    //    the crate's fused one.
    let ad = device.autodiff();
    let q = Tensor::<4>::random([1, 4, 64, 32], normal, &ad).require_grad();
    let k = Tensor::<4>::random([1, 4, 64, 32], normal, &ad).require_grad();
    let v = Tensor::<4>::random([1, 4, 64, 32], normal, &ad).require_grad();
    let out = Attention::new()
        .causal(Causal::TopLeft)
        .forward(q.clone(), k.clone(), v.clone())?;
    let grads = out.powi_scalar(2).sum().backward();
    let dq = q.grad(&grads).expect("q is tracked");
    println!(
        "dq: {:?}, |dq| = {:.4}",
        dq.dims(),
        dq.powi_scalar(2).sum().sqrt().into_scalar::<f32>()
    );
    Ok(())
}
