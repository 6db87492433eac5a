//! Each backward kernel against the reference's stages (`reference::backward`), given the
//! reference's own inputs to its stage (the forward's output and logsumexp, D, the scores and
//! dP), so that what a kernel gets wrong is its own: `bwd_prep` (lse and D per row), `bwd_ds`
//! (P and dS, and their group transposes), `bwd_dkv` and `bwd_dq` in the device's fused form,
//! the unfused recorder's products in whole and row-split chunks, and `bwd_dbias`. On a shape
//! with tails (odd E, L != S, GQA) under every mask kind at once, and on a plain vec4 shape.

use ndarray::{Array, Array4, ArrayD, IxDyn};

use super::io::Io;
use super::record::{record_dbias, record_stats, Sizes};
use crate::check::{compare, flash_rule, Report, F32_TOLERANCE};
use crate::device::buffers::{dummy, f32_bytes, output, storage_init};
use crate::device::context::Context;
use crate::kernels::backward as kb;
use crate::kernels::stage_tests::{ctx, lcg};
use crate::options::Options;
use crate::problem::{Causal, Problem};
use crate::reference::{self, Gradients};
use crate::sdpa::bindings::pack_mask;
use crate::sdpa::plan::ChunkPlan;
use crate::sdpa::Path;
use crate::storage::Storage;
use crate::tensor::{Mask, Tensor};

type Shape = (usize, usize, usize, usize, usize, usize, usize);

/// Tails on every edge, odd E, GQA; with every mask kind.
const MASKED: Shape = (2, 4, 2, 37, 45, 19, 12);
/// vec4 rows, MQA, no mask.
const PLAIN: Shape = (1, 2, 1, 20, 33, 16, 16);

/// One problem's host inputs and options; `reference` gives the reference's gradients (f64,
/// and the plain f32 ones that FlashAttention's rule compares with), `dsum` D = rowsum(dO ∘ O).
struct Staged {
    q: Array4<f32>,
    k: Array4<f32>,
    v: Array4<f32>,
    dout: Array4<f32>,
    mask: Option<ArrayD<bool>>,
    bias: Option<Array4<f32>>,
    kv_lens: Option<Vec<usize>>,
    causal: Causal,
}

fn array4((a, b, c, d): (usize, usize, usize, usize), seed: u64) -> Array4<f32> {
    Array4::from_shape_vec((a, b, c, d), lcg(a * b * c * d, seed)).unwrap()
}

impl Staged {
    fn new((b, hq, hkv, l, s, e, ev): Shape, masked: bool) -> Staged {
        let mask = masked.then(|| {
            // Rows 3 and 4 of every head fully masked, the others about 2 keys in 3 allowed.
            let bits = lcg(b * l * s, 11);
            Array::from_shape_fn(IxDyn(&[b, 1, l, s]), |i| {
                let (bi, ii, j) = (i[0], i[2], i[3]);
                ii != 3 && ii != 4 && bits[(bi * l + ii) * s + j] > -0.3
            })
        });
        Staged {
            q: array4((b, hq, l, e), 1),
            k: array4((b, hkv, s, e), 2),
            v: array4((b, hkv, s, ev), 3),
            dout: array4((b, hq, l, ev), 4),
            mask,
            bias: masked.then(|| array4((1, hq, l, s), 5)),
            kv_lens: masked.then(|| (0..b).map(|i| s - 3 * i).collect()),
            causal: if masked { Causal::BottomRight } else { Causal::None },
        }
    }

    fn options(&self) -> Options<'_> {
        Options {
            causal: self.causal,
            mask: self.mask.as_ref().map(Mask::from),
            bias: self.bias.as_ref().map(Tensor::from),
            kv_lens: self.kv_lens.clone(),
            ..Options::default()
        }
    }

    fn problem(&self) -> Problem {
        self.options()
            .problem(self.q.shape(), self.k.shape(), self.v.shape())
            .unwrap()
    }

    fn reference(&self) -> (Gradients<f64>, Gradients<f32>) {
        let o = self.options();
        let (q, k, v, g) = (self.q.view(), self.k.view(), self.v.view(), self.dout.view());
        (
            reference::sdpa_backward(q, k, v, g, &o).unwrap(),
            reference::sdpa_backward_f32(q, k, v, g, &o).unwrap(),
        )
    }

    /// D = rowsum(dO ∘ O) per query row, in f64.
    fn dsum(&self, r: &Gradients<f64>) -> Vec<f64> {
        r.out
            .rows()
            .into_iter()
            .zip(self.dout.rows())
            .map(|(o, g)| o.iter().zip(g).map(|(&o, &g)| o * g as f64).sum())
            .collect()
    }
}

