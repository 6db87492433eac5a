//! The paged KV cache: appends (K rotated by RoPE as it is written), attention through its
//! block tables against the f64 reference on contiguous keys kept on the host, forks with
//! copy-on-write, the free list over many rounds, and typed errors for misuse.

mod common;

use common::*;
use ndarray::{Array3, Array4};
use rand::rngs::StdRng;
use wgpu_attention::check::Tolerance;
use wgpu_attention::{
    reference, Causal, Context, Error, KvCache, KvCacheConfig, Options, Rope, RopeStyle, SeqId, Step,
    Storage, Tensor,
};

const HKV: usize = 2;
const HQ: usize = 4;
const E: usize = 16;
const EV: usize = 8;

/// The host's copy of each sequence's keys and values (rotated as the cache holds them).
#[derive(Clone, Default)]
struct Host {
    k: Vec<Vec<f32>>, // per token: [Hkv * E]
    v: Vec<Vec<f32>>,
}

struct Model {
    cache: KvCache,
    host: std::collections::BTreeMap<SeqId, Host>,
    rope: Option<Rope>,
    storage: Storage,
    rng: StdRng,
}

impl Model {
    fn new(
        ctx: &Context,
        block_size: usize,
        num_blocks: usize,
        storage: Storage,
        rope: Option<Rope>,
    ) -> Model {
        let cache = KvCache::new(
            ctx,
            KvCacheConfig {
                layers: 2,
                kv_heads: HKV,
                head_dim: E,
                head_dim_v: EV,
                block_size,
                num_blocks,
                storage,
                v_storage: None,
                rope,
            },
        )
        .unwrap();
        Model {
            cache,
            host: Default::default(),
            rope,
            storage,
            rng: rng(11),
        }
    }

    /// One step: append `batch`'s new tokens (random K/V, both layers: layer 1's are
    /// negated) and check the attention of random queries on every sequence of equal count
    /// (causal by default, so a prefill's queries see their own prefix; nothing asks for it)
    /// against the reference.
    fn step(&mut self, ctx: &Context, batch: &[(SeqId, usize)], label: &str) {
        let step = self.append(ctx, batch);
        // Mixed counts: KvCache::attention refuses them, ragged_attention takes them packed.
        let n = batch[0].1;
        if batch.iter().any(|&(_, m)| m != n) {
            self.check_ragged(ctx, &step, batch, label);
        } else {
            self.check_equal(ctx, &step, batch, label);
        }
    }

    /// Reserve and append `batch`'s new tokens (random K/V, both layers: layer 1's are
    /// negated), keeping the host copy: K rotated at the tokens' positions (layer 0's values).
    fn append(&mut self, ctx: &Context, batch: &[(SeqId, usize)]) -> Step {
        let st = self.storage;
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let step = self.cache.reserve(batch).unwrap();
        let t = step.tokens();
        let mut k: Array3<f32> = rand_array(&mut self.rng, (t, HKV, E));
        let mut v: Array3<f32> = rand_array(&mut self.rng, (t, HKV, EV));
        k.mapv_inplace(|x| st.round(x));
        v.mapv_inplace(|x| st.round(x));
        for layer in 0..2 {
            let sign = if layer == 0 { 1.0 } else { -1.0 };
            let (kl, vl) = (k.mapv(|x| sign * x), v.mapv(|x| sign * x));
            self.cache
                .append(
                    ctx,
                    &mut enc,
                    &step,
                    layer,
                    &Tensor::from(&kl).with_storage(st),
                    &Tensor::from(&vl).with_storage(st),
                )
                .unwrap();
        }
        ctx.queue().submit([enc.finish()]);
        // The host copy: K rotated at the tokens' positions (layer 0's values).
        let mut kr = k.clone();
        if let Some(r) = &self.rope {
            r.apply(kr.view_mut(), step.positions()).unwrap();
        }
        let mut at = 0;
        for &(seq, n) in batch {
            let h = self.host.entry(seq).or_default();
            for i in at..at + n {
                h.k.push(kr.slice(ndarray::s![i, .., ..]).iter().copied().collect());
                h.v.push(v.slice(ndarray::s![i, .., ..]).iter().copied().collect());
            }
            at += n;
        }
        step
    }

