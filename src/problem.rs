//! The problem description: shapes, masks and options, validated once.
//!
//! [`Problem`] knows every size the kernels need, the FLOP count used in benchmarks and the
//! broadcast strides of masks and biases. It is built by [`Options::problem`](crate::Options::problem)
//! (for [`crate::Sdpa`], the layer and the reference) before any GPU work.

use crate::error::{Error, Result};
use crate::view::pad4;

/// Causal masking, by alignment. The semantics table is in `docs/semantics.md`.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Causal {
    /// No causal mask.
    #[default]
    None,
    /// PyTorch `is_causal=True`: query `i` sees keys `j <= i` (`tril(ones(L, S))`).
    TopLeft,
    /// FlashAttention / KV-cache decoding: query `i` sees keys `j <= i + S - L`.
    /// When `L > S` the first `L - S` query rows see no key and are fully masked.
    /// With key lengths (`kv_lens`), `S` is each batch's key length, not the tensor's: the
    /// last query row is aligned with the batch's last key (FlashAttention's rule for varlen
    /// batches and `flash_attn_with_kvcache`).
    BottomRight,
    /// Query `i` sees keys `j <= i + d` for the given diagonal offset `d`, whatever L and S
    /// (`Diagonal(0)` is [`Causal::TopLeft`]). The causal mask of one block of a longer
    /// sequence (chunked prefill, the ring's blocks: rows from `q0`, keys from `k0` of a
    /// top-left causal sequence take `d = q0 - k0`). Rows that see no key are fully masked.
    Diagonal(i64),
}

impl Causal {
    /// The diagonal offset `d` such that query `i` may see key `j` iff `j <= i + d`, for `L =
    /// seq_q` queries and `seq_kv` keys. `None` when there is no causal mask. With key lengths,
    /// pass the batch's key length as `seq_kv` (see [`Causal::BottomRight`];
    /// [`Causal::offset_for`] does it).
    pub fn offset(self, seq_q: usize, seq_kv: usize) -> Option<i64> {
        match self {
            Causal::None => None,
            Causal::TopLeft => Some(0),
            Causal::BottomRight => Some(seq_kv as i64 - seq_q as i64),
            Causal::Diagonal(d) => Some(d),
        }
    }

    /// [`Causal::offset`] for a batch whose key length is `kv_len` (when key lengths are
    /// given) in a tensor of `seq_kv` keys: bottom-right alignment follows the batch's length.
    pub fn offset_for(self, seq_q: usize, seq_kv: usize, kv_len: Option<usize>) -> Option<i64> {
        self.offset(seq_q, kv_len.unwrap_or(seq_kv))
    }
}

/// A sliding window over the keys, FlashAttention's `window_size = (left, right)`: query `i`
/// sees keys `i + S - L - left <= j <= i + S - L + right` (`-1`: unbounded on that side), and
/// the first `sink_tokens` keys whatever the window (StreamingLLM's attention sinks; the other
/// masks still apply to them). With key lengths, `S` is the batch's key length. The semantics
/// table is in `docs/semantics.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window {
    /// Keys before the aligned diagonal a query sees (`-1`: all of them).
    pub left: i64,
    /// Keys after the aligned diagonal a query sees (`-1`: all of them).
    pub right: i64,
    /// The first keys every query sees, exempt from the window.
    pub sink_tokens: usize,
}

impl Window {
    /// Whether query `i` may see key `j` under the window, for `L = seq_q` queries and a
    /// batch of `seq_kv` keys (its key length when key lengths are given).
    pub fn allows(&self, i: usize, j: usize, seq_q: usize, seq_kv: usize) -> bool {
        if j < self.sink_tokens {
            return true;
        }
        let c = i as i64 + seq_kv as i64 - seq_q as i64;
        let j = j as i64;
        (self.left < 0 || j >= c - self.left) && (self.right < 0 || j <= c + self.right)
    }
}

/// Document ids of packed sequences (see [`Problem::with_doc_ids`]): query `i` of batch `b`
/// sees key `j` only if `q[b·L + i] == k[b·S + j]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DocIds {
    /// The document of each query, `[B, L]` row-major.
    pub q: Vec<i32>,
    /// The document of each key, `[B, S]` row-major.
    pub k: Vec<i32>,
}

