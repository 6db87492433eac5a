//! Half-precision storage (f16, bf16) on every path against the f64 reference computed on the
//! rounded inputs: the grid of shapes (tails, L != S, E != Ev, odd head dims, GQA/MQA) times
//! every mask kind, decode shapes, fully masked rows, large logits, NaN and infinity, the
//! caller's buffers in a declared format, mixed formats and the merge.

mod common;

use common::{ctx, mask_and_window_kinds, modifier_kinds, user_kinds, Case, SHAPES};
use half::{bf16, f16};
use ndarray::Array4;
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::{wgpu, Causal, Error, Path, Sdpa, Storage, Tensor};

const HALF: [Storage; 2] = [Storage::F16, Storage::Bf16];

/// The grid in half formats: every (format, path, shape) with even index sum (so each format
/// meets every shape, each on some path, and each path every shape, in some format: the
/// formats' code is their loads and stores, on every path), with every mask kind, except that
/// the boolean mask alone and the bias alone take turns (each compiles the kernels again;
/// causal modes and key lengths do not). tests/sdpa.rs runs the whole grid in f32.
#[test]
fn grid_of_shapes_and_masks_in_half_formats() {
    let Some(ctx) = ctx() else { return };
    for (fi, s) in HALF.into_iter().enumerate() {
        let tol = Tolerance::for_storage(s);
        for (pi, path) in Path::ALL.into_iter().enumerate() {
            for (si, &shape) in SHAPES.iter().enumerate() {
                if (fi + pi + si) % 2 != 0 {
                    continue;
                }
                let alone = if (si + pi) % 4 < 2 { "bias" } else { "bool_mask" };
                for (ki, (name, apply)) in mask_and_window_kinds().into_iter().enumerate() {
                    // The window kinds on every other (format, path, shape) of the grid (each
                    // compiles the kernels again; tests/forms.rs and tests/sdpa.rs run them
                    // more widely): CI time.
                    if name == alone || (name.starts_with("window") && (si + ki) % 2 == 1) {
                        continue;
                    }
                    let case = apply(Case::random(shape, si as u64)).with_storage(s);
                    case.check(ctx, path, tol, &format!("{s} {path:?} {shape:?} {name}"));
                }
            }
        }
    }
}

/// The built-in score modifiers in half formats on every path (each kind in one format, the
/// combined one in both), at a shape with tails, L != S and GQA.
#[test]
fn modifiers_in_half_formats() {
    let Some(ctx) = ctx() else { return };
    for (ki, (name, kind)) in modifier_kinds().into_iter().chain(user_kinds()).enumerate() {
        for (fi, s) in HALF.into_iter().enumerate() {
            if ki != 2 && ki % 2 != fi {
                continue;
            }
            let case = kind(Case::random((2, 4, 2, 33, 47, 16, 24), 800 + ki as u64)).with_storage(s);
            case.check_all_paths(ctx, Tolerance::for_storage(s), &format!("{s} {name}"));
        }
    }
}

/// Odd and even head dims where the output's words straddle rows (E = 37, Ev = 5, 3), decode
/// shapes (many keys, few rows) with GQA, and the large case on the fastest fused forms.
#[test]
fn odd_dims_decode_and_large_in_half_formats() {
    let Some(ctx) = ctx() else { return };
    for s in HALF {
        let tol = Tolerance::for_storage(s);
        for (i, shape) in [
            (1, 2, 1, 7, 19, 37, 37),
            (2, 2, 2, 3, 9, 37, 5),
            (1, 3, 3, 5, 6, 6, 3),
            (1, 8, 2, 1, 1500, 64, 64),
            (2, 4, 1, 3, 700, 37, 6),
        ]
        .into_iter()
        .enumerate()
        {
            let case = Case::random(shape, 60 + i as u64)
                .with_causal(Causal::BottomRight)
                .with_random_mask(61)
                .with_random_bias(62)
                .with_storage(s);
            case.check_all_paths(ctx, tol, &format!("{s} {shape:?}"));
        }
        Case::large()
            .with_storage(s)
            .check(ctx, Path::Fused, tol, &format!("{s} large"));
    }
    // On CPU adapters the large case's fastest form compiles in the background: it must be
    // done before the process exits (a compilation cut off by exit can crash the driver).
    ctx.wait_idle().unwrap();
}

