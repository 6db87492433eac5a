//! The GPU-free kernel tests: every kernel of [`super::ALL`] assembled in its variants, validated
//! by naga against the Rust params, translated to MSL and HLSL, and (the matrix units' forms)
//! checked by `spirv-val` where one is named.

thread_local! {
    /// The kernels this test thread assembled.
    static COVERED: std::cell::RefCell<std::collections::BTreeSet<&'static str>> = Default::default();
}

/// [`super::source`], recording the kernel as assembled by this test.
fn covered_source(spec: &KernelSpec, prelude: &str, storage: bool) -> String {
    COVERED.with(|c| c.borrow_mut().insert(spec.name));
    super::source(spec, prelude, storage)
}

/// Which GPU-free test assembles which kernels (each asserts its own at its end); their
/// union is every kernel of [`super::ALL`] (`the_kernel_list_is_complete`).
const ASSEMBLED_BY: &[(&str, &[&str])] = &[
    (
        "attention",
        &["flash", "flash_tiles", "decode", "decode_tiles", "softmax"],
    ),
    (
        "ops",
        &[
            "merge",
            "matmul",
            "matmul_sg",
            "matmul_tiles",
            "permute",
            "rope",
            "pinv_init",
            "eye_minus",
            "bwd_dsink",
            "bwd_dcap_sum",
            "mod_map",
            "bwd_dcap",
        ],
    ),
    (
        "backward",
        &["bwd_prep", "bwd_dq", "bwd_dkv", "bwd_dbias", "bwd_ds"],
    ),
    ("coop matmul", &["matmul_coop"]),
    ("coop forward", &["flash_coop"]),
    ("coop backward", &["bwd_dq_coop", "bwd_dkv_coop"]),
];

/// This test thread assembled every kernel `ASSEMBLED_BY` gives test `which`.
fn assert_assembled(which: &str) {
    let (_, want) = ASSEMBLED_BY
        .iter()
        .find(|(w, _)| *w == which)
        .expect("a test of the table");
    let got = COVERED.with(|c| c.borrow().clone());
    let missing: Vec<&&str> = want.iter().filter(|n| !got.contains(*n)).collect();
    assert!(missing.is_empty(), "{which}: kernels not assembled: {missing:?}");
}

/// [`super::ALL`] names every `KernelSpec` of `src/kernels/`, once.
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
    let mut assembled: Vec<String> = ASSEMBLED_BY
        .iter()
        .flat_map(|(_, n)| n.iter().map(|n| n.to_string()))
        .collect();
    assembled.sort();
    assert_eq!(assembled, listed, "the GPU-free tests' kernels and kernels::ALL");
}
use super::*;

use crate::forms::Caps;
use crate::problem::{Causal, Problem};
use wgsl::WgslStruct;

/// Every kernel fits WebGPU's default of 8 storage buffers per shader stage with its params
/// in a uniform buffer, and its params binding comes last (see `params_in_storage` for
/// where the params take a storage binding instead).
#[test]
fn every_kernel_fits_webgpu_default_binding_limits() {
    let webgpu = wgpu::Limits::default().max_storage_buffers_per_shader_stage as usize;
    assert_eq!(webgpu, 8);
    for spec in [
        &flash::SPEC,
        &flash::TILES_SPEC,
        &pinv::INIT,
        &pinv::EYE_MINUS,
        &decode::DECODE,
        &decode::DECODE_TILES,
        &merge::MERGE,
        &matmul::SPEC,
        &matmul::SG_SPEC,
        &matmul::TILES_SPEC,
        &permute::SPEC,
        &softmax::SPEC,
    ]
    .into_iter()
    .chain(backward::ALL)
    {
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

/// Views of every tensor (odd offsets and strides: the scalar form of each accessor).
fn test_views() -> crate::view::Views {
    let v = |offset| {
        Some(crate::view::View {
            offset,
            strides: [9001, 97, 131, 1],
        })
    };
    crate::view::Views {
        q: v(1),
        k: v(3),
        v: v(0),
        out: v(5),
        dout: v(7),
        bias: v(9),
        paged: None,
        q_rope: None,
    }
}

/// Parse and validate `src` with naga (the front end wgpu uses), then check that the WGSL
/// struct `T` has the Rust struct's fields, in order, at the same offsets.
fn validate_with<T: WgslStruct>(label: &str, src: &str) {
    let module =
        naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(src)));
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{label}: {e:?}"));
    drop(info);
    check_struct::<T>(label, &module);
    // As wgpu's Metal and DX12 backends would translate it.
    translate::check(label, src, &[]).unwrap_or_else(|e| panic!("{e}"));
}

