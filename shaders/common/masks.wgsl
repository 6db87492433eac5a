// The masks every attention kernel applies, in one place: the causal limit, the key lengths,
// the sliding window, the document ids, the packed boolean mask, the additive bias and the
// score modifiers (softcap, ALiBi, sink logits). Bindings 0 (mask) and 1 (bias) of every
// attention kernel; the bias is declared by the host in its storage format
// (src/kernels/access.rs), and so is `kv_len(b)`, the key length of batch b: binding 2 of the
// forward kernels, a tail of the statistics buffer in the backward ones (src/kernels/mod.rs).
//
// The including kernel's `Params` (generated from Rust) has `m: Masks` and the key length
// `s`; its prelude declares HAS_MASK, HAS_BIAS and HAS_WINDOW (the mask, bias and window code
// is compiled out when absent: CPU adapters execute both sides of every branch). `Masks` fields: has_causal,
// causal_off (query i may see keys j <= i + causal_off, plus kv_len(b) when causal_by_len is
// set: bottom-right alignment to each batch's key length), has_lens, the packed mask's word
// strides mask_b, mask_h, mask_l (0 on broadcast dimensions) and the bias's element offset and
// strides bias_off, bias_b, bias_h, bias_l, bias_s (a view's, or its dense broadcast ones).

@group(0) @binding(0) var<storage, read> mask: array<u32>;

// The key length of batch b: auxiliary word b (the forward kernels' binding 2, the backward's
// statistics tail; `aux_word` is declared by the host or common/backward.wgsl).
fn kv_len(b: u32) -> u32 {
    return aux_word(b);
}

// The ALiBi slope of query head h (HAS_ALIBI): auxiliary word alibi_off + h, as f32 bits.
fn alibi_slope(h: u32) -> f32 {
    return bitcast<f32>(aux_word(p.m.alibi_off + h));
}

// The sink logit of query head h (HAS_SINKS): auxiliary word sink_off + h, as f32 bits.
fn sink_logit(h: u32) -> f32 {
    return bitcast<f32>(aux_word(p.m.sink_off + h));
}

// A row's final state (max `m`, sum `s` of exp(logit - m)) with head h's sink logit added to
// the denominator (HAS_SINKS): vec3(max', sum', f), where an accumulator kept under `m` moves
// to max' by the factor f. A row with no allowed key (m = START, s = 0) gets sum' = 1 and
// f = 0: output 0, logsumexp the sink logit.
fn with_sink(m: f32, s: f32, h: u32) -> vec3<f32> {
    if (!HAS_SINKS) {
        return vec3<f32>(m, s, 1.0);
    }
    let sk = sink_logit(h);
    let m2 = max(m, sk);
    let f = rescale(m, m2);
    return vec3<f32>(m2, s * f + exp(sk - m2), f);
}

// The position of query `i` of batch `b` among the keys, for the user functions (whose `i` is
// the query's index in the call, plus a ring chunk's start): the queries are the newest
// positions, so the last query of a batch is at its last key (`S - L + i`, or
// `kv_len(b) - L + i` with key lengths: a KV cache's decode query is at the cache's length - 1).
fn q_pos(b: u32, i: u32) -> u32 {
    var off = p.m.qpos_off;
    if (p.m.has_lens != 0u) {
        off += i32(kv_len(b));
    }
    return u32(max(i32(i) + off, 0));
}

// The causal offset of batch `b`: query i may see keys j <= i + causal_offset(b).
fn causal_offset(b: u32) -> i32 {
    return p.m.causal_off + select(0, i32(kv_len(b)), p.m.causal_by_len != 0u);
}

// End (exclusive) of the keys query row `i` of batch `b` may see under the causal limit.
fn causal_end(b: u32, i: u32) -> u32 {
    return u32(clamp(i32(i) + causal_offset(b) + 1, 0, i32(p.s)));
}

// The sliding window's diagonal of batch `b`: query i is aligned with key i + window_offset(b)
// (S - L; with key lengths, the batch's length - L).
fn window_offset(b: u32) -> i32 {
    if (p.m.has_lens != 0u) {
        return p.m.win_off + i32(kv_len(b));
    }
    return p.m.win_off;
}

