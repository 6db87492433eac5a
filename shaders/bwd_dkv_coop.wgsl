// Backward, dK and dV on the GPU's matrix units (`BackwardForm::Coop`): bwd_dkv.wgsl's
// algorithm (see there: one workgroup per key tile of a kv head, the query tiles of every
// query head of its group streamed, the same tiles skipped) with its four products in
// cooperative matrices, T x T tiles of f16 operands accumulated in f32:
//   S = Q Kᵀ and dP = dO Vᵀ (into workgroup memory, f32);
//   scalar f32 code per (query, key): the logit scaled, every mask, P = exp(x - lse),
//   dS = P (dP - D), both stored as f16 (FlashAttention's rounding);
//   dV += Pᵀ dO and dK += dSᵀ Q (accumulators in workgroup memory, f32; dK scaled at the end,
//   Q is staged unscaled as the coop forward stages it).
//
// Every block is zero-padded to EP / EVP columns (multiples of T) and past L and S (the blocks
// and the steps both coop backward kernels take are common/coop_backward.wgsl's), so every
// cooperative load reads in range by construction, the tails are exact, and nothing past the
// tensors reaches a product. Subgroup s of nsg takes product tiles s, s + nsg, ... (as the
// kernel sees them at run time); every cooperative value is a typed `var` (naga 30's `let`
// bug). The host prepends what bwd_dkv.wgsl gets (but SG_Q and the q_at helpers), the
// `enable` directives and TILE, WG, BQ (query rows per tile), BK (keys per workgroup), EP,
// EVP and the aliases AT, BT, CT.
//
// Bindings: those of bwd_dkv.wgsl.

var<workgroup> p_blk: array<f16, BQ * BK>; // [BQ][BK]: P
var<workgroup> dk_acc: array<f32, BK * EP>; // [BK][EP]
var<workgroup> dv_acc: array<f32, BK * EVP>; // [BK][EVP]

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
    let kt = wid % p.tiles;
    let kvh = wid / p.tiles;
    let kv_heads = p.heads / p.group;
    let b = kvh / kv_heads;
    let hk = kvh % kv_heads;
    let j_first = kt * BK;

    // This workgroup's keys and values (common/coop_backward.wgsl), the accumulators zeroed.
    stage_key_tile(kvh, j_first, p.s, tid);
    for (var t = tid; t < BK * EP; t += WG) {
        dk_acc[t] = 0.0;
    }
    for (var t = tid; t < BK * EVP; t += WG) {
        dv_acc[t] = 0.0;
    }

    // The query rows that may see these keys (bwd_dkv.wgsl's bounds).
    var i_start = 0u;
    if (p.m.has_causal != 0u) {
        i_start = u32(clamp(i32(j_first) - causal_offset(b), 0, i32(p.l)));
    }
    var i_stop = p.l;
    if (p.m.has_lens != 0u && j_first >= kv_len(b)) {
        i_stop = 0u;
    }
    if (HAS_WINDOW && j_first >= p.m.win_sinks) {
        let woff = window_offset(b);
        if (p.m.win_right >= 0) {
            i_start = max(i_start, u32(clamp(i32(j_first) - woff - p.m.win_right, 0, i32(p.l))));
        }
        if (p.m.win_left >= 0) {
            let j_last = min(j_first + BK, p.s) - 1u;
            i_stop = min(i_stop, u32(clamp(i32(j_last) - woff + p.m.win_left + 1, 0, i32(p.l))));
        }
    }
    let t0 = i_start / BQ;
    var kd = vec2<i32>(0);
    if (HAS_DOCS) {
        kd = doc_span(p.m.doc_kb, p.s, b, min(j_first, p.s - 1u), min(j_first + BK, p.s));
    }
    workgroupBarrier();

    for (var hh = 0u; hh < p.group; hh++) {
        let h = group_head(hk, hh);
        let bh = b * p.heads + h;
        for (var i0 = t0 * BQ; i0 < i_stop; i0 += BQ) {
            if (HAS_DOCS) {
                let qd = query_docs(b, i0, i0 + BQ);
                if (kd.x > qd.y || qd.x > kd.y) {
                    continue;
                }
            }
            if (HAS_MASK_MOD && !mask_mod_any(b, h, i0, BQ, j_first, BK, tid, WG)) {
                continue;
            }
            set_mod_full(b, h, i0, BQ, j_first, BK);
            stage_query_tile(bh, b, i0, tid);
            workgroupBarrier();
            scores_and_dp(sg, nsg);
            workgroupBarrier();
            for (var t = tid; t < BQ * BK; t += WG) {
                p_blk[t] = f16(prob_and_ds(t, i0, j_first, b, h));
            }
            workgroupBarrier();
            // dV += Pᵀ dO and dK += dSᵀ Q (Pᵀ and dSᵀ read column-major from the rows).
            for (var t = sg; t < (BK / TILE) * (EVP / TILE); t += nsg) {
                let rt = t / (EVP / TILE);
                let ct = t % (EVP / TILE);
                var acc: CT = coopLoadT<CT>(&dv_acc[rt * TILE * EVP + ct * TILE], EVP);
                for (var kk = 0u; kk < BQ; kk += TILE) {
                    var a: AT = coopLoad<AT>(&p_blk[kk * BK + rt * TILE], BK);
                    var g: BT = coopLoadT<BT>(&do_blk[kk * EVP + ct * TILE], EVP);
                    acc = coopMultiplyAdd(a, g, acc);
                }
                coopStoreT(acc, &dv_acc[rt * TILE * EVP + ct * TILE], EVP);
            }
            for (var t = sg; t < (BK / TILE) * (EP / TILE); t += nsg) {
                let rt = t / (EP / TILE);
                let ct = t % (EP / TILE);
                var acc: CT = coopLoadT<CT>(&dk_acc[rt * TILE * EP + ct * TILE], EP);
                for (var kk = 0u; kk < BQ; kk += TILE) {
                    var a: AT = coopLoad<AT>(&ds_blk[kk * BK + rt * TILE], BK);
                    var qb: BT = coopLoadT<BT>(&q_blk[kk * EP + ct * TILE], EP);
                    acc = coopMultiplyAdd(a, qb, acc);
                }
                coopStoreT(acc, &dk_acc[rt * TILE * EP + ct * TILE], EP);
            }
            workgroupBarrier();
        }
    }

    for (var t = tid; t < BK * E4; t += WG) {
        let jj = t / E4;
        let d4 = t % E4;
        if (j_first + jj < p.s) {
            let o = jj * EP + 4u * d4;
            store_dk(kvh * p.s + j_first + jj, d4, vec4<f32>(dk_acc[o], dk_acc[o + 1u], dk_acc[o + 2u], dk_acc[o + 3u]) * p.scale);
        }
    }
    for (var t = tid; t < BK * EV4; t += WG) {
        let jj = t / EV4;
        let d4 = t % EV4;
        if (j_first + jj < p.s) {
            let o = jj * EVP + 4u * d4;
            store_dv(kvh * p.s + j_first + jj, d4, vec4<f32>(dv_acc[o], dv_acc[o + 1u], dv_acc[o + 2u], dv_acc[o + 3u]));
        }
    }
}
