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

/// PyTorch float64 goldens (`tests/fixtures/rope`, scripts/make_rope_goldens.py: Hugging Face's
/// `rotate_half` and GPT-J's `rotate_every_two` with `inv_freq = 1 / theta ** (arange(0, D, 2) /
/// D)`): the rotation (reference and GPU op) at positions up to 262143, and paged attention
/// with RoPE (q rotated inside the kernels, K by the GPU op) of ragged batches, at positions
/// past 131072 through a window that hides a long context's earlier keys.
#[test]
fn pytorch_goldens() {
    let Some(ctx) = ctx() else { return };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rope");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    assert_eq!(dirs.len(), 8, "the rope goldens");
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let rope = Rope {
            style: match meta["style"].as_str().unwrap() {
                "half" => RopeStyle::HalfSplit,
                _ => RopeStyle::Interleaved,
            },
            theta: meta["theta"].as_f64().unwrap(),
            dim: Some(meta["dim"].as_u64().unwrap() as usize),
        };
        if name.starts_with("op_") {
            golden_rotation(ctx, &dir, &name, &rope);
        } else {
            golden_attention(ctx, &dir, &name, &rope, &meta);
        }
    }
}

fn golden_file(dir: &std::path::Path, file: &str) -> Vec<u8> {
    std::fs::read(dir.join(file)).unwrap()
}

/// An `op_*` golden: the rotation of `x.npy` at `positions.npy`, by the reference and the GPU.
fn golden_rotation(ctx: &wgpu_attention::Context, dir: &std::path::Path, name: &str, rope: &Rope) {
    use ndarray::Array1;
    let x: Array3<f32> = npy(golden_file(dir, "x.npy"));
    let pos: Array1<i64> = npy(golden_file(dir, "positions.npy"));
    let pos: Vec<usize> = pos.iter().map(|&p| p as usize).collect();
    let want: Array3<f64> = npy(golden_file(dir, "out.npy"));
    let mut host = x.clone();
    rope.apply(host.view_mut(), &pos).unwrap();
    assert_report(
        compare(host.iter().copied(), want.iter().copied(), TOL),
        &format!("{name} reference"),
    );
    let gpu = rope.run_blocking(ctx, &Tensor::from(&x), &pos).unwrap();
    assert_report(
        compare(gpu.iter().copied(), want.iter().copied(), TOL),
        &format!("{name} GPU"),
    );
}

/// Paged caches of blocks of 16 for a golden's sequences `[B, Hkv, S, E]` whose keys sit at
/// positions `offset + t`: block 0 stands for every block of the long context before `offset`
/// (filled with 1e3, so a read of it shows), each sequence's keys after, K rotated on the GPU.
/// The K and V caches, the block table and its row length.
fn golden_caches(
    ctx: &wgpu_attention::Context,
    rope: &Rope,
    (k, v): (&ndarray::Array4<f32>, &ndarray::Array4<f32>),
    seq_lens: &[usize],
    offset: usize,
) -> (ndarray::Array4<f32>, ndarray::Array4<f32>, Vec<i32>, usize) {
    let bs = 16;
    assert_eq!(offset % bs, 0);
    let (_, hkv, _, e) = k.dim();
    let ev = v.dim().3;
    let dummy = offset / bs;
    let per_seq: Vec<usize> = seq_lens.iter().map(|l| l.div_ceil(bs)).collect();
    let nb = 1 + per_seq.iter().sum::<usize>();
    let mut kc = ndarray::Array4::<f32>::from_elem((nb, bs, hkv, e), 1e3);
    let mut vc = ndarray::Array4::<f32>::from_elem((nb, bs, hkv, ev), 1e3);
    let max_blocks = dummy + per_seq.iter().max().unwrap();
    let mut table = vec![-1i32; seq_lens.len() * max_blocks];
    let mut next = 1;
    for (s, &l) in seq_lens.iter().enumerate() {
        let rows = k
            .slice(ndarray::s![s, .., ..l, ..])
            .permuted_axes([1, 0, 2])
            .to_owned();
        let pos: Vec<usize> = (0..l).map(|t| offset + t).collect();
        let rotated = rope.run_blocking(ctx, &Tensor::from(&rows), &pos).unwrap();
        for blk in 0..max_blocks {
            table[s * max_blocks + blk] = if blk < dummy {
                0
            } else if blk - dummy < per_seq[s] {
                next += 1;
                next - 1
            } else {
                -1
            };
        }
        for t in 0..l {
            let phys = table[s * max_blocks + dummy + t / bs] as usize;
            kc.slice_mut(ndarray::s![phys, t % bs, .., ..])
                .assign(&rotated.slice(ndarray::s![t, .., ..]));
            vc.slice_mut(ndarray::s![phys, t % bs, .., ..])
                .assign(&v.slice(ndarray::s![s, .., t, ..]));
        }
    }
    (kc, vc, table, max_blocks)
}

