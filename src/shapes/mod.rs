//! Named benchmark shapes and seeded random inputs (the `shapes` feature), shared by the
//! command-line tool's `bench` and the criterion benchmark (`benches/attention.rs`); the
//! multi-head attention layers are in [`mha`].
//!
//! Inputs are uploaded once as GPU storage buffers, so a timed [`Sdpa::run`] measures the
//! kernels and the readback of the output, not the upload.

pub mod host;
pub mod mha;

use ndarray::Array4;
use wgpu::util::DeviceExt;

use crate::device::context::Context;
use crate::problem::Causal;
use crate::problem::Problem;
use crate::sdpa::Sdpa;
use crate::tensor::Tensor;

/// One attention problem size: `q [B, Hq, L, E]`, `k [B, Hkv, S, E]`, `v [B, Hkv, S, Ev]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// Name used on the command line and in reports.
    pub name: &'static str,
    /// Batch `B`.
    pub batch: usize,
    /// Query heads `Hq`.
    pub q_heads: usize,
    /// Key/value heads `Hkv`.
    pub kv_heads: usize,
    /// Query length `L`.
    pub seq_q: usize,
    /// Key/value length `S`.
    pub seq_kv: usize,
    /// Query/key head dimension `E`.
    pub head_dim: usize,
    /// Value head dimension `Ev`.
    pub head_dim_v: usize,
    /// Causal alignment.
    pub causal: Causal,
    /// Per-batch key lengths (key padding), if any.
    pub kv_lens: Option<&'static [usize]>,
    /// A sliding window `(left, right)` (see [`crate::Window`]), if any.
    pub window: Option<(i64, i64)>,
    /// A logit softcap (see [`crate::Problem::with_softcap`]), if any.
    pub softcap: Option<f32>,
    /// ALiBi with the paper's slopes for `q_heads` ([`crate::alibi_slopes`]).
    pub alibi: bool,
    /// Sink logits (0 for every query head: as much weight as a logit of 0).
    pub sinks: bool,
    /// Packed documents: this many of equal length in every batch (0: none), as document ids
    /// (see [`crate::Problem::with_doc_ids`]), or as the same mask given densely (a boolean
    /// `[1, 1, L, S]` mask, packed and uploaded by each call) with `docs_dense`.
    pub docs: usize,
    /// The documents as a dense boolean mask instead of document ids.
    pub docs_dense: bool,
    /// A user WGSL function (see [`crate::UserMod`]): [`USER_RELBIAS`] or [`USER_WINDOW`].
    pub user_mod: Option<&'static str>,
    /// K and V as paged caches of `paged_block` tokens per block (see `paged_layout`) read through a block table
    /// ([`Sdpa::paged`]; blocks in shuffled order, sequence lengths the key lengths or S),
    /// when not 0.
    pub paged_block: usize,
    /// The paged caches' layout (head-major, [`crate::KvCache`]'s, unless the shape says).
    pub paged_layout: crate::paged::PagedLayout,
    /// Paged shapes: every sequence's table begins with the same blocks holding this many
    /// keys (forks of one prompt; a multiple of `paged_block`; 0: none). Run as a
    /// [`crate::PagedAttention`] batch (`seq_q` queries per sequence), with the shared keys
    /// read once when [`cascade`](Self::cascade) is set.
    pub shared_prefix: usize,
    /// Read [`shared_prefix`](Self::shared_prefix) once ([`crate::PagedAttention::shared_prefix`]).
    pub cascade: bool,
    /// K and V in this format whatever the run's (q and the output keep the run's): f16, or
    /// an 8-bit cache ([`crate::quant`]: int8 with its row scales, fp8 at each head's largest
    /// |x| / 448), quantised on the host before the upload.
    pub kv_storage: Option<crate::storage::Storage>,
    /// Part of the default `bench` set (false for shapes too slow on software renderers).
    pub default: bool,
}

const fn shape(
    name: &'static str,
    (batch, q_heads, kv_heads): (usize, usize, usize),
    (seq_q, seq_kv): (usize, usize),
    (head_dim, head_dim_v): (usize, usize),
    causal: Causal,
    kv_lens: Option<&'static [usize]>,
    default: bool,
) -> Shape {
    Shape {
        name,
        batch,
        q_heads,
        kv_heads,
        seq_q,
        seq_kv,
        head_dim,
        head_dim_v,
        causal,
        kv_lens,
        window: None,
        softcap: None,
        alibi: false,
        sinks: false,
        docs: 0,
        docs_dense: false,
        user_mod: None,
        paged_block: 0,
        paged_layout: crate::paged::PagedLayout::HeadMajor,
        shared_prefix: 0,
        cascade: false,
        kv_storage: None,
        default,
    }
}

/// `s` with K and V in `st` ([`Shape::kv_storage`]).
const fn kv_in(mut s: Shape, st: crate::storage::Storage) -> Shape {
    s.kv_storage = Some(st);
    s
}

/// `s` with K and V in paged caches of `block` tokens per block.
const fn paged(mut s: Shape, block: usize) -> Shape {
    s.paged_block = block;
    s
}

