//! Ring attention over several devices of one adapter (lavapipe gives as many as asked for)
//! against the f64 reference and one device: every mask kind (causal top-left, bottom-right,
//! boolean mask and bias sliced per pair, key lengths with 0, fully masked rows), GQA, L != S,
//! sequences not divisible by N (down to one position per device), both layouts, forced
//! paths, weights, half formats; the backward by FlashAttention's rule; the causal balance of
//! the layouts; the refusals.

mod common;

use common::*;
use ndarray::Array4;
use wgpu_attention::{Causal, Context, Error, Layout, Path, Ring, Storage, Tensor};

/// GQA, L != S, tails everywhere, E != Ev.
const SHAPE: Shape = (2, 4, 2, 37, 29, 16, 12);

/// Bottom-right causal aligns each batch to its own key length; the ring takes one diagonal for
/// every batch, so it refuses unequal lengths (checked here, forward and backward) and the case
/// goes on with every batch at the shortest length.
fn equal_lens_if_bottom_right(mut case: Case) -> Case {
    let Some(lens) = case.kv_lens.clone() else {
        return case;
    };
    if case.causal != Causal::BottomRight || lens.iter().all(|&l| l == lens[0]) {
        return case;
    }
    let devices = devices(2).expect("devices");
    let e = Ring::new(&devices).run_blocking(&case.sdpa()).unwrap_err();
    assert!(
        matches!(e, Error::Ring { .. }) && e.to_string().contains("unequal key lengths"),
        "{e}"
    );
    let (b, h, l, _) = case.dims();
    let dout = Array4::<f32>::zeros((b, h, l, case.v.dim().3));
    let e = Ring::new(&devices)
        .backward_blocking(&case.sdpa().backward(&dout))
        .unwrap_err();
    assert!(matches!(e, Error::Ring { .. }), "{e}");
    let min = *lens.iter().min().unwrap();
    case.kv_lens = Some(vec![min; lens.len()]);
    case
}

fn check_forward(devices: &[Context], case: &Case, layout: Layout, path: Path, label: &str) {
    let want = case.reference();
    let mut sdpa = case.sdpa().path(path).return_lse();
    if path == Path::Unfused {
        sdpa = sdpa.return_weights();
    }
    let got = Ring::new(devices)
        .layout(layout)
        .run_blocking(&sdpa)
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let tol = if case.storage == Storage::F32 {
        TOL
    } else {
        // Merged in f32, rounded once: the format's rounding, twice for the parts' order.
        twice_storage_tolerance(case.storage)
    };
    case.assert_output(&got.output, &want, path, tol, label);
    assert_eq!(got.report.devices.len(), devices.len(), "{label}");
}

/// [`check_forward`] on the first 1, 2 and 3 of `devices`, in both layouts, on the automatic
/// and the unfused path.
fn check_forward_on_1_to_3(devices: &[Context], case: &Case, label: &str) {
    for n in 1..=3 {
        for layout in [Layout::Zigzag, Layout::Contiguous] {
            for path in [Path::Auto, Path::Unfused] {
                let label = format!("{label} {layout:?} N={n} {path:?}");
                check_forward(&devices[..n], case, layout, path, &label);
            }
        }
    }
}

/// The ring backward of `case` on every one of `devices` (a random dO from `seed`) against the
/// reference by FlashAttention's rule.
fn check_backward(devices: &[Context], case: &Case, seed: u64, label: &str) {
    let (b, h, l, _) = case.dims();
    let dout = rand_array(&mut rng(seed), (b, h, l, case.v.dim().3));
    let g = Ring::new(devices)
        .backward_blocking(&case.sdpa().backward(&dout))
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    assert_grads(case, &g.grads, &dout, label);
}

/// Every mask kind on 1 to 4 devices, zigzag, the automatic path.
#[test]
fn forward_matches_reference_for_every_mask_kind() {
    let Some(devices) = devices(4) else { return };
    for (name, kind) in mask_kinds() {
        let case = equal_lens_if_bottom_right(kind(Case::random(SHAPE, 3)));
        for n in 1..=4 {
            check_forward(
                &devices[..n],
                &case,
                Layout::Zigzag,
                Path::Auto,
                &format!("{name} N={n}"),
            );
        }
    }
}