// Whether the sliding window (HAS_WINDOW) lets query `i` of batch `b` see key `j`: within
// [c - left, c + right] around its diagonal c (a side -1: unbounded), or a sink token.
fn window_allows(b: u32, i: u32, j: u32) -> bool {
    let c = i32(i) + window_offset(b);
    let jj = i32(j);
    let inside = (p.m.win_left < 0 || jj >= c - p.m.win_left) && (p.m.win_right < 0 || jj <= c + p.m.win_right);
    return inside || j < p.m.win_sinks;
}

// The first key the window's left side lets query row `i` of batch `b` see (0 without one); the
// sink tokens before it stay visible. Grows with i: a tile of rows takes its first row's.
fn key_begin(b: u32, i: u32) -> u32 {
    if (!HAS_WINDOW || p.m.win_left < 0) {
        return 0u;
    }
    return u32(clamp(i32(i) + window_offset(b) - p.m.win_left, 0, i32(p.s)));
}

// The first key worth visiting at or after key `j` for query row `i` of batch `b`: past the
// sink tokens, keys before the window's first are skipped (j itself otherwise).
fn first_key(b: u32, i: u32, j: u32) -> u32 {
    if (HAS_WINDOW && j >= p.m.win_sinks) {
        return max(j, key_begin(b, i));
    }
    return j;
}

// The key tile to visit at or after tile start `j` (tiles of `tile` keys, `begin` the rows'
// smallest key_begin): the tiles past the sink tokens and wholly before `begin` are skipped.
fn next_tile(j: u32, begin: u32, tile: u32) -> u32 {
    let bt = begin / tile * tile;
    return select(j, bt, HAS_WINDOW && j >= p.m.win_sinks && j < bt);
}

// Document ids (HAS_DOCS): query i of batch b sees key j only if their documents are equal.
// The ids are auxiliary words from p.m.doc_q ([B, L]) and p.m.doc_k ([B, S]); the (min, max)
// of each block of DOC_BLOCK queries and keys follow (p.m.doc_qb, p.m.doc_kb), for skipping
// key tiles that hold none of a query tile's documents.
const DOC_BLOCK: u32 = 16u;

fn docs_allow(b: u32, i: u32, j: u32) -> bool {
    let qd = aux_word(p.m.doc_q + b * p.m.doc_l + min(i, p.m.doc_l - 1u));
    let kd = aux_word(p.m.doc_k + b * p.s + min(j, p.s - 1u));
    return qd == kd;
}

// The (min, max) document id of rows [a, e) (a < e <= n) of batch b's n ids, from the block
// pairs at word `off`: of the blocks covering the rows, so a superset's range.
fn doc_span(off: u32, n: u32, b: u32, a: u32, e: u32) -> vec2<i32> {
    let nb = (n + DOC_BLOCK - 1u) / DOC_BLOCK;
    var lo = bitcast<i32>(0x7fffffffu);
    var hi = bitcast<i32>(0x80000000u);
    for (var t = a / DOC_BLOCK; t <= (e - 1u) / DOC_BLOCK; t++) {
        let w = off + (b * nb + t) * 2u;
        lo = min(lo, bitcast<i32>(aux_word(w)));
        hi = max(hi, bitcast<i32>(aux_word(w + 1u)));
    }
    return vec2<i32>(lo, hi);
}

// The document range of query rows [i0, i1) of batch b (clamped into L; HAS_DOCS).
fn query_docs(b: u32, i0: u32, i1: u32) -> vec2<i32> {
    let e = min(i1, p.m.doc_l);
    return doc_span(p.m.doc_qb, p.m.doc_l, b, min(i0, e - 1u), e);
}

