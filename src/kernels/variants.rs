//! The variant space, enumerated once: every kernel of [`super::ALL`] in the forms,
//! specialisations, formats, layouts, masks and modifiers the crate assembles it in, as
//! [`Variant`]s. The GPU-free tests (`kernels/tests.rs`) iterate it: each variant is assembled,
//! validated by naga against its Rust params struct and typed constants, translated to MSL and
//! HLSL (`translate::check`), and, for the matrix units' forms, written as SPIR-V for
//! `spirv-val`. The attention kernels' variants are taken through [`crate::sdpa::plan::Plan`],
//! as a call's are; the others through the preludes their recording code uses.

use super::consts::{ConstValue, Prelude, WgslConsts};
use super::wgsl::WgslStruct;
use super::*;
use crate::forms::Caps;
use crate::problem::{Causal, Problem};
use crate::storage::{Formats, Storage};

/// One kernel variant: the kernel, its prelude, the override settings it runs with, where its
/// params live, and the check of its params struct.
pub(crate) struct Variant {
    /// Which part of the space: `attention`, `ops`, `backward`, `coop`.
    pub group: &'static str,
    pub spec: &'static KernelSpec,
    pub prelude: Prelude,
    /// The override settings it is translated with (none: the WGSL defaults).
    pub overrides: Vec<Vec<(&'static str, ConstValue)>>,
    /// The params in a read-only storage buffer (CPU adapters) rather than a uniform one.
    pub params_in_storage: bool,
    /// Check the module's params struct against the Rust one.
    pub params: fn(&str, &naga::Module),
}

impl Variant {
    fn new<T: WgslStruct>(group: &'static str, spec: &'static KernelSpec, prelude: Prelude) -> Self {
        Variant {
            group,
            spec,
            prelude,
            overrides: Vec::new(),
            params_in_storage: false,
            params: check_struct::<T>,
        }
    }

    fn in_storage(mut self, yes: bool) -> Self {
        self.params_in_storage = yes;
        self
    }

