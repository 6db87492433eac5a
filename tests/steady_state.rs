//! A call repeated with the same buffers and shapes creates nothing on the GPU after its first
//! times: its parameter buffers, constant inputs (key lengths), scratch and bind groups come
//! from the context's cache, counted by wgpu's own counters of buffers, bind groups and
//! pipelines. And the cache is never wrong: two different calls in one encoder each read their
//! own values, a dropped and reallocated buffer is never served from a stale binding, and the
//! bytes the cache keeps alive stay within its bound.

mod common;

use common::*;
use ndarray::Array4;
use wgpu_attention::wgpu::{self, util::DeviceExt};
use wgpu_attention::{reference, CacheLimits, Causal, Context, Options, Sdpa, Storage, Tensor};

/// wgpu's live buffers, bind groups and compute pipelines on `ctx`'s device.
fn counts(ctx: &Context) -> [isize; 3] {
    let c = ctx.device().get_internal_counters();
    [
        c.hal.buffers.read(),
        c.hal.bind_groups.read(),
        c.hal.compute_pipelines.read(),
    ]
}

fn gpu(ctx: &Context, data: &[f32]) -> wgpu::Buffer {
    ctx.device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("steady state"),
            contents: bytemuck::cast_slice(data),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        })
}

fn out_buffer(ctx: &Context, elems: usize) -> wgpu::Buffer {
    gpu(ctx, &vec![0.0; elems])
}

/// q `[B, Hq, L, E]`, k and v `[B, Hkv, S, E]` on the host and in GPU buffers.
struct Inputs {
    q: Array4<f32>,
    k: Array4<f32>,
    v: Array4<f32>,
    bufs: [wgpu::Buffer; 3],
}

impl Inputs {
    fn new(ctx: &Context, l: usize, seed: u64) -> Inputs {
        let mut r = rng(seed);
        let q: Array4<f32> = rand_array(&mut r, (2, 8, l, 32));
        let k: Array4<f32> = rand_array(&mut r, (2, 2, 90, 32));
        let v: Array4<f32> = rand_array(&mut r, (2, 2, 90, 32));
        let bufs = [&q, &k, &v].map(|x| gpu(ctx, x.as_slice().unwrap()));
        Inputs { q, k, v, bufs }
    }

    fn call<'a>(&'a self, out: &'a wgpu::Buffer, lse: &'a wgpu::Buffer, lens: &'a [usize]) -> Sdpa<'a> {
        let t = |i: usize, x: &Array4<f32>| Tensor::from_buffer(&self.bufs[i], Storage::F32, x.shape());
        let l = self.q.dim().2;
        Sdpa::new(t(0, &self.q), t(1, &self.k), t(2, &self.v))
            .causal(Causal::BottomRight)
            .kv_lens(lens)
            .output_into(Tensor::from_buffer(out, Storage::F32, &[2, 8, l, 32]))
            .lse_into(Tensor::from_buffer(lse, Storage::F32, &[2, 8, l]))
    }

    fn check(&self, ctx: &Context, out: &wgpu::Buffer, lens: &[usize], label: &str) {
        let opts = Options {
            causal: Causal::BottomRight,
            kv_lens: Some(lens.to_vec()),
            ..Options::default()
        };
        let want = reference::sdpa(self.q.view(), self.k.view(), self.v.view(), &opts).unwrap();
        let got = pollster::block_on(ctx.read_f32(out, 0, out.size())).unwrap();
        assert_report(
            wgpu_attention::check::compare(got.iter().copied(), want.out.iter().copied(), TOL),
            label,
        );
    }
}