/// The contiguous layout, each forced path (unfused with the weights), f16 and bf16.
#[test]
fn forward_layouts_paths_weights_and_half_formats() {
    let Some(devices) = devices(3) else { return };
    let case = Case::random(SHAPE, 4)
        .with_causal(Causal::BottomRight)
        .with_random_mask(5)
        .with_random_bias(6)
        .with_kv_lens();
    let case = equal_lens_if_bottom_right(case);
    for path in [Path::Fused, Path::Unfused] {
        for layout in [Layout::Zigzag, Layout::Contiguous] {
            check_forward(&devices, &case, layout, path, &format!("{layout:?} {path:?}"));
        }
    }
    for st in [Storage::F16, Storage::Bf16] {
        let case = Case::random(SHAPE, 7)
            .with_causal(Causal::TopLeft)
            .with_storage(st);
        check_forward(&devices, &case, Layout::Zigzag, Path::Auto, &format!("{st}"));
    }
}

/// Sequences barely longer than the ring (chunks of 0 or 1 positions), L > S and L < S with
/// both causal alignments (bottom-right with L > S: the first rows see no key at all), and the
/// exchanges run after the kernels (overlap off) giving the same results.
#[test]
fn forward_short_sequences_and_no_overlap() {
    let Some(devices) = devices(4) else { return };
    for (l, s) in [(4, 4), (5, 7), (9, 4), (4, 13)] {
        for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
            let case = Case::random((1, 2, 1, l, s, 8, 8), 8).with_causal(causal);
            check_forward(
                &devices,
                &case,
                Layout::Zigzag,
                Path::Auto,
                &format!("L={l} S={s} {causal:?}"),
            );
        }
    }
    let case = Case::random(SHAPE, 9)
        .with_causal(Causal::TopLeft)
        .with_random_mask(10);
    let a = Ring::new(&devices).run_blocking(&case.sdpa()).unwrap();
    let b = Ring::new(&devices)
        .overlap(false)
        .run_blocking(&case.sdpa())
        .unwrap();
    assert_eq!(a.output.output, b.output.output);
    assert!(!b.report.overlap);
}

/// Zigzag gives every device the same causal work; contiguous blocks do not.
#[test]
fn zigzag_balances_causal_work() {
    let Some(devices) = devices(4) else { return };
    let case = Case::random((1, 1, 1, 64, 64, 8, 8), 11).with_causal(Causal::TopLeft);
    let zz = Ring::new(&devices).run_blocking(&case.sdpa()).unwrap().report;
    let ct = Ring::new(&devices)
        .layout(Layout::Contiguous)
        .run_blocking(&case.sdpa())
        .unwrap()
        .report;
    let total = |r: &wgpu_attention::RingReport| r.devices.iter().map(|d| d.work).sum::<u64>();
    // Every allowed (query, key) entry once: 64 * 65 / 2.
    assert_eq!(total(&zz), 64 * 65 / 2);
    assert_eq!(total(&ct), 64 * 65 / 2);
    assert!(zz.balance() < 1.01, "zigzag balance {}", zz.balance());
    // Contiguous: the last device's 16 rows see 48..64 keys, the first's 1..16.
    assert!(ct.balance() > 1.6, "contiguous balance {}", ct.balance());
    let works: Vec<u64> = ct.devices.iter().map(|d| d.work).collect();
    assert!(works.windows(2).all(|w| w[0] < w[1]), "{works:?}");
    // Each device sent the N - 1 blocks it forwarded.
    for d in &zz.devices {
        assert!(d.bytes_sent > 0 && d.peak_memory > 0, "{d:?}");
    }
}