/// `s` with its paged caches token-major (`[NB, BS, Hkv, E]`, vLLM's).
const fn token_major(mut s: Shape) -> Shape {
    s.paged_layout = crate::paged::PagedLayout::TokenMajor;
    s
}

/// `s` paged in blocks of 16 with its sequences sharing their first `prefix` keys, read once
/// when `cascade`.
const fn forked(mut s: Shape, prefix: usize, cascade: bool) -> Shape {
    s.paged_block = 16;
    s.shared_prefix = prefix;
    s.cascade = cascade;
    s
}

/// 64 forks of a 4096-token prompt with 64 keys each of their own (B=64 Hq=32
/// Hkv=8 E=128, one decode query each), the prompt read once when `cascade`.
const fn cascade64(name: &'static str, cascade: bool) -> Shape {
    forked(
        shape(
            name,
            (64, 32, 8),
            (1, 4160),
            (128, 128),
            Causal::BottomRight,
            None,
            false,
        ),
        4096,
        cascade,
    )
}

/// The ragged decode batch's key counts: 512 to 4096 in steps of 512.
const RAGGED8: &[usize] = &[512, 1024, 1536, 2048, 2560, 3072, 3584, 4096];

/// A `score_mod` adding a learned relative-position bias (a captured `[Hq, 129]` table, the
/// key's distance clamped to 64: T5's and AlphaFold's learned biases), for
/// `relbias_mod_h8_s1024`.
/// Its derivatives are given too (the bias adds: `ds` is 1, and each logit's gradient goes to
/// the table entry it read), so the backward runs on it.
pub const USER_RELBIAS: &str = "const R: i32 = 64;
fn bucket(h: u32, i: u32, j: u32) -> u32 {
    return h * u32(2 * R + 1) + u32(clamp(i32(j) - i32(i), -R, R) + R);
}
fn score_mod(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    return s + rel(bucket(h, i, j));
}
fn score_mod_ds(s: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    return 1.0;
}
fn score_mod_dcapture(s: f32, b: u32, h: u32, i: u32, j: u32, g: f32) {
    d_rel(bucket(h, i, j), g);
}";

/// A sliding window of 1024 keys written as a `mask_mod` (with the shape's causal mask), for
/// `window_mod_h8_s16384`.
pub const USER_WINDOW: &str = "fn mask_mod(b: u32, h: u32, i: u32, j: u32) -> bool {
    return i32(i) - i32(j) <= 1023;
}";

/// `s` with user function `src`.
const fn user(mut s: Shape, src: &'static str) -> Shape {
    s.user_mod = Some(src);
    s
}

/// `s` with `n` packed documents of equal length, as ids or (`dense`) as a boolean mask.
const fn documents(mut s: Shape, n: usize, dense: bool) -> Shape {
    s.docs = n;
    s.docs_dense = dense;
    s
}

/// `s` with a sliding window `(left, right)`.
const fn windowed(mut s: Shape, left: i64, right: i64) -> Shape {
    s.window = Some((left, right));
    s
}

/// `s` with a logit softcap `c`.
const fn softcapped(mut s: Shape, c: f32) -> Shape {
    s.softcap = Some(c);
    s
}

/// `s` with ALiBi (the paper's slopes).
const fn alibied(mut s: Shape) -> Shape {
    s.alibi = true;
    s
}

/// `s` with sink logits.
const fn sunk(mut s: Shape) -> Shape {
    s.sinks = true;
    s
}

