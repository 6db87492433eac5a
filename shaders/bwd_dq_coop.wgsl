// Backward, dQ on the GPU's matrix units (`BackwardForm::Coop`): bwd_dq.wgsl's algorithm (see
// there: one workgroup per query tile of a head, the key tiles streamed, the same tiles
// skipped) with its three products in cooperative matrices, T x T tiles of f16 operands
// accumulated in f32:
//   S = Q Kᵀ and dP = dO Vᵀ (into workgroup memory, f32);
//   scalar f32 code per (query, key): the logit scaled, every mask, P = exp(x - lse),
//   dS = P (dP - D), stored as f16 (FlashAttention's rounding);
//   dQ += dS K (the accumulator in workgroup memory, f32; scaled at the end).
//
// Q and dO (f16) and each K and V tile (f16) are zero-padded to EP / EVP columns (multiples of
// T) and past L and the workgroup's key range (common/coop_backward.wgsl, which holds the blocks
// and steps both coop backward kernels take), so every cooperative load reads in range by
// construction and no key outside it reaches dS K. Subgroup s of nsg takes product tiles s,
// s + nsg, ...; every cooperative value is a typed `var`. The host prepends what bwd_dq.wgsl
// gets (but SG_KV and the K/V tile helpers), the `enable` directives and TILE, WG, BQ (query
// rows per workgroup), BK (keys per tile), EP, EVP and the aliases AT, BT, CT.
//
// Bindings: those of bwd_dq.wgsl.

var<workgroup> dq_acc: array<f32, BQ * EP>; // [BQ][EP]

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
) {
    let wid = wg.x + wg.y * nwg.x;
    if (wid >= p.total) {
        return;
    }
    let tile = query_tile(wid, p.tiles);
    let qt = tile.qt;
    let bh = tile.bh;
    let b = tile.b;
    let h = tile.h;
    let kvh = tile.kvh;
    let i0 = qt * BQ;

    let keys = tile_keys(b, i0, BQ, tid);
    let kv_begin = keys.x;
    let kv_end = keys.y;
    var qd = vec2<i32>(0);
    if (HAS_DOCS) {
        qd = query_docs(b, i0, i0 + BQ);
    }

    // The query tile (common/coop_backward.wgsl), dQ zeroed.
    stage_query_tile(bh, b, i0, tid);
    for (var t = tid; t < BQ * EP; t += WG) {
        dq_acc[t] = 0.0;
    }
    workgroupBarrier();

    for (var j0 = next_key_tile(b, h, 0u, kv_begin, BK, kv_end, qd, i0, BQ, tid, WG); j0 < kv_end;
         j0 = next_key_tile(b, h, j0 + BK, kv_begin, BK, kv_end, qd, i0, BQ, tid, WG)) {
        set_mod_full(b, h, i0, BQ, j0, BK);
        stage_key_tile(kvh, j0, kv_end, tid);
        workgroupBarrier();
        scores_and_dp(sg, nsg);
        workgroupBarrier();
        for (var t = tid; t < BQ * BK; t += WG) {
            prob_and_ds(t, i0, j0, b, h);
        }
        workgroupBarrier();
        // dQ += dS K.
        for (var t = sg; t < (BQ / TILE) * (EP / TILE); t += nsg) {
            let rt = t / (EP / TILE);
            let ct = t % (EP / TILE);
            var acc: CT = coopLoadT<CT>(&dq_acc[rt * TILE * EP + ct * TILE], EP);
            for (var kk = 0u; kk < BK; kk += TILE) {
                var a: AT = coopLoadT<AT>(&ds_blk[rt * TILE * BK + kk], BK);
                var kb: BT = coopLoadT<BT>(&k_blk[kk * EP + ct * TILE], EP);
                acc = coopMultiplyAdd(a, kb, acc);
            }
            coopStoreT(acc, &dq_acc[rt * TILE * EP + ct * TILE], EP);
        }
        workgroupBarrier();
    }

    for (var t = tid; t < BQ * E4; t += WG) {
        let r = t / E4;
        let d4 = t % E4;
        if (i0 + r < p.l) {
            let o = r * EP + 4u * d4;
            store_dq(bh * p.l + i0 + r, d4, vec4<f32>(dq_acc[o], dq_acc[o + 1u], dq_acc[o + 2u], dq_acc[o + 3u]) * p.scale);
        }
    }
}
