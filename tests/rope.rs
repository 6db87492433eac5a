//! RoPE: the GPU op against the f64 reference, and the reference against Hugging Face's
//! definition written out independently (`q * cos + rotate_half(q) * sin`, cos and sin of
//! `position * inv_freq` repeated over both halves; GPT-J's interleaved pairs).

mod common;

use common::*;
use ndarray::Array3;
use wgpu_attention::check::{compare, Tolerance};
use wgpu_attention::{Error, Rope, RopeStyle, Storage, Tensor};

/// Hugging Face's `apply_rotary_pos_emb` for one token row of `d` rotated dims (the rest
/// passed through), in f64.
fn hf_rope(x: &[f64], pos: usize, theta: f64, d: usize, style: RopeStyle) -> Vec<f64> {
    let inv: Vec<f64> = (0..d / 2)
        .map(|k| 1.0 / theta.powf((2 * k) as f64 / d as f64))
        .collect();
    let mut out = x.to_vec();
    match style {
        RopeStyle::HalfSplit => {
            // emb = cat(freqs, freqs); rotate_half(x) = cat(-x2, x1).
            for i in 0..d {
                let a = pos as f64 * inv[i % (d / 2)];
                let rot = if i < d / 2 { -x[i + d / 2] } else { x[i - d / 2] };
                out[i] = x[i] * a.cos() + rot * a.sin();
            }
        }
        RopeStyle::Interleaved => {
            // GPT-J: freqs repeated pairwise; rotate_every_two(x) = (-x1, x0, -x3, x2, ...).
            for i in 0..d {
                let a = pos as f64 * inv[i / 2];
                let rot = if i % 2 == 0 { -x[i + 1] } else { x[i - 1] };
                out[i] = x[i] * a.cos() + rot * a.sin();
            }
        }
        other => panic!("no Hugging Face definition written here for {other:?}"),
    }
    out
}

fn positions(t: usize) -> Vec<usize> {
    // Small, mid and far positions (past 100k: where f32 angles computed on the GPU fail).
    (0..t)
        .map(|i| [0, 1, 7, 4095, 100_003, 131_071, 140_000][i % 7] + i)
        .collect()
}

#[test]
fn reference_is_hugging_faces_definition() {
    let mut r = rng(3);
    for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
        for (e, dim, theta) in [(16, None, 1e4), (24, Some(16), 5e5), (10, Some(6), 1e4)] {
            let x = rand_array(&mut r, (7, 2, e));
            let pos = positions(7);
            let rope = Rope { style, theta, dim };
            let mut got = x.clone();
            rope.apply(got.view_mut(), &pos).unwrap();
            let d = dim.unwrap_or(e);
            for t in 0..7 {
                for h in 0..2 {
                    let row: Vec<f64> = (0..e).map(|i| x[[t, h, i]] as f64).collect();
                    let want = hf_rope(&row, pos[t], theta, d, style);
                    for i in 0..e {
                        let g = got[[t, h, i]] as f64;
                        assert!(
                            (g - want[i]).abs() <= 1e-6 * (1.0 + want[i].abs()),
                            "{style:?} e {e} d {d} t {t} h {h} i {i}: {g} vs {}",
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_rotation_matches_the_reference() {
    let Some(ctx) = ctx() else { return };
    let mut r = rng(4);
    for st in [Storage::F32, Storage::F16, Storage::Bf16] {
        for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
            // Head dims odd (half rows sharing words), partial, and theta 1e4 / 5e5.
            for (t, h, e, dim, theta) in [
                (9, 3, 64, None, 1e4),
                (7, 2, 13, Some(8), 5e5),
                (5, 4, 32, Some(16), 1e4),
            ] {
                let mut x: Array3<f32> = rand_array(&mut r, (t, h, e));
                x.mapv_inplace(|v| st.round(v));
                let pos = positions(t);
                let rope = Rope { style, theta, dim };
                let got = rope
                    .run_blocking(ctx, &Tensor::from(&x).with_storage(st), &pos)
                    .unwrap_or_else(|e| panic!("{st:?} {style:?}: {e}"));
                let mut want = x.clone();
                rope.apply(want.view_mut(), &pos).unwrap();
                let tol = if st == Storage::F32 {
                    Tolerance {
                        atol: 1e-6,
                        rtol: 1e-6,
                    }
                } else {
                    Tolerance::for_storage(st)
                };
                assert_report(
                    compare(got.iter().copied(), want.iter().map(|&v| v as f64), tol),
                    &format!("rope {st:?} {style:?} e {e} dim {dim:?} theta {theta}"),
                );
            }
        }
    }
}

#[test]
fn bad_rope_input_is_a_typed_error() {
    let x = Array3::<f32>::zeros((2, 1, 8));
    let bad = |rope: Rope, pos: &[usize]| {
        let mut y = x.clone();
        match rope.apply(y.view_mut(), pos) {
            Err(Error::InvalidModifier { modifier: "rope", .. }) => {}
            other => panic!("{rope:?} {pos:?}: expected a rope error, got {other:?}"),
        }
    };
    bad(
        Rope {
            dim: Some(5),
            ..Rope::default()
        },
        &[0, 1],
    );
    bad(
        Rope {
            dim: Some(10),
            ..Rope::default()
        },
        &[0, 1],
    );
    bad(
        Rope {
            dim: Some(0),
            ..Rope::default()
        },
        &[0, 1],
    );
    bad(
        Rope {
            theta: f64::NAN,
            ..Rope::default()
        },
        &[0, 1],
    );
    bad(
        Rope {
            theta: 0.0,
            ..Rope::default()
        },
        &[0, 1],
    );
    bad(Rope::default(), &[0]);
    let Some(ctx) = ctx() else { return };
    let r = Rope::default().run_blocking(ctx, &Tensor::from(&Array3::<f32>::zeros((2, 1, 7))), &[0, 1]);
    assert!(matches!(r, Err(Error::InvalidModifier { .. })), "{r:?}");
}
