//! A paged KV cache on the caller's device: per layer, K and V pages of `block_size` tokens,
//! a block table per sequence, sequences added, forked (copy-on-write) and freed, and the
//! append of a ragged batch's new K/V (RoPE applied to K as it is written), recorded into the
//! caller's encoder. Attention reads it through [`Sdpa::paged`].
//!
//! The step protocol is checked, not trusted: a step is used at the epoch it was reserved
//! (no reserve, fork or free since), each layer is appended once per step, and a layer's
//! attention comes after its append. The copy-on-write of a shared block is recorded by each
//! layer's append, before its writes and in the same encoder, so it cannot be left
//! unsubmitted or land after the writes it protects.
//!
//! Layout: each layer's K is one buffer `[num_blocks, Hkv, block_size, E]` and V `[num_blocks,
//! Hkv, block_size, Ev]` ([`PagedLayout::HeadMajor`](crate::PagedLayout::HeadMajor): each
//! head's keys of a block together), row-major in the cache's storage format; every layer uses the same
//! block table. Blocks are reference-counted: a fork shares all of its parent's blocks, and
//! the first append into a shared block that is not full copies it (every layer's K and V)
//! into a fresh block first. Freed blocks return to a free list.

use std::collections::BTreeMap;

use crate::device::buffers::{create, Operand};
use crate::device::context::Context;
use crate::error::{Error, Result};
use crate::rope::Rope;
use crate::sdpa::Sdpa;
use crate::storage::Storage;
use crate::tensor::Tensor;

/// The shape of a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCacheConfig {
    /// Transformer layers (one K and one V buffer each).
    pub layers: usize,
    /// K/V heads `Hkv`.
    pub kv_heads: usize,
    /// K's head dim `E` and V's `Ev`.
    pub head_dim: usize,
    /// V's head dim `Ev`.
    pub head_dim_v: usize,
    /// Tokens per block (16 is vLLM's default).
    pub block_size: usize,
    /// Blocks per layer: the cache holds `num_blocks * block_size` tokens in all.
    pub num_blocks: usize,
    /// The storage format of K, and of V unless `v_storage` says otherwise. An 8-bit format
    /// ([`Storage::Int8`], [`Storage::Fp8`]) keeps its scales in a buffer of its own per
    /// layer ([`KvCache::scales`]) and quantises as it appends ([`crate::quant`]).
    pub storage: Storage,
    /// V's storage format, when it differs from K's (`None`: `storage`).
    pub v_storage: Option<Storage>,
    /// RoPE applied to K as it is appended (and to q by [`KvCache::attention`]), if any.
    pub rope: Option<Rope>,
}

/// A sequence of a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(u64);

#[derive(Debug, Clone)]
struct Seq {
    blocks: Vec<u32>,
    len: usize,
}

/// A paged KV cache on the caller's device (see the module docs of `kv_cache.rs` and
/// `docs/paged.md`).
///
/// One decode step: [`reserve`](KvCache::reserve) the batch's new tokens (once for all
/// layers), then per layer [`append`](KvCache::append) their K and V and run
/// [`attention`](KvCache::attention).
///
/// ```
/// use wgpu_attention::{Causal, Context, KvCache, KvCacheConfig, Storage};
/// let ctx = Context::new_blocking()?;
/// let mut cache = KvCache::new(&ctx, KvCacheConfig {
///     layers: 1, kv_heads: 2, head_dim: 8, head_dim_v: 8,
///     block_size: 16, num_blocks: 8, storage: Storage::F32, v_storage: None, rope: None,
/// })?;
/// let seq = cache.add_sequence();
/// let step = cache.reserve(&[(seq, 3)])?; // a 3-token prompt
/// let kv = ndarray::Array3::<f32>::ones((3, 2, 8)); // [T, Hkv, E]
/// let mut enc = ctx.device().create_command_encoder(&Default::default());
/// cache.append(&ctx, &mut enc, &step, 0, &(&kv).into(), &(&kv).into())?;
/// ctx.queue().submit([enc.finish()]);
/// let q = ndarray::Array4::<f32>::ones((1, 4, 3, 8)); // [B, Hq, n, E]
/// // Causal (bottom-right, by position) unless told otherwise: `.causal(Causal::None)`.
/// let out = cache.attention(&step, 0, (&q).into())?.run_blocking(&ctx)?;
/// assert_eq!(out.output.shape(), &[1, 4, 3, 8]);
/// # Ok::<(), wgpu_attention::Error>(())
/// ```
#[derive(Debug)]
pub struct KvCache {
    config: KvCacheConfig,
    k: Vec<wgpu::Buffer>,
    v: Vec<wgpu::Buffer>,
    /// Per layer, an 8-bit K's (V's) scales: int8 `[NB, Hkv, BS]`, fp8 `[Hkv]`.
    k_scales: Vec<Option<wgpu::Buffer>>,
    v_scales: Vec<Option<wgpu::Buffer>>,
    free: Vec<u32>,
    refs: Vec<u32>,
    seqs: BTreeMap<SeqId, Seq>,
    next: u64,
    /// Changed by every reserve, fork and free: a [`Step`] is used at the epoch it was made.
    epoch: u64,
    id: u64,
    /// Per layer: the copies-on-write its next append records first, and the epoch of its
    /// last append (append takes `&self`, so that a layer's attention may borrow the cache).
    layers: std::sync::Mutex<Vec<LayerState>>,
    /// One block of K or V: the copy-on-write goes through it (a copy within one buffer is
    /// not allowed).
    cow_scratch: wgpu::Buffer,
}

