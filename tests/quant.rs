//! 8-bit K/V caches (int8 with a scale per row, fp8 e4m3 with a scale per kv head): attention
//! over the codes equals the f64 reference over their dequantised values, within the f32
//! tolerance, on contiguous and paged caches (both layouts), the fused and decode paths, every
//! mask and modifier (fully masked rows included), GQA, L != S, head dims that are not
//! multiples of the tiles, mixed K/V formats; and every misuse is a typed error before any GPU
//! work.

mod common;

use common::*;
use ndarray::{Array1, Array3, Array4};
use wgpu_attention::quant::{self, E4m3};
use wgpu_attention::{Causal, Context, Error, PagedLayout, Pages, Path, Sdpa, Storage, Tensor};

/// A cache `x` (row-major, rows of `e`, dims `dims` without E, the kv head at `head_axis`) in
/// format `s`: its codes, its scales, and the values they stand for.
pub struct Coded {
    pub int8: Option<Vec<i8>>,
    pub fp8: Option<Vec<E4m3>>,
    pub scales: Vec<f32>,
    pub scales_shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Coded {
    pub fn new(x: &[f32], e: usize, dims: &[usize], head_axis: usize, s: Storage, seed: u64) -> Coded {
        match s {
            Storage::Int8 => {
                let (c, sc) = quant::quantize_int8(x, e);
                let values = quant::dequantize_int8(&c, &sc, e);
                Coded {
                    int8: Some(c),
                    fp8: None,
                    scales: sc,
                    scales_shape: dims.to_vec(),
                    values,
                }
            }
            Storage::Fp8 => {
                // Per-head scales around amax / 448 (vLLM's calibration), varied per head so
                // a wrong head's scale shows; some values saturate.
                let h = dims[head_axis];
                let amax = x
                    .iter()
                    .filter(|v| v.is_finite())
                    .fold(0f32, |m, v| m.max(v.abs()));
                let scales: Vec<f32> = (0..h)
                    .map(|i| amax / 448.0 * (0.6 + 0.3 * ((i as u64 + seed) % 4) as f32))
                    .collect();
                let c = quant::quantize_fp8_heads(x, e, dims, head_axis, &scales);
                let values = quant::dequantize_fp8_heads(&c, e, dims, head_axis, &scales);
                Coded {
                    int8: None,
                    fp8: Some(c),
                    scales,
                    scales_shape: vec![h],
                    values,
                }
            }
            _ => Coded {
                int8: None,
                fp8: None,
                scales: Vec::new(),
                scales_shape: Vec::new(),
                values: x.iter().map(|&v| s.round(v)).collect(),
            },
        }
    }

    /// The tensor of shape `shape` over the codes, with the scales (host data); a float
    /// format's values as they are.
    pub fn tensor(&self, shape: &[usize], s: Storage) -> Tensor<'_> {
        let scales = || Tensor::from_slice(&self.scales, &self.scales_shape);
        match (&self.int8, &self.fp8) {
            (Some(c), _) => Tensor::from_slice(c, shape).with_scales(scales()),
            (_, Some(c)) => Tensor::from_slice(c, shape).with_scales(scales()),
            _ => Tensor::from_slice(&self.values, shape).with_storage(s),
        }
    }
}

/// The case's K and V coded as `kf`, `vf` (contiguous `[B, Hkv, S, E]`), and the case with
/// the values they stand for (what the reference sees).
fn coded(case: &Case, kf: Storage, vf: Storage) -> (Coded, Coded, Case) {
    let (b, hkv, s, e) = case.k.dim();
    let ev = case.v.dim().3;
    let k = Coded::new(case.k.as_slice().unwrap(), e, &[b, hkv, s], 1, kf, 1);
    let v = Coded::new(case.v.as_slice().unwrap(), ev, &[b, hkv, s], 1, vf, 2);
    let mut c = case.clone();
    c.k = Array4::from_shape_vec((b, hkv, s, e), k.values.clone()).unwrap();
    c.v = Array4::from_shape_vec((b, hkv, s, ev), v.values.clone()).unwrap();
    (k, v, c)
}