/// The named shapes, in report order.
pub const SHAPES: &[Shape] = &[
    shape(
        "small_h4_s128",
        (1, 4, 4),
        (128, 128),
        (64, 64),
        Causal::None,
        None,
        true,
    ),
    shape(
        "a_h8_s1024",
        (1, 8, 8),
        (1024, 1024),
        (64, 64),
        Causal::None,
        None,
        true,
    ),
    shape(
        "b_h8_s1024_causal",
        (1, 8, 8),
        (1024, 1024),
        (64, 64),
        Causal::TopLeft,
        None,
        true,
    ),
    shape(
        "c_h8_s4096_causal",
        (1, 8, 8),
        (4096, 4096),
        (64, 64),
        Causal::TopLeft,
        None,
        false,
    ),
    shape(
        "d_decode_h32_s4096_e128",
        (1, 32, 32),
        (1, 4096),
        (128, 128),
        Causal::None,
        None,
        true,
    ),
    // Key padding: kv_lens[i] = 256 - 37 i.
    shape(
        "e_b4_h12_s256_padmask",
        (4, 12, 12),
        (256, 256),
        (64, 64),
        Causal::None,
        Some(&[256, 219, 182, 145]),
        true,
    ),
    // Memory: the fused path needs only q, k, v and the output (linear in L and S); the
    // unfused path would need 4 GiB of scores and survives only by chunking.
    // The backward's long case: memory linear in L and S (the unfused backward would hold
    // four 1 GiB chunks of scores).
    shape(
        "long_h1_s16384_causal",
        (1, 1, 1),
        (16384, 16384),
        (64, 64),
        Causal::TopLeft,
        None,
        false,
    ),
    // An LLM prefill: Llama-3-8B's attention (GQA 32/8, E 128) over a 4096-token prompt.
    shape(
        "prefill_h32_s4096_e128",
        (1, 32, 8),
        (4096, 4096),
        (128, 128),
        Causal::TopLeft,
        None,
        false,
    ),
    shape(
        "long_h1_s32768_causal",
        (1, 1, 1),
        (32768, 32768),
        (64, 64),
        Causal::TopLeft,
        None,
        false,
    ),
    shape(
        "gpt2_h12_t1024_causal",
        (1, 12, 12),
        (1024, 1024),
        (64, 64),
        Causal::TopLeft,
        None,
        true,
    ),
    // A sliding window against causal alone: 1024 keys per row against 8192 on
    // average (8x less work).
    shape(
        "causal_h8_s16384",
        (1, 8, 8),
        (16384, 16384),
        (64, 64),
        Causal::BottomRight,
        None,
        false,
    ),
    windowed(
        shape(
            "window_h8_s16384",
            (1, 8, 8),
            (16384, 16384),
            (64, 64),
            Causal::BottomRight,
            None,
            false,
        ),
        1023,
        0,
    ),
    // Score modifiers against the plain a_h8_s1024: Gemma 2's softcap of 50, and
    // ALiBi with the paper's slopes.
    softcapped(
        shape(
            "softcap_h8_s1024",
            (1, 8, 8),
            (1024, 1024),
            (64, 64),
            Causal::None,
            None,
            false,
        ),
        50.0,
    ),
    alibied(shape(
        "alibi_h8_s1024",
        (1, 8, 8),
        (1024, 1024),
        (64, 64),
        Causal::None,
        None,
        false,
    )),
    sunk(shape(
        "sinks_h8_s1024",
        (1, 8, 8),
        (1024, 1024),
        (64, 64),
        Causal::None,
        None,
        false,
    )),
    // Packed sequences: 8 documents of 1024 tokens, causal within each, as document
    // ids (key tiles of other documents skipped) and as the same dense boolean mask.
    documents(
        shape(
            "docs8_h8_s8192",
            (1, 8, 8),
            (8192, 8192),
            (64, 64),
            Causal::BottomRight,
            None,
            false,
        ),
        8,
        false,
    ),
    documents(
        shape(
            "docs8_dense_h8_s8192",
            (1, 8, 8),
            (8192, 8192),
            (64, 64),
            Causal::BottomRight,
            None,
            false,
        ),
        8,
        true,
    ),
    // User functions: the window above as a mask_mod (against causal_h8_s16384),
    // and a captured relative-position bias as a score_mod (against a_h8_s1024).
    user(
        shape(
            "window_mod_h8_s16384",
            (1, 8, 8),
            (16384, 16384),
            (64, 64),
            Causal::BottomRight,
            None,
            false,
        ),
        USER_WINDOW,
    ),
    user(
        shape(
            "relbias_mod_h8_s1024",
            (1, 8, 8),
            (1024, 1024),
            (64, 64),
            Causal::None,
            None,
            false,
        ),
        USER_RELBIAS,
    ),
    // The paged KV cache: `d`'s decode through a block table of 16-token blocks
    // against the same keys contiguous, and a ragged decode batch of 8 sequences (512 to 4096
    // keys, GQA 32/8) paged against the same batch padded to 4096 with key lengths.
    paged(
        shape(
            "paged_d",
            (1, 32, 32),
            (1, 4096),
            (128, 128),
            Causal::BottomRight,
            None,
            false,
        ),
        16,
    ),
    // `paged_d` with f16, int8 and fp8 pages (q and the output in the run's format): the
    // 8-bit caches' decode against the f16 one.
    kv_in(
        paged(
            shape(
                "paged_d_f16",
                (1, 32, 32),
                (1, 4096),
                (128, 128),
                Causal::BottomRight,
                None,
                false,
            ),
            16,
        ),
        crate::storage::Storage::F16,
    ),
    kv_in(
        paged(
            shape(
                "paged_d_int8",
                (1, 32, 32),
                (1, 4096),
                (128, 128),
                Causal::BottomRight,
                None,
                false,
            ),
            16,
        ),
        crate::storage::Storage::Int8,
    ),
    kv_in(
        paged(
            shape(
                "paged_d_fp8",
                (1, 32, 32),
                (1, 4096),
                (128, 128),
                Causal::BottomRight,
                None,
                false,
            ),
            16,
        ),
        crate::storage::Storage::Fp8,
    ),
    // A long decode: 32768 keys, GQA 32/8 (Llama 3 8B's heads), f16 and int8 pages.
    kv_in(
        paged(
            shape(
                "paged_long_f16",
                (1, 32, 8),
                (1, 32768),
                (128, 128),
                Causal::BottomRight,
                None,
                false,
            ),
            16,
        ),
        crate::storage::Storage::F16,
    ),
    kv_in(
        paged(
            shape(
                "paged_long_int8",
                (1, 32, 8),
                (1, 32768),
                (128, 128),
                Causal::BottomRight,
                None,
                false,
            ),
            16,
        ),
        crate::storage::Storage::Int8,
    ),
    // The same in vLLM's token-major layout `[NB, BS, Hkv, E]` (the CLI's).
    token_major(paged(
        shape(
            "paged_d_token_major",
            (1, 32, 32),
            (1, 4096),
            (128, 128),
            Causal::BottomRight,
            None,
            false,
        ),
        16,
    )),
    shape(
        "contiguous_d",
        (1, 32, 32),
        (1, 4096),
        (128, 128),
        Causal::BottomRight,
        None,
        false,
    ),
    paged(
        shape(
            "ragged8",
            (8, 32, 8),
            (1, 4096),
            (128, 128),
            Causal::BottomRight,
            Some(RAGGED8),
            false,
        ),
        16,
    ),
    shape(
        "ragged8_padded",
        (8, 32, 8),
        (1, 4096),
        (128, 128),
        Causal::BottomRight,
        Some(RAGGED8),
        false,
    ),
    // Shared prefixes: 64 forks of a 4096-token prompt, each with 64 keys of its
    // own, decoding one query each (GQA 32/8): the prompt's keys read once, and per fork.
    cascade64("cascade64", true),
    cascade64("cascade64_unshared", false),
];

