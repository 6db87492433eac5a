//! Kernel stages: each module owns one WGSL file from `shaders/`, its parameter struct (mirrored
//! field for field in WGSL) and the code that records its dispatch.
//!
//! Pipelines are built once per (kernel, override constants) and cached in the
//! [`Context`](crate::Context).

pub(crate) mod matmul;
pub(crate) mod softmax;
#[cfg(test)]
mod stage_tests;

use wgpu::util::DeviceExt;

use crate::context::Context;
use crate::error::{Error, Result};

/// How a kernel binds one buffer; the binding number is the index in [`KernelSpec::bindings`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Binding {
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    ReadWrite,
    /// `var<uniform>` (the params struct, always last).
    Uniform,
}

/// A kernel: its name, WGSL source and bindings in order.
pub(crate) struct KernelSpec {
    pub(crate) name: &'static str,
    pub(crate) source: &'static str,
    pub(crate) bindings: &'static [Binding],
}

/// Split `n` workgroups over x and y so that neither exceeds `max`; kernels recover the linear
/// index as `wg.x + wg.y * num_workgroups.x` and return when it is `>= n`.
pub(crate) fn grid_1d(n: u32, max: u32) -> [u32; 3] {
    if n <= max {
        [n.max(1), 1, 1]
    } else {
        [max, n.div_ceil(max), 1]
    }
}

/// Record one dispatch of `spec` in its own compute pass. `buffers` are bound in order to
/// bindings `0..buffers.len()`; `params` goes to the final uniform binding.
pub(crate) fn dispatch(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    spec: &KernelSpec,
    constants: &[(&'static str, f64)],
    buffers: &[wgpu::BufferBinding<'_>],
    params: &[u8],
    grid: [u32; 3],
) -> Result<()> {
    let max = ctx.limits().max_compute_workgroups_per_dimension;
    if grid.iter().any(|&g| g > max) {
        return Err(Error::TooLargeForDevice {
            what: format!("{} dispatch grid {grid:?}", spec.name),
            bytes: 0,
            limit_name: "max_compute_workgroups_per_dimension",
            limit: max as u64,
            hint: "",
        });
    }
    if grid.contains(&0) {
        return Ok(());
    }
    debug_assert_eq!(buffers.len() + 1, spec.bindings.len());
    let device = ctx.device();
    let pipeline = ctx.pipeline(spec, constants);
    let uniform = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some(spec.name),
        contents: params,
        usage: wgpu::BufferUsages::UNIFORM,
    });
    let mut entries: Vec<wgpu::BindGroupEntry> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: wgpu::BindingResource::Buffer(b.clone()),
        })
        .collect();
    entries.push(wgpu::BindGroupEntry {
        binding: buffers.len() as u32,
        resource: uniform.as_entire_binding(),
    });
    let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some(spec.name),
        layout: &pipeline.layout,
        entries: &entries,
    });
    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some(spec.name),
        timestamp_writes: None,
    });
    pass.set_pipeline(&pipeline.pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_folds_over_the_limit() {
        assert_eq!(grid_1d(10, 65535), [10, 1, 1]);
        assert_eq!(grid_1d(65536, 65535), [65535, 2, 1]);
        let g = grid_1d(200_000, 65535);
        assert!(g[0] as u64 * g[1] as u64 >= 200_000);
    }
}
