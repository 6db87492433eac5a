//! 8-bit K/V caches (int8 with a scale per row, fp8 e4m3 with a scale per kv head): attention
//! over the codes equals the f64 reference over their dequantised values, within the f32
//! tolerance, on contiguous and paged caches (both layouts), the fused and decode paths, every
//! mask and modifier (fully masked rows included), GQA, L != S, head dims that are not
//! multiples of the tiles, mixed K/V formats; and every misuse is a typed error before any GPU
//! work.

mod common;

use common::*;
use ndarray::{Array1, Array2, Array3, Array4};
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

/// What a cache's layer holds, read back: K and V `[NB, Hkv, BS, E]` values (the codes'
/// values, unscaled) and their scales.
struct Held {
    k: Vec<f32>,
    v: Vec<f32>,
    ks: Vec<f32>,
    vs: Vec<f32>,
}

fn read_layer(ctx: &Context, cache: &wgpu_attention::KvCache, layer: usize) -> Held {
    let c = *cache.config();
    let (kb, vb) = cache.buffers(layer).unwrap();
    let (ks, vs) = cache.scales(layer).unwrap();
    let n = c.num_blocks * c.kv_heads * c.block_size;
    let read = |b: &wgpu::Buffer, elems: usize, s: Storage| {
        pollster::block_on(ctx.read_as_f32(b, 0, elems, s)).unwrap()
    };
    let scales = |b: Option<&wgpu::Buffer>, s: Storage| match (b, s) {
        (Some(b), Storage::Int8) => read(b, n, Storage::F32),
        (Some(b), _) => read(b, c.kv_heads, Storage::F32),
        (None, _) => Vec::new(),
    };
    Held {
        k: read(kb, n * c.head_dim, c.storage),
        v: read(vb, n * c.head_dim_v, c.v_format()),
        ks: scales(ks, c.storage),
        vs: scales(vs, c.v_format()),
    }
}

/// The values a cache row stands for: code value times its scale (int8: the row's, fp8: the
/// head's), rows of `e` at row index `r` (`[NB, Hkv, BS]` order), head `h`.
fn row_values(codes: &[f32], scales: &[f32], s: Storage, e: usize, r: usize, h: usize) -> Vec<f32> {
    let sc = if s == Storage::Int8 { scales[r] } else { scales[h] };
    codes[r * e..(r + 1) * e].iter().map(|&c| c * sc).collect()
}

/// Check the codes of one appended row `x` (the values given, K rotated) against the rule,
/// with the cache's scale for it. A code may differ by 1 only where `x / scale` lies within
/// float rounding (the GPU's division: 2.5 ulp; RoPE's f32 rotation: 1e-5 relative here) of a
/// .5 boundary (int8) or of the midpoint of two e4m3 values (fp8): counted in `near`.
fn check_row_codes(x: &[f32], codes: &[f32], scale: f32, s: Storage, near: &mut usize, label: &str) {
    for (i, (&xv, &got)) in x.iter().zip(codes).enumerate() {
        let q = xv / scale;
        let close = |m: f32| (q - m).abs() <= 1e-5 * q.abs().max(1e-3);
        let (want, got_code, at_tie) = match s {
            Storage::Int8 => (
                quant::int8_code(xv, scale) as i32,
                got as i32,
                close(q.trunc() + 0.5 * q.signum()),
            ),
            _ => {
                let w = E4m3::from_f32(q);
                let value = |c: u8| E4m3(c).to_f32();
                let mids = [w.0.wrapping_sub(1), w.0.wrapping_add(1)].map(|n| (w.to_f32() + value(n)) / 2.0);
                (
                    (w.0 & 0x7f) as i32,
                    (E4m3::from_f32(got).0 & 0x7f) as i32,
                    mids.into_iter().any(close),
                )
            }
        };
        if want == got_code {
            continue;
        }
        // An exact quotient (a power-of-two scale) gets no allowance: its tie is the rule's.
        let exact = (xv as f64 / scale as f64) == q as f64;
        assert!(
            (want - got_code).abs() == 1 && at_tie && !exact,
            "{label} element {i}: x {xv} / scale {scale} = {q}: code {got_code}, the rule gives {want}"
        );
        *near += 1;
    }
}