/// Run the case with K and V coded as `kf`, `vf` on `path`, contiguous, and compare with the
/// reference over the dequantised values.
fn check_contiguous(ctx: &Context, case: &Case, kf: Storage, vf: Storage, path: Path, label: &str) {
    let (k, v, deq) = coded(case, kf, vf);
    let want = deq.reference();
    let got = Sdpa::new(
        &case.q,
        k.tensor(case.k.shape(), kf),
        v.tensor(case.v.shape(), vf),
    )
    .options(deq.options())
    .path(path)
    .return_lse()
    .run_blocking(ctx)
    .unwrap_or_else(|e| panic!("{label} {kf}/{vf} {path:?}: {e}"));
    deq.assert_output(&got, &want, path, TOL, &format!("{label} {kf}/{vf} [{path:?}]"));
}

const FORMATS: [(Storage, Storage); 4] = [
    (Storage::Int8, Storage::Int8),
    (Storage::Fp8, Storage::Fp8),
    (Storage::Int8, Storage::Fp8),
    (Storage::F16, Storage::Int8),
];

#[test]
fn contiguous_caches_on_the_fused_and_decode_paths() {
    let Some(ctx) = ctx() else { return };
    // (B, Hq, Hkv, L, S, E, Ev): GQA decode, L != S prefill, head dims 4·odd, L > S.
    let shapes = [
        (2, 4, 2, 1, 77, 64, 64),
        (1, 3, 1, 13, 45, 36, 20),
        (2, 2, 2, 9, 5, 8, 12),
    ];
    for (i, &shape) in shapes.iter().enumerate() {
        for (kf, vf) in FORMATS {
            let case = Case::random(shape, 300 + i as u64).with_causal(Causal::BottomRight);
            for path in [Path::Auto, Path::Fused, Path::Decode] {
                check_contiguous(ctx, &case, kf, vf, path, &format!("{shape:?}"));
            }
        }
    }
}

#[test]
fn every_mask_and_modifier_over_8_bit_caches() {
    let Some(ctx) = ctx() else { return };
    for (name, kind) in mask_kinds()
        .into_iter()
        .chain(window_kinds())
        .chain(modifier_kinds())
        .chain(user_kinds())
    {
        let case = kind(Case::random((2, 2, 1, 6, 41, 16, 16), 310));
        for (kf, vf) in [(Storage::Int8, Storage::Int8), (Storage::Fp8, Storage::Fp8)] {
            for path in [Path::Fused, Path::Decode] {
                check_contiguous(ctx, &case, kf, vf, path, name);
            }
        }
    }
}

/// A token-major page array `[NB, BS, Hkv, E]` coded as `s` (scales `[NB, BS, Hkv]` or `[Hkv]`),
/// and the page array of the values they stand for. The unwritten slots (NaN) stay NaN in fp8
/// (its NaN code) and become 10^6 in int8 (no NaN code; a finite scale is required): either
/// shows if read.
fn coded_pages(a: &Array4<f32>, s: Storage, seed: u64) -> (Coded, Array4<f32>) {
    let (nb, bs, h, e) = a.dim();
    let a = match s {
        Storage::Int8 => a.mapv(|x| if x.is_nan() { 1e6 } else { x }),
        _ => a.clone(),
    };
    let c = Coded::new(a.as_slice().unwrap(), e, &[nb, bs, h], 2, s, seed);
    let values = Array4::from_shape_vec((nb, bs, h, e), c.values.clone()).unwrap();
    (c, values)
}

/// The same codes head-major: `[NB, Hkv, BS, E]`, scales `[NB, Hkv, BS]` (int8).
fn head_major(c: &Coded, (nb, bs, h, e): (usize, usize, usize, usize)) -> Coded {
    let perm = |i: usize| {
        // Row r of the head-major array is (blk, head, slot); its token-major row.
        let (blk, rest) = (i / (h * bs), i % (h * bs));
        let (hd, slot) = (rest / bs, rest % bs);
        (blk * bs + slot) * h + hd
    };
    let rows = nb * bs * h;
    let gather = |x: &[i8]| {
        (0..rows)
            .flat_map(|r| x[perm(r) * e..][..e].to_vec())
            .collect::<Vec<_>>()
    };
    let gather8 = |x: &[E4m3]| {
        (0..rows)
            .flat_map(|r| x[perm(r) * e..][..e].to_vec())
            .collect::<Vec<_>>()
    };
    Coded {
        int8: c.int8.as_deref().map(gather),
        fp8: c.fp8.as_deref().map(gather8),
        scales: if c.int8.is_some() {
            (0..rows).map(|r| c.scales[perm(r)]).collect()
        } else {
            c.scales.clone()
        },
        scales_shape: if c.int8.is_some() {
            vec![nb, h, bs]
        } else {
            c.scales_shape.clone()
        },
        values: Vec::new(),
    }
}