// Whether keys [j0, j0 + n) of batch b may hold a document in range `qd` (HAS_DOCS; true
// without document ids).
fn key_docs_meet(b: u32, j0: u32, n: u32, qd: vec2<i32>) -> bool {
    if (!HAS_DOCS || j0 >= p.s) {
        return true;
    }
    let kd = doc_span(p.m.doc_kb, p.s, b, j0, min(j0 + n, p.s));
    return kd.x <= qd.y && qd.x <= kd.y;
}

// Whether the user's mask_mod (HAS_MASK_MOD) allows any pair of query rows [i0, i0 + ni) and
// keys [j0, j0 + nj) of batch b, head h: the workgroup's `nt` invocations (this one `tid`)
// evaluate it on every pair of the block, their verdicts met through workgroup memory. Called
// by every invocation of the workgroup alike (it has barriers). The matrix units' kernels
// take another form of this function (src/kernels/mod.rs, COOP_MOD_ANY: votes in an array, no
// atomics), from here to "mask_mod_any end".
var<workgroup> wg_mod_any: atomic<u32>;
var<workgroup> wg_mod_flag: u32;
fn mask_mod_any(b: u32, h: u32, i0: u32, ni: u32, j0: u32, nj: u32, tid: u32, nt: u32) -> bool {
    if (tid == 0u) {
        atomicStore(&wg_mod_any, 0u);
    }
    workgroupBarrier();
    var any = false;
    for (var t = tid; t < ni * nj; t += nt) {
        let i = i0 + t / nj;
        let j = j0 + t % nj;
        any = any || (i < p.m.doc_l && j < p.s && u_mask_mod(b, h, min(i, p.m.doc_l - 1u) + p.m.pos_q, min(j, p.s - 1u) + p.m.pos_k));
    }
    if (any) {
        atomicOr(&wg_mod_any, 1u);
    }
    workgroupBarrier();
    if (tid == 0u) {
        wg_mod_flag = atomicLoad(&wg_mod_any);
    }
    return workgroupUniformLoad(&wg_mod_flag) != 0u;
}
// mask_mod_any end

// The mask_mod block map (p.m.mod_map != 0: built by shaders/mod_map.wgsl, cached by the
// host per source, captures and shape, in binding 0 from word p.m.mod_map - 1): 2 bits per
// block of MAP_BLOCK queries x MAP_BLOCK keys of each (batch, query head), bit 0 set when
// mask_mod allows some pair of the block, bit 1 when it allows every pair (past L or S counts
// as allowed). The verdict on rows [i0, i0 + ni) x keys [j0, j0 + nj) (both non-empty, i0 < L,
// j0 < S): bit 0 when some block they touch has an allowed pair, bit 1 when all have only
// allowed pairs. Reads at uniform addresses, no barriers.
const MAP_BLOCK: u32 = 16u;
// The flat index of block (qb, kb) of batch b, query head h in the map (the keys' blocks
// fastest, as mod_map.wgsl writes them); 16 per word.
fn mod_map_entry(b: u32, h: u32, qb: u32, kb: u32) -> u32 {
    let lb = (p.m.doc_l + MAP_BLOCK - 1u) / MAP_BLOCK;
    let sb = (p.s + MAP_BLOCK - 1u) / MAP_BLOCK;
    return ((b * p.m.map_heads + h) * lb + qb) * sb + kb;
}
fn mod_map_block(b: u32, h: u32, i0: u32, ni: u32, j0: u32, nj: u32) -> u32 {
    let qb1 = (min(i0 + ni, p.m.doc_l) - 1u) / MAP_BLOCK;
    let kb1 = (min(j0 + nj, p.s) - 1u) / MAP_BLOCK;
    var v = 2u;
    for (var qb = i0 / MAP_BLOCK; qb <= qb1; qb++) {
        for (var kb = j0 / MAP_BLOCK; kb <= kb1; kb++) {
            let e = mod_map_entry(b, h, qb, kb);
            let m = (mask[p.m.mod_map - 1u + e / 16u] >> (2u * (e % 16u))) & 3u;
            v = (v | (m & 1u)) & (m | 1u);
        }
    }
    return v;
}