/// A cache with 8-bit K and V (each format, mixed, with RoPE and without): the codes and
/// scales it holds for every token of every sequence follow the rule after each step (forks'
/// copies-on-write included), and its attention (decode and a prefill chunk, GQA) equals the
/// reference over the values they stand for.
#[test]
fn kv_cache_quantises_as_it_appends() {
    let Some(ctx) = ctx() else { return };
    let rope = wgpu_attention::Rope::default();
    for (kf, vf, rope) in [
        (Storage::Int8, Storage::Int8, None),
        (Storage::Fp8, Storage::Int8, Some(rope)),
        (Storage::Int8, Storage::Fp8, Some(rope)),
        (Storage::Fp8, Storage::Fp8, None),
    ] {
        let mut t = CacheTest::new(ctx, kf, vf, rope);
        let a = t.cache.add_sequence();
        t.step(ctx, &[(a, 7)], "prefill");
        let b = t.cache.fork(a).unwrap();
        let rows = t.given[&a].clone();
        t.given.insert(b, rows);
        t.step(ctx, &[(a, 1), (b, 1)], "decode after a fork");
        t.step(ctx, &[(a, 2), (b, 2)], "chunk");
    }
}

const HKV: usize = 2;
const HQ: usize = 4;
const E: usize = 16;
const EV: usize = 8;
const BS: usize = 4;

/// One token's K (rotated) and V rows given to a cache, `[Hkv, E]` and `[Hkv, Ev]`.
type KvRows = (Array2<f32>, Array2<f32>);

/// A one-layer 8-bit cache and the rows given to it (K rotated), per sequence and position.
struct CacheTest {
    cache: wgpu_attention::KvCache,
    kf: Storage,
    vf: Storage,
    rope: Option<wgpu_attention::Rope>,
    given: std::collections::BTreeMap<wgpu_attention::SeqId, Vec<KvRows>>,
    rng: rand::rngs::StdRng,
    label: String,
}

impl CacheTest {
    fn new(ctx: &Context, kf: Storage, vf: Storage, rope: Option<wgpu_attention::Rope>) -> CacheTest {
        let cache = wgpu_attention::KvCache::new(
            ctx,
            wgpu_attention::KvCacheConfig {
                layers: 1,
                kv_heads: HKV,
                head_dim: E,
                head_dim_v: EV,
                block_size: BS,
                num_blocks: 16,
                storage: kf,
                v_storage: Some(vf),
                rope,
            },
        )
        .unwrap();
        let fp8 = |s: Storage, x: &'static [f32]| (s == Storage::Fp8).then_some(x);
        cache
            .set_scales(ctx, 0, fp8(kf, &[0.0078125, 0.004]), fp8(vf, &[0.0078125, 0.01]))
            .unwrap();
        CacheTest {
            cache,
            kf,
            vf,
            rope,
            given: Default::default(),
            rng: rng(350),
            label: format!("{kf}/{vf} rope {}", rope.is_some()),
        }
    }

