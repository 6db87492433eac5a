// The fused forward on the GPU's matrix units (`FusedForm::Coop`): flash.wgsl's algorithm
// (see there: masks, windows, documents, key lengths, sinks, the online softmax, whole key
// tiles skipped) with its two products, S = Q Kᵀ and O += P V, in cooperative matrices: T x T
// tiles of f16 operands accumulated in f32. Cooperative matrices have no element access, so
// (llama.cpp's coopmat1 pattern) the logits go through workgroup memory, the softmax is scalar
// f32 code, P is stored as f16, and the output accumulator lives in workgroup memory (f32),
// rescaled there before each P V.
//
// One workgroup of WG invocations per tile of BQ query rows of one head; query row r of the
// tile belongs to invocation r (its max, sum and allowed key range), every invocation stages.
// Q (unscaled, f16), each K tile and then each V tile (f16, in one buffer) are zero-padded
// to EP / EVP columns (multiples of T) and past the key range, so every cooperative load
// reads in range by construction and the tails are exact. Subgroup s of nsg takes product
// tiles s, s + nsg, ... (nsg and s as the kernel sees them at run time).
//
// Every cooperative value is a typed `var` (naga 30 writes invalid SPIR-V for a `let`); the
// tile loops are uniform across a subgroup. The host prepends the `enable` directives and
// TILE, WG, BQ, BK, E4, EV4, EP, EVP, KVW (= max(EP, EVP)) and the aliases AT, BT, CT.
//
// Bindings: those of flash.wgsl.

@group(0) @binding(7) var<storage, read_write> lse: array<f32>;