    /// Mixed counts: KvCache::attention refuses them, ragged_attention takes them packed.
    fn check_ragged(&mut self, ctx: &Context, step: &Step, batch: &[(SeqId, usize)], label: &str) {
        let (st, t) = (self.storage, step.tokens());
        let q0 = Array4::<f32>::zeros((batch.len(), HQ, 1, E));
        let r = self.cache.attention(step, 0, Tensor::from(&q0)).map(|_| ());
        assert!(matches!(r, Err(Error::Paged { .. })), "{r:?}");
        let mut q: Array3<f32> = rand_array(&mut self.rng, (t, HQ, E));
        q.mapv_inplace(|x| st.round(x));
        let got = self
            .cache
            .ragged_attention(step, 0, Tensor::from(&q).with_storage(st))
            .unwrap()
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        let mut at = 0;
        for &(seq, n) in batch {
            let qs = q
                .slice(ndarray::s![at..at + n, .., ..])
                .permuted_axes([1, 0, 2])
                .insert_axis(ndarray::Axis(0))
                .to_owned();
            let want = self.reference(seq, qs);
            let gs = got
                .output
                .slice(ndarray::s![at..at + n, .., ..])
                .permuted_axes([1, 0, 2])
                .to_owned();
            let tol = if st == Storage::F32 {
                TOL
            } else {
                Tolerance::for_storage(st)
            };
            assert_report(
                wgpu_attention::check::compare(gs.iter().copied(), want.out.iter().copied(), tol),
                &format!("{label} ragged {seq:?}"),
            );
            at += n;
        }
    }

    /// Equal counts: one attention call of the batch, checked, and layer 1 read apart.
    fn check_equal(&mut self, ctx: &Context, step: &Step, batch: &[(SeqId, usize)], label: &str) {
        let (st, n) = (self.storage, batch[0].1);
        let b = batch.len();
        let mut q: Array4<f32> = rand_array(&mut self.rng, (b, HQ, n, E));
        q.mapv_inplace(|x| st.round(x));
        let lens: Vec<usize> = batch.iter().map(|&(s, _)| self.host[&s].k.len()).collect();
        let s_max = *lens.iter().max().unwrap();
        let mut kc = Array4::<f32>::zeros((b, HKV, s_max, E));
        let mut vc = Array4::<f32>::zeros((b, HKV, s_max, EV));
        for (bi, &(seq, _)) in batch.iter().enumerate() {
            for (j, (kr, vr)) in self.host[&seq].k.iter().zip(&self.host[&seq].v).enumerate() {
                for h in 0..HKV {
                    for d in 0..E {
                        kc[[bi, h, j, d]] = kr[h * E + d];
                    }
                    for d in 0..EV {
                        vc[[bi, h, j, d]] = vr[h * EV + d];
                    }
                }
            }
        }
        let mut qr = q.clone();
        if let Some(r) = &self.rope {
            for (bi, &len) in lens.iter().enumerate() {
                let mut rows = qr
                    .slice(ndarray::s![bi, .., .., ..])
                    .permuted_axes([1, 0, 2])
                    .to_owned();
                let pos: Vec<usize> = (0..n).map(|i| len - n + i).collect();
                r.apply(rows.view_mut(), &pos).unwrap();
                qr.slice_mut(ndarray::s![bi, .., .., ..])
                    .assign(&rows.permuted_axes([1, 0, 2]));
            }
        }
        let opts = Options {
            causal: Causal::BottomRight,
            kv_lens: Some(lens.clone()),
            ..Options::default()
        };
        let want = reference::sdpa(qr.view(), kc.view(), vc.view(), &opts).unwrap();
        let got = self
            .cache
            .attention(step, 0, Tensor::from(&q).with_storage(st))
            .unwrap()
            .return_lse()
            .run_blocking(ctx)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        let tol = if st == Storage::F32 {
            TOL
        } else {
            Tolerance::for_storage(st)
        };
        assert_report(
            wgpu_attention::check::compare(got.output.iter().copied(), want.out.iter().copied(), tol),
            &format!("{label} output"),
        );
        // Layer 1 holds the negated values: its output is the negation when K is negated too?
        // No: negated K changes the logits; check that it runs and differs from layer 0.
        let got1 = self
            .cache
            .attention(step, 1, Tensor::from(&q).with_storage(st))
            .unwrap()
            .run_blocking(ctx)
            .unwrap();
        assert!(
            got1.output
                .iter()
                .zip(got.output.iter())
                .any(|(a, b)| (a - b).abs() > 1e-3),
            "{label}: layer 1 reads layer 0's pages"
        );
    }
}