    /// Append random rows for `batch` (both signs, a row of zeros: scale 0, a value past
    /// fp8's range: saturated), then check every held row and the attention.
    fn step(&mut self, ctx: &Context, batch: &[(wgpu_attention::SeqId, usize)], tag: &str) {
        let step = self.cache.reserve(batch).unwrap();
        let t = step.tokens();
        let mut k: Array3<f32> = rand_array(&mut self.rng, (t, HKV, E));
        let v: Array3<f32> = rand_array(&mut self.rng, (t, HKV, EV));
        k.slice_mut(ndarray::s![0, 0, ..]).fill(0.0);
        k[[t - 1, 1, 3]] = 40.0;
        // Exact ties in head 0 of the last token (V is never rotated; K where no RoPE): the
        // scale is 2^-7 (int8: the row's largest value 127 · 2^-7; fp8: the head's).
        let mut v = v;
        let last = t - 1;
        let ties = |s: Storage| -> Vec<f32> {
            let x: Vec<f32> = match s {
                Storage::Int8 => vec![127.0, 63.5, -62.5, 0.5, 1.5, -2.5, 3.5, 100.5],
                _ => vec![1.0625, 1.1875, -1.0625, 1.5 / 512.0, 464.0, 17.0, 0.0, 1.0],
            };
            x.into_iter().map(|x| x / 128.0).collect()
        };
        for (d, x) in ties(self.vf).into_iter().enumerate() {
            v[[last, 0, d]] = x;
        }
        if self.rope.is_none() {
            for (d, x) in ties(self.kf).into_iter().enumerate() {
                k[[last, 0, d]] = x;
            }
        }
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        self.cache
            .append(ctx, &mut enc, &step, 0, &Tensor::from(&k), &Tensor::from(&v))
            .unwrap();
        ctx.queue().submit([enc.finish()]);
        let mut kr = k.clone();
        if let Some(rp) = &self.rope {
            rp.apply(kr.view_mut(), step.positions()).unwrap();
        }
        let mut at = 0;
        for &(seq, n) in batch {
            for i in at..at + n {
                let row = |a: &Array3<f32>| a.slice(ndarray::s![i, .., ..]).to_owned();
                self.given.entry(seq).or_default().push((row(&kr), row(&v)));
            }
            at += n;
        }
        let held = read_layer(ctx, &self.cache, 0);
        self.check_codes(&held, tag);
        self.check_attention(ctx, &step, &held, batch, tag);
    }

    /// Every held row of every sequence against the rule.
    fn check_codes(&self, held: &Held, tag: &str) {
        let mut near = 0;
        let label = format!("{} {tag}", self.label);
        for (&seq, rows) in &self.given {
            let blocks = self.cache.blocks(seq).unwrap();
            for (pos, (kx, vx)) in rows.iter().enumerate() {
                for h in 0..HKV {
                    let row = (blocks[pos / BS] as usize * HKV + h) * BS + pos % BS;
                    for (x, codes, scales, s, w) in [
                        (kx.row(h).to_vec(), &held.k, &held.ks, self.kf, E),
                        (vx.row(h).to_vec(), &held.v, &held.vs, self.vf, EV),
                    ] {
                        let scale = if s == Storage::Int8 {
                            scales[row]
                        } else {
                            scales[h]
                        };
                        if s == Storage::Int8 {
                            let want = quant::int8_scale(&x);
                            assert!(
                                (scale - want).abs() <= 2.0 * f32::EPSILON * want,
                                "{label} position {pos}: scale {scale}, the rule gives {want}"
                            );
                        }
                        let codes = &codes[row * w..(row + 1) * w];
                        check_row_codes(&x, codes, scale, s, &mut near, &format!("{label} position {pos}"));
                    }
                }
            }
        }
        eprintln!("{label}: {near} codes 1 off at a float-rounding tie");
    }