var<workgroup> q_blk: array<f16, BQ * EP>; // [BQ][EP]
var<workgroup> kv_blk: array<f16, BK * KVW>; // [BK][KVW]: K, then V
var<workgroup> s_blk: array<f32, BQ * BK>; // [BQ][BK]: logits
var<workgroup> p_blk: array<f16, BQ * BK>; // [BQ][BK]: weights
var<workgroup> o_blk: array<f32, BQ * EVP>; // [BQ][EVP]: output accumulators
var<workgroup> alpha_blk: array<f32, BQ>;

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
    let tile = query_tile(wid, p.q_tiles);
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

    // Q, unscaled, as f16 (the scale is applied to the f32 logits); O zeroed.
    for (var t = tid; t < BQ * (EP / 4u); t += WG) {
        let r = t / (EP / 4u);
        let d4 = t % (EP / 4u);
        let i = i0 + r;
        var x = vec4<f32>(0.0);
        if (i < p.l && d4 < E4) {
            x = load_q(bh * p.l + i, d4);
        }
        for (var c = 0u; c < 4u; c++) {
            q_blk[r * EP + 4u * d4 + c] = f16(x[c]);
        }
    }
    for (var t = tid; t < BQ * EVP; t += WG) {
        o_blk[t] = 0.0;
    }

    // Row tid's state (invocations past BQ own no row).
    let own = tid < BQ;
    let i = i0 + tid;
    let valid = own && i < p.l;
    let ic = min(i, p.l - 1u);
    var m = START;
    var sum = 0.0;
    var row_end = select(0u, kv_end, valid);
    var row_begin = 0u;
    if (p.m.has_causal != 0u) {
        row_end = min(row_end, causal_end(b, i));
    }
    if (HAS_WINDOW) {
        row_end = min(row_end, key_end(b, ic));
        row_begin = key_begin(b, ic);
    }
    workgroupBarrier();

    let kh = k_head(kvh);
    let vh = v_head(kvh);
    for (var j0 = next_key_tile(b, h, 0u, kv_begin, BK, kv_end, qd, i0, BQ, tid, WG); j0 < kv_end;
         j0 = next_key_tile(b, h, j0 + BK, kv_begin, BK, kv_end, qd, i0, BQ, tid, WG)) {
        set_mod_full(b, h, i0, BQ, j0, BK);
        // K tile, f16, zero past kv_end and E.
        for (var t = tid; t < BK * (EP / 4u); t += WG) {
            let jj = t / (EP / 4u);
            let d4 = t % (EP / 4u);
            var x = vec4<f32>(0.0);
            if (j0 + jj < kv_end && d4 < E4) {
                x = load_kb(k_at(kh, j0 + jj), d4);
            }
            for (var c = 0u; c < 4u; c++) {
                kv_blk[jj * KVW + 4u * d4 + c] = f16(x[c]);
            }
        }
        workgroupBarrier();
        // S = Q Kᵀ: B is Kᵀ, read column-major from the K rows.
        for (var t = sg; t < (BQ / TILE) * (BK / TILE); t += nsg) {
            let rt = t / (BK / TILE);
            let ct = t % (BK / TILE);
            var acc: CT = CT();
            for (var d = 0u; d < EP; d += TILE) {
                var a: AT = coopLoadT<AT>(&q_blk[rt * TILE * EP + d], EP);
                var kt: BT = coopLoad<BT>(&kv_blk[ct * TILE * KVW + d], KVW);
                acc = coopMultiplyAdd(a, kt, acc);
            }
            coopStoreT(acc, &s_blk[rt * TILE * BK + ct * TILE], BK);
        }
        workgroupBarrier();
        // V tile over K, f16, zero past kv_end and Ev.
        for (var t = tid; t < BK * (EVP / 4u); t += WG) {
            let jj = t / (EVP / 4u);
            let d4 = t % (EVP / 4u);
            var x = vec4<f32>(0.0);
            if (j0 + jj < kv_end && d4 < EV4) {
                x = load_vb(v_at(vh, j0 + jj), d4);
            }
            for (var c = 0u; c < 4u; c++) {
                kv_blk[jj * KVW + 4u * d4 + c] = f16(x[c]);
            }
        }
        // The row's logits: scaled, its key range, the masks; then the online softmax.
        if (own) {
            var smax = m;
            for (var jj = 0u; jj < BK; jj++) {
                let j = j0 + jj;
                var x = s_blk[tid * BK + jj] * p.scale;
                var ok = j < row_end;
                if (HAS_WINDOW) {
                    ok = ok && (j >= row_begin || j < p.m.win_sinks);
                }
                x = select(START, x, ok);
                if (MASKED_LOGIT) {
                    x = masked_logit(x, in_range(x), b, h, ic, j);
                }
                s_blk[tid * BK + jj] = x;
                smax = max(smax, x);
            }
            let alpha = rescale(m, smax);
            var s = 0.0;
            for (var jj = 0u; jj < BK; jj++) {
                let pj = weight(s_blk[tid * BK + jj], smax);
                p_blk[tid * BK + jj] = f16(pj);
                s += pj;
            }
            sum = sum * alpha + s;
            m = smax;
            alpha_blk[tid] = alpha;
        }
        workgroupBarrier();
        for (var t = tid; t < BQ * EVP; t += WG) {
            o_blk[t] *= alpha_blk[t / EVP];
        }
        workgroupBarrier();
        // O += P V.
        for (var t = sg; t < (BQ / TILE) * (EVP / TILE); t += nsg) {
            let rt = t / (EVP / TILE);
            let ct = t % (EVP / TILE);
            var acc: CT = coopLoadT<CT>(&o_blk[rt * TILE * EVP + ct * TILE], EVP);
            for (var kk = 0u; kk < BK; kk += TILE) {
                var a: AT = coopLoadT<AT>(&p_blk[rt * TILE * BK + kk], BK);
                var vt: BT = coopLoadT<BT>(&kv_blk[kk * KVW + ct * TILE], KVW);
                acc = coopMultiplyAdd(a, vt, acc);
            }
            coopStoreT(acc, &o_blk[rt * TILE * EVP + ct * TILE], EVP);
        }
        workgroupBarrier();
    }

    if (valid) {
        let row = bh * p.l + i;
        let st = with_sink(m, sum, h);
        if (st.y == 0.0) {
            for (var d4 = 0u; d4 < EV4; d4++) {
                store_out(row, d4, vec4<f32>(0.0));
            }
            lse[row] = neg_inf();
        } else {
            let inv = st.z / st.y;
            for (var d4 = 0u; d4 < EV4; d4++) {
                let o = tid * EVP + 4u * d4;
                store_out(row, d4, vec4<f32>(o_blk[o], o_blk[o + 1u], o_blk[o + 2u], o_blk[o + 3u]) * inv);
            }
            lse[row] = row_lse(st.x, st.y);
        }
    }
}