/// The ALiBi paper's slopes for `heads` query heads (Press et al., 2022; the reference code's
/// `get_slopes`): `2^(-8 (h + 1) / n)` for a power of two `n`; otherwise those of the largest
/// power of two below, then every other slope of twice that. For [`Problem::with_alibi`] and
/// the `alibi` option.
pub fn alibi_slopes(heads: usize) -> Vec<f32> {
    fn pow2(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-8.0 / n as f64);
        (1..=n).map(|h| start.powi(h as i32)).collect()
    }
    if heads == 0 {
        return Vec::new();
    }
    let m = 1usize << heads.ilog2();
    let mut out = pow2(m);
    out.extend(pow2(2 * m).into_iter().step_by(2).take(heads - m));
    out.into_iter().map(|x| x as f32).collect()
}

/// A `[B|1, H|1, L|1, S|1]` broadcast shape of a mask or bias, with element strides
/// (0 on broadcast dimensions) into its row-major storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Broadcast {
    /// The 4-D shape after left-padding with ones.
    pub shape: [usize; 4],
}

impl Broadcast {
    /// Validate `shape` (rank 1 to 4) against the score shape `[B, Hq, L, S]`.
    pub fn new(tensor: &'static str, shape: &[usize], target: [usize; 4]) -> Result<Self> {
        if shape.is_empty() || shape.len() > 4 {
            return Err(Error::WrongRank {
                tensor,
                expected: 4,
                actual: shape.len(),
                shape: shape.to_vec(),
            });
        }
        if shape.contains(&0) {
            return Err(Error::ZeroSized {
                tensor,
                shape: shape.to_vec(),
            });
        }
        let s4 = pad4(shape);
        for d in 0..4 {
            if s4[d] != 1 && s4[d] != target[d] {
                return Err(Error::NotBroadcastable {
                    tensor,
                    shape: shape.to_vec(),
                    target: target.to_vec(),
                });
            }
        }
        Ok(Broadcast { shape: s4 })
    }

    /// Element strides of the row-major storage, 0 on broadcast dimensions.
    pub fn strides(&self) -> [usize; 4] {
        let s = self.shape;
        let dense = [s[1] * s[2] * s[3], s[2] * s[3], s[3], 1];
        let mut out = [0; 4];
        for d in 0..4 {
            out[d] = if s[d] == 1 { 0 } else { dense[d] };
        }
        out
    }

    /// Number of stored elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Always false: broadcast shapes have no zero dimension.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// A validated attention problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Batch `B`.
    pub batch: usize,
    /// Query heads `Hq`.
    pub q_heads: usize,
    /// Key/value heads `Hkv` (divides `Hq`).
    pub kv_heads: usize,
    /// Query length `L`.
    pub seq_q: usize,
    /// Key/value length `S`.
    pub seq_kv: usize,
    /// Query/key head dimension `E`.
    pub head_dim: usize,
    /// Value head dimension `Ev`.
    pub head_dim_v: usize,
    /// Softmax scale (default `1/sqrt(E)`).
    pub scale: f32,
    /// Causal alignment.
    pub causal: Causal,
    /// Boolean mask broadcast shape, if any.
    pub mask: Option<Broadcast>,
    /// Additive bias broadcast shape, if any.
    pub bias: Option<Broadcast>,
    /// Per-batch key lengths, if any.
    pub kv_lens: Option<Vec<u32>>,
    /// A sliding window (with attention-sink tokens), if any.
    pub window: Option<Window>,
    /// The logit softcap `C` (`s = C tanh(s / C)`, Gemma 2 and Grok), if any: finite, > 0.
    pub softcap: Option<f32>,
    /// ALiBi slopes, one per query head (`s -= slope[h] |i + S - L - j|`), if any.
    pub alibi: Option<Vec<f32>>,
    /// Sink logits, one per query head, added to each row's softmax denominator with no value
    /// (gpt-oss), if any.
    pub sink_logits: Option<Vec<f32>>,
    /// Document ids of packed sequences (query `i` sees key `j` only within its document), if
    /// any.
    pub doc_ids: Option<DocIds>,
    /// User WGSL functions (checked), if any.
    pub(crate) user_fns: Option<std::sync::Arc<crate::user_mod::UserFns>>,
    /// Added to the diagonal `S - L` that the window and ALiBi measure from: a ring pair's
    /// shift, so that its local positions measure the global problem's distances (0 else).
    pub(crate) diag_shift: i64,
    /// Added to the query and key positions the user functions see: a ring pair's chunk
    /// starts ([0, 0] else).
    pub(crate) pos_offset: [usize; 2],
    /// The storage formats of q, k, v, the bias and the output (all f32 by default).
    pub storage: crate::storage::Formats,
    /// Where q, k, v, the output (and the backward's dout) lie in their buffers, for those
    /// that are not dense (see [`TensorLayout`](crate::TensorLayout)).
    pub(crate) views: crate::view::Views,
    /// K and V read from paged caches through a block table ([`Sdpa::paged`](crate::Sdpa::paged)),
    /// if so: the problem's k and v shapes are then the logical `[B, Hkv, S, E]`, S the
    /// longest sequence.
    pub(crate) paged: Option<Paged>,
    /// RoPE applied to q as the kernels read it ([`Sdpa::rope`](crate::Sdpa::rope)), if any,
    /// with its rotated dims.
    pub(crate) rope: Option<(crate::rope::Rope, usize)>,
}