impl Model {
    /// The reference attention of one sequence's queries `[1, Hq, n, E]` (un-rotated) over
    /// its host keys, causal by position.
    fn reference(&self, seq: SeqId, q: Array4<f32>) -> reference::Output {
        let host = &self.host[&seq];
        let (len, n) = (host.k.len(), q.dim().2);
        let mut kc = Array4::<f32>::zeros((1, HKV, len, E));
        let mut vc = Array4::<f32>::zeros((1, HKV, len, EV));
        for (j, (kr, vr)) in host.k.iter().zip(&host.v).enumerate() {
            for h in 0..HKV {
                for d in 0..E {
                    kc[[0, h, j, d]] = kr[h * E + d];
                }
                for d in 0..EV {
                    vc[[0, h, j, d]] = vr[h * EV + d];
                }
            }
        }
        let mut qr = q;
        if let Some(r) = &self.rope {
            let mut rows = qr
                .slice(ndarray::s![0, .., .., ..])
                .permuted_axes([1, 0, 2])
                .to_owned();
            let pos: Vec<usize> = (0..n).map(|i| len - n + i).collect();
            r.apply(rows.view_mut(), &pos).unwrap();
            qr.slice_mut(ndarray::s![0, .., .., ..])
                .assign(&rows.permuted_axes([1, 0, 2]));
        }
        let opts = Options {
            causal: Causal::BottomRight,
            ..Options::default()
        };
        reference::sdpa(qr.view(), kc.view(), vc.view(), &opts).unwrap()
    }
}

#[test]
fn prefill_in_chunks_then_decode_batched() {
    let Some(ctx) = ctx() else { return };
    let ropes = [
        None,
        Some(Rope {
            style: RopeStyle::HalfSplit,
            theta: 1e4,
            dim: None,
        }),
        Some(Rope {
            style: RopeStyle::Interleaved,
            theta: 5e5,
            dim: Some(8),
        }),
    ];
    for (st, rope, block_size) in [
        (Storage::F32, ropes[0], 16),
        (Storage::F32, ropes[1], 1),
        (Storage::F32, ropes[2], 5),
        (Storage::F16, ropes[1], 16),
        (Storage::Bf16, ropes[2], 4),
    ] {
        let label = format!("{st:?} {rope:?} block {block_size}");
        let mut m = Model::new(ctx, block_size, 80, st, rope);
        let seqs: Vec<SeqId> = (0..3).map(|_| m.cache.add_sequence()).collect();
        // Prompts of 7, 19 and 33 tokens in chunks of up to 8 (mixed counts append only).
        m.step(ctx, &[(seqs[0], 7), (seqs[1], 8), (seqs[2], 8)], &label);
        m.step(ctx, &[(seqs[1], 8), (seqs[2], 8)], &label);
        m.step(ctx, &[(seqs[1], 3), (seqs[2], 8)], &label);
        m.step(ctx, &[(seqs[2], 9)], &label);
        for _ in 0..5 {
            m.step(ctx, &[(seqs[0], 1), (seqs[1], 1), (seqs[2], 1)], &label);
        }
    }
}

#[test]
fn forks_share_blocks_and_copy_on_write() {
    let Some(ctx) = ctx() else { return };
    let rope = Some(Rope::default());
    let mut m = Model::new(ctx, 8, 32, Storage::F32, rope);
    let a = m.cache.add_sequence();
    m.step(ctx, &[(a, 12)], "prompt"); // one full block and a partial one
    let b = m.cache.fork(a).unwrap();
    m.host.insert(b, m.host[&a].clone());
    assert_eq!(m.cache.blocks(a).unwrap(), m.cache.blocks(b).unwrap());
    let free = m.cache.free_blocks();
    // Both append into the shared partial block: the first copies it.
    m.step(ctx, &[(a, 1), (b, 1)], "fork step 1");
    let (ba, bb) = (
        m.cache.blocks(a).unwrap().to_vec(),
        m.cache.blocks(b).unwrap().to_vec(),
    );
    assert_eq!(ba[0], bb[0], "the full block stays shared");
    assert_ne!(ba[1], bb[1], "the partial block is copied on write");
    assert_eq!(m.cache.free_blocks(), free - 1);
    for i in 0..6 {
        m.step(ctx, &[(b, 1), (a, 1)], &format!("fork step {}", i + 2));
    }
    // A fork of a fork, then the parents freed: the child still reads the shared prefix.
    let c = m.cache.fork(b).unwrap();
    m.host.insert(c, m.host[&b].clone());
    m.cache.free_sequence(a).unwrap();
    m.cache.free_sequence(b).unwrap();
    m.host.remove(&a);
    m.host.remove(&b);
    m.step(ctx, &[(c, 1)], "grandchild");
    m.cache.free_sequence(c).unwrap();
    assert_eq!(m.cache.free_blocks(), 32, "every block back on the free list");
}

