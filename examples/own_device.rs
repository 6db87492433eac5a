//! Attention inside your own wgpu application: your adapter, device and queue, your buffers,
//! your command encoder, your error scope; the result read back and checked against the CPU
//! reference.
//!
//! ```sh
//! cargo run --release --example own_device
//! ```

use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::{reference, wgpu, Causal, Context, Sdpa, Storage, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    pollster::block_on(run())
}

/// 1. Your device, requested with the adapter's own limits and the features the crate uses;
///    the matrix units (tensor cores) are an experimental wgpu feature, which wgpu grants only
///    with its experimental features enabled: here only where the adapter has them.
async fn your_device() -> Result<(wgpu::Adapter, wgpu::Device, wgpu::Queue), Box<dyn std::error::Error>> {
    // `wgpu::Instance::new(..)` works too; the crate's instance for compute lists the GPUs
    // without probing the window systems (no display-server messages on a machine without one).
    let instance = Context::compute_instance(wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY));
    let adapter = instance.request_adapter(&Default::default()).await?;
    let experimental = adapter.features() & Context::wanted_experimental_features();
    let (device, queue) = adapter
        .request_device(&wgpu::DeviceDescriptor {
            label: Some("my app"),
            required_features: (adapter.features() & Context::wanted_features()) | experimental,
            required_limits: adapter.limits(),
            experimental_features: if experimental.is_empty() {
                wgpu::ExperimentalFeatures::disabled()
            } else {
                // SAFETY: wgpu's contract for experimental features; the crate uses only the
                // cooperative-matrix tiles the adapter lists.
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            },
            ..Default::default()
        })
        .await?;
    Ok((adapter, device, queue))
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (adapter, device, queue) = your_device().await?;
    // The context keeps clones of your handles and reads the adapter's information.
    let ctx = Context::from_parts(&adapter, device.clone(), queue.clone());
    println!("adapter: {}", ctx.describe());
    assert!(ctx.missing(&adapter).is_empty(), "{:?}", ctx.missing(&adapter));

    // 2. Your buffers: q [B, Hq, L, E], k and v [B, Hkv, S, E] in f16, the output in f32.
    let (b, hq, hkv, l, s, e) = (1, 8, 2, 16, 40, 64);
    let host = |n: usize, seed: u32| -> Vec<half::f16> {
        (0..n)
            .map(|i| {
                half::f16::from_f32(
                    (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0,
                )
            })
            .collect()
    };
    let (qh, kh, vh) = (
        host(b * hq * l * e, 1),
        host(b * hkv * s * e, 2),
        host(b * hkv * s * e, 3),
    );
    let upload = |data: &[half::f16]| {
        let buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (data.len() * 2) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        queue.write_buffer(&buf, 0, bytemuck::cast_slice(data));
        buf
    };
    let (qb, kb, vb) = (upload(&qh), upload(&kh), upload(&vh));
    let out = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("attention output"),
        size: (b * hq * l * e * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });

    // 3. Record into your encoder, inside your error scope: record's device errors go there.
    let call = Sdpa::new(
        Tensor::from_buffer(&qb, Storage::F16, &[b, hq, l, e]),
        Tensor::from_buffer(&kb, Storage::F16, &[b, hkv, s, e]),
        Tensor::from_buffer(&vb, Storage::F16, &[b, hkv, s, e]),
    )
    .causal(Causal::BottomRight)
    .output_into(Tensor::from_buffer(&out, Storage::F32, &[b, hq, l, e]));
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let mut encoder = device.create_command_encoder(&Default::default());
    call.record(&ctx, &mut encoder)?; // shape, format and size mistakes: typed errors here
    queue.submit([encoder.finish()]);
    if let Some(e) = scope.pop().await {
        return Err(e.into());
    }

    // 4. Read back (elements in the output's format, widened to f32) and check.
    let got = ctx.read_as_f32(&out, 0, b * hq * l * e, Storage::F32).await?;
    let f = |v: &[half::f16], shape: [usize; 4]| {
        ndarray::Array4::from_shape_vec(shape, v.iter().map(|x| x.to_f32()).collect::<Vec<_>>()).unwrap()
    };
    let want = reference::sdpa(
        f(&qh, [b, hq, l, e]).view(),
        f(&kh, [b, hkv, s, e]).view(),
        f(&vh, [b, hkv, s, e]).view(),
        &wgpu_attention::Options {
            causal: Causal::BottomRight,
            ..Default::default()
        },
    )?;
    // f16 inputs: f16's accuracy (docs/storage.md). The scalar forms come out far closer (f32
    // arithmetic throughout); on a GPU's matrix units the softmax weights are rounded to f16
    // before P V, as FlashAttention's f16 kernels do.
    let report = compare(
        got.iter().copied(),
        want.out.iter().copied(),
        Tolerance::for_storage(Storage::F16),
    );
    println!("own device, f16 inputs, f32 output: {report}");
    if !report.passed() {
        return Err("results differ from the reference".into());
    }
    println!("check: PASS");
    Ok(())
}