/// A layer's part of the step protocol.
#[derive(Debug, Clone, Default)]
struct LayerState {
    /// Blocks `(from, to)` to copy before the layer's next writes.
    pending: Vec<(u32, u32)>,
    /// The epoch of the step the layer was last appended in.
    appended: Option<u64>,
}

/// The new tokens of one step, reserved by [`KvCache::reserve`]: where each is written, its
/// position, and the block table and sequence lengths attention reads (the new tokens
/// included).
#[derive(Debug, Clone)]
pub struct Step {
    cache: u64,
    epoch: u64,
    seqs: Vec<SeqId>,
    q_lens: Vec<usize>,
    slots: Vec<u32>,
    positions: Vec<usize>,
    table: Vec<i32>,
    seq_lens: Vec<usize>,
}

impl Step {
    /// The sequences, in the batch's order.
    pub fn sequences(&self) -> &[SeqId] {
        &self.seqs
    }
    /// New tokens per sequence.
    pub fn q_lens(&self) -> &[usize] {
        &self.q_lens
    }
    /// Each new token's position (its sequence's length before the step, plus its index).
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }
    /// The block table `[B, max_blocks]` (unused entries -1) and the sequence lengths, the
    /// new tokens included: what [`Sdpa::paged`] takes.
    pub fn block_table(&self) -> (&[i32], &[usize]) {
        (&self.table, &self.seq_lens)
    }
    /// The new tokens in all `T`.
    pub fn tokens(&self) -> usize {
        self.slots.len()
    }
}

fn bad<T>(reason: impl Into<String>) -> Result<T> {
    Err(Error::Paged {
        reason: reason.into(),
    })
}

impl KvCacheConfig {
    /// V's storage format: `v_storage`, else `storage`.
    pub fn v_format(&self) -> Storage {
        self.v_storage.unwrap_or(self.storage)
    }
}

