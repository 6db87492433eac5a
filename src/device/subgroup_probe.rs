//! A check that the subgroup operations do what the adapter's reported subgroup size says,
//! run once per context before any subgroup form is chosen: peers have shipped wrong results at
//! subgroup sizes they never tested (onnxruntime-web at 32, llama.cpp's WebGPU backend), and
//! drivers get them wrong too (Mesa 22.3.6's lavapipe at 32 lanes, `LP_NATIVE_VECTOR_WIDTH=1024`,
//! fails this check; the same kernels are right at 32 lanes on an NVIDIA H100). A device whose subgroup operations
//! fail the check is treated as having no fixed subgroup size: the plan does not choose a
//! subgroup form, and a pinned one is a typed refusal.

/// One workgroup of `size` invocations, the reported subgroup size: each invocation writes
/// what the subgroup operations the kernels use (subgroupAdd, subgroupMax, subgroupShuffle,
/// subgroupShuffleXor, subgroupBroadcastFirst, the invocation id) give it.
fn source(size: u32) -> String {
    format!(
        "const N: u32 = {size}u;
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(N, 1, 1)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(subgroup_invocation_id) lane: u32,
        @builtin(subgroup_size) sg: u32) {{
    let x = f32(tid);
    let v = vec4<f32>(x, 1.0, 2.0 * x, -x);
    let s = subgroupAdd(v);
    out[tid * 8u + 0u] = s.x;
    out[tid * 8u + 1u] = s.y + s.z + s.w;
    out[tid * 8u + 2u] = subgroupMax(x);
    out[tid * 8u + 3u] = subgroupShuffleXor(x, 1u);
    out[tid * 8u + 4u] = subgroupShuffle(x, (tid + 3u) % N);
    out[tid * 8u + 5u] = subgroupBroadcastFirst(x + 1.0);
    out[tid * 8u + 6u] = f32(lane);
    out[tid * 8u + 7u] = f32(sg);
}}
"
    )
}

/// What invocation `t` of `n` must read.
fn expected(t: u32, n: u32) -> [f32; 8] {
    let total = (n * (n - 1) / 2) as f32;
    [
        total,
        n as f32 + 2.0 * total - total,
        (n - 1) as f32,
        (t ^ 1) as f32,
        ((t + 3) % n) as f32,
        1.0,
        t as f32,
        n as f32,
    ]
}

/// Whether the device's subgroup operations are right at subgroup size `size` (native: blocks
/// on the device; any device error counts as a failure).
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn subgroups_work(device: &wgpu::Device, queue: &wgpu::Queue, size: u32) -> bool {
    if !size.is_power_of_two() || !(2..=128).contains(&size) {
        return false;
    }
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("wgpu-attention subgroup probe"),
        source: wgpu::ShaderSource::Wgsl(source(size).into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("wgpu-attention subgroup probe"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bytes = u64::from(size) * 8 * 4;
    let out = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("wgpu-attention subgroup probe"),
        size: bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let read = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("wgpu-attention subgroup probe readback"),
        size: bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: out.as_entire_binding(),
        }],
    });
    let mut enc = device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    enc.copy_buffer_to_buffer(&out, 0, &read, 0, bytes);
    queue.submit([enc.finish()]);
    if pollster::block_on(scope.pop()).is_some() {
        return false;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    read.map_async(wgpu::MapMode::Read, .., move |r| {
        let _ = tx.send(r);
    });
    if device.poll(wgpu::PollType::wait_indefinitely()).is_err() || !matches!(rx.recv(), Ok(Ok(()))) {
        return false;
    }
    let ok = {
        let Ok(view) = read.get_mapped_range(..) else {
            return false;
        };
        let got: &[f32] = bytemuck::cast_slice(&view);
        (0..size).all(|t| got[(t * 8) as usize..(t * 8 + 8) as usize] == expected(t, size))
    };
    read.unmap();
    ok
}

#[cfg(test)]
mod tests {
    #[test]
    fn expected_values() {
        assert_eq!(super::expected(0, 4), [6.0, 10.0, 3.0, 1.0, 3.0, 1.0, 0.0, 4.0]);
        assert_eq!(super::expected(3, 4)[3..5], [2.0, 2.0]);
    }
}