/// The block table of a paged K/V read: key `t` of sequence `b` is token slot `t % block_size`
/// of cache block `table[b * max_blocks + t / block_size]`. Entries past a sequence's last
/// block are 0 here (the caller's may be anything): the kernels read (and mask) keys past a
/// sequence's length in bounds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Paged {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in each cache.
    pub num_blocks: usize,
    /// Table entries per sequence.
    pub max_blocks: usize,
    /// `[B, max_blocks]`, every entry below `num_blocks`.
    pub table: Vec<u32>,
    /// The caches are [`PagedLayout::HeadMajor`](crate::PagedLayout::HeadMajor).
    pub head_major: bool,
}

/// K and V read as paged caches, checked where the call was built (`paged/pages.rs`): the
/// logical k and v shapes `[B, Hkv, S, E]` (S the longest sequence), the key lengths, the
/// block table, and how the kernels read the caches (their element offsets and strides).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PagedKv {
    pub k_shape: [usize; 4],
    pub v_shape: [usize; 4],
    pub lens: Vec<usize>,
    pub paged: Paged,
    pub views: [crate::view::View; 2],
}

impl PagedKv {
    /// Caches of `paged`'s blocks with `hkv` heads of dims `e` and `ev`, for sequences of
    /// `lens` keys; the caches start `offsets` elements into their bindings.
    pub(crate) fn new(paged: Paged, lens: Vec<usize>, [hkv, e, ev]: [usize; 3], offsets: [usize; 2]) -> Self {
        let b = lens.len();
        let s = lens.iter().copied().max().unwrap_or(1).max(1);
        let bs = paged.block_size;
        let view = |offset, e: usize| crate::view::View {
            offset,
            strides: if paged.head_major {
                [0, bs * e, e, 1]
            } else {
                [0, e, hkv * e, 1]
            },
        };
        PagedKv {
            k_shape: [b, hkv, s, e],
            v_shape: [b, hkv, s, ev],
            views: [view(offsets[0], e), view(offsets[1], ev)],
            lens,
            paged,
        }
    }
}

pub(crate) fn dims4(tensor: &'static str, shape: &[usize]) -> Result<[usize; 4]> {
    let s: [usize; 4] = shape.try_into().map_err(|_| Error::WrongRank {
        tensor,
        expected: 4,
        actual: shape.len(),
        shape: shape.to_vec(),
    })?;
    if s.contains(&0) {
        return Err(Error::ZeroSized {
            tensor,
            shape: shape.to_vec(),
        });
    }
    Ok(s)
}