fn check_struct<T: WgslStruct>(label: &str, module: &naga::Module) {
    let name = T::wgsl_name();
    let (_, ty) = module
        .types
        .iter()
        .find(|(_, t)| t.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("{label}: no struct {name}"));
    let naga::TypeInner::Struct { members, span } = &ty.inner else {
        panic!("{label}: {name} is not a struct")
    };
    let wgsl: Vec<(&str, usize)> = members
        .iter()
        .map(|m| (m.name.as_deref().unwrap(), m.offset as usize))
        .collect();
    assert_eq!(wgsl, T::fields(), "{label}: {name} fields and offsets");
    assert_eq!(*span as usize, std::mem::size_of::<T>(), "{label}: {name} size");
    assert_eq!(
        std::mem::size_of::<T>() % 16,
        0,
        "{name}: uniform structs are multiples of 16 bytes"
    );
}

/// Every kernel, in every form and specialisation, assembles into WGSL that naga accepts,
/// and its params struct has the Rust struct's layout field by field (the nested masks
/// included). Runs without a GPU.
#[test]
fn every_kernel_assembles_and_params_match_rust() {
    let caps_list = [
        Caps::new(&wgpu::Limits::default(), false, Some(32)),
        Caps::new(&wgpu::Limits::default(), true, Some(8)),
        Caps::new(&wgpu::Limits::default(), true, None),
    ];
    use crate::storage::{Formats, Storage};
    let formats = [
        Formats::all(Storage::F32),
        Formats::all(Storage::F16),
        Formats::all(Storage::Bf16),
        Formats {
            out: Storage::F32,
            bias: Storage::F16,
            ..Formats::all(Storage::Bf16)
        },
    ];
    for (e, ev, fi) in [
        (64, 64, 0),
        (37, 5, 0),
        (64, 64, 1),
        (37, 5, 1),
        (64, 64, 2),
        (37, 6, 2),
        (37, 5, 3),
    ] {
        for masked in [false, true] {
            let mut p = Problem::new(&[2, 4, 9, e], &[2, 2, 600, e], &[2, 2, 600, ev])
                .unwrap()
                .with_storage(formats[fi]);
            if masked {
                p = p
                    .with_causal(Causal::BottomRight)
                    .with_mask(&[9, 600])
                    .unwrap()
                    .with_bias(&[4, 1, 600])
                    .unwrap()
                    .with_kv_lens(&[5, 600])
                    .unwrap()
                    .with_window(Some((20, 3)), 2)
                    .unwrap()
                    .with_softcap(Some(5.0))
                    .unwrap()
                    .with_alibi(Some(&[0.5, 0.25, 0.125, 0.0625]))
                    .unwrap();
                p.views = test_views();
                // Paged caches (the block table's reads) in half of the cases.
                p.views.paged = [None, Some(16), None, Some(3)][fi];
                // q rotated as it is read: half-split, interleaved, none.
                p.views.q_rope = [Some((e - e % 2, true)), Some((4, false)), None, None][fi];
            }
            for caps in caps_list {
                for form in caps.fused_forms() {
                    let c = caps.with_forms(form);
                    let cfg = flash::Config::new(&p, &c).unwrap();
                    for storage in [false, true] {
                        let label = format!("flash {form:?} E {e} Ev {ev} masked {masked} formats {fi}");
                        validate_with::<flash::Params>(
                            &label,
                            &covered_source(cfg.spec(), &cfg.prelude(), storage),
                        );
                    }
                }
                for form in caps.decode_forms() {
                    let c = caps.with_forms(form);
                    let cfg = decode::Config::new(&p, &c).unwrap();
                    let label = format!("decode {form:?} E {e} Ev {ev} masked {masked} formats {fi}");
                    validate_with::<decode::Params>(
                        &label,
                        &covered_source(cfg.spec(), &cfg.prelude(), false),
                    );
                }
            }
            validate_with::<softmax::Params>(
                "softmax",
                &covered_source(
                    &softmax::SPEC,
                    &mask_consts(
                        p.mask.is_some(),
                        p.bias.is_some(),
                        Mods::of(&p, &Default::default()),
                        p.storage.bias,
                    ),
                    false,
                ),
            );
        }
    }
    assert_assembled("attention");
}

