// The user's mask_mod (HAS_MASK_MOD): whether a block holds an allowed pair, by the
// workgroup or by the block map the host built.

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