    /// The cache's attention of random queries against the reference over the held values.
    fn check_attention(
        &mut self,
        ctx: &Context,
        step: &wgpu_attention::Step,
        held: &Held,
        batch: &[(wgpu_attention::SeqId, usize)],
        tag: &str,
    ) {
        let (nb, n) = (batch.len(), batch[0].1);
        let q: Array4<f32> = rand_array(&mut self.rng, (nb, HQ, n, E));
        let got = self
            .cache
            .attention(step, 0, Tensor::from(&q))
            .unwrap()
            .run_blocking(ctx)
            .unwrap();
        let (table, lens) = step.block_table();
        let smax = *lens.iter().max().unwrap();
        let max_blocks = table.len() / nb;
        let mut kk = Array4::<f32>::zeros((nb, HKV, smax, E));
        let mut vv = Array4::<f32>::zeros((nb, HKV, smax, EV));
        for b in 0..nb {
            for t in 0..lens[b] {
                let blk = table[b * max_blocks + t / BS] as usize;
                for h in 0..HKV {
                    let row = (blk * HKV + h) * BS + t % BS;
                    let kr = row_values(&held.k, &held.ks, self.kf, E, row, h);
                    let vr = row_values(&held.v, &held.vs, self.vf, EV, row, h);
                    kk.slice_mut(ndarray::s![b, h, t, ..])
                        .assign(&ndarray::Array1::from(kr));
                    vv.slice_mut(ndarray::s![b, h, t, ..])
                        .assign(&ndarray::Array1::from(vr));
                }
            }
        }
        // q rotated as the cache's attention rotates it (query i at position len - n + i).
        let mut qr = q.clone();
        if let Some(rp) = &self.rope {
            for (b, &len) in lens.iter().enumerate() {
                let mut rows = qr
                    .slice(ndarray::s![b, .., .., ..])
                    .permuted_axes([1, 0, 2])
                    .to_owned();
                let pos: Vec<usize> = (0..n).map(|i| len - n + i).collect();
                rp.apply(rows.view_mut(), &pos).unwrap();
                qr.slice_mut(ndarray::s![b, .., .., ..])
                    .assign(&rows.permuted_axes([1, 0, 2]));
            }
        }
        let options = wgpu_attention::Options {
            causal: Causal::BottomRight,
            kv_lens: Some(lens.to_vec()),
            ..Default::default()
        };
        let want = wgpu_attention::reference::sdpa(qr.view(), kk.view(), vv.view(), &options).unwrap();
        let r = wgpu_attention::check::compare(got.output.iter().copied(), want.out.iter().copied(), TOL);
        assert_report(r, &format!("{} {tag} output", self.label));
    }
}

/// A ragged batch over 8-bit pages whose sequences share a 272-key prefix (read once, merged
/// by logsumexp) and a sequence of its own, both layouts, each path: equal to the reference
/// over the dequantised pages (and `PagedAttention::reference` on the codes and scales equals
/// the reference over the values they stand for).
#[test]
fn ragged_batches_and_shared_prefixes_over_8_bit_pages() {
    use wgpu_attention::PagedAttention;
    let Some(ctx) = ctx() else { return };
    let (hkv, hq, e, ev, bs) = (2, 4, 16, 12, 16);
    // Sequences 0-2 share blocks 0..17; each has its own tail blocks after; sequence 3 is apart.
    let lens = [280usize, 300, 290, 40];
    let q_lens = [1usize, 3, 2, 1];
    let max_blocks = 300usize.div_ceil(bs);
    let mut table = vec![-1i32; lens.len() * max_blocks];
    let mut next = 17;
    for (s, &len) in lens.iter().enumerate() {
        for blk in 0..len.div_ceil(bs) {
            table[s * max_blocks + blk] = if s < 3 && blk < 17 {
                blk as i32
            } else {
                next += 1;
                next - 1
            };
        }
    }
    let nb = next as usize;
    let mut r = rng(360);
    let k: Array4<f32> = rand_array(&mut r, (nb, bs, hkv, e));
    let v: Array4<f32> = rand_array(&mut r, (nb, bs, hkv, ev));
    let t: usize = q_lens.iter().sum();
    let q: Array3<f32> = rand_array(&mut r, (t, hq, e));
    for (kf, vf) in [(Storage::Int8, Storage::Fp8), (Storage::Fp8, Storage::Int8)] {
        let (kc, kd) = coded_pages(&k, kf, 1);
        let (vc, vd) = coded_pages(&v, vf, 2);
        let (kh, vh) = (head_major(&kc, k.dim()), head_major(&vc, v.dim()));
        let (kdim, vdim) = (k.dim(), v.dim());
        let hm = |(a, b, c, d): (usize, usize, usize, usize)| [a, c, b, d];
        let tm = |(a, b, c, d): (usize, usize, usize, usize)| [a, b, c, d];
        let float = PagedAttention::new(
            &q,
            &q_lens,
            Pages::new(&kd, &vd, PagedLayout::TokenMajor),
            &table,
            &lens,
        )
        .causal(Causal::BottomRight);
        let want = float.reference().unwrap();
        for (layout, kt, vt) in [
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
            let call = PagedAttention::new(&q, &q_lens, Pages::new(kt, vt, layout), &table, &lens)
                .causal(Causal::BottomRight);
            let label = format!("{kf}/{vf} {layout:?}");
            assert!(
                !call.shared_prefixes().unwrap().is_empty(),
                "{label}: no shared prefix found"
            );
            assert_paged(
                &call.reference().unwrap(),
                &want,
                TOL,
                &format!("{label} reference on codes"),
            );
            for path in [Path::Auto, Path::Fused, Path::Decode] {
                let got = call
                    .clone()
                    .path(path)
                    .run_blocking(ctx)
                    .unwrap_or_else(|e| panic!("{label} {path:?}: {e}"));
                assert_paged(&got, &want, TOL, &format!("{label} [{path:?}]"));
            }
        }
    }
}