/// Speculative decoding's rollback: a sequence truncated (into a block its fork shares, and
/// past whole blocks) writes its next tokens at the new length, copying the shared partial
/// block first; the fork still reads its own keys; blocks past the length come back; a length
/// above the sequence's is refused.
#[test]
fn truncate_rolls_back_rejected_tokens() {
    let Some(ctx) = ctx() else { return };
    let mut m = Model::new(ctx, 4, 32, Storage::F32, Some(Rope::default()));
    let a = m.cache.add_sequence();
    m.step(ctx, &[(a, 10)], "prompt"); // blocks of 4, 4, 2
    let b = m.cache.fork(a).unwrap();
    m.host.insert(b, m.host[&a].clone());
    let free = m.cache.free_blocks();
    // Five draft tokens, three rejected.
    m.step(ctx, &[(a, 5)], "draft");
    assert_eq!(m.cache.len(a).unwrap(), 15);
    m.cache.truncate(a, 12).unwrap();
    let h = m.host.get_mut(&a).unwrap();
    h.k.truncate(12);
    h.v.truncate(12);
    assert_eq!(m.cache.len(a).unwrap(), 12);
    assert_eq!(m.cache.blocks(a).unwrap().len(), 3);
    m.step(ctx, &[(a, 2), (b, 1)], "after the rollback");
    // Back into the block the fork shares: 5 keys kept, the next written after a copy.
    m.cache.truncate(a, 5).unwrap();
    let h = m.host.get_mut(&a).unwrap();
    h.k.truncate(5);
    h.v.truncate(5);
    assert_eq!(m.cache.blocks(a).unwrap()[1], m.cache.blocks(b).unwrap()[1]);
    m.step(ctx, &[(a, 1), (b, 1)], "into the shared block");
    assert_ne!(m.cache.blocks(a).unwrap()[1], m.cache.blocks(b).unwrap()[1]);
    let err = m.cache.truncate(a, 7).map(|_| ());
    assert!(
        matches!(&err, Err(wgpu_attention::Error::Paged { reason }) if reason.contains("cannot be truncated")),
        "{err:?}"
    );
    m.cache.truncate(a, 0).unwrap();
    m.host.insert(a, Default::default());
    m.cache.free_sequence(b).unwrap();
    m.host.remove(&b);
    assert_eq!(
        m.cache.free_blocks(),
        32,
        "every block back ({free} free after the fork)"
    );
    m.step(ctx, &[(a, 3)], "a truncated sequence starts over");
}

#[test]
fn free_list_stays_whole_over_many_rounds() {
    let Some(ctx) = ctx() else { return };
    let mut cache = KvCache::new(
        ctx,
        KvCacheConfig {
            layers: 1,
            kv_heads: 1,
            head_dim: 4,
            head_dim_v: 4,
            block_size: 4,
            num_blocks: 12,
            storage: Storage::F16,
            v_storage: None,
            rope: Some(Rope::default()),
        },
    )
    .unwrap();
    let mut r = rng(5);
    for round in 0..200 {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        let a = cache.add_sequence();
        let n = 1 + round % 9;
        let step = cache.reserve(&[(a, n)]).unwrap();
        let kv: Array3<f32> = rand_array(&mut r, (n, 1, 4));
        cache
            .append(ctx, &mut enc, &step, 0, &Tensor::from(&kv), &Tensor::from(&kv))
            .unwrap();
        let b = cache.fork(a).unwrap();
        let step = cache.reserve(&[(b, 2), (a, 1)]).unwrap();
        let kv: Array3<f32> = rand_array(&mut r, (3, 1, 4));
        cache
            .append(ctx, &mut enc, &step, 0, &Tensor::from(&kv), &Tensor::from(&kv))
            .unwrap();
        ctx.queue().submit([enc.finish()]);
        cache.free_sequence(a).unwrap();
        cache.free_sequence(b).unwrap();
        assert_eq!(cache.free_blocks(), 12, "round {round}");
        assert!(cache.is_empty());
    }
    // Too few blocks: an error, and nothing taken.
    let a = cache.add_sequence();
    let r = cache.reserve(&[(a, 49)]);
    assert!(matches!(r, Err(Error::Paged { .. })), "{r:?}");
    assert_eq!((cache.free_blocks(), cache.len(a).unwrap()), (12, 0));
}

/// The small cache the misuse tests start from.
fn misuse_config() -> KvCacheConfig {
    KvCacheConfig {
        layers: 1,
        kv_heads: 1,
        head_dim: 4,
        head_dim_v: 4,
        block_size: 4,
        num_blocks: 8,
        storage: Storage::F32,
        v_storage: None,
        rope: None,
    }
}

/// `r` is an [`Error::Paged`] whose reason says `what`.
fn paged(r: Result<(), Error>, what: &str) {
    match r {
        Err(Error::Paged { reason }) => assert!(reason.contains(what), "{reason:?} should say {what:?}"),
        other => panic!("{what}: expected Error::Paged, got {other:?}"),
    }
}

