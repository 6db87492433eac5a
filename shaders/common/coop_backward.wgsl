// What the backward's matrix-unit kernels share (bwd_dq_coop.wgsl, bwd_dkv_coop.wgsl): the
// query tile and key tile blocks (f16, zero-padded to EP / EVP columns and past their ranges,
// so every cooperative load reads in range), the logits and dP (f32), dS (f16), the query rows'
// statistics, and the steps both take on them. Each kernel sets BQ (query rows per tile) and BK
// (keys per tile) and calls these from uniform control flow (every invocation alike).

var<workgroup> q_blk: array<f16, BQ * EP>; // [BQ][EP], unscaled
var<workgroup> do_blk: array<f16, BQ * EVP>; // [BQ][EVP]
var<workgroup> k_blk: array<f16, BK * EP>; // [BK][EP]
var<workgroup> v_blk: array<f16, BK * EVP>; // [BK][EVP]
var<workgroup> s_blk: array<f32, BQ * BK>; // [BQ][BK]: logits
var<workgroup> dp_blk: array<f32, BQ * BK>; // [BQ][BK]: dP
var<workgroup> ds_blk: array<f16, BQ * BK>; // [BQ][BK]: dS
var<workgroup> lse_tile: array<f32, BQ>;
var<workgroup> dsum_tile: array<f32, BQ>;
var<workgroup> end_tile: array<u32, BQ>;

// Stage query rows [i0, i0 + BQ) of batch-head bh (batch b): q (unscaled) and dO as f16, zero
// past L and the head dims, and the rows' logsumexp, D and key end (0 past L).
fn stage_query_tile(bh: u32, b: u32, i0: u32, tid: u32) {
    for (var t = tid; t < BQ * (EP / 4u); t += WG) {
        let r = t / (EP / 4u);
        let d4 = t % (EP / 4u);
        var x = vec4<f32>(0.0);
        if (i0 + r < p.l && d4 < E4) {
            x = load_q(bh * p.l + i0 + r, d4);
        }
        for (var c = 0u; c < 4u; c++) {
            q_blk[r * EP + 4u * d4 + c] = f16(x[c]);
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
}

// Stage keys [j0, j0 + BK) of kv head row base kvh: k and v as f16, zero from key `end` on and
// past the head dims.
fn stage_key_tile(kvh: u32, j0: u32, end: u32, tid: u32) {
    for (var t = tid; t < BK * (EP / 4u); t += WG) {
        let jj = t / (EP / 4u);
        let d4 = t % (EP / 4u);
        var x = vec4<f32>(0.0);
        if (j0 + jj < end && d4 < E4) {
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
        if (j0 + jj < end && d4 < EV4) {
            x = load_v(kvh * p.s + j0 + jj, d4);
        }
        for (var c = 0u; c < 4u; c++) {
            v_blk[jj * EVP + 4u * d4 + c] = f16(x[c]);
        }
    }
}

// S = Q Kᵀ and dP = dO Vᵀ into s_blk and dp_blk (Kᵀ and Vᵀ read column-major from the rows):
// subgroup sg of nsg takes product tiles sg, sg + nsg, ...
fn scores_and_dp(sg: u32, nsg: u32) {
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
}

// P and dS of element t of the tile (query row i0 + t / BK, key j0 + t % BK; batch b, head h)
// in f32: the logit scaled, its key range and every mask, P = exp(x - lse), dS = P (dP - D)
// times the modifiers' gradient. dS is also stored in ds_blk as f16.
fn prob_and_ds(t: u32, i0: u32, j0: u32, b: u32, h: u32) -> f32 {
    let ii = t / BK;
    let j = j0 + t % BK;
    let i = min(i0 + ii, p.l - 1u);
    var x = select(START, s_blk[t] * p.scale, j < end_tile[ii]);
    let x0 = x;
    if (MASKED_LOGIT || HAS_WINDOW) {
        x = masked_logit(x, in_range(x), b, h, i, j);
    }
    let pij = prob(x, lse_tile[ii]);
    ds_blk[t] = f16(dscore(pij, dp_blk[t], dsum_tile[ii]) * logit_grad(x0, x, b, h, i, j));
    return pij;
}