// The first key of the first map block at or after key j's where mask_mod allows some pair of
// rows [i0, i0 + ni) (i0 < L; p.s when none): the map read a word (16 blocks) at a time, so
// that a row's empty blocks are passed 256 keys per step.
fn mod_map_next(b: u32, h: u32, i0: u32, ni: u32, j: u32) -> u32 {
    let sb = (p.s + MAP_BLOCK - 1u) / MAP_BLOCK;
    let qb1 = (min(i0 + ni, p.m.doc_l) - 1u) / MAP_BLOCK;
    var kb = j / MAP_BLOCK;
    while (kb < sb) {
        // Bit 2x of `hits`: block kb + x allows a pair of some row block, for the n blocks
        // every row block's word still holds.
        var hits = 0u;
        var n = sb - kb;
        for (var qb = i0 / MAP_BLOCK; qb <= qb1; qb++) {
            let e = mod_map_entry(b, h, qb, kb);
            hits |= mask[p.m.mod_map - 1u + e / 16u] >> (2u * (e % 16u));
            n = min(n, 16u - e % 16u);
        }
        hits &= select(0x55555555u, (1u << (2u * n)) - 1u, n < 16u) & 0x55555555u;
        if (hits != 0u) {
            return (kb + countTrailingZeros(hits) / 2u) * MAP_BLOCK;
        }
        kb += n;
    }
    return p.s;
}

// Whether mask_mod allows every pair of the tile a kernel is about to process (rows [i0,
// i0 + ni), keys [j0, j0 + nj)): then masked_logit skips it (FlexAttention's full blocks).
// Only with the block map; the fused kernels set it per tile. Likewise `docs_full`: every row
// and key of the tile in one document (HAS_DOCS, from the blocks' id ranges), so that
// masked_logit skips the per-logit document test.
var<private> mod_full: bool = false;
var<private> docs_full: bool = false;
fn set_mod_full(b: u32, h: u32, i0: u32, ni: u32, j0: u32, nj: u32) {
    if (HAS_MASK_MOD && p.m.mod_map != 0u) {
        mod_full = i0 < p.m.doc_l && j0 < p.s && mod_map_block(b, h, i0, ni, j0, nj) >= 2u;
    }
    if (HAS_DOCS) {
        docs_full = false;
        if (i0 < p.m.doc_l && j0 < p.s) {
            let qd = query_docs(b, i0, i0 + ni);
            let kd = doc_span(p.m.doc_kb, p.s, b, j0, min(j0 + nj, p.s));
            docs_full = qd.x == qd.y && kd.x == kd.y && qd.x == kd.x;
        }
    }
}

// next_tile, then past the key tiles (before `end`) that can hold no allowed key of the query
// rows [i0, i0 + ni): those holding none of the documents in `qd` (the rows' range, HAS_DOCS),
// and those where the user's mask_mod allows no pair (HAS_MASK_MOD: by the block map when the
// host bound one, else the workgroup evaluates it on the block; `tid`, `nt` as in
// mask_mod_any). A packed sequence's rows visit their documents' tiles; a mask_mod's empty
// blocks are skipped like the built-in masks' (FlexAttention's block sparsity, computed on the
// GPU).
fn next_key_tile(b: u32, h: u32, j: u32, begin: u32, tile: u32, end: u32, qd: vec2<i32>, i0: u32, ni: u32, tid: u32, nt: u32) -> u32 {
    var t = next_tile(j, begin, tile);
    if (HAS_DOCS) {
        while (t < end && !key_docs_meet(b, t, tile, qd)) {
            t = next_tile(t + tile, begin, tile);
        }
    }
    if (HAS_MASK_MOD && p.m.mod_map != 0u) {
        // To the tile of the next block with an allowed pair (tiles start at multiples of
        // `tile`), then past the documents' empty tiles, until both agree.
        while (t < end && i0 < p.m.doc_l) {
            let n = mod_map_next(b, h, i0, ni, t);
            if (n / tile * tile <= t) {
                break;
            }
            t = next_tile(n / tile * tile, begin, tile);
            if (HAS_DOCS) {
                while (t < end && !key_docs_meet(b, t, tile, qd)) {
                    t = next_tile(t + tile, begin, tile);
                }
            }
        }
    } else if (HAS_MASK_MOD) {
        while (t < end && !mask_mod_any(b, h, i0, ni, t, tile, tid, nt)) {
            t = next_tile(t + tile, begin, tile);
            if (HAS_DOCS) {
                while (t < end && !key_docs_meet(b, t, tile, qd)) {
                    t = next_tile(t + tile, begin, tile);
                }
            }
        }
    }
    return t;
}