impl KvCache {
    /// Allocate every layer's K and V pages on `ctx`'s device (zeroed). Checked: every
    /// dimension positive, the head dims even for RoPE's rotated part, each buffer within the
    /// device's binding limit.
    pub fn new(ctx: &Context, config: KvCacheConfig) -> Result<Self> {
        let c = config;
        if [
            c.layers,
            c.kv_heads,
            c.head_dim,
            c.head_dim_v,
            c.block_size,
            c.num_blocks,
        ]
        .contains(&0)
        {
            return bad(format!("every dimension of the cache must be positive: {c:?}"));
        }
        if let Some(r) = &c.rope {
            r.rotated_dims(c.head_dim)?;
        }
        for (name, st, e) in [("K", c.storage, c.head_dim), ("V", c.v_format(), c.head_dim_v)] {
            if st.is_half() && (c.block_size * c.kv_heads * e) % 2 == 1 {
                return bad(format!(
                    "a {st} {name} block of {} tokens x {} heads x {e} dims is an odd number of 2-byte elements: blocks are copied in whole 4-byte words (make block_size even)",
                    c.block_size, c.kv_heads,
                ));
            }
            if st.is_quantized() && !e.is_multiple_of(4) {
                return Err(Error::Quantized {
                    reason: format!(
                        "an {st} {name} cache's head dim {e} is not a multiple of 4: codes are packed four to a 32-bit word"
                    ),
                });
            }
        }
        let bytes = |e: usize, st: Storage| -> Result<u64> {
            let elems = c.num_blocks * c.block_size * c.kv_heads * e;
            if u32::try_from(elems).is_err() {
                return bad(format!(
                    "{elems} elements per layer exceed the kernels' u32 indices"
                ));
            }
            let b = st.bytes(elems).next_multiple_of(16);
            crate::device::buffers::fits(
                "KV cache layer",
                b,
                ctx.max_binding(),
                "max_storage_buffer_binding_size",
            )?;
            Ok(b)
        };
        let (kb, vb) = (bytes(c.head_dim, c.storage)?, bytes(c.head_dim_v, c.v_format())?);
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        let (mut k, mut v, mut k_scales, mut v_scales) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for l in 0..c.layers {
            k.push(create(ctx, &format!("KV cache K layer {l}"), kb, usage));
            v.push(create(ctx, &format!("KV cache V layer {l}"), vb, usage));
            k_scales.push(scales_buffer(
                ctx,
                &c,
                c.storage,
                &format!("KV cache K scales layer {l}"),
            )?);
            v_scales.push(scales_buffer(
                ctx,
                &c,
                c.v_format(),
                &format!("KV cache V scales layer {l}"),
            )?);
        }
        let block = |e: usize, st: Storage| element_bytes(st, (c.block_size * c.kv_heads * e) as u64);
        let cow_scratch = create(
            ctx,
            "KV cache copy-on-write",
            block(c.head_dim, c.storage)
                .max(block(c.head_dim_v, c.v_format()))
                .max(4 * (c.block_size * c.kv_heads) as u64)
                .next_multiple_of(4),
            wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        );
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(KvCache {
            config: c,
            k,
            v,
            k_scales,
            v_scales,
            free: (0..c.num_blocks as u32).rev().collect(),
            refs: vec![0; c.num_blocks],
            seqs: BTreeMap::new(),
            next: 0,
            epoch: 0,
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            layers: std::sync::Mutex::new(vec![LayerState::default(); c.layers]),
            cow_scratch,
        })
    }

