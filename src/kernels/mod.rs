//! Kernel stages: each module owns one WGSL file from `shaders/`, its parameter struct (mirrored
//! field for field in WGSL) and the code that records its dispatch.
//!
//! Pipelines are built once per (kernel, override constants) and cached in the
//! [`Context`](crate::Context).

pub(crate) mod decode;
pub(crate) mod flash;
pub(crate) mod matmul;
pub(crate) mod permute;
pub(crate) mod softmax;
#[cfg(test)]
mod stage_tests;
pub(crate) mod unroll;

use wgpu::util::DeviceExt;

use crate::context::Context;
use crate::error::{Error, Result};

/// The mask fields shared by the softmax and fused kernels (flattened into their WGSL
/// `Params` in this order): causal limit, packed boolean mask and bias strides, key lengths.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct MaskParams {
    pub has_causal: u32,
    pub causal_off: i32,
    pub has_mask: u32,
    pub has_bias: u32,
    pub has_lens: u32,
    pub mask_b: u32,
    pub mask_h: u32,
    pub mask_l: u32,
    pub bias_b: u32,
    pub bias_h: u32,
    pub bias_l: u32,
    pub bias_s: u32,
}

impl MaskParams {
    /// From the problem and the word strides of its packed mask (if any).
    pub(crate) fn new(p: &crate::problem::Problem, mask_strides: Option<[u32; 3]>) -> Self {
        let bias = p.bias.map(|b| b.strides()).unwrap_or([0; 4]);
        let mask = mask_strides.unwrap_or([0; 3]);
        MaskParams {
            has_causal: (p.causal != crate::problem::Causal::None) as u32,
            causal_off: p
                .causal
                .offset(p.seq_q, p.seq_kv)
                .unwrap_or(0)
                .clamp(i32::MIN as i64, i32::MAX as i64) as i32,
            has_mask: mask_strides.is_some() as u32,
            has_bias: p.bias.is_some() as u32,
            has_lens: p.kv_lens.is_some() as u32,
            mask_b: mask[0],
            mask_h: mask[1],
            mask_l: mask[2],
            bias_b: bias[0] as u32,
            bias_h: bias[1] as u32,
            bias_l: bias[2] as u32,
            bias_s: bias[3] as u32,
        }
    }
}

/// How a kernel binds one buffer; the binding number is the index in [`KernelSpec::bindings`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Binding {
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    ReadWrite,
    /// `var<uniform> p: Params` (the params struct, always last); a read-only storage buffer
    /// where [`Context::params_in_storage`] says so.
    Uniform,
}

/// The bindings of the fused and decode kernels: q, k, v, mask, bias, kv_lens (read), two
/// outputs (read_write), params.
pub(crate) const ATTENTION_BINDINGS: &[Binding] = &[
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::Read,
    Binding::ReadWrite,
    Binding::ReadWrite,
    Binding::Uniform,
];

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
#[allow(clippy::too_many_arguments)] // each argument is a distinct part of one dispatch
pub(crate) fn dispatch(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    spec: &KernelSpec,
    prelude: &str,
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
    let pipeline = ctx.pipeline(spec, prelude, constants);
    let uniform = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some(spec.name),
        contents: params,
        // Either binding type (see `Context::params_in_storage`).
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::STORAGE,
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