// End (exclusive) of the keys query row `i` of batch `b` may see under the causal limit, the
// key length and the window's right side (sink tokens past it kept); the boolean mask, the
// bias and the window's left side act within it.
fn key_end(b: u32, i: u32) -> u32 {
    var end = p.s;
    if (p.m.has_lens != 0u) {
        end = min(end, kv_len(b));
    }
    if (p.m.has_causal != 0u) {
        end = min(end, causal_end(b, i));
    }
    if (HAS_WINDOW && p.m.win_right >= 0) {
        let w = u32(clamp(i32(i) + window_offset(b) + p.m.win_right + 1, 0, i32(p.s)));
        end = min(end, max(w, min(p.m.win_sinks, p.s)));
    }
    return end;
}

// Whether the boolean mask (32 keys per u32, bit set = may attend) lets row `i` of batch `b`,
// head `h` see key `j` (clamped into the row, so keys past S read in bounds).
fn mask_allows(b: u32, h: u32, i: u32, j: u32) -> bool {
    let w = mask[b * p.m.mask_b + h * p.m.mask_h + i * p.m.mask_l + min(j, p.s - 1u) / 32u];
    return (w & (1u << (j % 32u))) != 0u;
}

// The bias of (b, h, i, j), j clamped into the row.
fn bias_at(b: u32, h: u32, i: u32, j: u32) -> f32 {
    return bias_get(p.m.bias_off + b * p.m.bias_b + h * p.m.bias_h + i * p.m.bias_l + min(j, p.s - 1u) * p.m.bias_s);
}

// Whether logit `x` belongs to a key within its row's range: callers set the keys outside it
// (past the causal limit or the key length) to START exactly. By bits for NaN: `x != START` is
// an ordered comparison on CPU adapters, false for NaN, and a NaN logit must stay.
fn in_range(x: f32) -> bool {
    return is_nan_bits(x) || x != START;
}

// tanh without the built-in (whose lowering may divide twice or overflow): for |x| < 1/4 its
// odd Taylor polynomial to x^9 (the next term is below 1e-8 of x), else 1 - 2 / (e^(2|x|) + 1)
// with the sign (no cancellation there: |tanh| > 0.24), saturated at |x| = 9 (1 in f32).
fn tanh_sat(x: f32) -> f32 {
    // SOFTCAP_FORM 2 (a measuring knob): the built-in.
    if (SOFTCAP_FORM == 2u) {
        return tanh(x);
    }
    let a = min(abs(x), 9.0);
    // SOFTCAP_FORM 1 (a measuring knob, src/tune.rs): one branch, absolute error ~1e-7 near 0.
    if (SOFTCAP_FORM == 1u) {
        let t = exp(-2.0 * a);
        let r = (1.0 - t) / (1.0 + t);
        return select(r, -r, x < 0.0);
    }
    // Both sides are evaluated: the polynomial's on a clamped argument (no infinities, which
    // WGSL lets a compiler assume away).
    let xs = clamp(x, -0.25, 0.25);
    let y = xs * xs;
    let poly = xs * (1.0 + y * (-1.0 / 3.0 + y * (2.0 / 15.0 + y * (-17.0 / 315.0 + y * (62.0 / 2835.0)))));
    let big = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    return select(select(big, -big, x < 0.0), poly, a < 0.25);
}

// The softcap C tanh(x / C) of scaled logit `x` (HAS_SOFTCAP; x itself otherwise). NaN stays.
fn softcapped(x: f32) -> f32 {
    if (!HAS_SOFTCAP || is_nan_bits(x)) {
        return x;
    }
    return p.m.softcap * tanh_sat(x * p.m.softcap_inv);
}