    /// The cache's shape.
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// Blocks on the free list.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Layer `layer`'s K and V pages with their layout, for [`Sdpa::paged`] and
    /// [`PagedAttention::new`](crate::PagedAttention::new) when a call needs more than
    /// [`attention`](KvCache::attention) gives (a mask per group, say). Their block table and
    /// lengths are [`Step::block_table`].
    pub fn pages<'a>(&'a self, layer: usize) -> Result<crate::paged::Pages<'a>> {
        let (kb, vb) = self.buffers(layer)?;
        let c = &self.config;
        let shape = |e| [c.num_blocks, c.kv_heads, c.block_size, e];
        let (ks, vs) = self.scales(layer)?;
        let with = |t: Tensor<'a>, s: Option<&'a wgpu::Buffer>, st: Storage| match s {
            Some(b) => {
                let dims = match st {
                    Storage::Int8 => vec![c.num_blocks, c.kv_heads, c.block_size],
                    _ => vec![c.kv_heads],
                };
                t.with_scales(Tensor::from_buffer(b, Storage::F32, &dims))
            }
            None => t,
        };
        Ok(crate::paged::Pages::new(
            with(
                Tensor::from_buffer(kb, c.storage, &shape(c.head_dim)),
                ks,
                c.storage,
            ),
            with(
                Tensor::from_buffer(vb, c.v_format(), &shape(c.head_dim_v)),
                vs,
                c.v_format(),
            ),
            crate::paged::PagedLayout::HeadMajor,
        ))
    }

    /// Layer `layer`'s scales of an 8-bit K and V (`None` for a float one), read in place: int8
    /// `[num_blocks, Hkv, block_size]` f32 (a scale per token and head, laid out as the
    /// head-major pages' rows), fp8 `[Hkv]` f32 (a scale per kv head, 1 until
    /// [`set_scales`](KvCache::set_scales)).
    pub fn scales(&self, layer: usize) -> Result<(Option<&wgpu::Buffer>, Option<&wgpu::Buffer>)> {
        self.buffers(layer)?;
        Ok((self.k_scales[layer].as_ref(), self.v_scales[layer].as_ref()))
    }

    /// Set layer `layer`'s fp8 scales per kv head (vLLM's `k_scale` / `v_scale`: about the
    /// largest |x| a head holds over 448): `k` for an fp8 K, `v` for an fp8 V (`None` leaves
    /// them). New appends quantise at these scales and attention reads every code at them, so
    /// set them before the first append. Written through the queue (`Queue::write_buffer`,
    /// ordered before later submissions). Checked: one finite, positive scale per kv head,
    /// and only for an fp8 tensor.
    pub fn set_scales(
        &self,
        ctx: &Context,
        layer: usize,
        k: Option<&[f32]>,
        v: Option<&[f32]>,
    ) -> Result<()> {
        let c = &self.config;
        let (ks, vs) = self.scales(layer)?;
        for (name, given, st, buf) in [("K", k, c.storage, ks), ("V", v, c.v_format(), vs)] {
            let Some(x) = given else { continue };
            let refuse = |reason: String| Err(Error::Quantized { reason });
            if st != Storage::Fp8 {
                return refuse(format!(
                    "set_scales sets an fp8 cache's per-head scales; this cache's {name} is {st}{}",
                    if st == Storage::Int8 {
                        " (its scales are computed per token as it appends)"
                    } else {
                        ""
                    }
                ));
            }
            if x.len() != c.kv_heads || x.iter().any(|s| !s.is_finite() || *s <= 0.0) {
                return refuse(format!(
                    "{name}'s fp8 scales must be {} finite, positive values (one per kv head); got {x:?}",
                    c.kv_heads
                ));
            }
            if let Some(b) = buf {
                ctx.queue().write_buffer(b, 0, bytemuck::cast_slice(x));
            }
        }
        Ok(())
    }

    /// Bytes the cache holds per token per layer, scales included (an fp8 tensor's per-head
    /// scales are per layer, not per token, and are not counted): `Hkv · (E · k bytes + Ev · v
    /// bytes)`, plus 4 bytes per head for each int8 tensor's scale.
    pub fn bytes_per_token(&self) -> u64 {
        let c = &self.config;
        let part = |e: usize, st: Storage| {
            c.kv_heads as u64 * (e as u64 * st.element_bytes() + if st == Storage::Int8 { 4 } else { 0 })
        };
        part(c.head_dim, c.storage) + part(c.head_dim_v, c.v_format())
    }

    /// Bytes of every layer's K, V and scales buffers on the device.
    pub fn memory_bytes(&self) -> u64 {
        let bufs = self.k.iter().chain(&self.v).map(|b| b.size());
        let scales = self
            .k_scales
            .iter()
            .chain(&self.v_scales)
            .flatten()
            .map(|b| b.size());
        bufs.chain(scales).sum()
    }

    /// Layer `layer`'s K buffer `[num_blocks, Hkv, block_size, E]` and V buffer `[num_blocks,
    /// Hkv, block_size, Ev]` ([`PagedLayout::HeadMajor`](crate::PagedLayout::HeadMajor)), the
    /// raw buffers; [`pages`](KvCache::pages) gives them with their layout.
    pub fn buffers(&self, layer: usize) -> Result<(&wgpu::Buffer, &wgpu::Buffer)> {
        match (self.k.get(layer), self.v.get(layer)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => bad(format!(
                "layer {layer} of a cache of {} layers",
                self.config.layers
            )),
        }
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        let id = SeqId(self.next);
        self.next += 1;
        self.seqs.insert(
            id,
            Seq {
                blocks: Vec::new(),
                len: 0,
            },
        );
        id
    }

    /// Keys held for `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    /// Whether the cache holds no sequence.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// The physical blocks of `seq`, in order.
    pub fn blocks(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(seq)?.blocks)
    }

    fn seq(&self, seq: SeqId) -> Result<&Seq> {
        self.seqs.get(&seq).map_or_else(
            || {
                bad(format!(
                    "{seq:?} is not a sequence of this cache (freed, or another cache's)"
                ))
            },
            Ok,
        )
    }

    /// Free `seq`: its blocks that no other sequence shares return to the free list.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seq(seq)?.clone();
        for b in s.blocks {
            self.release(b);
        }
        self.seqs.remove(&seq);
        self.epoch += 1;
        Ok(())
    }

    /// Drop `seq`'s keys from position `len` on (rejected draft tokens of speculative
    /// decoding, or a rolled-back step): it keeps its first `len` keys, and its blocks past
    /// them return to the free list (those it shares stay with their other sequences). The
    /// next [`reserve`](KvCache::reserve) writes its new tokens at `len`, copying a shared
    /// partial block first as it always does. `len` above the sequence's length is an error.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let s = self.seq(seq)?;
        if len > s.len {
            return bad(format!(
                "{seq:?} holds {} keys: it cannot be truncated to {len}",
                s.len
            ));
        }
        let keep = len.div_ceil(self.config.block_size);
        let dropped: Vec<u32> = s.blocks[keep..].to_vec();
        for b in dropped {
            self.release(b);
        }
        let s = self.seqs.get_mut(&seq).expect("checked above");
        s.blocks.truncate(keep);
        s.len = len;
        self.epoch += 1;
        Ok(())
    }

    fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
        }
    }

    /// A new sequence with `parent`'s keys, sharing its blocks (beam search, parallel
    /// sampling): nothing is copied until one of them appends into a shared block that is not
    /// full (copy-on-write).
    pub fn fork(&mut self, parent: SeqId) -> Result<SeqId> {
        let s = self.seq(parent)?.clone();
        for &b in &s.blocks {
            self.refs[b as usize] += 1;
        }
        let id = SeqId(self.next);
        self.next += 1;
        self.seqs.insert(id, s);
        self.epoch += 1;
        Ok(id)
    }

    /// Reserve slots for `batch`'s new tokens (`(sequence, count)`, each sequence once):
    /// blocks are taken from the free list, and a shared block that is not full is given a
    /// fresh block, into which each layer's next [`append`](KvCache::append) copies the shared
    /// one before it writes (copy-on-write). Either every sequence gets its slots or nothing
    /// changes (too few free blocks is an error). Host work only.
    pub fn reserve(&mut self, batch: &[(SeqId, usize)]) -> Result<Step> {
        let bs = self.config.block_size;
        if batch.is_empty() {
            return bad("a step needs at least one sequence");
        }
        let mut needed = 0;
        for (i, &(seq, n)) in batch.iter().enumerate() {
            if batch[..i].iter().any(|&(s, _)| s == seq) {
                return bad(format!("{seq:?} appears twice in one step"));
            }
            if n == 0 {
                return bad(format!("{seq:?}: a step appends at least one token per sequence"));
            }
            let s = self.seq(seq)?;
            let have = s.blocks.len();
            needed += (s.len + n).div_ceil(bs) - have;
            let partial_shared = !s.len.is_multiple_of(bs) && self.refs[s.blocks[have - 1] as usize] > 1;
            needed += partial_shared as usize;
        }
        if needed > self.free.len() {
            return bad(format!(
                "the step needs {needed} blocks, {} are free (free sequences or make a larger cache)",
                self.free.len()
            ));
        }
        let mut slots = Vec::new();
        let mut positions = Vec::new();
        for &(seq, n) in batch {
            let mut s = self.seqs[&seq].clone();
            // Copy-on-write of a shared partial block.
            if !s.len.is_multiple_of(bs) {
                let last = *s.blocks.last().expect("a partial block");
                if self.refs[last as usize] > 1 {
                    let fresh = self.free.pop().expect("counted");
                    self.refs[fresh as usize] = 1;
                    for layer in self.layers.get_mut().unwrap_or_else(|e| e.into_inner()) {
                        layer.pending.push((last, fresh));
                    }
                    self.release(last);
                    *s.blocks.last_mut().expect("a partial block") = fresh;
                }
            }
            while s.blocks.len() < (s.len + n).div_ceil(bs) {
                let fresh = self.free.pop().expect("counted");
                self.refs[fresh as usize] = 1;
                s.blocks.push(fresh);
            }
            for t in s.len..s.len + n {
                slots.push(s.blocks[t / bs] * bs as u32 + (t % bs) as u32);
                positions.push(t);
            }
            s.len += n;
            self.seqs.insert(seq, s);
        }
        self.epoch += 1;
        let seqs: Vec<SeqId> = batch.iter().map(|&(s, _)| s).collect();
        let max_blocks = seqs
            .iter()
            .map(|s| self.seqs[s].blocks.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut table = vec![-1i32; seqs.len() * max_blocks];
        for (i, s) in seqs.iter().enumerate() {
            for (j, &b) in self.seqs[s].blocks.iter().enumerate() {
                table[i * max_blocks + j] = b as i32;
            }
        }
        Ok(Step {
            cache: self.id,
            epoch: self.epoch,
            seq_lens: seqs.iter().map(|s| self.seqs[s].len).collect(),
            q_lens: batch.iter().map(|&(_, n)| n).collect(),
            seqs,
            slots,
            positions,
            table,
        })
    }

    /// Record the copy of block `from` into block `to`, layer `layer`'s K and V, through the
    /// scratch buffer (a copy within one buffer is not allowed).
    fn copy_block(&self, encoder: &mut wgpu::CommandEncoder, layer: usize, from: u32, to: u32) {
        let c = &self.config;
        let scratch = &self.cow_scratch;
        let rows = (c.block_size * c.kv_heads) as u64;
        let mut copy = |buf: &wgpu::Buffer, st: Storage, block: u64| {
            // Whole 4-byte words: `new` refuses half-format blocks of an odd element count,
            // and 8-bit head dims that are not multiples of 4.
            let start = element_bytes(st, from as u64 * block);
            let size = element_bytes(st, block);
            let dst = element_bytes(st, to as u64 * block);
            encoder.copy_buffer_to_buffer(buf, start, scratch, 0, size);
            encoder.copy_buffer_to_buffer(scratch, 0, buf, dst, size);
        };
        for (bufs, scales, e, st) in [
            (&self.k, &self.k_scales, c.head_dim, c.storage),
            (&self.v, &self.v_scales, c.head_dim_v, c.v_format()),
        ] {
            copy(&bufs[layer], st, rows * e as u64);
            // An int8 block's scales, one per row (fp8's are per head, shared by every block).
            if let (Some(s), Storage::Int8) = (&scales[layer], st) {
                copy(s, Storage::F32, rows);
            }
        }
    }

    fn check_step(&self, step: &Step, layer: usize) -> Result<()> {
        if step.cache != self.id {
            return bad("the step was reserved on another cache");
        }
        if step.epoch != self.epoch {
            return bad("the cache changed since this step was reserved (a reserve, fork or free came after it): reserve again");
        }
        self.buffers(layer).map(|_| ())
    }

    /// Record the append of `step`'s new K `[T, Hkv, E]` and V `[T, Hkv, Ev]` (host data or
    /// GPU buffers, any storage format; T the step's tokens, in its batch order) into layer
    /// `layer`, K rotated by the cache's RoPE at each token's position. A GPU buffer may be
    /// a view with three strides `[T, Hkv, E]` ([`Tensor::with_strides`], the last 1): the k
    /// and v parts of a fused QKV projection, as vLLM's `reshape_and_cache` takes them.
    /// First the copies-on-write [`reserve`](KvCache::reserve) left for this layer are
    /// recorded, so that they land in the same encoder before the writes.
    ///
    /// Checked before anything is recorded: the step (this cache's, at its epoch), the shapes,
    /// the buffers, and that the layer was not appended in this step already (its tokens
    /// would be written twice).
    pub fn append(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        step: &Step,
        layer: usize,
        k: &Tensor<'_>,
        v: &Tensor<'_>,
    ) -> Result<()> {
        self.check_step(step, layer)?;
        let c = &self.config;
        let t = step.tokens();
        let mut sources = Vec::new();
        for (name, x, e) in [("k", k, c.head_dim), ("v", v, c.head_dim_v)] {
            if x.shape != [t, c.kv_heads, e] {
                return Err(Error::ShapeMismatch {
                    tensor: name,
                    expected: vec![t, c.kv_heads, e],
                    actual: x.shape.clone(),
                });
            }
            sources.push(Source::check(ctx, name, x, [t, c.kv_heads, e])?);
        }
        let d = match &c.rope {
            Some(r) => r.rotated_dims(c.head_dim)?,
            None => 0,
        };
        let mut layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut layers[layer];
        if state.appended == Some(step.epoch) {
            return bad(format!(
                "layer {layer} was already appended in this step: each layer takes one append per step (its tokens' slots would be written twice); reserve a new step for more tokens"
            ));
        }
        let (kbuf, vbuf) = self.buffers(layer)?;
        // The copies-on-write first: the shared blocks' tokens, then the new ones over them.
        for &(from, to) in &state.pending {
            self.copy_block(encoder, layer, from, to);
        }
        let (ku, vu) = (
            sources[0].dense(ctx, encoder, "new k")?,
            sources[1].dense(ctx, encoder, "new v")?,
        );
        // K rotated and V copied (or quantised) into the step's slots, with one auxiliary buffer.
        let rows = [
            (
                ku.binding(),
                k.storage(),
                kbuf,
                c.head_dim,
                true,
                c.storage,
                &self.k_scales[layer],
            ),
            (
                vu.binding(),
                v.storage(),
                vbuf,
                c.head_dim_v,
                false,
                c.v_format(),
                &self.v_scales[layer],
            ),
        ]
        .map(|(src, st, dst, e, rotate, fmt, scales)| crate::ops::rope::Rows {
            dims: [t, c.kv_heads, e],
            dest: match scales {
                Some(s) => crate::ops::rope::Dest::Quantized {
                    src: (src, st),
                    cache: (dst.as_entire_buffer_binding(), fmt),
                    scales: s.as_entire_buffer_binding(),
                },
                None => crate::ops::rope::Dest::Slots {
                    src: (src, st),
                    cache: (dst.as_entire_buffer_binding(), fmt),
                },
            },
            rotate,
        });
        crate::ops::rope::rotate(
            ctx,
            encoder,
            c.rope.map(|r| (r, d)),
            &step.positions,
            Some(crate::ops::rope::Slots {
                slots: &step.slots,
                head_major_block: c.block_size,
            }),
            rows.into(),
        )?;
        state.pending.clear();
        state.appended = Some(step.epoch);
        Ok(())
    }

    /// Check that layer `layer` was appended in `step` (its attention reads the step's new
    /// keys, and the copies-on-write its append records).
    fn check_appended(&self, step: &Step, layer: usize) -> Result<()> {
        let layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        if layers[layer].appended != Some(step.epoch) {
            return bad(format!(
                "layer {layer}'s K and V are not appended in this step: append them first (its attention reads the step's new keys)"
            ));
        }
        Ok(())
    }

    /// The attention of `step`'s queries `[B, Hq, n, E]` (every sequence of the step with the
    /// same count `n`; B in the step's order) over layer `layer`: an [`Sdpa::paged`] call on
    /// the layer's pages, q rotated by the cache's RoPE, causal by position
    /// ([`Causal::BottomRight`](crate::Causal::BottomRight): query `i` of a sequence of `l`
    /// keys is at position `l - n + i` and sees the keys up to it). Add options (non-causal
    /// is `.causal(Causal::None)`) and run or record it. The layer must have been appended in
    /// this step.
    pub fn attention<'a>(&'a self, step: &'a Step, layer: usize, q: Tensor<'a>) -> Result<Sdpa<'a>> {
        self.check_step(step, layer)?;
        let n = step.q_lens[0];
        if step.q_lens.iter().any(|&m| m != n) {
            return bad(format!(
                "attention takes the same query count for every sequence of a step; this step has {:?} (run one call per group of equal counts)",
                step.q_lens
            ));
        }
        self.check_q(
            &q,
            &[step.seqs.len(), 0, n, self.config.head_dim],
            "[B, Hq, n, E]",
        )?;
        self.check_appended(step, layer)?;
        let c = &self.config;
        let call = Sdpa::paged(q, self.pages(layer)?, &step.table, &step.seq_lens)
            .causal(crate::problem::Causal::BottomRight);
        Ok(match c.rope {
            Some(r) => call.rope(r),
            None => call,
        })
    }
}

