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
// T) and past L and the workgroup's key range, so every cooperative load reads in range by
// construction and no key outside it reaches dS K. Subgroup s of nsg takes product tiles s,
// s + nsg, ...; every cooperative value is a typed `var`. The host prepends what bwd_dq.wgsl
// gets (but SG_KV and the K/V tile helpers), the `enable` directives and TILE, WG, BQ (query
// rows per workgroup), BK (keys per tile), EP, EVP and the aliases AT, BT, CT.
//
// Bindings: those of bwd_dq.wgsl.

var<workgroup> q_blk: array<f16, BQ * EP>; // [BQ][EP], unscaled
var<workgroup> do_blk: array<f16, BQ * EVP>; // [BQ][EVP]
var<workgroup> k_blk: array<f16, BK * EP>; // [BK][EP]
var<workgroup> v_blk: array<f16, BK * EVP>; // [BK][EVP]
var<workgroup> s_blk: array<f32, BQ * BK>; // [BQ][BK]: logits
var<workgroup> dp_blk: array<f32, BQ * BK>; // [BQ][BK]: dP
var<workgroup> ds_blk: array<f16, BQ * BK>; // [BQ][BK]: dS
var<workgroup> dq_acc: array<f32, BQ * EP>; // [BQ][EP]
var<workgroup> lse_tile: array<f32, BQ>;
var<workgroup> dsum_tile: array<f32, BQ>;
var<workgroup> end_tile: array<u32, BQ>;
var<workgroup> wg_end: u32;
var<workgroup> wg_begin: u32;

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
    let qt = p.tiles - 1u - wid % p.tiles;
    let bh = wid / p.tiles;
    let b = bh / p.heads;
    let h = bh % p.heads;
    let kvh = b * (p.heads / p.group) + h / p.group;
    let i0 = qt * BQ;

    if (tid == 0u) {
        let last_row = min(i0 + BQ, p.l) - 1u;
        wg_end = key_end(b, last_row);
        wg_begin = key_begin(b, min(i0, p.l - 1u));
    }
    let kv_end = workgroupUniformLoad(&wg_end);
    let kv_begin = workgroupUniformLoad(&wg_begin);
    var qd = vec2<i32>(0);
    if (HAS_DOCS) {
        qd = query_docs(b, i0, i0 + BQ);
    }

    // The query tile: q (unscaled) and dO as f16, zero past L and the head dims; the rows'
    // statistics; dQ zeroed.
    for (var t = tid; t < BQ * (EP / 4u); t += WG) {
        let r = t / (EP / 4u);
        let d4 = t % (EP / 4u);
        var x = vec4<f32>(0.0);
        if (i0 + r < p.l && d4 < E4) {
            x = load_q(bh * p.l + i0 + r, d4);
        }
        for (var c = 0u; c < 4u; c++) {
            q_blk[r * EP + 4u * d4 + c] = f16(x[c]);
            dq_acc[r * EP + 4u * d4 + c] = 0.0;
        }
    }
    for (var t = tid; t < BQ * (EVP / 4u); t += WG) {
        let r = t / (EVP / 4u);
        let d4 = t % (EVP / 4u);
        var x = vec4<f32>(0.0);
        if (i0 + r < p.l && d4 < EV4) {
            x = load_dout(bh * p.l + i0 + r, d4);
        }
        for (var c = 0u; c < 4u; c++) {
            do_blk[r * EVP + 4u * d4 + c] = f16(x[c]);
        }
    }
    for (var t = tid; t < BQ; t += WG) {
        let i = min(i0 + t, p.l - 1u);
        lse_tile[t] = lse_of(bh * p.l + i);
        dsum_tile[t] = dsum_of(bh * p.l + i);
        end_tile[t] = select(0u, key_end(b, i), i0 + t < p.l);
    }
    workgroupBarrier();

    for (var j0 = next_key_tile(b, h, 0u, kv_begin, BK, kv_end, qd, i0, BQ, tid, WG); j0 < kv_end;
         j0 = next_key_tile(b, h, j0 + BK, kv_begin, BK, kv_end, qd, i0, BQ, tid, WG)) {
        set_mod_full(b, h, i0, BQ, j0, BK);
        // K and V, f16, zero past kv_end and the head dims.
        for (var t = tid; t < BK * (EP / 4u); t += WG) {
            let jj = t / (EP / 4u);
            let d4 = t % (EP / 4u);
            var x = vec4<f32>(0.0);
            if (j0 + jj < kv_end && d4 < E4) {
                x = load_k(kvh * p.s + j0 + jj, d4);
            }
            for (var c = 0u; c < 4u; c++) {
                k_blk[jj * EP + 4u * d4 + c] = f16(x[c]);
            }
        }
        for (var t = tid; t < BK * (EVP / 4u); t += WG) {
            let jj = t / (EVP / 4u);
            let d4 = t % (EVP / 4u);
            var x = vec4<f32>(0.0);
            if (j0 + jj < kv_end && d4 < EV4) {
                x = load_v(kvh * p.s + j0 + jj, d4);
            }
            for (var c = 0u; c < 4u; c++) {
                v_blk[jj * EVP + 4u * d4 + c] = f16(x[c]);
            }
        }
        workgroupBarrier();
        // S = Q Kᵀ and dP = dO Vᵀ (Kᵀ and Vᵀ read column-major from the rows).
        for (var t = sg; t < (BQ / TILE) * (BK / TILE); t += nsg) {
            let rt = t / (BK / TILE);
            let ct = t % (BK / TILE);
            var s: CT = CT();
            for (var d = 0u; d < EP; d += TILE) {
                var a: AT = coopLoadT<AT>(&q_blk[rt * TILE * EP + d], EP);
                var kt: BT = coopLoad<BT>(&k_blk[ct * TILE * EP + d], EP);
                s = coopMultiplyAdd(a, kt, s);
            }
            coopStoreT(s, &s_blk[rt * TILE * BK + ct * TILE], BK);
            var dp: CT = CT();
            for (var d = 0u; d < EVP; d += TILE) {
                var a: AT = coopLoadT<AT>(&do_blk[rt * TILE * EVP + d], EVP);
                var vt: BT = coopLoad<BT>(&v_blk[ct * TILE * EVP + d], EVP);
                dp = coopMultiplyAdd(a, vt, dp);
            }
            coopStoreT(dp, &dp_blk[rt * TILE * BK + ct * TILE], BK);
        }
        workgroupBarrier();
        // dS per (query, key), in f32; stored as f16.
        for (var t = tid; t < BQ * BK; t += WG) {
            let ii = t / BK;
            let j = j0 + t % BK;
            let i = min(i0 + ii, p.l - 1u);
            var x = select(START, s_blk[t] * p.scale, j < end_tile[ii]);
            let x0 = x;
            if (MASKED_LOGIT || HAS_WINDOW) {
                x = masked_logit(x, in_range(x), b, h, i, j);
            }
            let pij = prob(x, lse_tile[ii]);
            let ds = dscore(pij, dp_blk[t], dsum_tile[ii]) * logit_grad(x0, x, b, h, i, j);
            ds_blk[t] = f16(ds);
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