fn check_paged(ctx: &Context, case: &Case, kf: Storage, vf: Storage, bs: usize, path: Path, label: &str) {
    let lens = seq_lens(case);
    let pg = page(case, &lens, bs, bs as u64 + 3);
    let (kc, kd) = coded_pages(&pg.k, kf, 1);
    let (vc, vd) = coded_pages(&pg.v, vf, 2);
    // The reference over the dequantised values, gathered back into contiguous keys.
    let mut deq = case.clone();
    deq.kv_lens = Some(lens.clone());
    let back = |pages: &Array4<f32>, like: &Array4<f32>| {
        let mut out = like.clone();
        let max_blocks = pg.table.len() / lens.len();
        for ((b, h, t, d), x) in out.indexed_iter_mut() {
            if t < lens[b] {
                let blk = pg.table[b * max_blocks + t / bs] as usize;
                *x = pages[[blk, t % bs, h, d]];
            }
        }
        out
    };
    deq.k = back(&kd, &case.k);
    deq.v = back(&vd, &case.v);
    let want = deq.reference();
    let mut options = deq.options();
    options.kv_lens = None;
    let (kh, vh) = (head_major(&kc, pg.k.dim()), head_major(&vc, pg.v.dim()));
    let (kdim, vdim) = (pg.k.dim(), pg.v.dim());
    let hm = |(a, b, c, d): (usize, usize, usize, usize)| [a, c, b, d];
    let tm = |(a, b, c, d): (usize, usize, usize, usize)| [a, b, c, d];
    for (layout, k, v) in [
        (
            PagedLayout::TokenMajor,
            kc.tensor(&tm(kdim), kf),
            vc.tensor(&tm(vdim), vf),
        ),
        (
            PagedLayout::HeadMajor,
            kh.tensor(&hm(kdim), kf),
            vh.tensor(&hm(vdim), vf),
        ),
    ] {
        if kf.is_half() && layout == PagedLayout::HeadMajor {
            continue; // a float K's head-major values are not regathered here
        }
        let got = Sdpa::paged(&case.q, Pages::new(k, v, layout), &pg.table, &pg.lens)
            .options(options.clone())
            .path(path)
            .return_lse()
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label} {kf}/{vf} {layout:?} {path:?}: {e}"));
        deq.assert_output(
            &got,
            &want,
            path,
            TOL,
            &format!("{label} {kf}/{vf} block {bs} {layout:?} [{path:?}]"),
        );
    }
}

#[test]
fn paged_caches_in_both_layouts() {
    let Some(ctx) = ctx() else { return };
    let shapes = [(3, 4, 2, 1, 70, 64, 64), (2, 2, 1, 5, 45, 32, 16)];
    for (i, &shape) in shapes.iter().enumerate() {
        let case = Case::random(shape, 320 + i as u64).with_causal(Causal::BottomRight);
        for (kf, vf) in FORMATS {
            for (bs, path) in [(16, Path::Fused), (16, Path::Decode), (3, Path::Auto)] {
                check_paged(ctx, &case, kf, vf, bs, path, &format!("{shape:?}"));
            }
        }
    }
}

#[test]
fn modifiers_over_paged_8_bit_caches() {
    let Some(ctx) = ctx() else { return };
    for (name, kind) in window_kinds().into_iter().chain(modifier_kinds()) {
        let mut case = kind(Case::random((3, 2, 1, 3, 41, 16, 16), 330));
        if case.causal == Causal::TopLeft {
            case.causal = Causal::BottomRight;
        }
        case.kv_lens = None;
        for path in [Path::Fused, Path::Decode] {
            check_paged(ctx, &case, Storage::Int8, Storage::Fp8, 16, path, name);
        }
    }
}