/// A cache's configuration is checked when it is made: block size, head dims of half formats,
/// RoPE's dims.
#[test]
fn bad_configs_are_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let config = misuse_config();
    paged(
        KvCache::new(
            ctx,
            KvCacheConfig {
                block_size: 0,
                ..config
            },
        )
        .map(|_| ()),
        "positive",
    );
    paged(
        KvCache::new(
            ctx,
            KvCacheConfig {
                block_size: 3,
                head_dim: 5,
                head_dim_v: 5,
                storage: Storage::F16,
                v_storage: None,
                ..config
            },
        )
        .map(|_| ()),
        "odd number",
    );
    let r = KvCache::new(
        ctx,
        KvCacheConfig {
            rope: Some(Rope {
                dim: Some(6),
                ..Rope::default()
            }),
            ..config
        },
    );
    assert!(matches!(r, Err(Error::InvalidModifier { .. })), "{r:?}");
}

#[test]
fn misuse_is_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let config = misuse_config();
    let mut cache = KvCache::new(ctx, config).unwrap();
    let mut other = KvCache::new(ctx, config).unwrap();
    let a = cache.add_sequence();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    paged(cache.reserve(&[(a, 1), (a, 1)]).map(|_| ()), "twice");
    paged(cache.reserve(&[(a, 0)]).map(|_| ()), "at least one token");
    paged(cache.reserve(&[]).map(|_| ()), "at least one sequence");
    let step = cache.reserve(&[(a, 2)]).unwrap();
    let kv = Array3::<f32>::zeros((2, 1, 4));
    let (k, v) = (Tensor::from(&kv), Tensor::from(&kv));
    // Wrong shape; another cache's step; a stale step; an unknown layer; q of another count.
    let wrong = Array3::<f32>::zeros((3, 1, 4));
    let r = cache.append(ctx, &mut enc, &step, 0, &Tensor::from(&wrong), &v);
    assert!(matches!(r, Err(Error::ShapeMismatch { .. })), "{r:?}");
    paged(other.append(ctx, &mut enc, &step, 0, &k, &v), "another cache");
    paged(cache.append(ctx, &mut enc, &step, 1, &k, &v), "layer 1");
    let q = Array4::<f32>::zeros((1, 2, 3, 4));
    paged(
        cache.attention(&step, 0, Tensor::from(&q)).map(|_| ()),
        "[1, Hq, 2, 4]",
    );
    // Attention before the layer's append reads keys not yet written.
    let q = Array4::<f32>::zeros((1, 2, 2, 4));
    paged(
        cache.attention(&step, 0, Tensor::from(&q)).map(|_| ()),
        "not appended",
    );
    let q3 = Array3::<f32>::zeros((2, 2, 4));
    paged(
        cache.ragged_attention(&step, 0, Tensor::from(&q3)).map(|_| ()),
        "not appended",
    );
    cache.append(ctx, &mut enc, &step, 0, &k, &v).unwrap();
    // The same step appended twice would write its tokens' slots twice.
    paged(cache.append(ctx, &mut enc, &step, 0, &k, &v), "already appended");
    // q of another head dim than the cache's, and [B, n, Hq, E] for [B, Hq, n, E]: named as
    // q, with the shape expected (Hq as such).
    let q = Array4::<f32>::zeros((1, 2, 2, 8));
    paged(
        cache.attention(&step, 0, Tensor::from(&q)).map(|_| ()),
        "head dim 8 is not the cache's 4",
    );
    let q = Array4::<f32>::zeros((1, 2, 3, 4));
    paged(
        cache.attention(&step, 0, Tensor::from(&q)).map(|_| ()),
        "q must be [B, Hq, n, E] = [1, Hq, 2, 4]",
    );
    let q3 = Array3::<f32>::zeros((2, 2, 5));
    paged(
        cache.ragged_attention(&step, 0, Tensor::from(&q3)).map(|_| ()),
        "[T, Hq, E] = [2, Hq, 4]",
    );
    assert!(cache
        .attention(&step, 0, Tensor::from(&Array4::<f32>::zeros((1, 2, 2, 4))))
        .is_ok());
    let b = cache.fork(a).unwrap();
    paged(cache.append(ctx, &mut enc, &step, 0, &k, &v), "changed since");
    cache.free_sequence(b).unwrap();
    paged(cache.free_sequence(b), "not a sequence");
    paged(cache.fork(b).map(|_| ()), "not a sequence");
    let c = other.add_sequence();
    let _ = c;
    ctx.queue().submit([enc.finish()]);
}