/// Logits around ±1e4 (inputs that stay in f16's range): no overflow, the softmax still right.
#[test]
fn large_logits_in_half_formats() {
    let Some(ctx) = ctx() else { return };
    for s in HALF {
        let mut case = Case::random((1, 2, 2, 9, 33, 16, 16), 70).with_random_mask(71);
        case.q.mapv_inplace(|x| x * 100.0);
        case.k.mapv_inplace(|x| x * 25.0);
        case.scale = Some(1.0);
        let case = case.with_storage(s);
        case.check_all_paths(ctx, Tolerance::for_storage(s), &format!("{s} large logits"));
    }
}

/// A NaN in q poisons its row (without masks: with them, the fused and decode kernels' NaN
/// rows may come out 0 on CPU adapters, as in f32, see tests/sdpa.rs), a -inf bias masks;
/// nothing crashes; the other rows are right.
#[test]
fn nan_and_inf_propagate_in_half_formats() {
    let Some(ctx) = ctx() else { return };
    for s in HALF {
        let mut case = Case::random((1, 1, 1, 4, 6, 4, 4), 80).with_storage(s);
        case.q[[0, 0, 1, 2]] = f32::NAN;
        for path in Path::ALL {
            let got = case.sdpa().path(path).run_blocking(ctx).unwrap();
            for j in 0..4 {
                assert!(got.output[[0, 0, 1, j]].is_nan(), "{s} {path:?}: NaN row");
            }
        }
        let mut case = Case::random((1, 1, 1, 4, 6, 4, 4), 80)
            .with_random_bias(81)
            .with_storage(s);
        case.bias.as_mut().unwrap()[[0, 0, 2, 3]] = f32::NEG_INFINITY;
        let want = case.reference();
        for path in Path::ALL {
            let got = case.sdpa().path(path).run_blocking(ctx).unwrap();
            for i in 0..4 {
                let r = compare(
                    got.output.slice(ndarray::s![0, 0, i, ..]).iter().copied(),
                    want.out.slice(ndarray::s![0, 0, i, ..]).iter().copied(),
                    Tolerance::for_storage(s),
                );
                assert!(r.passed(), "{s} {path:?} row {i}: {r}");
            }
        }
        // An infinite input value is the caller's concern, but it must not crash.
        let mut inf = Case::random((1, 1, 1, 2, 3, 4, 4), 82).with_storage(s);
        inf.v[[0, 0, 1, 0]] = f32::INFINITY;
        for path in Path::ALL {
            inf.sdpa().path(path).run_blocking(ctx).unwrap();
        }
    }
}