impl Problem {
    /// Validate q `[B, Hq, L, E]`, k `[B, Hkv, S, E]`, v `[B, Hkv, S, Ev]`.
    pub fn new(q: &[usize], k: &[usize], v: &[usize]) -> Result<Self> {
        let [b, hq, l, e] = dims4("q", q)?;
        let [kb, hkv, s, ke] = dims4("k", k)?;
        if kb != b || ke != e {
            return Err(Error::ShapeMismatch {
                tensor: "k",
                expected: vec![b, hkv, s, e],
                actual: k.to_vec(),
            });
        }
        let [vb, vh, vs, ev] = dims4("v", v)?;
        if vb != b || vh != hkv || vs != s {
            return Err(Error::ShapeMismatch {
                tensor: "v",
                expected: vec![b, hkv, s, ev],
                actual: v.to_vec(),
            });
        }
        if hq % hkv != 0 {
            return Err(Error::HeadsNotDivisible {
                q_heads: hq,
                kv_heads: hkv,
            });
        }
        Ok(Problem {
            batch: b,
            q_heads: hq,
            kv_heads: hkv,
            seq_q: l,
            seq_kv: s,
            head_dim: e,
            head_dim_v: ev,
            scale: 1.0 / (e as f32).sqrt(),
            causal: Causal::None,
            mask: None,
            bias: None,
            kv_lens: None,
            window: None,
            softcap: None,
            alibi: None,
            sink_logits: None,
            doc_ids: None,
            user_fns: None,
            diag_shift: 0,
            pos_offset: [0, 0],
            storage: Default::default(),
            views: Default::default(),
            paged: None,
            rope: None,
        })
    }

    /// Set the storage formats.
    pub fn with_storage(mut self, storage: crate::storage::Formats) -> Self {
        self.storage = storage;
        self
    }

    /// Set the scale (must be finite).
    /// The kernels use its f32 rounding, which must be finite too.
    pub fn with_scale(mut self, scale: Option<f64>) -> Result<Self> {
        if let Some(s) = scale {
            let s32 = s as f32;
            if !s.is_finite() || !s32.is_finite() {
                return Err(Error::InvalidScale { scale: s });
            }
            self.scale = s32;
        }
        Ok(self)
    }

    /// Set the causal alignment.
    pub fn with_causal(mut self, causal: Causal) -> Self {
        self.causal = causal;
        self
    }

    /// Set a sliding window `(left, right)` (each `-1` or more) with `sink_tokens` keys
    /// exempt from it; sink tokens without a window are an error (they would change nothing).
    pub fn with_window(mut self, window: Option<(i64, i64)>, sink_tokens: usize) -> Result<Self> {
        let Some((left, right)) = window else {
            if sink_tokens > 0 {
                return Err(Error::InvalidModifier {
                    modifier: "sink_tokens",
                    reason: format!(
                        "{sink_tokens} sink tokens without a sliding window change nothing; set a window"
                    ),
                });
            }
            self.window = None;
            return Ok(self);
        };
        for (side, v) in [("left", left), ("right", right)] {
            if v < -1 {
                return Err(Error::InvalidModifier {
                    modifier: "window",
                    reason: format!("{side} = {v}: each side is -1 (unbounded) or a number of keys >= 0"),
                });
            }
        }
        self.window = Some(Window {
            left,
            right,
            sink_tokens,
        });
        Ok(self)
    }

    /// Set the logit softcap `C`: each scaled logit becomes `C tanh(s / C)` before the bias
    /// and ALiBi are added (Gemma 2, Grok). `C` must be > 0 with `C` and `1/C` normal f32
    /// numbers (about 1.2e-38 to 8.5e37).
    pub fn with_softcap(mut self, softcap: Option<f32>) -> Result<Self> {
        if let Some(c) = softcap {
            // The kernels multiply by 1/C: both C and 1/C must be normal f32 numbers (a GPU
            // may flush subnormals to 0), so C lies in about [1.2e-38, 8.5e37].
            if !(c > 0.0 && c.is_normal() && (1.0 / c).is_normal()) {
                return Err(Error::InvalidModifier {
                    modifier: "softcap",
                    reason: format!(
                        "C = {c}: the softcap is a number > 0 whose reciprocal is a normal f32 \
                         (about 1.2e-38 to 8.5e37)"
                    ),
                });
            }
        }
        self.softcap = softcap;
        Ok(self)
    }