/// PyTorch float64 goldens (`tests/fixtures/quant`, scripts/make_quant_goldens.py): ragged
/// batches with RoPE over token-major 8-bit pages, int8 dequantised explicitly and fp8 through
/// `torch.float8_e4m3fn`. The host rules give PyTorch's codes and scales from the same rotated
/// values, bit for bit; the GPU's attention over the pages matches the goldens.
#[test]
fn pytorch_goldens_over_8_bit_pages() {
    use wgpu_attention::{PagedAttention, Rope, RopeStyle};
    let Some(ctx) = ctx() else { return };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant");
    let mut names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|d| d.unwrap().path())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "the quant goldens");
    for dir in names {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let file = |f: &str| std::fs::read(dir.join(f)).unwrap_or_else(|e| panic!("{name}/{f}: {e}"));
        let meta: serde_json::Value = serde_json::from_slice(&file("meta.json")).unwrap();
        let fmt = |key: &str| meta[key].as_str().unwrap().parse::<Storage>().unwrap();
        let (kf, vf) = (fmt("k_format"), fmt("v_format"));
        let q: Array3<f32> = npy(file("q.npy"));
        let table: Array2<i32> = npy(file("table.npy"));
        let want: Array3<f64> = npy(file("out.npy"));
        let want_lse: Array2<f64> = npy(file("lse.npy"));
        let lens: Vec<usize> = meta["seq_lens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let q_lens: Vec<usize> = meta["q_lens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let (kc, kdims) = golden_cache(&name, &file, "k", kf);
        let (vc, vdims) = golden_cache(&name, &file, "v", vf);
        let rope = &meta["rope"];
        let rope = Rope {
            style: RopeStyle::HalfSplit,
            theta: rope["theta"].as_f64().unwrap(),
            dim: Some(rope["dim"].as_u64().unwrap() as usize),
        };
        let table = table.into_raw_vec_and_offset().0;
        let pages = Pages::new(
            kc.tensor(&kdims, kf),
            vc.tensor(&vdims, vf),
            PagedLayout::TokenMajor,
        );
        let call = PagedAttention::new(&q, &q_lens, pages, &table, &lens)
            .causal(Causal::BottomRight)
            .rope(rope);
        for path in [Path::Auto, Path::Fused, Path::Decode] {
            let got = call
                .clone()
                .path(path)
                .run_blocking(ctx)
                .unwrap_or_else(|e| panic!("{name} {path:?}: {e}"));
            let r = wgpu_attention::check::compare(got.output.iter().copied(), want.iter().copied(), TOL);
            assert_report(r, &format!("{name} [{path:?}] output"));
            let r = wgpu_attention::check::compare(got.lse.iter().copied(), want_lse.iter().copied(), TOL);
            assert_report(r, &format!("{name} [{path:?}] lse"));
        }
    }
}

/// A NaN in an fp8 cache (its NaN code, 0x7f or 0xff) reads as NaN, on both paths and in
/// both load widths (E 64: 16 codes per load; E 20: 4), as a NaN in a float cache would.
#[test]
fn fp8_nan_codes_read_as_nan() {
    let Some(ctx) = ctx() else { return };
    for e in [64usize, 20] {
        let q = Array4::<f32>::ones((1, 2, 1, e));
        let mut codes = vec![E4m3::from_f32(0.5); 7 * e];
        codes[3 * e + 1] = E4m3(0xff);
        let scales = Array1::<f32>::from_elem(1, 0.25);
        let v = Array4::<f32>::ones((1, 1, 7, e));
        for path in [Path::Fused, Path::Decode] {
            let k = Tensor::from_slice(&codes, &[1, 1, 7, e]).with_scales(&scales);
            let out = Sdpa::new(&q, k, &v).path(path).run_blocking(ctx).unwrap();
            assert!(
                out.output.iter().all(|x| x.is_nan()),
                "E {e} {path:?}: {:?}",
                out.output
            );
        }
    }
}