/// A long decode (split-K with many splits) on int8, and the fused path on fp8 with a key
/// length past the fused kernel's key tiles.
#[test]
fn split_k_decode_over_long_8_bit_caches() {
    let Some(ctx) = ctx() else { return };
    let case = Case::random((1, 4, 1, 1, 2100, 64, 64), 340);
    for (kf, vf) in [(Storage::Int8, Storage::Int8), (Storage::Fp8, Storage::Int8)] {
        check_contiguous(ctx, &case, kf, vf, Path::Decode, "long");
    }
}

#[test]
fn misuse_is_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let q = Array4::<f32>::ones((1, 2, 1, 8));
    let k = Array4::<f32>::ones((1, 1, 5, 8));
    let codes = vec![1i8; 40];
    let fp8 = vec![E4m3(0x38); 40];
    let scales = Array3::<f32>::ones((1, 1, 5));
    let head = Array1::<f32>::ones(1);
    let quantized = |r: Result<wgpu_attention::Output, Error>, what: &str| match r {
        Err(Error::Quantized { reason }) => eprintln!("{what}: {reason}"),
        other => panic!("{what}: expected Error::Quantized, got {other:?}"),
    };
    let k8 = || Tensor::from_slice(&codes, &[1, 1, 5, 8]);
    let run = |k: Tensor, v: Tensor| Sdpa::new(&q, k, v).run_blocking(ctx);
    quantized(run(k8(), Tensor::from(&k)), "int8 k without scales");
    quantized(
        run(Tensor::from(&k).with_scales(&scales), Tensor::from(&k)),
        "scales on f32 k",
    );
    quantized(
        run(k8().with_scales(&head), Tensor::from(&k)),
        "int8 with per-head scales",
    );
    quantized(
        run(
            Tensor::from_slice(&fp8, &[1, 1, 5, 8]).with_scales(&scales),
            Tensor::from(&k),
        ),
        "fp8 with per-row scales",
    );
    let neg = Array3::<f32>::from_elem((1, 1, 5), -1.0);
    quantized(run(k8().with_scales(&neg), Tensor::from(&k)), "negative scales");
    let nan = Array1::<f32>::from_elem(1, f32::NAN);
    quantized(
        run(
            Tensor::from_slice(&fp8, &[1, 1, 5, 8]).with_scales(&nan),
            Tensor::from(&k),
        ),
        "NaN scale",
    );
    // Head dims that are not whole words of codes.
    let odd = vec![1i8; 30];
    let q6 = Array4::<f32>::ones((1, 2, 1, 6));
    let sc6 = Array3::<f32>::ones((1, 1, 5));
    let k6 = Array4::<f32>::ones((1, 1, 5, 6));
    quantized(
        Sdpa::new(
            &q6,
            Tensor::from_slice(&odd, &[1, 1, 5, 6]).with_scales(&sc6),
            &k6,
        )
        .run_blocking(ctx),
        "E = 6",
    );
    // q quantised.
    quantized(
        Sdpa::new(Tensor::from_slice(&codes[..16], &[1, 2, 1, 8]), &k, &k).run_blocking(ctx),
        "int8 q",
    );
    // The unfused path and the weights.
    let ok = || Sdpa::new(&q, k8().with_scales(&scales), &k);
    quantized(ok().path(Path::Unfused).run_blocking(ctx), "Path::Unfused");
    quantized(ok().return_weights().run_blocking(ctx), "weights");
    assert!(ok().run_blocking(ctx).is_ok());
    // The backward.
    let dout = Array4::<f32>::ones((1, 2, 1, 8));
    match ok().backward(&dout).run_blocking(ctx) {
        Err(Error::Quantized { .. }) => {}
        other => panic!("backward: {other:?}"),
    }
    // Host conversion to an 8-bit format.
    match Sdpa::new(&q, Tensor::from(&k).with_storage(Storage::Int8), &k).run_blocking(ctx) {
        Err(Error::BadBuffer { .. }) => {}
        other => panic!("with_storage(Int8) on host data: {other:?}"),
    }
}