/// An `attn_*` golden: paged attention with RoPE on q inside the kernels over a ragged batch,
/// on every path (output and logsumexp).
fn golden_attention(
    ctx: &wgpu_attention::Context,
    dir: &std::path::Path,
    name: &str,
    rope: &Rope,
    meta: &serde_json::Value,
) {
    use ndarray::{Array2, Array4};
    use wgpu_attention::{Causal, PagedAttention, Path};
    let q: Array3<f32> = npy(golden_file(dir, "q.npy"));
    let k: Array4<f32> = npy(golden_file(dir, "k.npy"));
    let v: Array4<f32> = npy(golden_file(dir, "v.npy"));
    let want: Array3<f64> = npy(golden_file(dir, "out.npy"));
    let want_lse: Array2<f64> = npy(golden_file(dir, "lse.npy"));
    let ints = |key: &str| -> Vec<usize> {
        meta[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect()
    };
    let (q_lens, seq_lens) = (ints("q_lens"), ints("seq_lens"));
    let offset = meta["offset"].as_u64().unwrap() as usize;
    let causal = match meta["causal"].as_str().unwrap() {
        "bottom_right" => Causal::BottomRight,
        _ => Causal::None,
    };
    let (kc, vc, table, max_blocks) = golden_caches(ctx, rope, (&k, &v), &seq_lens, offset);
    let total: Vec<usize> = seq_lens.iter().map(|l| offset + l).collect();
    // With an offset each sequence is its own call: its window (l - n keys to the left) is
    // its own.
    let runs: Vec<(usize, usize)> = if offset == 0 {
        vec![(0, seq_lens.len())]
    } else {
        (0..seq_lens.len()).map(|s| (s, s + 1)).collect()
    };
    for path in [Path::Auto, Path::Fused, Path::Decode] {
        for &(s0, s1) in &runs {
            let t0: usize = q_lens[..s0].iter().sum();
            let t1: usize = q_lens[..s1].iter().sum();
            let qs = q.slice(ndarray::s![t0..t1, .., ..]).to_owned();
            let tab = &table[s0 * max_blocks..s1 * max_blocks];
            let mut call = PagedAttention::new(
                &qs,
                &q_lens[s0..s1],
                wgpu_attention::Pages::new(&kc, &vc, wgpu_attention::PagedLayout::TokenMajor),
                tab,
                &total[s0..s1],
            )
            .causal(causal)
            .rope(*rope)
            .path(path);
            if offset > 0 {
                call = call.window((seq_lens[s0] - q_lens[s0]) as i64, 0);
            }
            let got = call
                .run_blocking(ctx)
                .unwrap_or_else(|e| panic!("{name} {path:?}: {e}"));
            let label = format!("{name} sequences {s0}..{s1} [{path:?}]");
            let w = want.slice(ndarray::s![t0..t1, .., ..]);
            assert_report(
                compare(got.output.iter().copied(), w.iter().copied(), TOL),
                &format!("{label} output"),
            );
            let wl = want_lse.slice(ndarray::s![t0..t1, ..]);
            assert_report(
                compare(got.lse.iter().copied(), wl.iter().copied(), TOL),
                &format!("{label} lse"),
            );
        }
    }
}