/// Decode (L = 1) and a prefill chunk (L = 16) with the outputs in the caller's buffers, and
/// `record_matmul`: the first calls create what they need, then 10 identical calls recorded
/// into one unsubmitted encoder create no buffer, bind group or pipeline; their results are
/// right once submitted.
#[test]
fn repeated_calls_create_no_gpu_objects() {
    let Some(_) = ctx() else { return };
    let ctx = &Context::new_blocking().unwrap();
    let before_any = counts(ctx);
    for l in [1, 16] {
        let x = Inputs::new(ctx, l, l as u64);
        let (out, lse) = (out_buffer(ctx, 2 * 8 * l * 32), out_buffer(ctx, 2 * 8 * l));
        let lens = [70, 90];
        for _ in 0..3 {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            x.call(&out, &lse, &lens).record(ctx, &mut enc).unwrap();
            ctx.queue().submit([enc.finish()]);
        }
        let warm = counts(ctx);
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        for _ in 0..10 {
            x.call(&out, &lse, &lens).record(ctx, &mut enc).unwrap();
        }
        assert_eq!(
            counts(ctx),
            warm,
            "L = {l}: [buffers, bind groups, pipelines] grew over 10 identical calls"
        );
        ctx.queue().submit([enc.finish()]);
        x.check(ctx, &out, &lens, &format!("L = {l}"));
    }
    assert!(
        counts(ctx)[0] > before_any[0],
        "wgpu's counters are off: the test would not see an allocation"
    );
    // record_matmul into the caller's buffer.
    let (a, b, c) = (
        gpu(ctx, &[0.5; 6 * 8]),
        gpu(ctx, &[0.25; 8 * 5]),
        out_buffer(ctx, 6 * 5),
    );
    let mm = |enc: &mut wgpu::CommandEncoder| {
        wgpu_attention::record_matmul(
            ctx,
            enc,
            Tensor::from_buffer(&a, Storage::F32, &[1, 6, 8]),
            Tensor::from_buffer(&b, Storage::F32, &[1, 8, 5]),
            Tensor::from_buffer(&c, Storage::F32, &[1, 6, 5]),
            false,
            1.0,
        )
        .unwrap()
    };
    for _ in 0..3 {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        mm(&mut enc);
        ctx.queue().submit([enc.finish()]);
    }
    let warm = counts(ctx);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    for _ in 0..10 {
        mm(&mut enc);
    }
    assert_eq!(
        counts(ctx),
        warm,
        "record_matmul: [buffers, bind groups, pipelines] grew"
    );
    ctx.queue().submit([enc.finish()]);
    let got = pollster::block_on(ctx.read_f32(&c, 0, c.size())).unwrap();
    assert!(got.iter().all(|&x| (x - 1.0).abs() < 1e-6), "{got:?}");
}

/// Two calls that differ only in their key lengths, recorded one after the other into one
/// encoder (each also cached from earlier calls): each reads its own lengths
/// (`queue.write_buffer` lands at submit, before every command of the encoder, so one reused
/// parameter buffer would give both the last call's).
#[test]
fn two_calls_in_one_encoder_keep_their_own_values() {
    let Some(ctx) = ctx() else { return };
    let x = Inputs::new(ctx, 3, 5);
    let outs = [0, 1].map(|_| (out_buffer(ctx, 2 * 8 * 3 * 32), out_buffer(ctx, 2 * 8 * 3)));
    let lens = [[40, 90], [90, 13]];
    for round in 0..3 {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        for ((out, lse), lens) in outs.iter().zip(&lens) {
            x.call(out, lse, lens).record(ctx, &mut enc).unwrap();
        }
        ctx.queue().submit([enc.finish()]);
        for ((out, _), lens) in outs.iter().zip(&lens) {
            x.check(ctx, out, lens, &format!("round {round}, lens {lens:?}"));
        }
    }
}

/// A buffer dropped and a new one allocated (the same size, other contents) is read as the
/// new one: the cache's bind groups hold the buffers they bind, so the new buffer is a new
/// key; and the bytes the cache keeps alive stay within its bound while a caller allocates new
/// output buffers in a loop; `release_cached` frees them.
#[test]
fn cache_is_never_stale_and_stays_bounded() {
    let Some(_) = ctx() else { return };
    let ctx = &Context::new_blocking().unwrap();
    let lens = [90, 90];
    for seed in 0..3 {
        let x = Inputs::new(ctx, 2, 100 + seed);
        let (out, lse) = (out_buffer(ctx, 2 * 8 * 2 * 32), out_buffer(ctx, 2 * 8 * 2));
        for _ in 0..2 {
            x.call(&out, &lse, &lens).run_blocking(ctx).unwrap();
        }
        x.check(ctx, &out, &lens, &format!("inputs {seed}"));
    }
    let limit = 1 << 20;
    ctx.set_cache_limits(CacheLimits {
        entries: 64,
        bytes: limit,
    });
    let x = Inputs::new(ctx, 1, 7);
    for i in 0..24 {
        // 256 KiB outputs, each used twice (so that the cache keeps its bind groups).
        let (out, lse) = (out_buffer(ctx, 64 << 10), out_buffer(ctx, 2 * 8));
        let o = Tensor::from_buffer(&out, Storage::F32, &[2, 8, 1, 32]);
        for _ in 0..2 {
            x.call(&out, &lse, &lens)
                .output_into(o.clone())
                .run_blocking(ctx)
                .unwrap();
        }
        let held = ctx.cache_stats().bytes_held;
        assert!(
            held <= limit,
            "call {i}: the cache holds {held} bytes, over its {limit}"
        );
        assert!(ctx.cache_stats().bind_groups <= 64);
    }
    assert!(
        ctx.cache_stats().bytes_held > 0,
        "nothing was cached: the bound was not tested"
    );
    ctx.release_cached();
    let s = ctx.cache_stats();
    assert_eq!((s.bind_groups, s.buffers, s.bytes_held), (0, 0, 0));
}

