//! Each kernel stage against its own reference stage: the scores matmul against
//! `reference::scores`, the masked softmax (given the reference scores) against
//! `reference::masked_softmax`, and the value weighting (given the reference weights) against
//! `reference::weighted_sum`.

use ndarray::{Array, Array4, IxDyn};
use wgpu::util::DeviceExt;

use super::{matmul, softmax};
use crate::check::{compare, F32_TOLERANCE};
use crate::device::context::Context;
use crate::options::Options;
use crate::problem::Causal;
use crate::reference;

pub(crate) fn ctx() -> Option<Context> {
    match Context::new_blocking() {
        Ok(c) => Some(c),
        Err(e) if std::env::var("WGPU_ATTENTION_REQUIRE_GPU").as_deref() != Ok("1") => {
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("WGPU_ATTENTION_REQUIRE_GPU=1 but {e}"),
    }
}

pub(crate) fn lcg(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn buf(ctx: &Context, data: &[u8]) -> wgpu::Buffer {
    ctx.device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: data,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        })
}

/// Shape (B, Hq, Hkv, L, S, E, Ev) with tails on every tile edge and GQA.
const SHAPE: (usize, usize, usize, usize, usize, usize, usize) = (2, 4, 2, 67, 71, 19, 66);

fn inputs() -> (Array4<f32>, Array4<f32>, Array4<f32>) {
    let (b, hq, hkv, l, s, e, ev) = SHAPE;
    (
        Array4::from_shape_vec((b, hq, l, e), lcg(b * hq * l * e, 1)).unwrap(),
        Array4::from_shape_vec((b, hkv, s, e), lcg(b * hkv * s * e, 2)).unwrap(),
        Array4::from_shape_vec((b, hkv, s, ev), lcg(b * hkv * s * ev, 3)).unwrap(),
    )
}

/// A dense product over the shape's batch-heads (GQA: B shared by groups of heads).
fn mm_params(m: usize, n: usize, k: usize, trans_b: bool, alpha: f32) -> matmul::Params {
    matmul::Params {
        heads: SHAPE.1 as u32,
        group: (SHAPE.1 / SHAPE.2) as u32,
        ..matmul::Params::dense(m as u32, n as u32, k as u32, trans_b, alpha)
    }
    .split_heads()
}

fn run_matmul(
    ctx: &Context,
    a: &wgpu::Buffer,
    b: &wgpu::Buffer,
    c_len: usize,
    params: matmul::Params,
    batch: usize,
    trans_b: bool,
) -> Vec<f32> {
    let c = buf(ctx, &vec![0u8; c_len * 4]);
    let dummy = buf(ctx, &[0u8; 16]);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    matmul::Matmul {
        a: a.as_entire_buffer_binding(),
        b: b.as_entire_buffer_binding(),
        bias: None,
        c: c.as_entire_buffer_binding(),
        params,
        batch: batch as u32,
        trans_b,
        formats: [crate::storage::Storage::F32; 4],
        accumulate: false,
    }
    .record(ctx, &mut enc, &dummy)
    .unwrap();
    ctx.queue().submit([enc.finish()]);
    pollster::block_on(ctx.read_f32(&c, 0, c_len as u64 * 4)).unwrap()
}

#[test]
fn scores_stage_matches_reference_scores() {
    let Some(ctx) = ctx() else { return };
    let (q, k, _) = inputs();
    let (b, hq, _, l, s, e, _) = SHAPE;
    let scale = 0.37f32;
    let got = run_matmul(
        &ctx,
        &buf(&ctx, bytemuck::cast_slice(q.as_slice().unwrap())),
        &buf(&ctx, bytemuck::cast_slice(k.as_slice().unwrap())),
        b * hq * l * s,
        mm_params(l, s, e, true, scale),
        b * hq,
        true,
    );
    let want = reference::scores(q.view(), k.view(), scale as f64);
    let r = compare(got, want.iter().copied(), F32_TOLERANCE);
    assert!(r.passed(), "{r}");
}