impl KvCache {
    /// The attention of `step`'s queries packed `[T, Hq, E]` (the step's counts, in its batch
    /// order; counts may differ: a prefill chunk beside decode queries) over layer `layer`: a
    /// [`PagedAttention`](crate::PagedAttention) on the layer's pages, q rotated by the
    /// cache's RoPE, causal by position as [`attention`](KvCache::attention) is. Add options
    /// (non-causal is `.causal(Causal::None)`) and run or record it. The layer must have been
    /// appended in this step.
    pub fn ragged_attention<'a>(
        &'a self,
        step: &'a Step,
        layer: usize,
        q: Tensor<'a>,
    ) -> Result<crate::paged::PagedAttention<'a>> {
        self.check_step(step, layer)?;
        self.check_q(&q, &[step.tokens(), 0, self.config.head_dim], "[T, Hq, E]")?;
        self.check_appended(step, layer)?;
        let c = &self.config;
        let call = crate::paged::PagedAttention::new(
            q,
            &step.q_lens,
            self.pages(layer)?,
            &step.table,
            &step.seq_lens,
        )
        .causal(crate::problem::Causal::BottomRight);
        Ok(match c.rope {
            Some(r) => call.rope(r),
            None => call,
        })
    }
}

impl KvCache {
    /// q against `expected`, whose index 1 is q's head count (its own to choose: a multiple
    /// of the cache's K/V heads) and last is the cache's head dim: errors name q, the shape
    /// expected (Hq written as such) and what q's dims mean (`dims`).
    fn check_q(&self, q: &Tensor<'_>, expected: &[usize], dims: &str) -> Result<()> {
        let c = &self.config;
        let got = &q.shape;
        let fits = got.len() == expected.len()
            && got
                .iter()
                .zip(expected)
                .enumerate()
                .all(|(i, (&g, &x))| i == 1 || g == x)
            && got[1] > 0
            && got[1].is_multiple_of(c.kv_heads);
        if fits {
            return Ok(());
        }
        let want: Vec<String> = expected
            .iter()
            .enumerate()
            .map(|(i, x)| if i == 1 { "Hq".to_string() } else { x.to_string() })
            .collect();
        let e_note = match got.last() {
            Some(&e) if got.len() == expected.len() && e != c.head_dim => {
                format!(" (its head dim {e} is not the cache's {})", c.head_dim)
            }
            _ => String::new(),
        };
        Err(Error::Paged {
            reason: format!(
                "q must be {dims} = [{}] for this step and cache, Hq a multiple of the cache's {} K/V heads; got {got:?}{e_note}",
                want.join(", "),
                c.kv_heads
            ),
        })
    }
}