/// `PagedAttention` (a ragged batch: a chunk of 5 beside two decode queries) with its output
/// and logsumexp in the caller's buffers, at offsets: the same result as `run`, and repeated
/// calls create nothing.
#[test]
fn paged_calls_into_the_callers_buffers() {
    let Some(_) = ctx() else { return };
    let ctx = &Context::new_blocking().unwrap();
    use wgpu_attention::{PagedAttention, PagedLayout, Pages};
    let mut r = rng(3);
    let (hq, hkv, e, bs) = (4, 2, 16, 4);
    let k: ndarray::Array4<f32> = rand_array(&mut r, (12, bs, hkv, e));
    let v: ndarray::Array4<f32> = rand_array(&mut r, (12, bs, hkv, e));
    let q: ndarray::Array3<f32> = rand_array(&mut r, (7, hq, e));
    let table = [0, 1, 2, 3, 4, 5, 6, -1, 8, 9, 10, -1];
    let (q_lens, seq_lens) = ([5, 1, 1], [13, 9, 11]);
    let bufs = [
        k.as_slice().unwrap(),
        v.as_slice().unwrap(),
        q.as_slice().unwrap(),
    ]
    .map(|x| gpu(ctx, x));
    let (out, lse) = (out_buffer(ctx, 64 + 7 * hq * e), out_buffer(ctx, 128 + 7 * hq));
    let call = |into: bool| {
        let pages = Pages::new(
            Tensor::from_buffer(&bufs[0], Storage::F32, k.shape()),
            Tensor::from_buffer(&bufs[1], Storage::F32, v.shape()),
            PagedLayout::TokenMajor,
        );
        let c = PagedAttention::new(
            Tensor::from_buffer(&bufs[2], Storage::F32, q.shape()),
            &q_lens,
            pages,
            &table,
            &seq_lens,
        )
        .causal(Causal::BottomRight);
        match into {
            true => c
                .output_into(Tensor::from_buffer(&out, Storage::F32, &[7, hq, e]).at_offset(256))
                .lse_into(Tensor::from_buffer(&lse, Storage::F32, &[7, hq]).at_offset(512)),
            false => c,
        }
    };
    let want = call(false).run_blocking(ctx).unwrap();
    for _ in 0..3 {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        call(true).record(ctx, &mut enc).unwrap();
        ctx.queue().submit([enc.finish()]);
    }
    let warm = counts(ctx);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    for _ in 0..10 {
        call(true).record(ctx, &mut enc).unwrap();
    }
    assert_eq!(
        counts(ctx),
        warm,
        "PagedAttention: [buffers, bind groups, pipelines] grew"
    );
    ctx.queue().submit([enc.finish()]);
    let got = pollster::block_on(ctx.read_f32(&out, 256, (7 * hq * e * 4) as u64)).unwrap();
    let got_lse = pollster::block_on(ctx.read_f32(&lse, 512, (7 * hq * 4) as u64)).unwrap();
    for (a, b) in got
        .iter()
        .zip(want.output.iter())
        .chain(got_lse.iter().zip(want.lse.iter()))
    {
        assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
    }
    // An output that is host data, of another shape, or over q: typed errors.
    let bad = call(false).output_into(Tensor::from_buffer(&bufs[2], Storage::F32, &[7, hq, e]));
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let r = bad.record(ctx, &mut enc).map(|_| ());
    assert!(
        matches!(&r, Err(wgpu_attention::Error::BadBuffer { tensor: "output", .. })),
        "{r:?}"
    );
    let r = call(false)
        .lse_into(Tensor::from_buffer(&lse, Storage::F32, &[7, hq + 1]))
        .record(ctx, &mut enc)
        .map(|_| ());
    assert!(
        matches!(
            &r,
            Err(wgpu_attention::Error::ShapeMismatch { tensor: "lse", .. })
        ),
        "{r:?}"
    );
}

