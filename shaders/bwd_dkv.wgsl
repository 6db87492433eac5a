// Backward, dK and dV (FlashAttention-2): one workgroup per (key tile, kv head, batch). Each
// invocation owns RK keys: their k, v and the dK, dV accumulators stay in registers while the
// query tiles of every query head of the group (GQA: the sum over the group is taken here, no
// atomics) stream through workgroup memory with their scaled q, dO, logsumexp, D and allowed
// key end. Per (query, key): the logit with every mask, P = exp(x - lse), dP = dO . v,
// dS = P (dP - D); dV += P dO and dK += dS (scale q). Query tiles that see none of the
// workgroup's keys (above the causal diagonal) are skipped whole, and so is everything when
// the key length ends before the tile.
//
// Output: one f32 buffer, dK [B, Hkv, S, E] at element 0 and dV [B, Hkv, S, Ev] at p.dv_off
// (converted to k's and v's formats by the host), so the kernel binds 8 storage buffers.
//
// The host prepends `Params` (src/kernels/backward.rs), common/softmax.wgsl, common/masks.wgsl,
// common/backward.wgsl, q, k, v, dout with load_*(row, c4), dkv with store_dk / store_dv(row,
// c4, x), and the constants E4, EV4, BQ (query rows per tile), WG, RK (keys per invocation),
// HAS_MASK, HAS_BIAS, UNROLL, and SG_Q: the query tile lives in registers, one row per
// invocation, read by subgroup shuffles (CPU adapters whose subgroup is the workgroup,
// BQ = WG; QT = 1), else it is staged in workgroup memory (QT = BQ); the prelude defines
// q_at, do_at and stat_at (row ii of the tile: vec4 block d4 of its scaled q and of its dO;
// its lse, D and key end) accordingly, so no subgroup operation appears without subgroups.
//
// Bindings: 0 mask, 1 bias, 2 q, 3 k, 4 v, 5 dout, 6 stats (read), 7 dkv (read_write), 8 params.

const BKV: u32 = WG * RK;