/// The device buffers of one problem: inputs, packed mask, bias, and the statistics (lse, D
/// and the key lengths) as the reference gives them.
struct Device {
    p: Problem,
    sizes: Sizes,
    params: kb::Params,
    bufs: [wgpu::Buffer; 7],
}

impl Device {
    fn new(ctx: &Context, st: &Staged, lse: &[f32], dsum: &[f64]) -> Device {
        let p = st.problem();
        let sizes = Sizes::new(&p);
        let o = st.options();
        let packed = o.mask.as_ref().map(|m| pack_mask(&p, m));
        let up = |label, a: &[f32]| storage_init(ctx, label, bytemuck::cast_slice(a));
        let mut stats: Vec<f32> = lse.to_vec();
        stats.extend(dsum.iter().map(|&d| d as f32));
        stats.extend(p.kv_lens.iter().flatten().map(|&n| f32::from_bits(n)));
        stats.resize(sizes.stats_len, 0.0);
        let bufs = [
            packed.as_ref().map_or_else(
                || dummy(ctx),
                |(w, _)| storage_init(ctx, "mask", bytemuck::cast_slice(w)),
            ),
            st.bias
                .as_ref()
                .map_or_else(|| dummy(ctx), |b| up("bias", b.as_slice().unwrap())),
            up("q", st.q.as_slice().unwrap()),
            up("k", st.k.as_slice().unwrap()),
            up("v", st.v.as_slice().unwrap()),
            up("dout", st.dout.as_slice().unwrap()),
            up("stats", &stats),
        ];
        let params = kb::Params::new(&p, packed.map(|(_, s)| s), sizes.dv_off);
        Device {
            p,
            sizes,
            params,
            bufs,
        }
    }

    fn io(&self) -> Io<'_> {
        let [mask, bias, q, k, v, dout, stats] = self.bufs.each_ref().map(|b| b.as_entire_buffer_binding());
        Io {
            mask,
            bias,
            q,
            k,
            v,
            dout,
            stats,
        }
    }
}

fn read(ctx: &Context, buf: &wgpu::Buffer, offset: usize, n: usize) -> Vec<f32> {
    pollster::block_on(ctx.read_f32(buf, f32_bytes(offset), f32_bytes(n))).unwrap()
}

fn submit(ctx: &Context, record: impl FnOnce(&mut wgpu::CommandEncoder)) {
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    record(&mut enc);
    ctx.queue().submit([enc.finish()]);
}

fn assert_rule(r: Report, what: &str) {
    assert!(r.passed(), "{what}: {r}");
}

/// `bwd_prep`: the logsumexp passed through and D = rowsum(dO ∘ O), from the reference's
/// output.
#[test]
fn prep_stage_matches_reference_statistics() {
    let Some(ctx) = ctx() else { return };
    for (shape, masked) in [(MASKED, true), (PLAIN, false)] {
        let st = Staged::new(shape, masked);
        let (r64, _) = st.reference();
        let d = st.dsum(&r64);
        let lse: Vec<f32> = r64.lse.iter().map(|&x| x as f32).collect();
        let dev = Device::new(&ctx, &st, &lse, &d);
        let out: Vec<f32> = r64.out.iter().map(|&x| x as f32).collect();
        let o = storage_init(&ctx, "o", bytemuck::cast_slice(&out));
        let mut stats = None;
        submit(&ctx, |enc| {
            let io = dev.io();
            stats = Some(
                record_stats(
                    &ctx,
                    enc,
                    (&dev.p, &dev.sizes),
                    &dev.params,
                    [o.as_entire_buffer_binding(), io.dout, io.stats],
                    Storage::F32,
                )
                .unwrap(),
            );
        });
        let rows = dev.sizes.rows;
        let got = read(&ctx, stats.as_ref().unwrap(), 0, 2 * rows);
        // The logsumexp is copied (-inf rows included), bit for bit.
        assert!(
            got[..rows]
                .iter()
                .zip(&lse)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{shape:?}: lse copied"
        );
        assert_rule(
            compare(got[rows..].iter().copied(), d, F32_TOLERANCE),
            &format!("{shape:?} D"),
        );
    }
}

