//! Every kernel as wgpu's Metal and DX12 backends would translate it (feature
//! `translation-check`, which the crate's own tests turn on): naga's MSL writer (MSL 2.3, what
//! wgpu's Metal backend needs for subgroups) and its HLSL writer (shader model 6.0, 6.2 where a
//! kernel uses f16), with the override constants resolved first, as wgpu does at pipeline
//! creation. Those backends translate every WGSL module through naga when a pipeline is made,
//! so a construct naga cannot translate would fail there at run time; with the feature on,
//! every pipeline the test suite creates on any backend (user functions included) is
//! translated first, and the GPU-free kernel tests translate every variant they assemble.
//!
//! The matrix units' kernels: MSL for 8 x 8 tiles only (Metal's simdgroup matrices are 8 x 8)
//! and no HLSL (wgpu's DX12 backend has no cooperative matrices): the plan never runs them
//! there (see docs/platforms.md).

/// Translate `src` (a kernel named `label`, its overrides set to `constants`) to MSL and HLSL;
/// the first writer's error or panic, naming the variant and the backend.
pub(crate) fn check(label: &str, src: &str, constants: &[(&str, f64)]) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| format!("{label}: {}", e.emit_to_string(src)))?;
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
        .validate(&module)
        .map_err(|e| format!("{label}: {e:?}"))?;
    let constants: naga::back::PipelineConstants = constants.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(&module, &info, None, &constants)
        .map_err(|e| format!("{label}: overrides: {e:?}"))?;
    let coop = src.contains("enable wgpu_cooperative_matrix;");
    let guarded = |backend: &str, f: &dyn Fn() -> Result<String, String>| -> Result<(), String> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(out)) if out.contains("main") => Ok(()),
            Ok(Ok(_)) => Err(format!("{label}: naga's {backend} writer wrote no entry point")),
            Ok(Err(e)) => Err(format!("{label}: naga's {backend} writer: {e}")),
            Err(_) => Err(format!("{label}: naga's {backend} writer panicked")),
        }
    };
    if !coop || !src.contains("coop_mat16x16") {
        guarded("MSL", &|| {
            let options = naga::back::msl::Options {
                lang_version: (2, 3),
                ..Default::default()
            };
            let pipeline = naga::back::msl::PipelineOptions {
                entry_point: Some((naga::ShaderStage::Compute, "main".into())),
                ..Default::default()
            };
            naga::back::msl::write_string(&module, &info, &options, &pipeline)
                .map(|(s, _)| s)
                .map_err(|e| format!("{e:?}"))
        })?;
    }
    if !coop {
        guarded("HLSL", &|| {
            let options = naga::back::hlsl::Options {
                shader_model: match src.contains("enable f16;") {
                    true => naga::back::hlsl::ShaderModel::V6_2,
                    false => naga::back::hlsl::ShaderModel::V6_0,
                },
                ..Default::default()
            };
            let pipeline = naga::back::hlsl::PipelineOptions {
                entry_point: Some((naga::ShaderStage::Compute, "main".into())),
            };
            let mut out = String::new();
            let mut w = naga::back::hlsl::Writer::new(&mut out, &options, &pipeline);
            w.write(&module, &info, None).map_err(|e| format!("{e:?}"))?;
            Ok(out)
        })?;
    }
    Ok(())
}
