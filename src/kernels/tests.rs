//! The GPU-free kernel tests: every variant of the enumerated space ([`super::variants`])
//! assembled, validated by naga against its Rust params struct and typed constants,
//! translated to MSL and HLSL, and (the matrix units' forms) written as SPIR-V and checked by
//! `spirv-val` where one is named.

use super::variants::{self, Variant};

/// [`super::ALL`] names every `KernelSpec` of `src/kernels/`, once, and the variant space
/// holds every one of them.
#[test]
fn the_kernel_list_is_complete() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
    let mut declared = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.starts_with("pub(crate) const ") && line.ends_with(": KernelSpec = KernelSpec {") {
                let name = lines[i + 1].trim().strip_prefix("name: \"").expect("name first");
                declared.push(name.trim_end_matches("\",").to_string());
            }
        }
    }
    declared.sort();
    let mut listed: Vec<String> = super::ALL.iter().map(|s| s.name.to_string()).collect();
    listed.sort();
    assert_eq!(
        declared, listed,
        "kernels::ALL and the KernelSpecs of src/kernels/"
    );
    listed.dedup();
    assert_eq!(listed.len(), super::ALL.len(), "a kernel listed twice");
    let mut enumerated: Vec<String> = variants::space()
        .iter()
        .map(|v| v.spec.name.to_string())
        .collect();
    enumerated.sort();
    enumerated.dedup();
    assert_eq!(enumerated, listed, "the variant space's kernels and kernels::ALL");
}

use super::*;

use crate::forms::Caps;
use crate::problem::Problem;

/// Every kernel fits WebGPU's default of 8 storage buffers per shader stage with its params
/// in a uniform buffer, and its params binding comes last (see `params_in_storage` for
/// where the params take a storage binding instead).
#[test]
fn every_kernel_fits_webgpu_default_binding_limits() {
    let webgpu = wgpu::Limits::default().max_storage_buffers_per_shader_stage as usize;
    assert_eq!(webgpu, 8);
    for spec in super::ALL {
        let spec = *spec;
        let storage = spec
            .bindings
            .iter()
            .filter(|b| !matches!(b, Binding::Params))
            .count();
        assert!(storage <= webgpu, "{}: {storage} storage buffers", spec.name);
        assert!(
            matches!(spec.bindings.last(), Some(Binding::Params)),
            "{}: params last",
            spec.name
        );
    }
}

/// Assemble `v`, validate it with naga (the front end wgpu uses), compare its params struct
/// and typed constants with the Rust ones, and translate it to MSL and HLSL with each of its
/// override settings; the matrix units' forms also as SPIR-V, through `spirv_val` where named.
fn check_variant(v: &Variant, spirv_val: Option<&str>) {
    let label = v.label();
    let src = v.source();
    let module =
        naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(&src)));
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{label}: {e:?}"));
    (v.params)(&label, &module);
    let declared_overrides = v.overrides.first().map_or(&[][..], |o| &o[..]);
    consts::check_module(&label, &module, &v.prelude, declared_overrides);
    let settings = if v.overrides.is_empty() {
        vec![Vec::new()]
    } else {
        v.overrides.clone()
    };
    for setting in &settings {
        let constants: Vec<(&str, f64)> = setting.iter().map(|(n, c)| (*n, c.as_f64())).collect();
        let label = format!("{label} {constants:?}");
        // As wgpu's Metal and DX12 backends would translate it.
        translate::check(&label, &src, &constants).unwrap_or_else(|e| panic!("{e}"));
        if v.group == "coop" {
            assert!(!src_has_atomics(&src), "{label}");
            let words = spirv_of(&src, &constants, &label);
            if let Some(cmd) = spirv_val {
                spirv_validates(cmd, &words, &label);
            }
        }
    }
}

/// Check every variant of `group` ([`check_variant`]); how many there were.
fn check_group(group: &str) -> usize {
    let spirv_val = std::env::var("WGPU_ATTENTION_SPIRV_VAL").ok();
    let space: Vec<Variant> = variants::space()
        .into_iter()
        .filter(|v| v.group == group)
        .collect();
    for v in &space {
        check_variant(v, spirv_val.as_deref());
    }
    space.len()
}

/// The fused forward in every form and the decode kernel in every form (as a call pinned to
/// each plans them), the softmax: every format, masked with every mask kind, modifier, view,
/// paged caches and RoPE on q, or not. Runs without a GPU.
#[test]
fn attention_variants_assemble_validate_and_translate() {
    assert!(check_group("attention") > 100);
}

/// The ops' kernels (merge, matmul forms with every override setting, strided copy, RoPE,
/// the pseudo-inverse's steps, d(sinks), the captures' sum, the user functions' kernels) in
/// every format. Runs without a GPU.
#[test]
fn op_variants_assemble_validate_and_translate() {
    assert!(check_group("ops") > 90);
}

/// Every backward kernel, in the GPU and CPU forms, every layout and format, masked or not.
#[test]
fn backward_variants_assemble_validate_and_translate() {
    assert!(check_group("backward") > 100);
}