/// The shape called `name`.
pub fn find(name: &str) -> Option<&'static Shape> {
    SHAPES.iter().find(|s| s.name == name)
}

/// Every shape name, comma separated (for messages).
pub fn names() -> String {
    SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
}

impl Shape {
    /// The FLOPs that `bench` counts for problem `p` of this shape: `p`'s, except that a
    /// user `mask_mod` ([`USER_WINDOW`]) counts the work of the window it writes (the same as
    /// `window_h8_s16384`), which the problem cannot know.
    pub fn counted_flops(&self, p: &Problem) -> f64 {
        if self.user_mod == Some(USER_WINDOW) {
            if let Ok(w) = p.clone().with_window(Some((1023, 0)), 0) {
                return w.flops();
            }
        }
        p.flops()
    }

    /// A custom shape (for `demo`).
    #[allow(clippy::too_many_arguments)]
    pub fn custom(
        batch: usize,
        q_heads: usize,
        kv_heads: usize,
        seq_q: usize,
        seq_kv: usize,
        head_dim: usize,
        head_dim_v: usize,
        causal: Causal,
    ) -> Shape {
        shape(
            "custom",
            (batch, q_heads, kv_heads),
            (seq_q, seq_kv),
            (head_dim, head_dim_v),
            causal,
            None,
            false,
        )
    }