#[test]
fn value_stage_matches_reference_weighted_sum() {
    let Some(ctx) = ctx() else { return };
    let (_, _, v) = inputs();
    let (b, hq, _, l, s, _, ev) = SHAPE;
    let p = Array4::from_shape_vec(
        (b, hq, l, s),
        lcg(b * hq * l * s, 4).iter().map(|x| x.abs() as f64).collect(),
    )
    .unwrap();
    let p32: Vec<f32> = p.iter().map(|&x| x as f32).collect();
    let got = run_matmul(
        &ctx,
        &buf(&ctx, bytemuck::cast_slice(&p32)),
        &buf(&ctx, bytemuck::cast_slice(v.as_slice().unwrap())),
        b * hq * l * ev,
        mm_params(l, ev, s, false, 1.0),
        b * hq,
        false,
    );
    let want = reference::weighted_sum(&p, v.view());
    let r = compare(got, want.iter().copied(), F32_TOLERANCE);
    assert!(r.passed(), "{r}");
}

#[test]
fn softmax_stage_matches_reference_masked_softmax() {
    let Some(ctx) = ctx() else { return };
    let (q, k, _) = inputs();
    let (b, hq, hkv, l, s, e, ev) = SHAPE;
    let scores = reference::scores(q.view(), k.view(), 0.25);
    let scores32: Vec<f32> = scores.iter().map(|&x| x as f32).collect();
    let mask = Array::from_shape_vec(
        IxDyn(&[b, 1, l, s]),
        lcg(b * l * s, 5).iter().map(|&x| x > -0.4).collect(),
    )
    .unwrap();
    let bias = Array::from_shape_vec(IxDyn(&[1, hq, l, s]), lcg(hq * l * s, 6)).unwrap();
    let lens = [s, s - 20];
    for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
        let spec = Options {
            scale: None,
            causal,
            mask: Some((&mask).into()),
            bias: Some((&bias).into()),
            kv_lens: Some(lens.to_vec()),
            ..Default::default()
        };
        let p = spec
            .problem(&[b, hq, l, e], &[b, hkv, s, e], &[b, hkv, s, ev])
            .unwrap();
        let m = crate::tensor::Mask::from(&mask);
        let (words, mstr) = crate::sdpa::bindings::pack_mask(&p, &m);
        let sc = buf(&ctx, bytemuck::cast_slice(&scores32));
        let lse = buf(&ctx, &vec![0u8; b * hq * l * 4]);
        let mask_b = buf(&ctx, bytemuck::cast_slice(&words));
        let bias_b = buf(&ctx, bytemuck::cast_slice(bias.as_slice().unwrap()));
        let lens32: Vec<u32> = lens.iter().map(|&x| x as u32).collect();
        let lens_b = buf(&ctx, bytemuck::cast_slice(&lens32));
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        softmax::record(
            &ctx,
            &mut enc,
            (&p, super::Masks::new(&p, Some(mstr))),
            [
                mask_b.as_entire_buffer_binding(),
                bias_b.as_entire_buffer_binding(),
                lens_b.as_entire_buffer_binding(),
                sc.as_entire_buffer_binding(),
                lse.as_entire_buffer_binding(),
            ],
            softmax::Chunk {
                z0: 0,
                heads: b * hq,
                i0: 0,
                rows: l,
            },
        )
        .unwrap();
        ctx.queue().submit([enc.finish()]);
        let got_p = pollster::block_on(ctx.read_f32(&sc, 0, scores32.len() as u64 * 4)).unwrap();
        let got_lse = pollster::block_on(ctx.read_f32(&lse, 0, (b * hq * l) as u64 * 4)).unwrap();
        // The reference softmax starts from the f64 scores; the kernel from their f32 rounding.
        let (want_p, want_lse) = reference::masked_softmax(&scores, &spec).unwrap();
        let r = compare(got_p, want_p.iter().copied(), F32_TOLERANCE);
        assert!(r.passed(), "{causal:?} weights: {r}");
        let r = compare(got_lse, want_lse.iter().copied(), F32_TOLERANCE);
        assert!(r.passed(), "{causal:?} lse: {r}");
    }
}