/// The backward over the ring by FlashAttention's rule: dQ where the queries live, dK and dV
/// summed round the ring, d(bias) over every device; with the forward run first or saved.
#[test]
fn backward_matches_reference() {
    let Some(devices) = devices(3) else { return };
    let kinds = mask_kinds();
    for (name, kind) in kinds
        .iter()
        .filter(|(n, _)| ["none", "causal_top_left", "all_combined", "top_left_mask_bias"].contains(n))
    {
        let case = equal_lens_if_bottom_right(kind(Case::random(SHAPE, 12)));
        let (b, h, l, _) = case.dims();
        let dout = rand_array(&mut rng(13), (b, h, l, case.v.dim().3));
        for n in [1, 2, 3] {
            let g = Ring::new(&devices[..n])
                .backward_blocking(&case.sdpa().backward(&dout))
                .unwrap_or_else(|e| panic!("{name} N={n}: {e}"));
            assert_grads(&case, &g.grads, &dout, &format!("ring backward {name} N={n}"));
        }
    }
    // Saved output and logsumexp (from one device), the unfused path, a broadcast bias.
    let mut case = Case::random(SHAPE, 14).with_causal(Causal::BottomRight);
    case.bias = Some(ndarray::Array::from_elem(ndarray::IxDyn(&[4, 1, 29]), 0.5f32));
    let (b, h, l, _) = case.dims();
    let dout: Array4<f32> = rand_array(&mut rng(15), (b, h, l, case.v.dim().3));
    let one = case.sdpa().return_lse().run_blocking(&devices[0]).unwrap();
    let lse = one.lse.unwrap();
    let g = Ring::new(&devices)
        .backward_blocking(
            &case
                .sdpa()
                .backward(&dout)
                .saved(&one.output, &lse)
                .path(Path::Unfused),
        )
        .unwrap();
    assert!(g.grads.output.is_none());
    let mut g = g.grads;
    g.output = Some(one.output.clone());
    assert_grads(&case, &g, &dout, "ring backward saved, unfused, bias [4, 1, 29]");
}

/// What splits with the keys: a softcap (per logit) and document ids (unordered, rows of a
/// document no key has fully masked), forward on 1 to 3 devices in both layouts and the
/// backward by FlashAttention's rule.
#[test]
fn softcap_and_documents_split_over_the_ring() {
    let Some(devices) = devices(3) else { return };
    let case = Case::random(SHAPE, 21)
        .with_causal(Causal::TopLeft)
        .with_softcap(1.5)
        .with_random_docs(22);
    for n in 1..=3 {
        for layout in [Layout::Zigzag, Layout::Contiguous] {
            let label = format!("softcap docs {layout:?} N={n}");
            check_forward(&devices[..n], &case, layout, Path::Auto, &label);
        }
    }
    check_backward(&devices, &case, 23, "ring backward softcap docs N=3");
}

/// A sliding window with sink tokens, ALiBi and sink logits split over the ring: each pair
/// measures the window's and ALiBi's distances from the global diagonal (its shift), the sink
/// tokens are the sequence's first keys, and the sink logit joins each row once (in its pair
/// with the first key chunk); causal both ways (bottom-right with L > S: rows that see no
/// key), L != S, 1 to 3 devices, both layouts, both paths; the backward (d(sink logits)
/// included) by FlashAttention's rule.
#[test]
fn windows_alibi_and_sink_logits_split_over_the_ring() {
    let Some(devices) = devices(3) else { return };
    let cases = [
        Case::random(SHAPE, 31).with_window(5, 3, 2).with_alibi(),
        // Bottom-right with L > S: the first rows see no key.
        Case::random(SHAPE, 32)
            .with_causal(Causal::BottomRight)
            .with_window(6, 0, 3)
            .with_alibi(),
        Case::random(SHAPE, 33)
            .with_causal(Causal::TopLeft)
            .with_window(4, 2, 1)
            .with_alibi()
            .with_sink_logits(),
    ];
    for (c, case) in cases.iter().enumerate() {
        check_forward_on_1_to_3(&devices, case, &format!("case {c}"));
    }
    // d(sink logits): each device sums its pairs' shares, the host the devices'.
    for (c, case) in [(0, &cases[0]), (2, &cases[2])] {
        check_backward(&devices, case, 34, &format!("ring backward case {c} N=3"));
    }
}