/// A small cache of `layers` layers: Hkv 2, head dim `e`, blocks of 4 tokens.
fn small_cache(ctx: &Context, layers: usize, e: usize, rope: Option<Rope>) -> KvCache {
    KvCache::new(
        ctx,
        KvCacheConfig {
            layers,
            kv_heads: HKV,
            head_dim: e,
            head_dim_v: e,
            block_size: 4,
            num_blocks: 32,
            storage: Storage::F32,
            v_storage: None,
            rope,
        },
    )
    .unwrap()
}

/// A GPU buffer holding `data` (f32), readable by the kernels.
fn upload(ctx: &Context, data: &[f32]) -> wgpu_attention::wgpu::Buffer {
    use wgpu_attention::wgpu::{self, util::DeviceExt};
    ctx.device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("fused qkv"),
            contents: bytemuck::cast_slice(data),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        })
}

/// A fused QKV projection `[T, Hq + 2 Hkv, E]` in one buffer (what every serving stack's QKV
/// matmul writes): q, k and v read in place through strides at offsets that are not
/// 256-byte aligned (E = 12), appended and attended exactly as the same tensors given dense.
#[test]
fn fused_qkv_buffer_is_read_in_place() {
    let Some(ctx) = ctx() else { return };
    const E12: usize = 12;
    let row = (HQ + 2 * HKV) * E12;
    let rope = Some(Rope::default());
    let mut r = rng(48);
    let (mut dense, mut viewed) = (small_cache(ctx, 1, E12, rope), small_cache(ctx, 1, E12, rope));
    let seqs: Vec<(SeqId, SeqId)> = (0..3)
        .map(|_| (dense.add_sequence(), viewed.add_sequence()))
        .collect();
    // A ragged prefill (5, 1, 3 tokens), then a chunk of 2 for each (equal counts: Sdpa).
    for counts in [[5, 1, 3], [2, 2, 2]] {
        let batch = |second: bool| -> Vec<(SeqId, usize)> {
            seqs.iter()
                .zip(counts)
                .map(|(&(a, b), n)| (if second { b } else { a }, n))
                .collect()
        };
        let (sd, sv) = (
            dense.reserve(&batch(false)).unwrap(),
            viewed.reserve(&batch(true)).unwrap(),
        );
        let t = sd.tokens();
        let qkv: Array3<f32> = rand_array(&mut r, (t, HQ + 2 * HKV, E12));
        let buf = upload(ctx, qkv.as_slice().unwrap());
        let part = |h0: usize, h: usize| {
            Tensor::from_buffer(&buf, Storage::F32, &[t, h, E12])
                .at_offset((h0 * E12 * 4) as u64)
                .with_strides(&[row, E12, 1])
        };
        let owned = |h0: usize, h: usize| qkv.slice(ndarray::s![.., h0..h0 + h, ..]).to_owned();
        let (q, k, v) = (owned(0, HQ), owned(HQ, HKV), owned(HQ + HKV, HKV));
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        dense
            .append(ctx, &mut enc, &sd, 0, &Tensor::from(&k), &Tensor::from(&v))
            .unwrap();
        viewed
            .append(ctx, &mut enc, &sv, 0, &part(HQ, HKV), &part(HQ + HKV, HKV))
            .unwrap();
        ctx.queue().submit([enc.finish()]);
        let want = dense
            .ragged_attention(&sd, 0, Tensor::from(&q))
            .unwrap()
            .run_blocking(ctx)
            .unwrap();
        let got = viewed
            .ragged_attention(&sv, 0, part(0, HQ))
            .unwrap()
            .run_blocking(ctx)
            .unwrap();
        assert_report(
            wgpu_attention::check::compare(
                got.output.iter().copied(),
                want.output.iter().map(|&x| x as f64),
                TOL,
            ),
            &format!("{counts:?} ragged, q a view"),
        );
        if counts[0] == counts[1] {
            // [B, Hq, n, E] views of the same buffer through KvCache::attention.
            let n = counts[0];
            let q4 = Tensor::from_buffer(&buf, Storage::F32, &[3, HQ, n, E12]).with_strides(&[
                n * row,
                E12,
                row,
                1,
            ]);
            let got = viewed.attention(&sv, 0, q4).unwrap().run_blocking(ctx).unwrap();
            for b in 0..3 {
                for i in 0..n {
                    for h in 0..HQ {
                        for d in 0..E12 {
                            let (x, y) = (got.output[[b, h, i, d]], want.output[[b * n + i, h, d]]);
                            assert!(
                                (x - y).abs() <= 1e-5,
                                "attention, q a view: [{b}, {h}, {i}, {d}] {x} vs {y}"
                            );
                        }
                    }
                }
            }
            // Causal by default: the chunk's first query does not see the second's key.
            let none = viewed
                .attention(&sv, 0, part4(&buf, [3, HQ, n, E12], row))
                .unwrap()
                .causal(Causal::None)
                .run_blocking(ctx)
                .unwrap();
            assert!(
                none.output
                    .iter()
                    .zip(got.output.iter())
                    .any(|(a, b)| (a - b).abs() > 1e-3),
                "Causal::None gave the causal answer"
            );
        }
    }
}