/// Tiered compilation of the fused kernel: on a CPU adapter with a fixed subgroup size, a large
/// problem's first call is served by the one-row-per-invocation form while the fastest form
/// compiles in the background; after `wait_idle` the fastest form runs. Both match the
/// reference, and give the same bits (each row's arithmetic is the same).
#[test]
fn fused_first_use_form_and_fastest_form_agree() {
    use super::flash;
    use crate::sdpa::Path;
    use crate::sdpa::Sdpa;
    let Some(ctx) = ctx() else { return };
    // E = 64, Ev = 40 (4 rows per invocation on lavapipe), L and S not multiples of any tile.
    let (b, h, l, s, e, ev) = (1, 4, 603, 611, 64, 40);
    let q = Array4::from_shape_vec((b, h, l, e), lcg(b * h * l * e, 1)).unwrap();
    let k = Array4::from_shape_vec((b, h, s, e), lcg(b * h * s * e, 2)).unwrap();
    let v = Array4::from_shape_vec((b, h, s, ev), lcg(b * h * s * ev, 3)).unwrap();
    let sdpa = || Sdpa::new(&q, &k, &v).path(Path::Fused);
    let p = sdpa().problem().unwrap();
    assert!(p.flops() >= flash::CPU_UNROLL_MIN_FLOPS);
    let full = flash::Config::new(&p, &ctx.caps()).unwrap();
    let tiered = ctx.is_cpu() && !full.pinned && full.rq > 1 && !cfg!(target_arch = "wasm32");
    if tiered {
        assert_eq!(
            full.clone().for_now(&ctx).rq,
            1,
            "a fresh context serves the one-row form first"
        );
    }
    let first = sdpa().run_blocking(&ctx).unwrap().output;
    ctx.wait_idle().unwrap();
    assert_eq!(
        full.clone().for_now(&ctx),
        full,
        "after wait_idle the fastest form is ready"
    );
    let second = sdpa().run_blocking(&ctx).unwrap().output;
    let want = reference::sdpa(q.view(), k.view(), v.view(), &Options::default())
        .unwrap()
        .out;
    for (name, got) in [("first use", &first), ("fastest", &second)] {
        let r = compare(got.iter().copied(), want.iter().copied(), F32_TOLERANCE);
        assert!(r.passed(), "{name}: {r}");
    }
    assert_eq!(first, second, "the two forms differ");
}

/// `alpha · A[z] op(B) + bias` in f64 for the `batch` slices of `rows` rows of A from row
/// `off` (`[batch, m, n, k]` = `dims`), one B shared (`[N, K]` when `trans_b`), the bias
/// (empty: none) added to every row.
fn f64_product(
    (a, off, rows): (&[f32], usize, usize),
    (b, trans_b): (&[f32], bool),
    bias: &[f32],
    [batch, m, n, k]: [usize; 4],
    alpha: f32,
) -> Vec<f64> {
    let mut want = vec![0f64; batch * m * n];
    for z in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f64;
                for kk in 0..k {
                    let bv = if trans_b { b[j * k + kk] } else { b[kk * n + j] };
                    acc += a[(z * rows + off + i) * k + kk] as f64 * bv as f64;
                }
                let bias_v = bias.get(j).map_or(0.0, |&x| x as f64);
                want[(z * m + i) * n + j] = alpha as f64 * acc + bias_v;
            }
        }
    }
    want
}

/// Every scalar matmul form the device runs (the subgroup one where it has a subgroup of 8),
/// every storage format of a, b, bias and c, transposed and plain B, with and without bias,
/// batches with a shared B (GQA mapping), row offsets, tails on every tile edge and K not a
/// multiple of 4, against the f64 product of the rounded inputs.
#[test]
fn matmul_forms_and_formats_match_f64_product() {
    let Some(ctx) = ctx() else { return };
    let forms: Vec<_> = ctx
        .caps()
        .matmul_forms()
        .into_iter()
        .filter(|f| !f.is_coop())
        .collect();
    check_matmul_forms(&ctx, &forms);
}