    /// Set ALiBi slopes, one per query head: the logit of query `i` and key `j` in head `h`
    /// gets `- slopes[h] |i + S - L - j|` (bottom-right aligned like the causal mask and the
    /// window; with key lengths, `S` is the batch's). Each slope must be finite.
    pub fn with_alibi(mut self, slopes: Option<&[f32]>) -> Result<Self> {
        self.alibi = self.per_head("alibi", ("slope", "slopes"), slopes)?;
        Ok(self)
    }

    /// `values` (one per query head, each finite) as the modifier `modifier` stores them, or
    /// its typed error naming `noun` (singular, plural).
    fn per_head(
        &self,
        modifier: &'static str,
        (one, many): (&str, &str),
        values: Option<&[f32]>,
    ) -> Result<Option<Vec<f32>>> {
        let Some(v) = values else { return Ok(None) };
        if v.len() != self.q_heads {
            return Err(Error::InvalidModifier {
                modifier,
                reason: format!(
                    "{} {many} for {} query heads: give one per query head",
                    v.len(),
                    self.q_heads
                ),
            });
        }
        if let Some((h, x)) = v.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(Error::InvalidModifier {
                modifier,
                reason: format!("{one} {h} is {x}: {many} are finite"),
            });
        }
        Ok(Some(v.to_vec()))
    }

    /// Set sink logits, one per query head: each row's softmax gets `exp(sink[h])` added to its
    /// denominator, with no value (gpt-oss's attention sinks): `P_ij = exp(s_ij) / (sum_j
    /// exp(s_ij) + exp(sink[h]))`, so a row's weights sum to less than 1 and a row with no
    /// allowed key is 0. Each must be finite. The backward gives their gradient.
    pub fn with_sink_logits(mut self, sinks: Option<&[f32]>) -> Result<Self> {
        self.sink_logits = self.per_head("sink_logits", ("sink logit", "sink logits"), sinks)?;
        Ok(self)
    }

    /// Set document ids (packed sequences, FlexAttention's document mask): `q` gives the
    /// document of each query (`[B, L]` row-major), `k` of each key (`[B, S]`); query `i` of
    /// batch `b` sees key `j` only if `q[b·L + i] == k[b·S + j]`. Any i32 values (a query whose
    /// document has no key gets a fully masked row). Key tiles holding no document of a query
    /// tile are skipped whole, so packed documents cost about their own attention, not the
    /// whole sequence's.
    pub fn with_doc_ids(mut self, ids: Option<(&[i32], &[i32])>) -> Result<Self> {
        if let Some((q, k)) = ids {
            let (bl, bs) = (self.batch * self.seq_q, self.batch * self.seq_kv);
            if q.len() != bl || k.len() != bs {
                return Err(Error::InvalidModifier {
                    modifier: "doc_ids",
                    reason: format!(
                        "{} query and {} key document ids for B = {}, L = {}, S = {}: give [B, L] = \
                         {bl} and [B, S] = {bs}",
                        q.len(),
                        k.len(),
                        self.batch,
                        self.seq_q,
                        self.seq_kv
                    ),
                });
            }
            self.doc_ids = Some(DocIds {
                q: q.to_vec(),
                k: k.to_vec(),
            });
        } else {
            self.doc_ids = None;
        }
        Ok(self)
    }

    /// Set user WGSL functions (see [`UserMod`](crate::UserMod)): the source and captures are
    /// checked by naga (a typed error before any GPU work).
    pub fn with_user_mod(mut self, m: Option<&crate::user_mod::UserMod>) -> Result<Self> {
        self.user_fns = m.map(|m| m.fns()).transpose()?;
        Ok(self)
    }

    /// Whether the problem has a user `score_mod`.
    pub fn has_score_mod(&self) -> bool {
        self.user_fns.as_ref().is_some_and(|u| u.score)
    }

    /// Whether the problem has a user `mask_mod`.
    pub(crate) fn has_mask_mod(&self) -> bool {
        self.user_fns.as_ref().is_some_and(|u| u.mask)
    }

    /// The user functions' capture elements, all of them (0 without captures).
    pub(crate) fn capture_len(&self) -> usize {
        self.user_fns.as_ref().map_or(0, |u| u.capture_len())
    }

    /// Whether the problem has user WGSL functions.
    pub fn has_user_mod(&self) -> bool {
        self.user_fns.is_some()
    }

    /// Whether the document ids (if any) let query `i` of batch `b` see key `j`.
    pub fn docs_allow(&self, b: usize, i: usize, j: usize) -> bool {
        self.doc_ids
            .as_ref()
            .is_none_or(|d| d.q[b * self.seq_q + i] == d.k[b * self.seq_kv + j])
    }

    /// The ALiBi distance of query `i` and key `j` in a batch of `seq_kv` keys (its key
    /// length when key lengths are given): `|i + S - L - j|`.
    pub fn alibi_distance(&self, i: usize, j: usize, seq_kv: usize) -> f64 {
        (i as f64 + seq_kv as f64 - self.seq_q as f64 - j as f64).abs()
    }

    /// Add a boolean mask of the given (broadcastable) shape.
    pub fn with_mask(mut self, shape: &[usize]) -> Result<Self> {
        self.mask = Some(Broadcast::new("mask", shape, self.score_shape())?);
        Ok(self)
    }

    /// Add an additive bias of the given (broadcastable) shape.
    pub fn with_bias(mut self, shape: &[usize]) -> Result<Self> {
        self.bias = Some(Broadcast::new("bias", shape, self.score_shape())?);
        Ok(self)
    }

    /// Add per-batch key lengths (each `<= S`; 0 masks every key of that batch).
    pub fn with_kv_lens(mut self, lens: &[usize]) -> Result<Self> {
        if lens.len() != self.batch {
            return Err(Error::KvLensCount {
                expected: self.batch,
                actual: lens.len(),
            });
        }
        for (batch, &len) in lens.iter().enumerate() {
            if len > self.seq_kv {
                return Err(Error::KvLenOutOfRange {
                    batch,
                    len,
                    max: self.seq_kv,
                });
            }
        }
        self.kv_lens = Some(lens.iter().map(|&l| l as u32).collect());
        Ok(self)
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// `[B, Hq, L, S]`.
    pub fn score_shape(&self) -> [usize; 4] {
        [self.batch, self.q_heads, self.seq_q, self.seq_kv]
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

    /// `[B, Hq, L, Ev]`.
    pub fn out_shape(&self) -> [usize; 4] {
        [self.batch, self.q_heads, self.seq_q, self.head_dim_v]
    }

    /// Where q, k, v, the output and dout lie: their views, or dense.
    pub(crate) fn views_or_dense(&self) -> [crate::view::View; 5] {
        let dense = crate::view::View::dense;
        let x = &self.views;
        [
            x.q.unwrap_or(dense(self.q_shape())),
            x.k.unwrap_or(dense(self.k_shape())),
            x.v.unwrap_or(dense(self.v_shape())),
            x.out.unwrap_or(dense(self.out_shape())),
            x.dout.unwrap_or(dense(self.out_shape())),
        ]
    }

    /// Whether the kernels can read q, k, v and the output as vec4 rows: E and Ev multiples of
    /// 4, and so every view's offset and strides.
    pub(crate) fn vec4_rows(&self) -> bool {
        self.head_dim.is_multiple_of(4) && self.head_dim_v.is_multiple_of(4) && self.views.aligned(4)
    }

    /// `B * Hq`.
    pub fn batch_heads(&self) -> usize {
        self.batch * self.q_heads
    }

    /// FLOPs counted as benchmarks report them: `2·B·Hq·L·S·(E + Ev)` (that is `4·B·H·L·S·E`
    /// when `E == Ev`), halved when a causal mask is set; with a sliding window, `2·B·Hq·(E +
    /// Ev)` per (query, key) pair the window and the causal mask allow (counted row by row;
    /// key lengths not counted), so that a window's GFLOP/s count the work it needs.
    pub fn flops(&self) -> f64 {
        let per_pair = 2.0 * self.batch_heads() as f64 * (self.head_dim + self.head_dim_v) as f64;
        if let Some(w) = self.window {
            let (l, s) = (self.seq_q as i64, self.seq_kv as i64);
            let causal = self.causal.offset(self.seq_q, self.seq_kv);
            let pairs: i64 = (0..l)
                .map(|i| {
                    let c = i + s - l;
                    // Keys [0, end) under the causal mask; the window's [lo, hi]; sinks [0, n).
                    let end = causal.map_or(s, |d| (i + d + 1).clamp(0, s));
                    let lo = if w.left < 0 { 0 } else { (c - w.left).max(0) };
                    let hi = if w.right < 0 {
                        end
                    } else {
                        (c + w.right + 1).clamp(0, end)
                    };
                    let inside = (hi - lo).max(0);
                    let sinks = (w.sink_tokens as i64).min(end).min(lo).max(0);
                    inside + sinks
                })
                .sum();
            return per_pair * pairs as f64;
        }
        let f = per_pair * self.seq_q as f64 * self.seq_kv as f64;
        if self.causal == Causal::None {
            f
        } else {
            f / 2.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window's FLOPs count the pairs it allows: (1023, 0) with causal at L = S = 16384
    /// is 1024 keys per row but the first 1023 rows' fewer; sink tokens add theirs.
    #[test]
    fn alibi_slopes_follow_the_paper() {
        // 8 heads: 1/2, 1/4, ..., 1/256.
        let s8 = alibi_slopes(8);
        assert_eq!(s8, (1..=8).map(|h| 0.5f32.powi(h)).collect::<Vec<_>>());
        // 12 heads: the 8 above, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other of 16's).
        let s12 = alibi_slopes(12);
        assert_eq!(&s12[..8], &s8[..]);
        for (k, x) in s12[8..].iter().enumerate() {
            assert!((*x as f64 - 2f64.powf(-0.5 - k as f64)).abs() < 1e-7, "{k}: {x}");
        }
        assert_eq!(alibi_slopes(1), vec![2f32.powi(-8)]);
    }

    #[test]
    fn window_flops_count_allowed_pairs() {
        let p = Problem::new(&[1, 8, 16384, 64], &[1, 8, 16384, 64], &[1, 8, 16384, 64])
            .unwrap()
            .with_causal(Causal::BottomRight);
        let w = p.clone().with_window(Some((1023, 0)), 0).unwrap();
        let pairs = 16384 * 1024 - 1023 * 1024 / 2;
        assert_eq!(w.flops(), 2.0 * 8.0 * 128.0 * pairs as f64);
        assert!(p.flops() / w.flops() > 8.0);
        let small = Problem::new(&[1, 1, 4, 2], &[1, 1, 6, 2], &[1, 1, 6, 2]).unwrap();
        // L = 4, S = 6: diagonals c = 2..5; window (1, 0) covers {c-1, c}; sinks {0}.
        let w = small.with_window(Some((1, 0)), 1).unwrap();
        assert_eq!(w.flops(), 2.0 * 4.0 * (4 * 2 + 4) as f64);
    }

    #[test]
    fn broadcast_pads_and_strides() {
        let b = Broadcast::new("mask", &[5, 7], [2, 3, 5, 7]).unwrap();
        assert_eq!(b.shape, [1, 1, 5, 7]);
        assert_eq!(b.strides(), [0, 0, 7, 1]);
        let b = Broadcast::new("mask", &[2, 1, 1, 7], [2, 3, 5, 7]).unwrap();
        assert_eq!(b.strides(), [7, 0, 0, 1]);
        assert!(Broadcast::new("mask", &[3, 5, 7], [2, 4, 5, 7]).is_err());
    }

    #[test]
    fn bottom_right_offset() {
        assert_eq!(Causal::BottomRight.offset(3, 10), Some(7));
        assert_eq!(Causal::BottomRight.offset(10, 3), Some(-7));
        assert_eq!(Causal::TopLeft.offset(10, 3), Some(0));
        assert_eq!(Causal::Diagonal(-4).offset(10, 3), Some(-4));
    }
}