/// The other kernels (the ops' merge, matmul forms, strided copy and RoPE, the
/// pseudo-inverse's steps, the backward's d(sinks) and captures' sum) assemble into WGSL
/// that naga accepts with the Rust params layout, in every format, and translate to MSL
/// and HLSL; and the nested masks' layout, through the fused kernel. Runs without a GPU.
#[test]
fn every_op_kernel_assembles_and_params_match_rust() {
    use crate::storage::Storage;
    for parts in Storage::ALL {
        for out in Storage::ALL {
            for ev in [4, 5] {
                for view in [None, test_views().out] {
                    validate_with::<merge::Params>(
                        "merge",
                        &covered_source(&merge::MERGE, &merge::prelude(parts, out, ev, view), false),
                    );
                }
            }
        }
    }
    for f in Storage::ALL {
        for words in [false, true] {
            validate_with::<matmul::Params>(
                "matmul",
                &covered_source(&matmul::SPEC, &matmul::prelude([f, f, f, f], words), false),
            );
            validate_with::<matmul::Params>(
                "matmul_tiles",
                &covered_source(
                    &matmul::TILES_SPEC,
                    &(matmul::prelude([f, f, f, f], words) + "const UNROLL: bool = true;\n"),
                    false,
                ),
            );
            for trans_b in [false, true] {
                for vec4 in [false, true] {
                    let pre = matmul::prelude_vec4([f, f, f, f], words, [vec4, vec4])
                        + &matmul::sg_prelude(3, trans_b, vec4, vec4);
                    validate_with::<matmul::Params>(
                        "matmul_sg",
                        &covered_source(&matmul::SG_SPEC, &pre, false),
                    );
                }
            }
        }
    }
    for src in Storage::ALL {
        for dst in Storage::ALL {
            let label = format!("permute {src:?} -> {dst:?}");
            validate_with::<permute::Params>(
                &label,
                &covered_source(&permute::SPEC, &permute::prelude(src, dst), false),
            );
            let label = format!("rope {src:?} -> {dst:?}");
            validate_with::<rope::Params>(
                &label,
                &covered_source(&rope::SPEC, &rope::prelude(Some(src), dst), false),
            );
        }
        let label = format!("rope in place {src:?}");
        validate_with::<rope::Params>(
            &label,
            &covered_source(&rope::SPEC, &rope::prelude(None, src), false),
        );
    }
    // The pseudo-inverse's steps, d(sink logits) and the captures' gradients' sum (no
    // prelude). The mask_mod block map and the captures' gradients themselves need a
    // user function: tests/sdpa.rs and tests/backward.rs run them, translated at pipeline
    // creation (src/kernels/translate.rs).
    validate_with::<pinv::InitParams>("pinv_init", &covered_source(&pinv::INIT, "", false));
    validate_with::<pinv::EyeParams>("eye_minus", &covered_source(&pinv::EYE_MINUS, "", false));
    validate_with::<backward::Params>("bwd_dsink", &covered_source(&backward::DSINK, "", false));
    validate_with::<backward::Params>("bwd_dcap_sum", &covered_source(&backward::DCAP_SUM, "", false));
    // The nested masks, through the fused kernel.
    let cfg = flash::Config::new(
        &Problem::new(&[1, 1, 1, 4], &[1, 1, 1, 4], &[1, 1, 1, 4]).unwrap(),
        &Caps::new(&wgpu::Limits::default(), false, Some(32)),
    )
    .unwrap();
    let src = covered_source(&flash::SPEC, &cfg.prelude(), false);
    check_struct::<Masks>("masks", &naga::front::wgsl::parse_str(&src).unwrap());
    // The user functions' kernels: the mask_mod block map and the capture gradients.
    let q = ndarray::Array4::<f32>::zeros((1, 2, 5, 8));
    let k = ndarray::Array4::<f32>::zeros((1, 2, 7, 8));
    let table = [0.5f32; 4];
    let user = crate::user_mod::UserMod::wgsl(
        "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return s + t(h); }\n\
         fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }\n\
         fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) { d_t(h, g); }\n\
         fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool { return i >= j; }",
    )
    .capture("t", &table);
    let p = crate::sdpa::Sdpa::new(&q, &k, &k)
        .user_mod(user)
        .problem()
        .unwrap();
    let mods = Mods {
        mask_mod: true,
        user: p.user_fns.as_ref().map(|u| u.code.clone()),
        ..Default::default()
    };
    validate_with::<mod_map::Params>(
        "mod_map",
        &covered_source(
            &mod_map::SPEC,
            &mask_consts(false, false, mods, Storage::F32),
            false,
        ),
    );
    let dcap = backward::dcap_prelude(&p, &Default::default()).expect("the source has score_mod_dcapture");
    validate_with::<backward::Params>("bwd_dcap", &covered_source(&backward::DCAP, &dcap, false));
    assert_assembled("ops");
}