/// `bwd_ds` on one chunk of every head and row: P and dS = P ∘ (dP − D) from the scores
/// scale·Q Kᵀ, dP = dO Vᵀ and the statistics, against `reference::softmax_backward` of the
/// recomputed P; and their transposes in groups of `gw` heads, for `gw` = 1 and the group.
#[test]
fn ds_stage_matches_reference_softmax_backward() {
    let Some(ctx) = ctx() else { return };
    let st = Staged::new(MASKED, true);
    let (b, hq, l, _) = st.q.dim();
    let (_, hkv, s, ev) = st.v.dim();
    let (r64, _) = st.reference();
    let d = st.dsum(&r64);
    let lse: Vec<f32> = r64.lse.iter().map(|&x| x as f32).collect();
    let dev = Device::new(&ctx, &st, &lse, &d);
    // The reference's scale, in f64.
    let scale = 1.0 / (st.q.dim().3 as f64).sqrt();
    let opts = st.options();
    let (p64, _) = reference::recompute(st.q.view(), st.k.view(), &opts, scale).unwrap();
    let sc = reference::scores(st.q.view(), st.k.view(), scale);
    let g = hq / hkv;
    let dp = Array4::from_shape_fn((b, hq, l, s), |(bi, h, i, j)| {
        (0..ev)
            .map(|c| st.dout[[bi, h, i, c]] as f64 * st.v[[bi, h / g, j, c]] as f64)
            .sum::<f64>()
    });
    let d3 = ndarray::Array3::from_shape_vec((b, hq, l), d).unwrap();
    let ds64 = reference::softmax_backward(&p64, &dp, &d3);
    let total = b * hq * l * s;
    for gw in [1, g] {
        let f32s = |a: &Array4<f64>| a.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let scb = storage_init(&ctx, "scores", bytemuck::cast_slice(&f32s(&sc)));
        let [dpo, pt, dst] = ["dP", "Pt", "dSt"].map(|n| output(&ctx, n, f32_bytes(total)));
        ctx.queue()
            .write_buffer(&dpo, 0, bytemuck::cast_slice(&f32s(&dp)));
        submit(&ctx, |enc| {
            let io = dev.io();
            kb::record(
                &ctx,
                enc,
                &kb::DS,
                &kb::ds_prelude(
                    true,
                    true,
                    crate::kernels::Mods::of(&dev.p, &ctx.tuning()),
                    Storage::F32,
                ),
                &[
                    io.mask,
                    io.bias,
                    scb.as_entire_buffer_binding(),
                    dpo.as_entire_buffer_binding(),
                    pt.as_entire_buffer_binding(),
                    dst.as_entire_buffer_binding(),
                    io.stats,
                ],
                &dev.params.chunk([0, 0, l, gw], total),
                total.div_ceil(64) as u32,
                crate::kernels::Checks::Kernel,
            )
            .unwrap();
        });
        let label = format!("gw {gw}");
        assert_rule(
            compare(read(&ctx, &dpo, 0, total), ds64.iter().copied(), F32_TOLERANCE),
            &format!("{label} dS"),
        );
        // Transposed by groups: head z = u gw + hl, row i, key j at ((u S + j) gw + hl) L + i.
        let t = |a: &Array4<f64>| {
            let mut out = vec![0.0f64; total];
            for ((bi, h, i, j), &x) in a.indexed_iter() {
                let z = bi * hq + h;
                out[((z / gw * s + j) * gw + z % gw) * l + i] = x;
            }
            out
        };
        assert_rule(
            compare(read(&ctx, &pt, 0, total), t(&p64), F32_TOLERANCE),
            &format!("{label} Pt"),
        );
        assert_rule(
            compare(read(&ctx, &dst, 0, total), t(&ds64), F32_TOLERANCE),
            &format!("{label} dSt"),
        );
    }
}