// d softcapped(x) / dx = 1 - tanh(x / C)^2 (1 without a softcap): the backward scales dS by it
// for dQ and dK (the bias is added after the softcap: its gradient is dS itself).
fn softcap_grad(x: f32) -> f32 {
    if (!HAS_SOFTCAP) {
        return 1.0;
    }
    let t = tanh_sat(x * p.m.softcap_inv);
    return 1.0 - t * t;
}

// The logit of scaled dot product `x` after the softcap, the bias and ALiBi: what a user
// score_mod is given.
fn pre_mod(x: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    var y = softcapped(x);
    if (HAS_BIAS) {
        y += bias_at(b, h, i, j);
    }
    if (HAS_ALIBI) {
        y += alibi_term(b, h, i, j);
    }
    return y;
}

// d(final logit) / d(pre_mod logit): the user's score_mod_ds (HAS_SCORE_MOD; 1 otherwise),
// for d(bias) and, times softcap_grad, dQ and dK. `x` is the masked logit: a masked entry
// (START; its dS is 0) takes 1, so that whatever the user's derivative gives there (it may be
// evaluated: CPU adapters run both sides) is not used.
fn mod_grad(x0: f32, x: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    if (!HAS_SCORE_MOD) {
        return 1.0;
    }
    let jj = min(j, p.s - 1u);
    return select(1.0, u_score_mod_ds(pre_mod(x0, b, h, i, jj), b, h, i + p.m.pos_q, jj + p.m.pos_k), in_range(x));
}

// d(final logit) / d(scaled dot product x0) (`x` the masked logit): the softcap's derivative
// and the user score_mod's.
fn logit_grad(x0: f32, x: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    return softcap_grad(x0) * mod_grad(x0, x, b, h, i, j);
}

// The ALiBi term of (b, h, i, j): -slope[h] |i + S - L - j| (S the batch's key length with key
// lengths, like the window's diagonal).
fn alibi_term(b: u32, h: u32, i: u32, j: u32) -> f32 {
    let c = i32(i) + window_offset(b);
    return -alibi_slope(h) * abs(f32(c - i32(j)));
}

// The logit `x` (the scaled dot product) of key `j` for row `i` after the softcap, the bias,
// ALiBi and the boolean mask: START when `keep` is false, when the mask forbids the key, or
// when the biased logit is -inf. Masked-out keys ignore the bias; a -inf bias masks; a NaN
// logit of an allowed key stays NaN. The order is docs/semantics.md's: softcap, then bias and
// ALiBi, then the masks.
fn masked_logit(x: f32, keep: bool, b: u32, h: u32, i: u32, j: u32) -> f32 {
    var y = softcapped(x);
    var k = keep;
    if (HAS_MASK) {
        k = k && mask_allows(b, h, i, j);
    }
    if (HAS_WINDOW) {
        k = k && window_allows(b, i, j);
    }
    if (HAS_DOCS && !docs_full) {
        k = k && docs_allow(b, i, j);
    }
    if (HAS_BIAS) {
        y += bias_at(b, h, i, j);
    }
    if (HAS_ALIBI) {
        y += alibi_term(b, h, i, j);
    }
    // The user's functions see keys in [0, S) (a tile's keys past S are masked by `keep`), at
    // their global positions (p.m.pos_q and pos_k: a ring pair's chunk starts, 0 else).
    if (HAS_SCORE_MOD) {
        y = u_score_mod(y, b, h, i + p.m.pos_q, min(j, p.s - 1u) + p.m.pos_k);
    }
    if (HAS_MASK_MOD && !mod_full) {
        k = k && u_mask_mod(b, h, i + p.m.pos_q, min(j, p.s - 1u) + p.m.pos_k);
    }
    // A NaN logit (or bias) stays NaN, tested by its bits (see is_nan_bits), so that its row
    // comes out NaN as in PyTorch.
    return select(START, y, k && (is_nan_bits(y) || !(y < MASKED)));
}
