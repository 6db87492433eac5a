// The masks every attention kernel applies: the causal limit, the key lengths, the packed
// boolean mask, the additive bias, the key tiles worth visiting, and `masked_logit`, which
// applies them with the modifiers, each in a file of its own in modifiers/ (softcap, ALiBi,
// sink logits, the window, document ids, the user's mask_mod; the host appends them to this
// file, src/kernels/mod.rs `common::MASKS`). Bindings 0 (mask) and 1 (bias) of every
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