/// Every backward kernel, in both forms, every layout and format, masked or not, assembles
/// into WGSL that naga accepts with the Rust params layout.
#[test]
fn backward_kernels_assemble() {
    use crate::storage::{Formats, Storage};
    for (e, ev) in [(64, 64), (37, 5), (8, 12)] {
        for fmt in Storage::ALL {
            for masked in [false, true] {
                let mut p = Problem::new(&[2, 4, 9, e], &[2, 2, 60, e], &[2, 2, 60, ev])
                    .unwrap()
                    .with_storage(Formats::all(fmt));
                if masked {
                    p = p
                        .with_causal(Causal::BottomRight)
                        .with_mask(&[9, 60])
                        .unwrap()
                        .with_bias(&[4, 1, 60])
                        .unwrap()
                        .with_kv_lens(&[5, 60])
                        .unwrap();
                    p.views = test_views();
                }
                for (cpu, sg) in [(false, Some(32)), (true, Some(8)), (true, None)] {
                    let caps = Caps::new(&wgpu::Limits::default(), cpu, sg);
                    let c = backward::Config::new(&p, &caps).unwrap();
                    let label = format!("E {e} Ev {ev} {fmt:?} masked {masked} cpu {cpu} subgroup {sg:?}");
                    for (spec, pre) in [
                        (&backward::DQ, c.dq_prelude()),
                        (&backward::DKV, c.dkv_prelude()),
                        (&backward::DBIAS, backward::dbias_prelude(&p, &Default::default())),
                        (
                            &backward::DS,
                            backward::ds_prelude(masked, masked, Mods::of(&p, &Default::default()), fmt),
                        ),
                        (
                            &backward::PREP,
                            backward::prep_prelude(fmt, Storage::F32, &p.views),
                        ),
                    ] {
                        validate_with::<backward::Params>(
                            &format!("{} {label}", spec.name),
                            &covered_source(spec, &pre, cpu),
                        );
                    }
                }
            }
        }
    }
    assert_assembled("backward");
}

/// On CPU adapters the fused backward takes one row (key) per invocation for problems
/// under the forward's threshold and several above it (the forward's rule); the
/// several-row kernels, which only large problems get, assemble and match the Rust params.
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
            for (spec, pre) in [(&backward::DQ, c.dq_prelude()), (&backward::DKV, c.dkv_prelude())] {
                validate_with::<backward::Params>(
                    &format!("{} E {e} Ev {ev} subgroup {sg:?} rows {}", spec.name, c.rq),
                    &covered_source(spec, &pre, true),
                );
            }
        }
    }
}