/// Views of a fused QKV buffer whose strides are not `[T, H, E]`'s three, or whose E stride
/// is not 1, are refused naming the tensor.
#[test]
fn fused_qkv_strides_are_checked() {
    let Some(ctx) = ctx() else { return };
    const E12: usize = 12;
    let row = (HQ + 2 * HKV) * E12;
    let mut viewed = small_cache(ctx, 1, E12, Some(Rope::default()));
    let seq = viewed.add_sequence();
    let step = viewed.reserve(&[(seq, 1)]).unwrap();
    let buf = upload(ctx, &vec![0.5; row]);
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let bad4 = Tensor::from_buffer(&buf, Storage::F32, &[1, HKV, E12]).with_strides(&[row, row, E12, 1]);
    let good = Tensor::from_buffer(&buf, Storage::F32, &[1, HKV, E12]).with_strides(&[row, E12, 1]);
    let r = viewed.append(ctx, &mut enc, &step, 0, &bad4, &good);
    assert!(
        matches!(&r, Err(Error::BadBuffer { tensor: "k", reason }) if reason.contains("three strides")),
        "{r:?}"
    );
    let bad_e = Tensor::from_buffer(&buf, Storage::F32, &[1, HKV, E12]).with_strides(&[row, E12, 2]);
    let r = viewed.append(ctx, &mut enc, &step, 0, &good, &bad_e);
    assert!(matches!(&r, Err(Error::BadBuffer { tensor: "v", .. })), "{r:?}");
    viewed.append(ctx, &mut enc, &step, 0, &good, &good).unwrap();
    ctx.queue().submit([enc.finish()]);
    let q4 = Tensor::from_buffer(&buf, Storage::F32, &[1, HQ, E12]).with_strides(&[row, E12, 0, 1]);
    let r = viewed.ragged_attention(&step, 0, q4).unwrap().run_blocking(ctx);
    assert!(
        matches!(&r, Err(Error::BadBuffer { tensor: "q", reason }) if reason.contains("three strides")),
        "{r:?}"
    );
    let qcap = Tensor::from_buffer(&buf, Storage::F32, &[1, HQ, E12]).with_seq_capacity(4);
    let r = viewed.ragged_attention(&step, 0, qcap).unwrap().run_blocking(ctx);
    assert!(matches!(&r, Err(Error::BadBuffer { tensor: "q", .. })), "{r:?}");
    // The appends in flight end before the process does.
    ctx.wait_idle().unwrap();
}

/// `[B, Hq, n, E]` view of a fused QKV buffer's q part.
fn part4(buf: &wgpu_attention::wgpu::Buffer, [b, h, n, e]: [usize; 4], row: usize) -> Tensor<'_> {
    Tensor::from_buffer(buf, Storage::F32, &[b, h, n, e]).with_strides(&[n * row, e, row, 1])
}

/// Copy-on-write is recorded by each layer's append, in the encoder of its writes: layers
/// appended in encoders of their own, submitted at different times (layer 1 after layer
/// 0's attention has run), each read their forked block right.
#[test]
fn copy_on_write_lands_with_each_layers_append() {
    let Some(ctx) = ctx() else { return };
    let mut cache = small_cache(ctx, 2, E, None);
    let mut r = rng(7);
    let a = cache.add_sequence();
    // A 6-token prompt (a full block and a partial one), the same values in both layers.
    let prompt: Array3<f32> = rand_array(&mut r, (6, HKV, E));
    let step = cache.reserve(&[(a, 6)]).unwrap();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    for l in 0..2 {
        cache
            .append(
                ctx,
                &mut enc,
                &step,
                l,
                &Tensor::from(&prompt),
                &Tensor::from(&prompt),
            )
            .unwrap();
    }
    ctx.queue().submit([enc.finish()]);
    let b = cache.fork(a).unwrap();
    // The fork appends into the shared partial block: it gets a copy.
    let step = cache.reserve(&[(b, 1)]).unwrap();
    let new: Array3<f32> = rand_array(&mut r, (1, HKV, E));
    let q: Array4<f32> = rand_array(&mut r, (1, HQ, 1, E));
    let mut all = ndarray::concatenate(ndarray::Axis(0), &[prompt.view(), new.view()]).unwrap();
    all = all.permuted_axes([1, 0, 2]).as_standard_layout().to_owned(); // [Hkv, 7, E]
    let kv = all.insert_axis(ndarray::Axis(0));
    let want = reference::sdpa(q.view(), kv.view(), kv.view(), &Options::default()).unwrap();
    for l in 0..2 {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        cache
            .append(ctx, &mut enc, &step, l, &Tensor::from(&new), &Tensor::from(&new))
            .unwrap();
        ctx.queue().submit([enc.finish()]);
        let got = cache
            .attention(&step, l, Tensor::from(&q))
            .unwrap()
            .run_blocking(ctx)
            .unwrap();
        assert_report(
            wgpu_attention::check::compare(got.output.iter().copied(), want.out.iter().copied(), TOL),
            &format!("layer {l} after copy-on-write"),
        );
    }
    assert_ne!(cache.blocks(a).unwrap()[1], cache.blocks(b).unwrap()[1]);
}