/// Typed errors before any GPU work: more devices than positions, GPU buffers, an output
/// buffer, no devices, the weights from a backward.
#[test]
fn refusals_are_typed() {
    let Some(devices) = devices(3) else { return };
    let case = Case::random((1, 1, 1, 2, 8, 4, 4), 16);
    let e = Ring::new(&devices).run_blocking(&case.sdpa()).unwrap_err();
    assert!(matches!(e, Error::Ring { devices: 3, .. }), "{e}");
    assert!(
        e.to_string().contains("more devices than sequence positions"),
        "{e}"
    );
    let e = Ring::new(&[]).run_blocking(&case.sdpa()).unwrap_err();
    assert!(matches!(e, Error::Ring { devices: 0, .. }), "{e}");

    let case = Case::random((1, 1, 1, 8, 8, 4, 4), 17);
    let buf = devices[0]
        .device()
        .create_buffer(&wgpu_attention::wgpu::BufferDescriptor {
            label: None,
            size: 256,
            usage: wgpu_attention::wgpu::BufferUsages::STORAGE | wgpu_attention::wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
    let on_gpu = wgpu_attention::Sdpa::new(
        Tensor::from_buffer(&buf, wgpu_attention::Storage::F32, &[1, 1, 8, 4]),
        &case.k,
        &case.v,
    );
    let e = Ring::new(&devices).run_blocking(&on_gpu).unwrap_err();
    assert!(
        matches!(e, Error::Ring { .. }) && e.to_string().contains("GPU buffer"),
        "{e}"
    );
    let e = Ring::new(&devices)
        .run_blocking(&case.sdpa().output_into(Tensor::from_buffer(
            &buf,
            wgpu_attention::Storage::F32,
            &[1, 1, 8, 4],
        )))
        .unwrap_err();
    assert!(e.to_string().contains("output_into"), "{e}");
    // Shape errors are the single device's.
    let short_v = case.v.slice(ndarray::s![.., .., ..7, ..]).to_owned();
    let bad = wgpu_attention::Sdpa::new(&case.q, &case.k, &short_v);
    assert!(matches!(
        Ring::new(&devices).run_blocking(&bad),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// User functions split over the ring: each pair's see their global positions (a relative
/// bias `score_mod` with captures, a band `mask_mod` read through its block map, a prefix-LM
/// dilated `mask_mod`), causal or not, 1 to 3 devices, both layouts, both paths; the backward
/// through a `mask_mod`, through a `score_mod` of the positions and through the relative bias
/// with its captures' gradients (summed over pairs and devices) by FlashAttention's rule.
#[test]
fn user_functions_split_over_the_ring() {
    let Some(devices) = devices(3) else { return };
    let cases = [
        Case::random(SHAPE, 41).with_relbias_score_mod(42),
        Case::random(SHAPE, 43)
            .with_causal(Causal::TopLeft)
            .with_band_mask_mod([9.0, 4.0]),
        Case::random(SHAPE, 44).with_prefix_dilated_mask_mod(),
    ];
    for (c, case) in cases.iter().enumerate() {
        check_forward_on_1_to_3(&devices, case, &format!("user case {c}"));
    }
    // A score_mod of the positions with its derivative in s (no capture gradients).
    let table: &'static [f32] = Box::leak(
        (0..64)
            .map(|x| (x as f32 * 0.37).sin())
            .collect::<Vec<_>>()
            .into_boxed_slice(),
    );
    let mut by_position = Case::random(SHAPE, 45).with_causal(Causal::BottomRight);
    by_position.user_mod = Some(
        wgpu_attention::UserMod::wgsl(
            "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
                 return s + rel((j * 7u + h) % 64u) - 0.02 * f32(i);
             }
             fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 { return 1.0; }",
        )
        .capture("rel", table)
        .cpu_score(|s, [_, h, i, j], c| s + c.get("rel", (j * 7 + h) % 64) - 0.02 * i as f64),
    );
    for case in [&cases[0], &cases[1], &by_position] {
        check_backward(&devices, case, 46, "ring backward user functions N=3");
    }
}