    /// `[B, Hq, L, E]`.
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.q_heads, self.seq_q, self.head_dim]
    }

    /// `[B, Hkv, S, E]`.
    pub fn k_shape(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.seq_kv, self.head_dim]
    }

    /// `[B, Hkv, S, Ev]`.
    pub fn v_shape(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.seq_kv, self.head_dim_v]
    }

    /// A paged shape's cache blocks: each sequence's, a shared prefix's counted once.
    fn cache_blocks(&self) -> usize {
        let bs = self.paged_block.max(1);
        let shared = self.shared_prefix / bs;
        let lens = self.kv_lens.map_or(vec![self.seq_kv; self.batch], |l| l.to_vec());
        shared + lens.iter().map(|l| l.div_ceil(bs) - shared).sum::<usize>()
    }

    /// The k and v that [`random_inputs`](Self::random_inputs) makes: [`k_shape`](Self::k_shape)
    /// and [`v_shape`](Self::v_shape), or for a [`shared_prefix`](Self::shared_prefix) the
    /// distinct keys `[1, Hkv, P + B (S - P), E]`: the shared ones, then each sequence's own.
    pub fn kv_host_shapes(&self) -> [[usize; 4]; 2] {
        if self.shared_prefix == 0 {
            return [self.k_shape(), self.v_shape()];
        }
        let keys = self.shared_prefix + self.batch * (self.seq_kv - self.shared_prefix);
        [
            [1, self.kv_heads, keys, self.head_dim],
            [1, self.kv_heads, keys, self.head_dim_v],
        ]
    }

    /// `B=.. Hq=.. Hkv=.. L=.. S=.. E=.. Ev=..` plus causal and padding, for reports.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "B={} Hq={} Hkv={} L={} S={} E={} Ev={}",
            self.batch, self.q_heads, self.kv_heads, self.seq_q, self.seq_kv, self.head_dim, self.head_dim_v
        );
        match self.causal {
            Causal::None => {}
            Causal::TopLeft => s.push_str(" causal=top-left"),
            Causal::BottomRight => s.push_str(" causal=bottom-right"),
            Causal::Diagonal(d) => s.push_str(&format!(" causal=diagonal({d})")),
        }
        if let Some(l) = self.kv_lens {
            s.push_str(&format!(" kv_lens={l:?}"));
        }
        if let Some((l, r)) = self.window {
            s.push_str(&format!(" window=({l}, {r})"));
        }
        if let Some(c) = self.softcap {
            s.push_str(&format!(" softcap={c}"));
        }
        if self.alibi {
            s.push_str(" alibi");
        }
        if self.sinks {
            s.push_str(" sink_logits");
        }
        if self.docs > 0 {
            let how = if self.docs_dense { "dense mask" } else { "ids" };
            s.push_str(&format!(" docs={} ({how})", self.docs));
        }
        if self.paged_block > 0 {
            s.push_str(&format!(
                " paged(block {}, {:?})",
                self.paged_block, self.paged_layout
            ));
        }
        if let Some(st) = self.kv_storage {
            s.push_str(&format!(" kv={st}"));
        }
        if self.shared_prefix > 0 {
            let how = if self.cascade {
                "read once"
            } else {
                "read per sequence"
            };
            s.push_str(&format!(" shared_prefix={} ({how})", self.shared_prefix));
        }
        if let Some(src) = self.user_mod {
            s.push_str(if src.contains("score_mod") {
                " score_mod"
            } else {
                " mask_mod"
            });
        }
        s
    }

    /// The query and key document ids of [`docs`](Self::docs) equal documents per batch
    /// (`[B, L]` and `[B, S]`; empty without documents).
    pub fn doc_ids(&self) -> (Vec<i32>, Vec<i32>) {
        let ids = |n: usize| -> Vec<i32> {
            (0..self.batch * n)
                .map(|t| ((t % n) * self.docs / n) as i32)
                .collect()
        };
        if self.docs == 0 {
            return (Vec::new(), Vec::new());
        }
        (ids(self.seq_q), ids(self.seq_kv))
    }

    /// The documents as a dense `[1, 1, L, S]` boolean mask (batch 0's; empty without).
    pub fn doc_mask(&self) -> Vec<bool> {
        let (q, k) = self.doc_ids();
        if q.is_empty() {
            return Vec::new();
        }
        let (l, s) = (self.seq_q, self.seq_kv);
        (0..l * s).map(|t| q[t / s] == k[t % s]).collect()
    }

    /// Validate the problem (as [`Problem`] does) and check that q, k and v each fit one
    /// storage buffer binding of the device, before anything large is allocated.
    pub fn check_fits(&self, ctx: &Context) -> Result<(), String> {
        let mut p = Problem::new(&self.q_shape(), &self.k_shape(), &self.v_shape())
            .map_err(|e| e.to_string())?
            .with_causal(self.causal)
            .with_window(self.window, 0)
            .and_then(|p| p.with_softcap(self.softcap))
            .and_then(|p| {
                p.with_alibi(
                    self.alibi
                        .then(|| crate::problem::alibi_slopes(self.q_heads))
                        .as_deref(),
                )
            })
            .and_then(|p| p.with_sink_logits(self.sinks.then(|| vec![0.0; self.q_heads]).as_deref()))
            .map_err(|e| e.to_string())?;
        if self.docs > 0 && !self.docs_dense {
            let (q, k) = self.doc_ids();
            p = p.with_doc_ids(Some((&q, &k))).map_err(|e| e.to_string())?;
        }
        if let Some(lens) = self.kv_lens {
            p = p.with_kv_lens(lens).map_err(|e| e.to_string())?;
        }
        let limits = ctx.limits();
        let limit = limits.max_buffer_size.min(limits.max_storage_buffer_binding_size);
        let [k, v] = self.kv_host_shapes();
        for (name, shape) in [("q", p.q_shape()), ("k", k), ("v", v)] {
            let bytes = shape.iter().try_fold(4u64, |acc, &d| acc.checked_mul(d as u64));
            if bytes.is_none_or(|b| b > limit) {
                let need = bytes.map_or("more than 2^64".to_string(), |b| b.to_string());
                return Err(format!(
                    "{name} {shape:?} needs {need} bytes, over the device's storage binding \
                     limit of {limit} bytes"
                ));
            }
        }
        Ok(())
    }

    /// Seeded random q, k, v, uniform in `[-1, 1)`.
    pub fn random_inputs(&self, seed: u64) -> HostInputs {
        let mut rng = SplitMix64(seed);
        let mut array = |shape: [usize; 4]| Array4::from_shape_simple_fn(shape, || rng.next_f32());
        HostInputs {
            q: array(self.q_shape()),
            k: array(self.kv_host_shapes()[0]),
            v: array(self.kv_host_shapes()[1]),
        }
    }
}

/// Host copies of the inputs.
#[derive(Debug, Clone)]
pub struct HostInputs {
    /// `[B, Hq, L, E]`.
    pub q: Array4<f32>,
    /// `[B, Hkv, S, E]`.
    pub k: Array4<f32>,
    /// `[B, Hkv, S, Ev]`.
    pub v: Array4<f32>,
}