var<workgroup> q_tile: array<vec4<f32>, QT * E4>;
var<workgroup> do_tile: array<vec4<f32>, QT * EV4>;
var<workgroup> lse_tile: array<f32, QT>;
var<workgroup> dsum_tile: array<f32, QT>;
var<workgroup> end_tile: array<u32, QT>;
// With SG_Q: this invocation's query row of the tile (scaled q, dO, lse, D, key end).
var<private> q_reg: array<vec4<f32>, E4>;
var<private> do_reg: array<vec4<f32>, EV4>;
var<private> stat_reg: vec3<f32>;

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
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
    let j_first = kt * BKV;

    var kr: array<vec4<f32>, RK * E4>;
    var vr: array<vec4<f32>, RK * EV4>;
    var dk: array<vec4<f32>, RK * E4>;
    var dv: array<vec4<f32>, RK * EV4>;
    for (var r = 0u; r < RK; r++) { // unroll
        let j = j_first + r * WG + tid;
        let row = kvh * p.s + min(j, p.s - 1u);
        for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
            kr[r * E4 + d4] = load_k(row, d4);
            dk[r * E4 + d4] = vec4<f32>(0.0);
        }
        for (var d4 = 0u; d4 < EV4; d4++) { // unroll if UNROLL_E
            vr[r * EV4 + d4] = load_v(row, d4);
            dv[r * EV4 + d4] = vec4<f32>(0.0);
        }
    }

    // The first query row that may see key j_first: i >= j_first - causal_offset(b).
    var i_start = 0u;
    if (p.m.has_causal != 0u) {
        i_start = u32(clamp(i32(j_first) - causal_offset(b), 0, i32(p.l)));
    }
    // Nothing to do past the key length (kv_len is uniform over the workgroup).
    var i_stop = p.l;
    if (p.m.has_lens != 0u && j_first >= kv_len(b)) {
        i_stop = 0u;
    }
    // The window: rows before j_first - offset - right see none of these keys, rows past
    // j_last - offset + left neither, unless the tile holds sink tokens.
    if (HAS_WINDOW && j_first >= p.m.win_sinks) {
        let woff = window_offset(b);
        if (p.m.win_right >= 0) {
            i_start = max(i_start, u32(clamp(i32(j_first) - woff - p.m.win_right, 0, i32(p.l))));
        }
        if (p.m.win_left >= 0) {
            let j_last = min(j_first + BKV, p.s) - 1u;
            i_stop = min(i_stop, u32(clamp(i32(j_last) - woff + p.m.win_left + 1, 0, i32(p.l))));
        }
    }
    let t0 = i_start / BQ;
    // The documents of this tile's keys (HAS_DOCS): query tiles holding none are skipped.
    var kd = vec2<i32>(0);
    if (HAS_DOCS) {
        kd = doc_span(p.m.doc_kb, p.s, b, min(j_first, p.s - 1u), min(j_first + BKV, p.s));
    }

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
            // Query tiles where the user's mask_mod allows none of these keys.
            if (HAS_MASK_MOD && !mask_mod_any(b, h, i0, BQ, j_first, BKV, tid, WG)) {
                continue;
            }
            if (SG_Q) {
                let i = i0 + tid;
                let row = bh * p.l + min(i, p.l - 1u);
                for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
                    q_reg[d4] = select(vec4<f32>(0.0), load_q(row, d4) * p.scale, i < p.l);
                }
                for (var d4 = 0u; d4 < EV4; d4++) { // unroll if UNROLL_E
                    do_reg[d4] = select(vec4<f32>(0.0), load_dout(row, d4), i < p.l);
                }
                let end = select(0u, key_end(b, min(i, p.l - 1u)), i < p.l);
                stat_reg = vec3<f32>(lse_of(row), dsum_of(row), bitcast<f32>(end));
            } else {
                for (var t = tid; t < BQ * E4; t += WG) {
                    let i = i0 + t / E4;
                    q_tile[t] = select(vec4<f32>(0.0), load_q(bh * p.l + min(i, p.l - 1u), t % E4) * p.scale, i < p.l);
                }
                for (var t = tid; t < BQ * EV4; t += WG) {
                    let i = i0 + t / EV4;
                    do_tile[t] = select(vec4<f32>(0.0), load_dout(bh * p.l + min(i, p.l - 1u), t % EV4), i < p.l);
                }
                for (var t = tid; t < BQ; t += WG) {
                    let i = min(i0 + t, p.l - 1u);
                    lse_tile[t] = lse_of(bh * p.l + i);
                    dsum_tile[t] = dsum_of(bh * p.l + i);
                    end_tile[t] = select(0u, key_end(b, i), i0 + t < p.l);
                }
                workgroupBarrier();
            }
            for (var ii = 0u; ii < BQ; ii++) { // unroll if SG_Q
                let i = min(i0 + ii, p.l - 1u);
                let st = stat_at(ii);
                let lse = st.x;
                let dsum = st.y;
                let end = bitcast<u32>(st.z);
                for (var r = 0u; r < RK; r++) { // unroll
                    let j = j_first + r * WG + tid;
                    var d = vec4<f32>(0.0);
                    var xs = 0.0;
                    for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
                        if (SCALAR_LOGITS) {
                            xs = dot_fma(xs, q_at(ii, d4), kr[r * E4 + d4]);
                        } else {
                            d += q_at(ii, d4) * kr[r * E4 + d4];
                        }
                    }
                    var x = select(START, select(d.x + d.y + d.z + d.w, xs, SCALAR_LOGITS), j < end);
                    let x0 = x;
                    if (MASKED_LOGIT || HAS_WINDOW) {
                        x = masked_logit(x, in_range(x), b, h, i, j);
                    }
                    let pij = prob(x, lse);
                    var dp = vec4<f32>(0.0);
                    for (var d4 = 0u; d4 < EV4; d4++) { // unroll if UNROLL_E
                        let g = do_at(ii, d4);
                        dp += g * vr[r * EV4 + d4];
                        dv[r * EV4 + d4] += pij * g;
                    }
                    let ds = dscore(pij, dp.x + dp.y + dp.z + dp.w, dsum) * logit_grad(x0, x, b, h, i, j);
                    for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
                        dk[r * E4 + d4] += ds * q_at(ii, d4);
                    }
                }
            }
            if (!SG_Q) {
                workgroupBarrier();
            }
        }
    }

    for (var r = 0u; r < RK; r++) { // unroll
        let j = j_first + r * WG + tid;
        if (j < p.s) {
            let row = kvh * p.s + j;
            for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
                store_dk(row, d4, dk[r * E4 + d4]);
            }
            for (var d4 = 0u; d4 < EV4; d4++) { // unroll if UNROLL_E
                store_dv(row, d4, dv[r * EV4 + d4]);
            }
        }
    }
}