/// The same for the matrix units' forms where the device lists their tiles (CI's coop pass);
/// elsewhere a pinned coop form is refused.
#[test]
fn coop_matmul_forms_and_formats_match_f64_product() {
    let Some(ctx) = ctx() else { return };
    let forms: Vec<_> = ctx
        .caps()
        .matmul_forms()
        .into_iter()
        .filter(|f| f.is_coop())
        .collect();
    eprintln!("coop matmul forms on {}: {forms:?}", ctx.describe());
    if forms.is_empty() {
        assert!(
            std::env::var("WGPU_ATTENTION_REQUIRE_COOP").as_deref() != Ok("1"),
            "WGPU_ATTENTION_REQUIRE_COOP=1 but no matrix units: {:?}",
            ctx.matrix_units()
        );
        let pinned = ctx.caps().with_forms(matmul::Form::Coop { tile: None });
        assert!(matmul::form_for(&pinned).is_err());
        return;
    }
    check_matmul_forms(&ctx, &forms);
}

fn check_matmul_forms(ctx: &Context, forms: &[matmul::Form]) {
    use crate::storage::Storage;
    let mixed = [Storage::F16, Storage::Bf16, Storage::F32, Storage::F16];
    let format_sets = [[Storage::F32; 4], [Storage::F16; 4], [Storage::Bf16; 4], mixed];
    // (batch, m, n, k, a_off rows): tails everywhere; aligned (vec4 loads); K % 4 != 0.
    // Every format set on the aligned shape (vec4 loads); on the others f32 and one half set,
    // in turn, so that each half set meets odd N (element-wise half stores), both B layouts
    // and tails (each shape, layout and format set compiles its own pipelines).
    let mut case = 0;
    for (si, (batch, m, n, k, off)) in [
        (2, 67, 45, 19, 0),
        (2, 33, 64, 64, 3),
        (1, 9, 130, 6, 1),
        (1, 150, 140, 21, 2),
    ]
    .into_iter()
    .enumerate()
    {
        for trans_b in [true, false] {
            let half_set = 1 + (si + usize::from(!trans_b)) % 3;
            for (fi, fs) in format_sets.into_iter().enumerate() {
                if si != 1 && fi != 0 && fi != half_set {
                    continue;
                }
                case += 1;
                // With and without the bias epilogue, alternately (each compiles its own pipelines).
                let mc = MatmulCase::new(ctx, [batch, m, n, k, off], trans_b, fs, case % 2 == 0);
                for &form in forms {
                    // The GPU form's loads and epilogue are format-generic: f32 and the mixed
                    // set cover them (each set compiles its own pipelines on CPU adapters).
                    if form == matmul::Form::GpuTiles && fs != [Storage::F32; 4] && fs != mixed {
                        continue;
                    }
                    mc.check(ctx, form);
                }
            }
        }
    }
}

/// One product of [`check_matmul_forms`]: `[batch, m, n, k]` with A's rows from `off`, one B
/// shared by the batch, in formats `fs` (a, b, bias, c), its operands on the device.
struct MatmulCase {
    dims: [usize; 5],
    trans_b: bool,
    fs: [crate::storage::Storage; 4],
    with_bias: bool,
    host: [Vec<f32>; 3],
    bufs: [wgpu::Buffer; 3],
}

impl MatmulCase {
    const ALPHA: f32 = 0.75;

    fn new(
        ctx: &Context,
        dims: [usize; 5],
        trans_b: bool,
        fs: [crate::storage::Storage; 4],
        with_bias: bool,
    ) -> Self {
        let [batch, m, n, k, off] = dims;
        let [fa, fb, fbias, _] = fs;
        let a: Vec<f32> = lcg(batch * (m + off) * k, 7)
            .iter()
            .map(|&x| fa.round(x))
            .collect();
        let b: Vec<f32> = lcg(n * k, 8).iter().map(|&x| fb.round(x)).collect();
        let bias: Vec<f32> = lcg(n, 9).iter().map(|&x| fbias.round(x)).collect();
        let bufs = [
            buf(ctx, &fa.encode(&a)),
            buf(ctx, &fb.encode(&b)),
            buf(ctx, &fbias.encode(&bias)),
        ];
        MatmulCase {
            dims,
            trans_b,
            fs,
            with_bias,
            host: [a, b, bias],
            bufs,
        }
    }