/// Host inputs as `half` slices and arrays; the output in a format of the caller's choosing;
/// every pair of input and output format agrees with the f32 computation on the same values.
#[test]
fn half_host_types_and_output_formats() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((2, 2, 1, 11, 23, 12, 10), 90).with_storage(Storage::F16);
    let want = case.reference();
    let q: Array4<f16> = case.q.mapv(f16::from_f32);
    let k: Vec<f16> = case.k.iter().map(|&x| f16::from_f32(x)).collect();
    // v in bf16: the reference sees its bf16 values.
    let v: Array4<bf16> = case.v.mapv(bf16::from_f32);
    let mut mixed = Case::random((2, 2, 1, 11, 23, 12, 10), 90).with_storage(Storage::F16);
    mixed.v = v.mapv(|x| x.to_f32());
    let want_mixed = mixed.reference();
    for out in Storage::ALL {
        let got = Sdpa::new(&q, Tensor::from_slice(&k, &[2, 1, 23, 12]), &v)
            .output_storage(out)
            .run_blocking(ctx)
            .unwrap();
        let r = compare(
            got.output.iter().copied(),
            want_mixed.out.iter().copied(),
            Tolerance::for_storage(out),
        );
        assert!(r.passed(), "out {out}: {r}");
        // Every output element is a value of the output format.
        assert!(
            got.output.iter().all(|&x| out.round(x) == x),
            "out {out} not rounded"
        );
    }
    // All f16, default output format: f16.
    let got = Sdpa::new(
        &q,
        Tensor::from_slice(&k, &[2, 1, 23, 12]),
        case.v.mapv(f16::from_f32).view(),
    )
    .run_blocking(ctx)
    .unwrap();
    assert!(got.output.iter().all(|&x| Storage::F16.round(x) == x));
    let r = compare(
        got.output.iter().copied(),
        want.out.iter().copied(),
        Tolerance::for_storage(Storage::F16),
    );
    assert!(r.passed(), "all f16: {r}");
}

/// The caller's buffers holding f16/bf16 (declared with `with_storage`), the output written to
/// a caller's buffer in its format; a buffer too small for its declared format is refused.
#[test]
fn caller_buffers_in_declared_formats() {
    let Some(ctx) = ctx() else { return };
    use wgpu::util::DeviceExt;
    for s in HALF {
        let case = Case::random((1, 2, 2, 5, 9, 6, 7), 95).with_storage(s);
        let want = case.reference();
        let dev = ctx.device();
        let upload = |a: &Array4<f32>| {
            let mut bytes: Vec<u8> = a
                .iter()
                .flat_map(|&x| match s {
                    Storage::F16 => f16::from_f32(x).to_le_bytes(),
                    _ => bf16::from_f32(x).to_le_bytes(),
                })
                .collect();
            bytes.resize(bytes.len().next_multiple_of(4), 0);
            dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: &bytes,
                usage: wgpu::BufferUsages::STORAGE,
            })
        };
        let (qb, kb, vb) = (upload(&case.q), upload(&case.k), upload(&case.v));
        let out_elems = 2 * 5 * 7;
        let ob = dev.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: s.bytes(out_elems),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let t = |b, shape: [usize; 4]| Tensor::from_buffer(b, s, &shape);
        for path in Path::ALL {
            let got = Sdpa::new(t(&qb, [1, 2, 5, 6]), t(&kb, [1, 2, 9, 6]), t(&vb, [1, 2, 9, 7]))
                .path(path)
                .output_into(t(&ob, [1, 2, 5, 7]))
                .run_blocking(ctx)
                .unwrap();
            let r = compare(
                got.output.iter().copied(),
                want.out.iter().copied(),
                Tolerance::for_storage(s),
            );
            assert!(r.passed(), "{s} {path:?}: {r}");
            let raw = pollster::block_on(ctx.read_as_f32(&ob, 0, out_elems, s)).unwrap();
            assert_eq!(raw, got.output.iter().copied().collect::<Vec<_>>());
        }
        // The same buffers declared f32 need twice the bytes: refused before any GPU work.
        let err = Sdpa::new(
            Tensor::from_buffer(&qb, wgpu_attention::Storage::F32, &[1, 2, 5, 6]),
            t(&kb, [1, 2, 9, 6]),
            t(&vb, [1, 2, 9, 7]),
        )
        .run_blocking(ctx)
        .unwrap_err();
        assert!(matches!(err, Error::BadBuffer { tensor: "q", .. }), "{err}");
        // An output buffer too small for f32 output: the error names the format and the fit.
        let err = Sdpa::new(t(&qb, [1, 2, 5, 6]), t(&kb, [1, 2, 9, 6]), t(&vb, [1, 2, 9, 7]))
            .output_into(Tensor::from_buffer(&ob, Storage::F32, &[1, 2, 5, 7]))
            .run_blocking(ctx)
            .unwrap_err();
        assert!(matches!(err, Error::BadBuffer { tensor: "output", .. }), "{err}");
        assert!(err.to_string().contains("declared format f32"), "{err}");
        // The buffer holds 70 half elements: either half format fits, f32 does not.
        assert!(err.to_string().contains("it would fit f16 or bf16"), "{err}");
        // output_storage and the buffer's declared format disagree: refused, not guessed.
        let err = Sdpa::new(t(&qb, [1, 2, 5, 6]), t(&kb, [1, 2, 9, 6]), t(&vb, [1, 2, 9, 7]))
            .output_storage(Storage::F32)
            .output_into(t(&ob, [1, 2, 5, 7]))
            .run_blocking(ctx)
            .unwrap_err();
        assert!(
            matches!(err, Error::StorageMismatch { tensor: "output", .. }),
            "{err}"
        );
        // The output's shape is checked too.
        let err = Sdpa::new(t(&qb, [1, 2, 5, 6]), t(&kb, [1, 2, 9, 6]), t(&vb, [1, 2, 9, 7]))
            .output_into(t(&ob, [1, 2, 7, 5]))
            .run_blocking(ctx)
            .unwrap_err();
        assert!(
            matches!(err, Error::ShapeMismatch { tensor: "output", .. }),
            "{err}"
        );
    }
}