/// The scales buffer of an 8-bit K or V in format `st` (`None` for a float one): int8 `[NB, Hkv,
/// BS]` zeros, fp8 `[Hkv]` ones.
fn scales_buffer(ctx: &Context, c: &KvCacheConfig, st: Storage, label: &str) -> Result<Option<wgpu::Buffer>> {
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    Ok(match st {
        Storage::Int8 => {
            let b = (4 * c.num_blocks * c.kv_heads * c.block_size) as u64;
            crate::device::buffers::fits(
                "KV cache scales",
                b,
                ctx.max_binding(),
                "max_storage_buffer_binding_size",
            )?;
            Some(create(ctx, label, b.next_multiple_of(16), usage))
        }
        Storage::Fp8 => {
            let mut ones = vec![1f32; c.kv_heads];
            ones.resize(c.kv_heads.next_multiple_of(4), 0.0);
            Some(crate::device::buffers::init(
                ctx,
                label,
                bytemuck::cast_slice(&ones),
                usage,
            ))
        }
        _ => None,
    })
}

/// Byte offset of element `i` in format `s` (elements packed: 4 bytes for f32, 2 else).
fn element_bytes(s: Storage, i: u64) -> u64 {
    i * s.element_bytes()
}

/// An appended K or V `[T, Hkv, E]`: host data or a dense buffer, or a buffer's view with
/// strides ([`crate::tensor::packed_rows`]), copied dense before the append kernel reads it.
struct Source<'t, 'a> {
    name: &'static str,
    tensor: &'t Tensor<'a>,
    /// The view as `[1, T, Hkv, E]` ([`crate::tensor::rows_view`]) when it has strides.
    rows: Option<Tensor<'a>>,
}

