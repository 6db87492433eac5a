//! `info`: the adapter, its backend and driver, and the limits and features that matter.

use std::process::ExitCode;

use wgpu_attention::wgpu;

use crate::{context, CliResult};

/// `info`: print the adapter, the limits and the features.
pub(crate) fn info() -> CliResult<ExitCode> {
    let ctx = context()?;
    println!("adapter: {}", ctx.describe());
    {
        let i = ctx.adapter_info();
        println!("  name:          {}", i.name);
        println!("  backend:       {:?}", i.backend);
        println!("  device type:   {:?}", i.device_type);
        println!("  driver:        {} ({})", i.driver, i.driver_info);
        println!("  vendor/device: {:#06x} / {:#06x}", i.vendor, i.device);
        println!(
            "  subgroup size: min {}, max {}",
            i.subgroup_min_size, i.subgroup_max_size
        );
    }
    let l = ctx.limits();
    println!("limits:");
    let rows: [(&str, String); 6] = [
        (
            "max_storage_buffer_binding_size",
            bytes(l.max_storage_buffer_binding_size),
        ),
        ("max_buffer_size", bytes(l.max_buffer_size)),
        (
            "max_compute_workgroup_storage_size",
            bytes(l.max_compute_workgroup_storage_size.into()),
        ),
        (
            "max_compute_invocations_per_workgroup",
            l.max_compute_invocations_per_workgroup.to_string(),
        ),
        (
            "max_compute_workgroups_per_dimension",
            l.max_compute_workgroups_per_dimension.to_string(),
        ),
        (
            "min_storage_buffer_offset_alignment",
            l.min_storage_buffer_offset_alignment.to_string(),
        ),
    ];
    for (name, value) in rows {
        println!("  {name:<38} {value}");
    }
    println!("features (enabled on this device when the adapter has them):");
    let f = ctx.features();
    for (name, feature) in [
        ("SHADER_F16", wgpu::Features::SHADER_F16),
        ("SUBGROUP", wgpu::Features::SUBGROUP),
        ("TIMESTAMP_QUERY", wgpu::Features::TIMESTAMP_QUERY),
        (
            "EXPERIMENTAL_COOPERATIVE_MATRIX",
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
        ),
    ] {
        println!("  {name:<38} {}", if f.contains(feature) { "yes" } else { "no" });
    }
    // The matrix units: every configuration the adapter lists, and the tiles the kernels use.
    println!("matrix units (cooperative matrices):");
    let list = ctx.cooperative_matrix_configurations();
    if list.is_empty() {
        println!("  the adapter lists no configuration (or the device was adopted without it)");
    }
    for c in list {
        println!(
            "  {}x{}x{} {:?} x {:?} -> {:?}{}",
            c.m_size,
            c.n_size,
            c.k_size,
            c.ab_type,
            c.ab_type,
            c.cr_type,
            if c.saturating_accumulation {
                " (saturating)"
            } else {
                ""
            }
        );
    }
    let units = ctx.matrix_units();
    match units.none_because {
        None => println!(
            "  kernels use tiles: {:?} (f16 operands, f32 accumulators)",
            units.list()
        ),
        Some(why) => println!("  kernels use none: {why}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `n` bytes, with a binary-unit rendering when large.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = "B";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{n} ({v:.1} {unit})")
}