/// Inputs uploaded to GPU storage buffers.
#[derive(Debug)]
pub struct GpuInputs {
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    /// An 8-bit K's and V's scales ([`Shape::kv_storage`]).
    k_scales: Option<wgpu::Buffer>,
    v_scales: Option<wgpu::Buffer>,
    shape: Shape,
    storage: crate::storage::Storage,
    /// The shape's documents: ids, or the dense boolean mask.
    doc_ids: (Vec<i32>, Vec<i32>),
    doc_mask: Vec<bool>,
    /// The user function's captured table ([`USER_RELBIAS`]'s).
    user_table: Vec<f32>,
    /// A paged shape's block table `[B, max_blocks]` and sequence lengths (empty else): k and
    /// v then hold the caches `[num_blocks, paged_block, Hkv, E]`.
    table: Vec<i32>,
    seq_lens: Vec<usize>,
}

impl GpuInputs {
    /// Upload `host` (which must have `shape`'s sizes) after [`Shape::check_fits`], as f32.
    pub fn upload(ctx: &Context, shape: &Shape, host: &HostInputs) -> Result<GpuInputs, String> {
        Self::upload_as(ctx, shape, host, crate::storage::Storage::F32)
    }

    /// [`upload`](Self::upload) in `storage` (rounded to nearest even); the attention call
    /// reads q, k, v and writes its output in that format.
    pub fn upload_as(
        ctx: &Context,
        shape: &Shape,
        host: &HostInputs,
        storage: crate::storage::Storage,
    ) -> Result<GpuInputs, String> {
        shape.check_fits(ctx)?;
        let buffer = |name: &str, a: &Array4<f32>| -> Result<wgpu::Buffer, String> {
            let data = a.as_slice().ok_or_else(|| format!("{name} is not contiguous"))?;
            Ok(ctx
                .device()
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(name),
                    contents: &storage.encode(data),
                    usage: wgpu::BufferUsages::STORAGE,
                }))
        };
        // A paged shape: each sequence's keys scattered into blocks in a shuffled order (a
        // shared prefix's blocks in every table).
        let (table, seq_lens, kc, vc) = if shape.paged_block > 0 {
            scatter_pages(shape, host)
        } else {
            (Vec::new(), Vec::new(), host.k.clone(), host.v.clone())
        };
        // K and V in the shape's own format, with their scales.
        let kv_fmt = shape.kv_storage.unwrap_or(storage);
        let head_axis =
            if shape.paged_block > 0 && shape.paged_layout == crate::paged::PagedLayout::TokenMajor {
                2
            } else {
                1
            };
        let init = |name: &str, bytes: &[u8]| {
            ctx.device()
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(name),
                    contents: bytes,
                    usage: wgpu::BufferUsages::STORAGE,
                })
        };
        let kv = |name: &str, a: &Array4<f32>| -> Result<(wgpu::Buffer, Option<wgpu::Buffer>), String> {
            let data = a.as_slice().ok_or_else(|| format!("{name} is not contiguous"))?;
            let (codes, scales) = encode_kv(data, a.shape(), head_axis, kv_fmt);
            let scales = scales.map(|s: Vec<f32>| init(&format!("{name} scales"), bytemuck::cast_slice(&s)));
            Ok((init(name, &codes), scales))
        };
        let ((k, k_scales), (v, v_scales)) = (kv("k", &kc)?, kv("v", &vc)?);
        Ok(GpuInputs {
            q: buffer("q", &host.q)?,
            k,
            v,
            k_scales,
            v_scales,
            table,
            seq_lens,
            shape: shape.clone(),
            storage,
            doc_ids: if shape.docs_dense {
                Default::default()
            } else {
                shape.doc_ids()
            },
            doc_mask: if shape.docs_dense {
                shape.doc_mask()
            } else {
                Vec::new()
            },
            user_table: {
                let mut rng = SplitMix64(0x7e1b);
                (0..shape.q_heads * 129).map(|_| rng.next_f32()).collect()
            },
        })
    }

    /// The attention variant of `params` on these buffers (no masks: the shape's causal mask
    /// and key padding are not applied).
    pub fn variant<'a>(&'a self, params: &'a crate::variants::VariantParams) -> crate::variants::Variant<'a> {
        let [q, k, v] = self.tensors();
        crate::variants::Variant::new(q, k, v, params)
    }

    /// q, k and v as tensors in their storage format (k and v with their scales where 8-bit).
    fn tensors<'a>(&'a self) -> [Tensor<'a>; 3] {
        let s = &self.shape;
        let cache = |e: usize| match s.paged_layout {
            crate::paged::PagedLayout::HeadMajor => [s.cache_blocks(), s.kv_heads, s.paged_block, e],
            _ => [s.cache_blocks(), s.paged_block, s.kv_heads, e],
        };
        let (k, v) = if s.paged_block > 0 {
            (cache(s.head_dim), cache(s.head_dim_v))
        } else {
            (s.k_shape(), s.v_shape())
        };
        let kv_fmt = s.kv_storage.unwrap_or(self.storage);
        let with_scales = |t: Tensor<'a>, shape: &[usize], scales: &'a Option<wgpu::Buffer>| match scales {
            Some(b) => {
                let dims = match kv_fmt {
                    crate::storage::Storage::Int8 => shape[..3].to_vec(),
                    _ => vec![s.kv_heads],
                };
                t.with_scales(Tensor::from_buffer(b, crate::storage::Storage::F32, &dims))
            }
            None => t,
        };
        [
            Tensor::from_buffer(&self.q, self.storage, &s.q_shape()),
            with_scales(Tensor::from_buffer(&self.k, kv_fmt, &k), &k, &self.k_scales),
            with_scales(Tensor::from_buffer(&self.v, kv_fmt, &v), &v, &self.v_scales),
        ]
    }

    /// A [`shared_prefix`](Shape::shared_prefix) shape's batch as a [`crate::PagedAttention`]
    /// call (q read as `[B L, Hq, E]`, `L` queries per sequence); `None` for other shapes.
    pub fn paged_attention(&self) -> Option<crate::paged::PagedAttention<'_>> {
        let s = &self.shape;
        if s.shared_prefix == 0 {
            return None;
        }
        let [_, k, v] = self.tensors();
        let q = Tensor::from_buffer(&self.q, self.storage, &[s.batch * s.seq_q, s.q_heads, s.head_dim]);
        Some(
            crate::paged::PagedAttention::new(
                q,
                &vec![s.seq_q; s.batch],
                crate::paged::Pages::new(k, v, s.paged_layout),
                &self.table,
                &self.seq_lens,
            )
            .causal(s.causal)
            .shared_prefix(s.cascade),
        )
    }

    /// The attention call on these buffers, with the shape's causal mask and key padding.
    pub fn sdpa(&self) -> Sdpa<'_> {
        let s = &self.shape;
        let [q, k, v] = self.tensors();
        let mut sdpa = Sdpa::new(q, k, v).causal(s.causal);
        if s.paged_block > 0 {
            sdpa = sdpa.over_pages(&self.table, &self.seq_lens, s.paged_layout);
        } else if let Some(lens) = s.kv_lens {
            sdpa = sdpa.kv_lens(lens);
        }
        if let Some((l, r)) = s.window {
            sdpa = sdpa.window(l, r);
        }
        if let Some(c) = s.softcap {
            sdpa = sdpa.softcap(c);
        }
        if s.alibi {
            sdpa = sdpa.alibi(&crate::problem::alibi_slopes(s.q_heads));
        }
        if s.sinks {
            sdpa = sdpa.sink_logits(&vec![0.0; s.q_heads]);
        }
        if !self.doc_ids.0.is_empty() {
            sdpa = sdpa.doc_ids(&self.doc_ids.0, &self.doc_ids.1);
        }
        if !self.doc_mask.is_empty() {
            let shape = [1, 1, s.seq_q, s.seq_kv];
            sdpa = sdpa.mask(crate::tensor::Mask::from_slice(&self.doc_mask, &shape));
        }
        if let Some(src) = s.user_mod {
            let mut m = crate::user_mod::UserMod::wgsl(src);
            if src.contains("rel(") {
                m = m.capture("rel", &self.user_table);
            }
            sdpa = sdpa.user_mod(m);
        }
        sdpa
    }
}