/// The multi-head layer's decode step as a generation loop records it: the new token's query
/// in a GPU buffer, the cached key and value heads in GPU buffers (read in place), the output
/// into the caller's buffer. After the first calls, 10 identical steps in one encoder create
/// no buffer, bind group or pipeline, and give the reference's answer.
#[test]
fn layer_decode_step_creates_nothing() {
    let Some(_) = ctx() else { return };
    let ctx = &Context::new_blocking().unwrap();
    use wgpu_attention::check::compare;
    use wgpu_attention::reference::MhaInputs;
    use wgpu_attention::{MhaConfig, MhaWeights, MultiHeadAttention};
    let c = MhaConfig::new(32, 4).kv_heads(2);
    let w = MhaWeights::xavier_uniform(c, 5).unwrap();
    let layer = MultiHeadAttention::new(ctx, &w).unwrap();
    let mut r = rng(6);
    let (b, s, d) = (2, 37, c.head_dim());
    let x: ndarray::Array3<f32> = rand_array(&mut r, (b, 1, 32));
    let kh: Array4<f32> = rand_array(&mut r, (b, 2, s, d));
    let vh: Array4<f32> = rand_array(&mut r, (b, 2, s, d));
    let inputs = MhaInputs {
        key_heads: Some(kh.view()),
        value_heads: Some(vh.view()),
        ..MhaInputs::self_attention(x.view())
    };
    let want = reference::mha(&w, &inputs, &Options::default()).unwrap();
    let bufs = [
        x.as_slice().unwrap(),
        kh.as_slice().unwrap(),
        vh.as_slice().unwrap(),
    ]
    .map(|a| gpu(ctx, a));
    let out = out_buffer(ctx, 64 + b * 32);
    let step = |enc: &mut wgpu::CommandEncoder| {
        layer
            .forward(Tensor::from_buffer(&bufs[0], Storage::F32, &[b, 1, 32]))
            .key_heads(Tensor::from_buffer(&bufs[1], Storage::F32, &[b, 2, s, d]))
            .value_heads(Tensor::from_buffer(&bufs[2], Storage::F32, &[b, 2, s, d]))
            .output_into(Tensor::from_buffer(&out, Storage::F32, &[b, 1, 32]).at_offset(256))
            .record(ctx, enc)
            .unwrap();
    };
    for _ in 0..3 {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        step(&mut enc);
        ctx.queue().submit([enc.finish()]);
    }
    let warm = counts(ctx);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    for _ in 0..10 {
        step(&mut enc);
    }
    assert_eq!(
        counts(ctx),
        warm,
        "the layer's decode step: [buffers, bind groups, pipelines] grew"
    );
    ctx.queue().submit([enc.finish()]);
    let got = pollster::block_on(ctx.read_f32(&out, 256, (b * 32 * 4) as u64)).unwrap();
    assert_report(
        compare(got.iter().copied(), want.out.iter().copied(), TOL),
        "the layer's decode step",
    );
}

/// A `KvCache` generation loop's token steps, the new K/V, q and the outputs in the caller's
/// buffers: what changes from step to step (positions, slots, the block table, key lengths)
/// is made once per step and shared by its layers, so after warm-up a step's new buffers do
/// not grow with its layers; what does is the three bind groups per layer that pair the
/// layer's pages with the step's values.
#[test]
fn kv_cache_step_objects_per_layer() {
    let Some(_) = ctx() else { return };
    let ctx = &Context::new_blocking().unwrap();
    use wgpu_attention::{KvCache, KvCacheConfig};
    let (layers, hkv, e, nseq) = (16, 2, 16, 3);
    let mut cache = KvCache::new(
        ctx,
        KvCacheConfig {
            layers,
            kv_heads: hkv,
            head_dim: e,
            head_dim_v: e,
            block_size: 4,
            num_blocks: 64,
            storage: Storage::F32,
            v_storage: None,
            rope: Some(wgpu_attention::Rope::default()),
        },
    )
    .unwrap();
    let seqs: Vec<_> = (0..nseq).map(|_| cache.add_sequence()).collect();
    let kv = gpu(ctx, &vec![0.5; nseq * hkv * e]);
    let q = gpu(ctx, &vec![0.25; nseq * 4 * e]);
    let (out, lse) = (out_buffer(ctx, nseq * 4 * e), out_buffer(ctx, nseq * 4));
    let mut step_counts = Vec::new();
    for _ in 0..6 {
        let before = counts(ctx);
        let step = cache
            .reserve(&seqs.iter().map(|&s| (s, 1)).collect::<Vec<_>>())
            .unwrap();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let t = Tensor::from_buffer(&kv, Storage::F32, &[nseq, hkv, e]);
        for l in 0..layers {
            cache.append(ctx, &mut enc, &step, l, &t, &t).unwrap();
            cache
                .attention(&step, l, Tensor::from_buffer(&q, Storage::F32, &[nseq, 4, 1, e]))
                .unwrap()
                .output_into(Tensor::from_buffer(&out, Storage::F32, &[nseq, 4, 1, e]))
                .lse_into(Tensor::from_buffer(&lse, Storage::F32, &[nseq, 4, 1]))
                .record(ctx, &mut enc)
                .unwrap();
        }
        let after = counts(ctx);
        ctx.queue().submit([enc.finish()]);
        step_counts.push([after[0] - before[0], after[1] - before[1], after[2] - before[2]]);
    }
    eprintln!("new [buffers, bind groups, pipelines] per step: {step_counts:?}");
    let last = step_counts[5];
    assert!(
        last[0] < layers as isize,
        "buffers made per step grow with the layers: {step_counts:?}"
    );
    assert!(
        last[1] <= 3 * layers as isize,
        "more than three bind groups per layer: {step_counts:?}"
    );
    assert_eq!(last[2], 0, "pipelines made in steady state: {step_counts:?}");
}