/// Every specialisation of the coop matmul (tiles 8 and 16, every storage format of its
/// operands and output, both B layouts, with and without bias and accumulation) assembles
/// into WGSL that naga validates with the Rust params layout, and into SPIR-V; where
/// `WGPU_ATTENTION_SPIRV_VAL` names a `spirv-val` command (scripts/coopmat_driver.sh sets
/// it), that SPIR-V passes it too (naga 30 writes invalid SPIR-V for a cooperative value
/// bound with `let`, which lavapipe runs anyway and a GPU driver may refuse).
#[test]
fn coop_matmul_validates_and_makes_valid_spirv() {
    use crate::storage::Storage;
    let spirv_val = std::env::var("WGPU_ATTENTION_SPIRV_VAL").ok();
    for t in [8, 16] {
        for (fa, fb, fc) in [
            (Storage::F16, Storage::F16, Storage::F16),
            (Storage::F16, Storage::F16, Storage::F32),
            (Storage::F32, Storage::F16, Storage::F32),
            (Storage::F32, Storage::F32, Storage::Bf16),
        ] {
            for c_words in [true, false] {
                // Half outputs stored element by element (atomics) are not the coop
                // form's: naga's atomics under the Vulkan memory model lack a capability.
                if fc.is_half() && !c_words {
                    continue;
                }
                let pre =
                    matmul::coop_prelude(t, 128) + &matmul::prelude([fa, fb, Storage::F32, fc], c_words);
                let src = covered_source(&matmul::COOP_SPEC, &pre, false);
                let label = format!("matmul_coop {t} {fa:?} {fb:?} -> {fc:?} words {c_words}");
                validate_with::<matmul::Params>(&label, &src);
                for trans_b in [true, false] {
                    for (bias, accum) in [(false, false), (true, false), (false, true)] {
                        let consts = [("TRANS_B", trans_b), ("HAS_BIAS", bias), ("ACCUM", accum)];
                        let words = spirv_of(&src, &consts, &label);
                        if let Some(cmd) = &spirv_val {
                            spirv_validates(cmd, &words, &format!("{label} {consts:?}"));
                        }
                    }
                }
            }
        }
    }
    assert_assembled("coop matmul");
}

/// A GPU with 48 KiB of workgroup memory, subgroups of 32 and both coop tiles.
fn coop_caps() -> Caps {
    let limits = wgpu::Limits {
        max_compute_workgroup_storage_size: 48 * 1024,
        ..wgpu::Limits::default()
    };
    let tiles = crate::forms::CoopTiles {
        t8: true,
        t16: true,
        none_because: None,
    };
    Caps::new(&limits, false, Some(32)).with_coop(tiles, 32)
}

/// The coop kernels' test problem (GQA, L != S, tails): with `masked` every mask kind,
/// key lengths, a window with sinks, a softcap and views of every tensor.
fn coop_problem(e: usize, ev: usize, formats: crate::storage::Formats, masked: bool) -> Problem {
    let p = Problem::new(&[2, 4, 9, e], &[2, 2, 60, e], &[2, 2, 60, ev])
        .unwrap()
        .with_storage(formats);
    if !masked {
        return p;
    }
    let mut p = p
        .with_causal(Causal::BottomRight)
        .with_mask(&[9, 60])
        .unwrap()
        .with_bias(&[4, 1, 60])
        .unwrap()
        .with_kv_lens(&[5, 60])
        .unwrap()
        .with_window(Some((5, 3)), 2)
        .unwrap()
        .with_softcap(Some(30.0))
        .unwrap();
    p.views = test_views();
    p
}