/// The matrix units' forms (matmul, fused forward and backward, tiles 8 and 16): naga
/// validates them with the Rust params layout, they make SPIR-V, and where
/// `WGPU_ATTENTION_SPIRV_VAL` names a `spirv-val` command (scripts/coopmat_driver.sh sets
/// it), that SPIR-V passes it too (naga 30 writes invalid SPIR-V for a cooperative value
/// bound with `let`, which lavapipe runs anyway and a GPU driver may refuse).
#[test]
fn coop_variants_validate_and_make_valid_spirv() {
    assert!(check_group("coop") > 20);
}

/// Every variant has its own label, so a pipeline's label names what it runs.
#[test]
fn variant_labels_tell_variants_apart() {
    let mut seen: std::collections::HashMap<String, String> = Default::default();
    for v in variants::space() {
        let text = format!("{}{}", v.spec.name, v.prelude.text());
        if let Some(other) = seen.insert(v.label(), text.clone()) {
            assert_eq!(other, text, "two variants labelled {}", v.label());
        }
    }
}

/// On CPU adapters the fused backward takes one row (key) per invocation for problems
/// under the forward's threshold and several above it (the forward's rule; the variant
/// space holds the several-row kernels).
#[test]
fn cpu_backward_rows_follow_the_problem_size() {
    for (e, ev) in [(64, 64), (37, 5), (8, 12)] {
        for sg in [Some(8), None] {
            let caps = Caps::new(&wgpu::Limits::default(), true, sg);
            let small = Problem::new(&[2, 4, 9, e], &[2, 2, 60, e], &[2, 2, 60, ev]).unwrap();
            assert!(small.flops() < flash::CPU_UNROLL_MIN_FLOPS);
            assert_eq!(backward::Config::new(&small, &caps).unwrap().rq, 1);
            let large = Problem::new(&[1, 8, 1024, e], &[1, 8, 1024, e], &[1, 8, 1024, ev]).unwrap();
            assert!(large.flops() >= flash::CPU_UNROLL_MIN_FLOPS);
            let c = backward::Config::new(&large, &caps).unwrap();
            assert!(c.rq > 1 && c.rk > 1, "E {e} Ev {ev} subgroup {sg:?}: {c:?}");
        }
    }
}

/// The matrix units' forms refuse what they cannot store: a half output through a view whose
/// pairs are not words, a half dQ of odd E (both would be stored by atomics), bf16 inputs.
#[test]
fn coop_forms_refuse_what_they_cannot_store() {
    use crate::storage::{Formats, Storage};
    let caps = variants::coop_caps();
    for t in [8, 16] {
        let fwd = caps.with_forms(crate::forms::FusedForm::Coop { tile: Some(t) });
        let half_view = variants::coop_problem(64, 64, Formats::all(Storage::F16), true);
        assert!(flash::Config::new(&half_view, &fwd).is_err());
        let bwd = caps.with_forms(crate::forms::BackwardForm::Coop { tile: Some(t) });
        let odd = Problem::new(&[1, 2, 9, 37], &[1, 2, 20, 37], &[1, 2, 20, 8])
            .unwrap()
            .with_storage(Formats::all(Storage::F16));
        assert!(backward::Config::new(&odd, &bwd).is_err());
        let bf16 = Problem::new(&[1, 2, 9, 32], &[1, 2, 20, 32], &[1, 2, 20, 8])
            .unwrap()
            .with_storage(Formats::all(Storage::Bf16));
        assert!(backward::Config::new(&bf16, &bwd).is_err());
    }
}

fn src_has_atomics(src: &str) -> bool {
    src.contains("atomic<")
}

/// `src` with its boolean overrides set, as SPIR-V for Vulkan 1.3 (what wgpu would hand
/// the driver).
fn spirv_of(src: &str, overrides: &[(&str, f64)], label: &str) -> Vec<u32> {
    let module =
        naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(src)));
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{label}: {e:?}"));
    let constants: naga::back::PipelineConstants =
        overrides.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(&module, &info, None, &constants)
        .unwrap_or_else(|e| panic!("{label}: overrides: {e:?}"));
    let options = naga::back::spv::Options {
        lang_version: (1, 6),
        ..Default::default()
    };
    let pipeline = naga::back::spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
        .unwrap_or_else(|e| panic!("{label}: SPIR-V: {e:?}"))
}

/// Run `cmd` (a `spirv-val` command line) on `words`.
fn spirv_validates(cmd: &str, words: &[u32], label: &str) {
    // One file per call: `cargo test` runs the tests that call this on threads of one process.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("wgpu-attention-{}-{n}.spv", std::process::id()));
    std::fs::write(&path, bytemuck::cast_slice(words)).unwrap();
    let mut parts = cmd.split_whitespace();
    let out = std::process::Command::new(parts.next().expect("a command"))
        .args(parts)
        .args(["--target-env", "vulkan1.3"])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("{label}: cannot run {cmd}: {e}"));
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "{label}: spirv-val: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn grid_folds_over_the_limit() {
    assert_eq!(grid_1d(10, 65535), [10, 1, 1]);
    assert_eq!(grid_1d(65536, 65535), [65535, 2, 1]);
    let g = grid_1d(200_000, 65535);
    assert!(g[0] as u64 * g[1] as u64 >= 200_000);
}