    fn with_overrides(mut self, settings: Vec<Vec<(&'static str, ConstValue)>>) -> Self {
        self.overrides = settings;
        self
    }

    /// The variant's label: its pipeline's ([`Prelude::label`]).
    pub(crate) fn label(&self) -> String {
        self.prelude.label(self.spec.name)
    }

    /// Its WGSL.
    pub(crate) fn source(&self) -> String {
        super::source(
            self.spec,
            self.prelude.text(),
            self.prelude.extra(),
            self.params_in_storage,
        )
    }
}

/// The whole space.
pub(crate) fn space() -> Vec<Variant> {
    let mut v = attention();
    v.extend(ops());
    v.extend(backward());
    v.extend(coop());
    v
}

/// Check that the WGSL struct `T` has the Rust struct's fields, in order, at the same offsets.
pub(crate) fn check_struct<T: WgslStruct>(label: &str, module: &naga::Module) {
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

/// Views of every tensor (odd offsets and strides: the scalar form of each accessor).
pub(crate) fn test_views() -> crate::view::Views {
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

/// Every mask kind with key lengths on a problem of `s` keys.
fn masked(p: Problem, s: usize) -> Problem {
    p.with_causal(Causal::BottomRight)
        .with_mask(&[9, s])
        .unwrap()
        .with_bias(&[4, 1, s])
        .unwrap()
        .with_kv_lens(&[5, s])
        .unwrap()
}

/// The attention problems: GQA, L != S, head dims that are and are not multiples of 4, every
/// storage format; masked ones with every mask kind, the built-in modifiers, views of every
/// tensor, paged caches and RoPE on q in some.
fn attention_problems() -> Vec<Problem> {
    let formats = [
        Formats::all(Storage::F32),
        Formats::all(Storage::F16),
        Formats::all(Storage::Bf16),
        Formats {
            out: Storage::F32,
            bias: Storage::F16,
            ..Formats::all(Storage::Bf16)
        },
        // 8-bit K/V caches (the forward's kernels only).
        Formats {
            k: Storage::Int8,
            v: Storage::Fp8,
            ..Formats::all(Storage::F32)
        },
        Formats {
            k: Storage::Fp8,
            v: Storage::Int8,
            ..Formats::all(Storage::F16)
        },
    ];
    let mut out = Vec::new();
    for (e, ev, fi) in [
        (64, 64, 0),
        (37, 5, 0),
        (64, 64, 1),
        (37, 5, 1),
        (64, 64, 2),
        (37, 6, 2),
        (37, 5, 3),
        (64, 64, 4),
        (36, 20, 5),
    ] {
        let p = Problem::new(&[2, 4, 9, e], &[2, 2, 600, e], &[2, 2, 600, ev])
            .unwrap()
            .with_storage(formats[fi]);
        out.push(p.clone());
        let mut p = masked(p, 600)
            .with_window(Some((20, 3)), 2)
            .unwrap()
            .with_softcap(Some(5.0))
            .unwrap()
            .with_alibi(Some(&[0.5, 0.25, 0.125, 0.0625]))
            .unwrap();
        p.views = test_views();
        // Paged caches (the block table's reads) in half of the cases.
        p.views.paged = [None, Some(16), None, Some(3), Some(16), None][fi];
        // q rotated as it is read: half-split, interleaved, none.
        p.views.q_rope = [
            Some((e - e % 2, true)),
            Some((4, false)),
            None,
            None,
            Some((8, false)),
            None,
        ][fi];
        out.push(p);
    }
    out
}

/// A GPU with subgroups of 32, a CPU adapter with subgroups of 8, one without subgroups.
fn device_caps() -> [Caps; 3] {
    [
        Caps::new(&wgpu::Limits::default(), false, Some(32)),
        Caps::new(&wgpu::Limits::default(), true, Some(8)),
        Caps::new(&wgpu::Limits::default(), true, None),
    ]
}

/// The fused forward in every form and the decode kernel in every form, through the plan of
/// a call pinned to each; and the unfused path's softmax.
fn attention() -> Vec<Variant> {
    use crate::sdpa::plan::{Plan, Request};
    let mut out = Vec::new();
    for p in attention_problems() {
        for caps in device_caps() {
            // The CPU adapters' default for large problems at head dims up to 64 too.
            let large_default = caps
                .fused_subgroup()
                .filter(|_| caps.cpu)
                .map(|_| crate::forms::FusedForm::Subgroup { rows: 8 });
            let forms: Vec<crate::forms::Forms> = caps
                .fused_forms()
                .into_iter()
                .chain(large_default)
                .map(Into::into)
                .chain(caps.decode_forms().into_iter().map(Into::into))
                .collect();
            for form in forms {
                let path = if form.decode.is_some() {
                    crate::sdpa::Path::Decode
                } else {
                    crate::sdpa::Path::Fused
                };
                let req = Request {
                    path,
                    weights: false,
                    max_scores_bytes: None,
                };
                let plan = Plan::new(&p, &req, &caps.with_forms(form)).unwrap();
                let (spec, prelude) = plan.variant().expect("the fused and decode paths have one");
                if path == crate::sdpa::Path::Decode {
                    out.push(Variant::new::<decode::Params>("attention", spec, prelude));
                    continue;
                }
                for storage in [false, true] {
                    out.push(
                        Variant::new::<flash::Params>("attention", spec, prelude.clone()).in_storage(storage),
                    );
                }
            }
        }
        let masks = mask_consts(
            p.mask.is_some(),
            p.bias.is_some(),
            Mods::of(&p, &Default::default()),
            p.storage.bias,
        );
        out.push(Variant::new::<softmax::Params>(
            "attention",
            &softmax::SPEC,
            masks,
        ));
    }
    // The nested masks' layout, through the fused kernel.
    let cfg = flash::Config::new(
        &Problem::new(&[1, 1, 1, 4], &[1, 1, 1, 4], &[1, 1, 1, 4]).unwrap(),
        &device_caps()[0],
    )
    .unwrap();
    out.push(Variant::new::<Masks>("attention", &flash::SPEC, cfg.prelude()));
    out
}

/// Every setting of the matmul's override constants.
fn matmul_overrides() -> Vec<Vec<(&'static str, ConstValue)>> {
    let mut v = Vec::new();
    for trans_b in [true, false] {
        for (bias, accum) in [(false, false), (true, false), (false, true)] {
            let o = matmul::Overrides {
                TRANS_B: trans_b,
                HAS_BIAS: bias,
                ACCUM: accum,
            };
            v.push(o.items());
        }
    }
    v
}

/// The ops' kernels: merge, the matmul forms, strided copy, RoPE, the pseudo-inverse's steps,
/// the backward's d(sinks) and captures' sum, and the user functions' kernels.
fn ops() -> Vec<Variant> {
    let mut out = Vec::new();
    for parts in Storage::ALL {
        for o in Storage::ALL {
            for ev in [4, 5] {
                for view in [None, test_views().out] {
                    let pre = merge::prelude(parts, o, ev, view);
                    out.push(Variant::new::<merge::Params>("ops", &merge::MERGE, pre));
                }
            }
        }
    }
    out.extend(matmuls());
    for src in Storage::ALL {
        for dst in Storage::ALL {
            out.push(Variant::new::<permute::Params>(
                "ops",
                &permute::SPEC,
                permute::prelude(src, dst),
            ));
            out.push(Variant::new::<rope::Params>(
                "ops",
                &rope::SPEC,
                rope::prelude(Some(src), dst),
            ));
        }
        out.push(Variant::new::<rope::Params>(
            "ops",
            &rope::SPEC,
            rope::prelude(None, src),
        ));
        for cache in Storage::QUANTIZED {
            out.push(Variant::new::<rope::Params>(
                "ops",
                &rope::QUANTIZE,
                rope::quantize_prelude(src, cache),
            ));
        }
    }
    out.push(Variant::new::<pinv::InitParams>(
        "ops",
        &pinv::INIT,
        Prelude::new(),
    ));
    out.push(Variant::new::<pinv::EyeParams>(
        "ops",
        &pinv::EYE_MINUS,
        Prelude::new(),
    ));
    out.push(Variant::new::<backward::Params>(
        "ops",
        &backward::DSINK,
        Prelude::new(),
    ));
    out.push(Variant::new::<backward::Params>(
        "ops",
        &backward::DCAP_SUM,
        Prelude::new(),
    ));
    out.extend(user_kernels());
    out
}

/// The matmul's tiled, GPU-tiled and subgroup forms in every format.
fn matmuls() -> Vec<Variant> {
    let mut out = Vec::new();
    let o = matmul_overrides();
    for f in Storage::ALL {
        for words in [false, true] {
            let pre = matmul::prelude([f, f, f, f], words);
            out.push(
                Variant::new::<matmul::Params>("ops", &matmul::SPEC, pre.clone()).with_overrides(o.clone()),
            );
            let tiles = pre.consts(&matmul::Unroll { UNROLL: true });
            out.push(
                Variant::new::<matmul::Params>("ops", &matmul::TILES_SPEC, tiles).with_overrides(o.clone()),
            );
            for trans_b in [false, true] {
                for vec4 in [false, true] {
                    let pre = matmul::prelude_vec4([f, f, f, f], words, [vec4, vec4])
                        .then(matmul::sg_prelude(3, trans_b, vec4, vec4));
                    let settings = o
                        .iter()
                        .filter(|s| s.contains(&("TRANS_B", trans_b.into())))
                        .cloned()
                        .collect();
                    out.push(
                        Variant::new::<matmul::Params>("ops", &matmul::SG_SPEC, pre).with_overrides(settings),
                    );
                }
            }
        }
    }
    out
}

/// The user functions' kernels: the mask_mod block map and the capture gradients.
fn user_kernels() -> Vec<Variant> {
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
    let map = mask_consts(false, false, mods, Storage::F32);
    let dcap = backward::dcap_prelude(&p, &Default::default()).expect("the source has score_mod_dcapture");
    vec![
        Variant::new::<mod_map::Params>("ops", &mod_map::SPEC, map),
        Variant::new::<backward::Params>("ops", &backward::DCAP, dcap),
    ]
}

/// The backward's problems: three head-dim pairs, every format, masked (every mask kind and
/// views of every tensor) or not.
fn backward_problems() -> Vec<(Problem, bool)> {
    let mut out = Vec::new();
    for (e, ev) in [(64, 64), (37, 5), (8, 12)] {
        for fmt in Storage::ALL {
            let p = Problem::new(&[2, 4, 9, e], &[2, 2, 60, e], &[2, 2, 60, ev])
                .unwrap()
                .with_storage(Formats::all(fmt));
            out.push((p.clone(), false));
            let mut p = masked(p, 60);
            p.views = test_views();
            out.push((p, true));
        }
    }
    out
}

/// Every backward kernel in the GPU and CPU forms; the CPU form's several-row kernels, which
/// only large problems get, too.
fn backward() -> Vec<Variant> {
    let mut out = Vec::new();
    let var = |spec, pre, cpu| Variant::new::<backward::Params>("backward", spec, pre).in_storage(cpu);
    for (p, is_masked) in backward_problems() {
        let fmt = p.storage.q;
        for (cpu, sg) in [(false, Some(32)), (true, Some(8)), (true, None)] {
            let caps = Caps::new(&wgpu::Limits::default(), cpu, sg);
            let c = backward::Config::new(&p, &caps).unwrap();
            let mods = Mods::of(&p, &Default::default());
            out.push(var(&backward::DQ, c.dq_prelude(), cpu));
            out.push(var(&backward::DKV, c.dkv_prelude(), cpu));
            out.push(var(
                &backward::DBIAS,
                backward::dbias_prelude(&p, &Default::default()),
                cpu,
            ));
            let ds = backward::ds_prelude(is_masked, is_masked, mods, fmt);
            out.push(var(&backward::DS, ds, cpu));
            out.push(var(
                &backward::PREP,
                backward::prep_prelude(fmt, Storage::F32, &p.views),
                cpu,
            ));
        }
    }
    for (e, ev) in [(64, 64), (37, 5), (8, 12)] {
        for sg in [Some(8), None] {
            let caps = Caps::new(&wgpu::Limits::default(), true, sg);
            let large = Problem::new(&[1, 8, 1024, e], &[1, 8, 1024, e], &[1, 8, 1024, ev]).unwrap();
            let c = backward::Config::new(&large, &caps).unwrap();
            assert!(c.rq > 1 && c.rk > 1, "E {e} Ev {ev} subgroup {sg:?}: {c:?}");
            out.push(var(&backward::DQ, c.dq_prelude(), true));
            out.push(var(&backward::DKV, c.dkv_prelude(), true));
        }
    }
    out
}

/// A GPU with 48 KiB of workgroup memory, subgroups of 32 and both coop tiles.
pub(crate) fn coop_caps() -> Caps {
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
pub(crate) fn coop_problem(e: usize, ev: usize, formats: Formats, is_masked: bool) -> Problem {
    let p = Problem::new(&[2, 4, 9, e], &[2, 2, 60, e], &[2, 2, 60, ev])
        .unwrap()
        .with_storage(formats);
    if !is_masked {
        return p;
    }
    let mut p = masked(p, 60)
        .with_window(Some((5, 3)), 2)
        .unwrap()
        .with_softcap(Some(30.0))
        .unwrap();
    p.views = test_views();
    p
}

/// The matrix units' kernels: the matmul (tiles 8 and 16, operand and output formats, both B
/// layouts, bias and accumulation), the fused forward and backward (both tiles, f16 and f32,
/// head dims that are and are not multiples of the tile, masked or not).
fn coop() -> Vec<Variant> {
    let mut out = Vec::new();
    let caps = coop_caps();
    for t in [8, 16] {
        for (fa, fb, fc) in [
            (Storage::F16, Storage::F16, Storage::F16),
            (Storage::F16, Storage::F16, Storage::F32),
            (Storage::F32, Storage::F16, Storage::F32),
            (Storage::F32, Storage::F32, Storage::Bf16),
        ] {
            for c_words in [true, false] {
                // Half outputs stored element by element (atomics) are not the coop form's:
                // naga's atomics under the Vulkan memory model lack a capability.
                if fc.is_half() && !c_words {
                    continue;
                }
                let pre =
                    matmul::coop_prelude(t, 128).then(matmul::prelude([fa, fb, Storage::F32, fc], c_words));
                out.push(
                    Variant::new::<matmul::Params>("coop", &matmul::COOP_SPEC, pre)
                        .with_overrides(matmul_overrides()),
                );
            }
        }
        let fwd = caps.with_forms(crate::forms::FusedForm::Coop { tile: Some(t) });
        let bwd = caps.with_forms(crate::forms::BackwardForm::Coop { tile: Some(t) });
        for (e, ev, fmt, is_masked) in [
            (64, 64, Storage::F16, false),
            (64, 64, Storage::F32, true),
            (37, 20, Storage::F32, true),
            (128, 128, Storage::F16, false),
            (128, 128, Storage::F16, true),
        ] {
            let p = coop_problem(e, ev, Formats::all(fmt), is_masked);
            if !(e == 128 && is_masked) {
                let cfg = flash::Config::new(&p, &fwd).unwrap();
                assert_eq!(cfg.form, crate::forms::FusedForm::Coop { tile: Some(t) });
                out.push(Variant::new::<flash::Params>("coop", cfg.spec(), cfg.prelude()));
            }
            if e != 128 || is_masked {
                let c = backward::Config::new(&p, &bwd).unwrap();
                assert_eq!(c.form, crate::forms::BackwardForm::Coop { tile: Some(t) });
                out.push(Variant::new::<backward::Params>(
                    "coop",
                    c.dq_spec(),
                    c.dq_prelude(),
                ));
                out.push(Variant::new::<backward::Params>(
                    "coop",
                    c.dkv_spec(),
                    c.dkv_prelude(),
                ));
            }
        }
    }
    out
}