impl GpuInputs {
    /// Run the forward (its default path) and keep its output and logsumexp, with a random
    /// upstream gradient dO from `seed` (in the inputs' format): what a timed backward starts
    /// from.
    pub fn saved_forward(&self, ctx: &Context, seed: u64) -> crate::error::Result<SavedForward> {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let fw = self.sdpa().record(ctx, &mut encoder)?;
        ctx.queue().submit([encoder.finish()]);
        let p = fw.problem.clone();
        let n: usize = p.out_shape().iter().product();
        // The shapes' own seeded generator, on a stream apart from the inputs'.
        let mut rng = SplitMix64(seed ^ 0xd0d0_d0d0);
        let data: Vec<f32> = (0..n).map(|_| rng.next_f32()).collect();
        let dout = ctx
            .device()
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("bench dout"),
                contents: &self.storage.encode(&data),
                usage: wgpu::BufferUsages::STORAGE,
            });
        Ok(SavedForward {
            out: fw.output,
            lse: fw.lse,
            dout,
            problem: p,
        })
    }
}

/// The forward's output and logsumexp of one shape on the GPU, and a random dO (from
/// [`GpuInputs::saved_forward`]).
#[derive(Debug)]
pub struct SavedForward {
    out: wgpu::Buffer,
    lse: wgpu::Buffer,
    dout: wgpu::Buffer,
    problem: Problem,
}

impl SavedForward {
    /// The backward of `gpu`'s attention on the saved output and logsumexp.
    pub fn backward<'a>(&'a self, gpu: &'a GpuInputs) -> crate::sdpa::backward::Backward<'a> {
        let p = &self.problem;
        gpu.sdpa()
            .backward(Tensor::from_buffer(&self.dout, p.storage.out, &p.out_shape()))
            .saved(
                Tensor::from_buffer(&self.out, p.storage.out, &p.out_shape()),
                Tensor::from_buffer(
                    &self.lse,
                    crate::storage::Storage::F32,
                    &[p.batch, p.q_heads, p.seq_q],
                ),
            )
    }
}

/// A small seeded generator (SplitMix64): a seed gives the same inputs whatever `rand`'s
/// version.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        unit * 2.0 - 1.0
    }
}