/// Bytes per token per layer at E = 128, Hkv 8 (scales included): int8 and fp8 hold at most
/// 53% of f16's (int8 51.6%: 128 codes and a 4-byte scale per head against 256 bytes; fp8 50%).
#[test]
fn eight_bit_caches_hold_about_half_of_f16() {
    let Some(ctx) = ctx() else { return };
    let bytes = |s: Storage| {
        let c = wgpu_attention::KvCache::new(
            ctx,
            wgpu_attention::KvCacheConfig {
                layers: 2,
                kv_heads: 8,
                head_dim: 128,
                head_dim_v: 128,
                block_size: 16,
                num_blocks: 64,
                storage: s,
                v_storage: None,
                rope: None,
            },
        )
        .unwrap();
        (c.bytes_per_token(), c.memory_bytes())
    };
    let (f16, f16_mem) = bytes(Storage::F16);
    assert_eq!(f16, 8 * 2 * 128 * 2);
    for s in Storage::QUANTIZED {
        let (b, mem) = bytes(s);
        let ratio = b as f64 / f16 as f64;
        eprintln!(
            "{s}: {b} bytes per token per layer, {:.1}% of f16's",
            100.0 * ratio
        );
        assert!(ratio <= 0.53, "{s}: {ratio}");
        assert!(
            (mem as f64) <= 0.53 * f16_mem as f64 + 1024.0,
            "{s}: {mem} bytes on the device"
        );
    }
}

/// A golden's cache `x` (`k` or `v`) in format `s`: its codes and scales from the files,
/// checked against the host rules on the same values (K rotated), and its dims.
fn golden_cache(name: &str, file: &dyn Fn(&str) -> Vec<u8>, x: &str, s: Storage) -> (Coded, Vec<usize>) {
    let vals: Array4<f32> = npy(file(&format!("{x}_vals.npy").replace("k_vals", "k_rot")));
    let dims = vals.shape().to_vec();
    let e = dims[3];
    let scales: ndarray::ArrayD<f32> = npy(file(&format!("{x}_scales.npy")));
    let scales = scales.into_raw_vec_and_offset().0;
    let flat = vals.as_slice().unwrap();
    let c = match s {
        Storage::Int8 => {
            let codes: Array4<i8> = npy(file(&format!("{x}_codes.npy")));
            let (mine, my_scales) = quant::quantize_int8(flat, e);
            assert_eq!(my_scales, scales, "{name} {x}: int8 scales");
            assert_eq!(&mine[..], codes.as_slice().unwrap(), "{name} {x}: int8 codes");
            Coded {
                int8: Some(mine),
                fp8: None,
                scales,
                scales_shape: dims[..3].to_vec(),
                values: Vec::new(),
            }
        }
        _ => {
            let codes: Array4<u8> = npy(file(&format!("{x}_codes.npy")));
            let mine = quant::quantize_fp8_heads(flat, e, &dims[..3], 2, &scales);
            let bits: Vec<u8> = mine.iter().map(|c| c.0).collect();
            assert_eq!(
                &bits[..],
                codes.as_slice().unwrap(),
                "{name} {x}: e4m3 codes against torch.float8_e4m3fn"
            );
            Coded {
                int8: None,
                fp8: Some(mine),
                scales_shape: vec![dims[2]],
                scales,
                values: Vec::new(),
            }
        }
    };
    (c, dims)
}