/// The fused forward's coop form, in both tiles, f16 and f32 inputs, head dims that are
/// and are not multiples of the tile, without masks and with every mask kind, modifier
/// and views: naga validates it with the Rust params layout, it makes SPIR-V, and where
/// `WGPU_ATTENTION_SPIRV_VAL` names `spirv-val` that SPIR-V passes it.
#[test]
fn coop_fused_forward_validates_and_makes_valid_spirv() {
    use crate::storage::{Formats, Storage};
    let spirv_val = std::env::var("WGPU_ATTENTION_SPIRV_VAL").ok();
    for t in [8, 16] {
        let caps = coop_caps();
        let caps = caps.with_forms(crate::forms::FusedForm::Coop { tile: Some(t) });
        for (e, ev, fmt, masked) in [
            (64, 64, Storage::F16, false),
            (64, 64, Storage::F32, true),
            (37, 20, Storage::F32, true),
            (128, 128, Storage::F16, false),
        ] {
            let p = coop_problem(e, ev, Formats::all(fmt), masked);
            // A half output through a view whose pairs are not words (or of odd Ev) is
            // stored by atomics: refused.
            let half_view = p.clone().with_storage(Formats::all(Storage::F16));
            if masked {
                assert!(flash::Config::new(&half_view, &caps).is_err());
            }
            let cfg = flash::Config::new(&p, &caps).unwrap();
            assert_eq!(cfg.form, crate::forms::FusedForm::Coop { tile: Some(t) });
            let src = covered_source(cfg.spec(), &cfg.prelude(), false);
            assert!(!src_has_atomics(&src));
            let label = format!("flash_coop {t} E {e} Ev {ev} {fmt:?} masked {masked}");
            validate_with::<flash::Params>(&label, &src);
            let words = spirv_of(&src, &[], &label);
            if let Some(cmd) = &spirv_val {
                spirv_validates(cmd, &words, &label);
            }
        }
    }
    assert_assembled("coop forward");
}

/// The fused backward's coop form (dQ and dK/dV), in both tiles, f16 and f32 inputs, head
/// dims that are and are not multiples of the tile, GQA, without masks and with every mask
/// kind, modifier and views: naga validates it with the Rust params layout, it makes
/// SPIR-V, and where `WGPU_ATTENTION_SPIRV_VAL` names `spirv-val` that SPIR-V passes it. A
/// half dQ of odd E (stored by atomics) and bf16 inputs are refused.
#[test]
fn coop_backward_validates_and_makes_valid_spirv() {
    use crate::storage::{Formats, Storage};
    let spirv_val = std::env::var("WGPU_ATTENTION_SPIRV_VAL").ok();
    for t in [8, 16] {
        let caps = coop_caps();
        let caps = caps.with_forms(crate::forms::BackwardForm::Coop { tile: Some(t) });
        for (e, ev, fmt, masked) in [
            (64, 64, Storage::F16, false),
            (64, 64, Storage::F32, true),
            (37, 20, Storage::F32, true),
            (128, 128, Storage::F16, true),
        ] {
            let p = coop_problem(e, ev, Formats::all(fmt), masked);
            let c = backward::Config::new(&p, &caps).unwrap();
            assert_eq!(c.form, crate::forms::BackwardForm::Coop { tile: Some(t) });
            for (spec, pre) in [(c.dq_spec(), c.dq_prelude()), (c.dkv_spec(), c.dkv_prelude())] {
                let src = covered_source(spec, &pre, false);
                assert!(!src_has_atomics(&src), "{}", spec.name);
                let label = format!("{} {t} E {e} Ev {ev} {fmt:?} masked {masked}", spec.name);
                validate_with::<backward::Params>(&label, &src);
                let words = spirv_of(&src, &[], &label);
                if let Some(cmd) = &spirv_val {
                    spirv_validates(cmd, &words, &label);
                }
            }
        }
        let odd = Problem::new(&[1, 2, 9, 37], &[1, 2, 20, 37], &[1, 2, 20, 8])
            .unwrap()
            .with_storage(Formats::all(Storage::F16));
        assert!(backward::Config::new(&odd, &caps).is_err());
        let bf16 = Problem::new(&[1, 2, 9, 32], &[1, 2, 20, 32], &[1, 2, 20, 8])
            .unwrap()
            .with_storage(Formats::all(Storage::Bf16));
        assert!(backward::Config::new(&bf16, &caps).is_err());
    }
    assert_assembled("coop backward");
}

fn src_has_atomics(src: &str) -> bool {
    src.contains("atomic<")
}

/// `src` with its boolean overrides set, as SPIR-V for Vulkan 1.3 (what wgpu would hand
/// the driver).
fn spirv_of(src: &str, overrides: &[(&str, bool)], label: &str) -> Vec<u32> {
    let module =
        naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(src)));
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{label}: {e:?}"));
    let constants: naga::back::PipelineConstants = overrides
        .iter()
        .map(|(k, v)| (k.to_string(), f64::from(u8::from(*v))))
        .collect();
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