impl<'t, 'a> Source<'t, 'a> {
    /// Check `x` (shape `dims`, already matched) against its buffer before any GPU work.
    fn check(ctx: &Context, name: &'static str, x: &'t Tensor<'a>, dims: [usize; 3]) -> Result<Self> {
        let strides = crate::tensor::packed_rows(name, x, dims)?;
        let rows = x
            .view
            .strides
            .is_some()
            .then(|| crate::tensor::rows_view(x, dims, strides))
            .flatten();
        match &rows {
            Some(viewed) => Operand::check_viewed(ctx, name, viewed).map(|_| ())?,
            None => Operand::check(ctx, name, x).map(|_| ())?,
        }
        Ok(Source {
            name,
            tensor: x,
            rows,
        })
    }

    /// The rows dense on the device: the upload or the caller's dense buffer, or a strided
    /// view's copy (recorded into `encoder`).
    fn dense(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        label: &str,
    ) -> Result<crate::device::buffers::Uploaded<'a>> {
        let Some(viewed) = &self.rows else {
            return Ok(Operand::check(ctx, self.name, self.tensor)?.upload(ctx, label));
        };
        let st = viewed.storage();
        let bytes = st.bytes(viewed.shape.iter().product());
        let dense = crate::device::buffers::output(ctx, label, bytes);
        crate::ops::copy::gather_rows(
            ctx,
            encoder,
            self.name,
            viewed,
            (dense.as_entire_buffer_binding(), st),
        )?;
        Ok(crate::device::buffers::Uploaded::Owned(dense, bytes))
    }
}
