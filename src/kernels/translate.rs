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
    let module =
        naga::front::wgsl::parse_str(src).map_err(|e| format!("{label}: {}", e.emit_to_string(src)))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| format!("{label}: {e:?}"))?;
    let constants: naga::back::PipelineConstants =
        constants.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(&module, &info, None, &constants)
        .map_err(|e| format!("{label}: overrides: {e:?}"))?;
    let coop = src.contains("enable wgpu_cooperative_matrix;");
    if !coop || !src.contains("coop_mat16x16") {
        msl(label, &module, &info)?;
    }
    if !coop {
        hlsl(label, src.contains("enable f16;"), &module, &info)?;
    }
    Ok(())
}

/// `f`'s output, or its error or panic as the failure of `backend`'s writer on `label`.
fn guarded(label: &str, backend: &str, f: &dyn Fn() -> Result<String, String>) -> Result<(), String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(out)) if out.contains("main") => Ok(()),
        Ok(Ok(_)) => Err(format!("{label}: naga's {backend} writer wrote no entry point")),
        Ok(Err(e)) => Err(format!("{label}: naga's {backend} writer: {e}")),
        Err(_) => Err(format!("{label}: naga's {backend} writer panicked")),
    }
}

/// The module in MSL 2.3.
fn msl(label: &str, module: &naga::Module, info: &naga::valid::ModuleInfo) -> Result<(), String> {
    guarded(label, "MSL", &|| {
        let options = naga::back::msl::Options {
            lang_version: (2, 3),
            ..Default::default()
        };
        let pipeline = naga::back::msl::PipelineOptions {
            entry_point: Some((naga::ShaderStage::Compute, "main".into())),
            ..Default::default()
        };
        naga::back::msl::write_string(module, info, &options, &pipeline)
            .map(|(s, _)| s)
            .map_err(|e| format!("{e:?}"))
    })
}

/// The module in HLSL for shader model 6.0, or 6.2 with `f16`.
fn hlsl(label: &str, f16: bool, module: &naga::Module, info: &naga::valid::ModuleInfo) -> Result<(), String> {
    guarded(label, "HLSL", &|| {
        let options = naga::back::hlsl::Options {
            shader_model: match f16 {
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
        w.write(module, info, None).map_err(|e| format!("{e:?}"))?;
        Ok(out)
    })
}

#[cfg(test)]
mod tests {
    /// A writer that fails, errs or panics, is a failure naming the variant and the backend:
    /// a cooperative-matrix kernel given to the HLSL writer (which has no cooperative
    /// matrices) is refused, never passed; a plain kernel passes both writers.
    #[test]
    fn a_writer_failure_is_a_failure() {
        let coop = "enable f16;\nenable wgpu_cooperative_matrix;\n\
            @group(0) @binding(0) var<storage, read_write> x: array<f32>;\n\
            @compute @workgroup_size(64) fn main() {\n\
            var a: coop_mat8x8<f32, C> = coop_mat8x8<f32, C>();\n\
            coopStore(a, &x[0], 8u);\n}\n";
        let module = naga::front::wgsl::parse_str(coop).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap();
        let e = super::hlsl("coop probe", true, &module, &info).unwrap_err();
        assert!(e.starts_with("coop probe: naga's HLSL writer"), "{e}");
        // The check itself leaves the coop kernel's HLSL out, and writes its MSL.
        super::check("coop probe", coop, &[]).unwrap();
        let plain = "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n\
            override N: u32 = 4u;\n\
            @compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {\n\
            if (g.x < N) { x[g.x] = subgroupAdd(x[g.x]); }\n}\n";
        super::check("plain", plain, &[("N", 8.0)]).unwrap();
        assert!(super::check("broken", "fn main( {", &[])
            .unwrap_err()
            .starts_with("broken"));
    }
}