/// Memory per format: half formats halve q, k, v and the output.
#[test]
fn device_memory_halves_with_half_formats() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((1, 4, 4, 64, 256, 32, 32), 99);
    let f32_bytes = case.sdpa().path(Path::Fused).device_memory(ctx).unwrap();
    let f16_bytes = case
        .with_storage(Storage::F16)
        .sdpa()
        .path(Path::Fused)
        .device_memory(ctx)
        .unwrap();
    let lse = 4 * 4 * 64;
    assert_eq!((f32_bytes - lse) / 2, f16_bytes - lse);
}

/// Two halves of the keys attended in a half format (f32 parts: the parts' output format is
/// chosen f32 so that only the merge rounds) and merged into that format equal the whole;
/// parts of different formats are a typed error.
#[test]
fn merge_in_half_formats() {
    let Some(ctx) = ctx() else { return };
    use ndarray::s;
    for st in HALF {
        let case = Case::random((1, 2, 2, 7, 30, 8, 5), 20).with_storage(st);
        let want = case.reference();
        let half = |r: std::ops::Range<usize>| {
            let k = case.k.slice(s![.., .., r.clone(), ..]).to_owned();
            let v = case.v.slice(s![.., .., r, ..]).to_owned();
            Sdpa::new(
                Tensor::from(&case.q).with_storage(st),
                Tensor::from(&k).with_storage(st),
                Tensor::from(&v).with_storage(st),
            )
            .output_storage(Storage::F32)
            .return_lse()
            .run_blocking(ctx)
            .unwrap()
        };
        let (a, b) = (half(0..13), half(13..30));
        let (o, _) = wgpu_attention::merge_blocking(
            ctx,
            Tensor::from(&a.output).with_storage(st),
            a.lse.as_ref().unwrap(),
            Tensor::from(&b.output).with_storage(st),
            b.lse.as_ref().unwrap(),
        )
        .unwrap();
        // The parts were rounded to the format on the way in, the merge's output too.
        let tol = common::twice_storage_tolerance(st);
        let r = compare(o.iter().copied(), want.out.iter().copied(), tol);
        assert!(r.passed(), "{st} merge: {r}");
        assert!(
            o.iter().all(|&x| st.round(x) == x),
            "{st}: merged output not in the format"
        );
        let err = wgpu_attention::merge_blocking(
            ctx,
            Tensor::from(&a.output).with_storage(st),
            a.lse.as_ref().unwrap(),
            &b.output,
            b.lse.as_ref().unwrap(),
        )
        .unwrap_err();
        assert!(
            matches!(err, Error::StorageMismatch { tensor: "o2", .. }),
            "{err}"
        );
    }
}