/// Contiguous 8-bit K/V in the caller's GPU buffers read through a view: int8 K with a
/// sequence capacity (its scales `[B, Hkv, capacity]` in a buffer laid out as its rows), fp8 V
/// in `[B, S, Hkv, E]` (`TensorLayout::Bshe`); both equal the reference over their values. A
/// scales buffer too small for the view, or host scales for a viewed cache, is a typed error.
#[test]
fn viewed_gpu_caches_with_their_scales() {
    use wgpu::util::DeviceExt;
    let Some(ctx) = ctx() else { return };
    let (b, hkv, s, cap, e) = (2usize, 2usize, 21usize, 32usize, 16usize);
    let case = Case::random((b, 4, hkv, 3, s, e, e), 370).with_causal(Causal::BottomRight);
    // K [B, Hkv, cap, E] with rows past S of garbage (huge values).
    let mut kfull = Array4::<f32>::from_elem((b, hkv, cap, e), 1e4);
    kfull.slice_mut(ndarray::s![.., .., ..s, ..]).assign(&case.k);
    let (kc, ks) = quant::quantize_int8(kfull.as_slice().unwrap(), e);
    // V [B, S, Hkv, E] (token-major rows), fp8 at one scale per head.
    let vt = case
        .v
        .view()
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .to_owned();
    let vs = [0.005f32, 0.008];
    let vc = quant::quantize_fp8_heads(vt.as_slice().unwrap(), e, &[b, s, hkv], 2, &vs);
    let mut deq = case.clone();
    let kd = Array4::from_shape_vec((b, hkv, cap, e), quant::dequantize_int8(&kc, &ks, e)).unwrap();
    deq.k = kd.slice(ndarray::s![.., .., ..s, ..]).to_owned();
    let vd = Array4::from_shape_vec(
        (b, s, hkv, e),
        quant::dequantize_fp8_heads(&vc, e, &[b, s, hkv], 2, &vs),
    )
    .unwrap();
    deq.v = vd.permuted_axes([0, 2, 1, 3]).as_standard_layout().to_owned();
    let want = deq.reference();
    let buf = |bytes: &[u8]| {
        ctx.device()
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytes,
                usage: wgpu::BufferUsages::STORAGE,
            })
    };
    let kb = buf(bytemuck::cast_slice(&kc));
    let ksb = buf(bytemuck::cast_slice(&ks));
    let vb = buf(&vc.iter().map(|c| c.0).collect::<Vec<u8>>());
    let vsb = buf(bytemuck::cast_slice(&vs));
    let small = buf(bytemuck::cast_slice(&ks[..ks.len() / 2]));
    let k = |scales| -> Tensor<'_> {
        Tensor::from_buffer(&kb, Storage::Int8, &[b, hkv, s, e])
            .with_seq_capacity(cap)
            .with_scales(Tensor::from_buffer(scales, Storage::F32, &[b, hkv, s]))
    };
    let v = || {
        Tensor::from_buffer(&vb, Storage::Fp8, &[b, hkv, s, e])
            .with_layout(wgpu_attention::TensorLayout::Bshe)
            .with_scales(Tensor::from_buffer(&vsb, Storage::F32, &[hkv]))
    };
    for path in [Path::Fused, Path::Decode] {
        let got = Sdpa::new(&case.q, k(&ksb), v())
            .options(deq.options())
            .path(path)
            .return_lse()
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{path:?}: {e}"));
        deq.assert_output(&got, &want, path, TOL, &format!("viewed 8-bit caches [{path:?}]"));
    }
    match Sdpa::new(&case.q, k(&small), v()).run_blocking(ctx) {
        Err(Error::Quantized { reason }) => assert!(reason.contains("scales buffer"), "{reason}"),
        other => panic!("a scales buffer too small: {other:?}"),
    }
    let host_scales = Array3::<f32>::ones((b, hkv, s));
    let viewed_host = Tensor::from_buffer(&kb, Storage::Int8, &[b, hkv, s, e])
        .with_seq_capacity(cap)
        .with_scales(&host_scales);
    match Sdpa::new(&case.q, viewed_host, v()).run_blocking(ctx) {
        Err(Error::Quantized { reason }) => assert!(reason.contains("GPU buffer"), "{reason}"),
        other => panic!("host scales for a viewed cache: {other:?}"),
    }
}