/// dK, dV (f32, one buffer) and dQ from the statistics, read back.
fn gradients(ctx: &Context, dev: &Device, path: Path, chunk_budget: Option<u64>) -> [Vec<f32>; 3] {
    let (p, sizes) = (&dev.p, &dev.sizes);
    let dq = output(ctx, "dq", f32_bytes(sizes.rows * p.head_dim));
    let dkv = output(ctx, "dkv", sizes.dkv_bytes);
    submit(ctx, |enc| {
        let io = dev.io();
        match path {
            Path::Fused => {
                let cfg = kb::Config::new(p, &ctx.caps()).unwrap();
                super::fused::record(ctx, enc, (p, &cfg), &io, &dev.params, [&dkv, &dq]).unwrap()
            }
            _ => {
                let caps = ctx.caps();
                let chunks = ChunkPlan::new(p, chunk_budget.unwrap_or(caps.max_binding), &caps).unwrap();
                enc.clear_buffer(&dkv, 0, None);
                super::unfused::record(
                    ctx,
                    enc,
                    (p, &chunks),
                    &io,
                    &dev.params,
                    [&dkv, &dq],
                    sizes.dv_off,
                )
                .unwrap()
            }
        }
    });
    let kv = sizes.kv_rows;
    [
        read(ctx, &dq, 0, sizes.rows * p.head_dim),
        read(ctx, &dkv, 0, kv * p.head_dim),
        read(ctx, &dkv, sizes.dv_off, kv * p.head_dim_v),
    ]
}

/// `bwd_dkv` and `bwd_dq` (the device's fused form) and the unfused recorder's chunks (whole
/// heads, and rows split in chunks of 16 with one head per chunk), each from the reference's
/// statistics, against the reference's gradients by FlashAttention's rule.
#[test]
fn gradient_stages_match_reference_gradients() {
    let Some(ctx) = ctx() else { return };
    for (shape, masked) in [(MASKED, true), (PLAIN, false)] {
        let st = Staged::new(shape, masked);
        let (r64, r32) = st.reference();
        let lse: Vec<f32> = r64.lse.iter().map(|&x| x as f32).collect();
        let dev = Device::new(&ctx, &st, &lse, &st.dsum(&r64));
        let row_chunks = f32_bytes(16 * dev.p.seq_kv);
        for (label, path, budget) in [
            ("fused", Path::Fused, None),
            ("unfused", Path::Unfused, None),
            ("unfused, row chunks", Path::Unfused, Some(row_chunks)),
        ] {
            let [dq, dk, dv] = gradients(&ctx, &dev, path, budget);
            for (name, got, want, plain) in [
                ("dq", dq, &r64.dq, &r32.dq),
                ("dk", dk, &r64.dk, &r32.dk),
                ("dv", dv, &r64.dv, &r32.dv),
            ] {
                assert_rule(
                    flash_rule(got, want.iter().copied(), plain.iter().copied()),
                    &format!("{shape:?} {label} {name}"),
                );
            }
        }
    }
}

/// `bwd_dbias`: d(bias) summed over the bias's broadcast batch, from the statistics.
#[test]
fn dbias_stage_matches_reference() {
    let Some(ctx) = ctx() else { return };
    let st = Staged::new(MASKED, true);
    let (r64, r32) = st.reference();
    let lse: Vec<f32> = r64.lse.iter().map(|&x| x as f32).collect();
    let dev = Device::new(&ctx, &st, &lse, &st.dsum(&r64));
    let n = dev.p.bias.unwrap().len();
    let mut buf = None;
    submit(&ctx, |enc| {
        buf = Some(record_dbias(&ctx, enc, &dev.p, n, (&dev.io(), &dev.params)).unwrap());
    });
    let got = read(&ctx, buf.as_ref().unwrap(), 0, n);
    let (want, plain) = (r64.dbias.unwrap(), r32.dbias.unwrap());
    assert_rule(
        flash_rule(got, want.iter().copied(), plain.iter().copied()),
        "dbias",
    );
}