/// A user score function that reads `q_pos(b, i)` (the query's position) gives a relative
/// bias the same meaning in training (L = S, `q_pos = i`) and in a KV cache's decode (one
/// query, `i = 0`, at the cache's length - 1); read as `i`, decode would differ.
#[test]
fn relative_bias_by_position_in_decode_matches_training() {
    let Some(ctx) = ctx() else { return };
    let n = 9; // the sequence; the last token is decoded
    let mut r = rng(9);
    let q: Array4<f32> = rand_array(&mut r, (1, HQ, n, E));
    let k: Array4<f32> = rand_array(&mut r, (1, HKV, n, E));
    let v: Array4<f32> = rand_array(&mut r, (1, HKV, n, E));
    let bias = |pos: &str| {
        wgpu_attention::UserMod::wgsl(&format!(
            "fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {{ return s - 0.3 * abs(f32(j) - f32({pos})); }}"
        ))
        .cpu_score(|s, [b, _, i, j], c| s - 0.3 * (j as f64 - c.q_pos(b, i) as f64).abs())
    };
    let train = wgpu_attention::Sdpa::new(&q, &k, &v)
        .causal(Causal::BottomRight)
        .user_mod(bias("q_pos(b, i)"))
        .run_blocking(ctx)
        .unwrap();
    // The reference reads the position through Captures::q_pos too.
    let opts = Options {
        causal: Causal::BottomRight,
        user_mod: Some(bias("q_pos(b, i)")),
        ..Options::default()
    };
    let want = reference::sdpa(q.view(), k.view(), v.view(), &opts).unwrap();
    assert_report(
        wgpu_attention::check::compare(train.output.iter().copied(), want.out.iter().copied(), TOL),
        "training",
    );
    let mut cache = small_cache(ctx, 1, E, None);
    let s = cache.add_sequence();
    let rows = |x: &Array4<f32>, t: std::ops::Range<usize>| {
        x.slice(ndarray::s![0, .., t, ..])
            .permuted_axes([1, 0, 2])
            .as_standard_layout()
            .to_owned()
    };
    for t in [0..n - 1, n - 1..n] {
        let step = cache.reserve(&[(s, t.len())]).unwrap();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        cache
            .append(
                ctx,
                &mut enc,
                &step,
                0,
                &Tensor::from(&rows(&k, t.clone())),
                &Tensor::from(&rows(&v, t.clone())),
            )
            .unwrap();
        ctx.queue().submit([enc.finish()]);
        if t.len() > 1 {
            continue;
        }
        let qd = q.slice(ndarray::s![.., .., n - 1..n, ..]).to_owned();
        for path in [wgpu_attention::Path::Fused, wgpu_attention::Path::Decode] {
            let got = cache
                .attention(&step, 0, Tensor::from(&qd))
                .unwrap()
                .user_mod(bias("q_pos(b, i)"))
                .path(path)
                .run_blocking(ctx)
                .unwrap();
            let last = train.output.slice(ndarray::s![.., .., n - 1..n, ..]);
            assert_report(
                wgpu_attention::check::compare(
                    got.output.iter().copied(),
                    last.iter().map(|&x| x as f64),
                    TOL,
                ),
                &format!("decode by position {path:?}"),
            );
            let by_index = cache
                .attention(&step, 0, Tensor::from(&qd))
                .unwrap()
                .user_mod(bias("i"))
                .path(path)
                .run_blocking(ctx)
                .unwrap();
            assert!(
                by_index
                    .output
                    .iter()
                    .zip(last.iter())
                    .any(|(a, b)| (a - b).abs() > 1e-3),
                "{path:?}: the bias by index should differ in decode"
            );
        }
    }
}