    /// The f64 product of the operands, each first rounded to f16 where `f16` and it is f32
    /// (what the matrix units take).
    fn want(&self, f16: bool) -> Vec<f64> {
        use crate::storage::Storage;
        let [batch, m, n, k, off] = self.dims;
        let [a, b, bias] = &self.host;
        let rounded = |x: &[f32], s: Storage| -> Vec<f32> {
            x.iter()
                .map(|&v| {
                    if f16 && s == Storage::F32 {
                        Storage::F16.round(v)
                    } else {
                        v
                    }
                })
                .collect()
        };
        let bias_used = if self.with_bias { &bias[..] } else { &[][..] };
        f64_product(
            (&rounded(a, self.fs[0]), off, m + off),
            (&rounded(b, self.fs[1]), self.trans_b),
            bias_used,
            [batch, m, n, k],
            Self::ALPHA,
        )
    }

    /// Record the product in `form` into a fresh C.
    fn record(
        &self,
        ctx: &Context,
        form: matmul::Form,
        whole: bool,
    ) -> (crate::error::Result<()>, wgpu::Buffer, wgpu::CommandEncoder) {
        let [batch, m, n, k, off] = self.dims;
        let c = buf(ctx, &vec![0u8; self.fs[3].bytes(batch * m * n) as usize]);
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let dense = matmul::Params::dense(m as u32, n as u32, k as u32, self.trans_b, Self::ALPHA);
        let (params, batch) = match whole {
            true => (
                matmul::Params {
                    heads: batch as u32,
                    group: batch as u32,
                    a_batch: ((m + off) * k) as u32,
                    a_off: (off * k) as u32,
                    ..dense
                }
                .split_heads(),
                batch as u32,
            ),
            false => (dense, 1),
        };
        let r = matmul::Matmul {
            a: self.bufs[0].as_entire_buffer_binding(),
            b: self.bufs[1].as_entire_buffer_binding(),
            bias: (whole && self.with_bias).then(|| self.bufs[2].as_entire_buffer_binding()),
            c: c.as_entire_buffer_binding(),
            params,
            batch,
            trans_b: self.trans_b,
            formats: self.fs,
            accumulate: false,
        }
        .record_form(ctx, &mut enc, &buf(ctx, &[0u8; 16]), form);
        (r, c, enc)
    }

    /// Run `form` and compare with the f64 product at C's format's tolerance; the matrix
    /// units take f16 operands (f32 ones rounded to f16: the products of f16 values are
    /// exact, the sums f32) and refuse bf16 ones and a half C of odd N (not whole words).
    fn check(&self, ctx: &Context, form: matmul::Form) {
        use crate::storage::Storage;
        let [batch, m, n, k, off] = self.dims;
        let [fa, fb, _, fc] = self.fs;
        let fs = self.fs;
        let coop = form.is_coop();
        let bf16 = fa == Storage::Bf16 || fb == Storage::Bf16;
        if coop && (bf16 || (fc.is_half() && n % 2 == 1)) {
            let (r, _, _) = self.record(ctx, form, false);
            let why = if bf16 { "bf16" } else { "whole words" };
            assert!(
                matches!(&r, Err(crate::error::Error::Unsupported { reason, .. }) if reason.contains(why)),
                "{form:?} {fs:?}: {r:?}"
            );
            return;
        }
        let want = self.want(coop);
        let (r, c, enc) = self.record(ctx, form, true);
        r.unwrap();
        ctx.queue().submit([enc.finish()]);
        let got = pollster::block_on(ctx.read_as_f32(&c, 0, batch * m * n, fc)).unwrap();
        let r = compare(
            got,
            want.iter().copied(),
            crate::check::Tolerance::for_storage(fc),
        );
        let (trans_b, bias) = (self.trans_b, self.with_bias);
        assert!(
            r.passed(),
            "{form:?} {fs:?} trans_b {trans_b} bias {bias} [{batch}, {m}, {n}, {k}] off {off}: {r}"
        );
    }
}