/// `data` (a cache of shape `dims`, rows of its last dim, kv heads at `head_axis`) in `fmt`:
/// its bytes, and an 8-bit format's scales (int8 per row; fp8 per head, its largest |x| / 448).
fn encode_kv(
    data: &[f32],
    dims: &[usize],
    head_axis: usize,
    fmt: crate::storage::Storage,
) -> (Vec<u8>, Option<Vec<f32>>) {
    use crate::storage::Storage;
    let e = dims[3];
    match fmt {
        Storage::Int8 => {
            let (c, s) = crate::quant::quantize_int8(data, e);
            let mut b: Vec<u8> = c.iter().map(|&x| x as u8).collect();
            b.resize(b.len().next_multiple_of(16), 0);
            (b, Some(s))
        }
        Storage::Fp8 => {
            let rows = &dims[..3];
            let mut amax = vec![0f32; dims[head_axis]];
            for (r, row) in data.chunks_exact(e).enumerate() {
                let h = crate::storage::head_of_row(r, rows, head_axis);
                amax[h] = row.iter().fold(amax[h], |m, x| m.max(x.abs()));
            }
            let scales: Vec<f32> = amax
                .iter()
                .map(|a| if *a > 0.0 { a / 448.0 } else { 1.0 })
                .collect();
            let c = crate::quant::quantize_fp8_heads(data, e, rows, head_axis, &scales);
            let mut b: Vec<u8> = c.iter().map(|x| x.0).collect();
            b.resize(b.len().next_multiple_of(16), 0);
            (b, Some(scales))
        }
        _ => (fmt.encode(data), None),
    }
}

/// A paged shape's caches `[NB, BS, Hkv, E]` (in its layout) on the host: each sequence's keys
/// scattered into blocks in a shuffled order (a shared prefix's blocks in every table), with
/// the block table and the key lengths.
fn scatter_pages(shape: &Shape, host: &HostInputs) -> (Vec<i32>, Vec<usize>, Array4<f32>, Array4<f32>) {
    let bs = shape.paged_block;
    let lens: Vec<usize> = shape
        .kv_lens
        .map_or(vec![shape.seq_kv; shape.batch], |l| l.to_vec());
    let max_blocks = shape.seq_kv.div_ceil(bs);
    let shared = shape.shared_prefix / bs;
    let nb = shape.cache_blocks();
    let mut order: Vec<usize> = (0..nb).collect();
    let mut rng = SplitMix64(0x9a6e);
    for i in (1..nb).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut table = vec![-1i32; shape.batch * max_blocks];
    let (hkv, e, ev) = (shape.kv_heads, shape.head_dim, shape.head_dim_v);
    let mut kc = Array4::<f32>::zeros((nb, bs, hkv, e));
    let mut vc = Array4::<f32>::zeros((nb, bs, hkv, ev));
    let mut next = order.into_iter();
    // Where key t of sequence b is in host.k: [b, .., t] or, with a shared prefix,
    // among the distinct keys.
    let p = shape.shared_prefix;
    let at = |b: usize, t: usize| match p {
        0 => (b, t),
        _ if t < p => (0, t),
        _ => (0, p + b * (shape.seq_kv - p) + t - p),
    };
    for (b, &len) in lens.iter().enumerate() {
        for blk in 0..len.div_ceil(bs) {
            if b > 0 && blk < shared {
                table[b * max_blocks + blk] = table[blk];
                continue;
            }
            let phys = next.next().expect("counted");
            table[b * max_blocks + blk] = phys as i32;
            for slot in 0..bs.min(len - blk * bs) {
                let (hb, ht) = at(b, blk * bs + slot);
                for h in 0..hkv {
                    kc.slice_mut(ndarray::s![phys, slot, h, ..])
                        .assign(&host.k.slice(ndarray::s![hb, h, ht, ..]));
                    vc.slice_mut(ndarray::s![phys, slot, h, ..])
                        .assign(&host.v.slice(ndarray::s![hb, h, ht, ..]));
                }
            }
        }
    }
    if shape.paged_layout == crate::paged::PagedLayout::HeadMajor {
        kc = kc.permuted_axes([0, 2, 1, 3]).as_standard_layout().to_owned();
        vc = vc.permuted_axes([0, 2, 1, 3]).as_standard_layout().to_owned();
    }
    (table, lens, kc, vc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_mod_shape_counts_the_windows_work() {
        let problem = |name: &str| {
            let s = find(name).unwrap();
            let p = Problem::new(&s.q_shape(), &s.k_shape(), &s.v_shape())
                .unwrap()
                .with_causal(s.causal)
                .with_window(s.window, 0)
                .unwrap();
            (s, p)
        };
        let (w, wp) = problem("window_h8_s16384");
        let (m, mp) = problem("window_mod_h8_s16384");
        let (c, cp) = problem("causal_h8_s16384");
        assert_eq!(m.counted_flops(&mp), w.counted_flops(&wp));
        assert_eq!(c.counted_flops(&cp), cp.flops());
        assert!(m.counted_flops(&mp) * 7.0 < c.counted_flops(&cp));
    }
}
