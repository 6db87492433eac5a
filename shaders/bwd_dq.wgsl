// Backward, dQ (FlashAttention-2): one workgroup per (query tile, head, batch), the forward's
// layout (flash.wgsl). Each invocation owns RQ query rows: their scaled q, dO, logsumexp, D
// and dQ accumulator stay in registers while K/V tiles stream through workgroup memory. Per
// key it recomputes the logit (every mask inside), P = exp(x - lse), dP = dO . v,
// dS = P (dP - D), and adds dS k; dQ = scale * sum. Key tiles past the workgroup's last
// allowed key are skipped whole; a fully masked row gets dQ = 0. No atomics: WGSL has no
// float atomics, so dK and dV come from the key-major bwd_dkv.wgsl.
//
// The host prepends `Params` (src/kernels/backward.rs), common/softmax.wgsl, common/masks.wgsl,
// common/backward.wgsl (stats, kv_len, prob, dscore), q, k, v, dout with
// load_q/load_k/load_v/load_dout(row, c4), dq with store_dq(row, c4, x), and the constants
//   E4, EV4 (head dims in vec4s), BK (keys per tile), WG (invocations), RQ (rows per
//   invocation), HAS_MASK, HAS_BIAS, UNROLL, and SG_KV: the K/V tile lives in registers, one
//   key per invocation, read by subgroup shuffles (CPU adapters whose subgroup is the
//   workgroup, BK = WG), else it is staged in workgroup memory; the prelude declares the tile
//   with stage_kv / release_kv / key_at / value_at accordingly (flash_kv_*.wgsl, shared with
//   the forward).
//
// Bindings: 0 mask, 1 bias, 2 q, 3 k, 4 v, 5 dout, 6 stats (read), 7 dq (read_write), 8 params.

const BQ: u32 = WG * RQ;


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
    let tile = query_tile(wid, p.tiles);
    let qt = tile.qt;
    let bh = tile.bh;
    let b = tile.b;
    let h = tile.h;
    let kvh = tile.kvh;

    var qr: array<vec4<f32>, RQ * E4>;
    var dor: array<vec4<f32>, RQ * EV4>;
    var acc: array<vec4<f32>, RQ * E4>;
    var lse: array<f32, RQ>;
    var dsum: array<f32, RQ>;
    var row_end: array<u32, RQ>;

    // Keys before kv_begin (past the sink tokens) are outside every row's window.
    let keys = tile_keys(b, qt * BQ, BQ, tid);
    let kv_begin = keys.x;
    let kv_end = keys.y;
    // The documents of this tile's rows (HAS_DOCS): key tiles holding none are skipped.
    var qd = vec2<i32>(0);
    if (HAS_DOCS) {
        qd = query_docs(b, qt * BQ, qt * BQ + BQ);
    }

    for (var r = 0u; r < RQ; r++) { // unroll
        let i = qt * BQ + r * WG + tid;
        let valid = i < p.l;
        let row = bh * p.l + min(i, p.l - 1u);
        for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
            qr[r * E4 + d4] = select(vec4<f32>(0.0), load_q(row, d4) * p.scale, valid);
            acc[r * E4 + d4] = vec4<f32>(0.0);
        }
        for (var d4 = 0u; d4 < EV4; d4++) { // unroll if UNROLL_E
            dor[r * EV4 + d4] = select(vec4<f32>(0.0), load_dout(row, d4), valid);
        }
        lse[r] = lse_of(row);
        dsum[r] = dsum_of(row);
        row_end[r] = select(0u, key_end(b, min(i, p.l - 1u)), valid);
    }

    let i0 = qt * BQ;
    for (var j0 = next_key_tile(b, h, 0u, kv_begin, BK, kv_end, qd, i0, BQ, tid, WG); j0 < kv_end;
         j0 = next_key_tile(b, h, j0 + BK, kv_begin, BK, kv_end, qd, i0, BQ, tid, WG)) {
        stage_kv(kvh, j0, kv_end, tid);
        set_mod_full(b, h, i0, BQ, j0, BK);
        for (var jj = 0u; jj < BK; jj++) { // unroll if SG_KV
            let j = j0 + jj;
            for (var r = 0u; r < RQ; r++) { // unroll
                var d = vec4<f32>(0.0);
                var xs = 0.0;
                for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
                    if (SCALAR_LOGITS) {
                        xs = dot_fma(xs, qr[r * E4 + d4], key_at(jj, d4));
                    } else {
                        d += qr[r * E4 + d4] * key_at(jj, d4);
                    }
                }
                var x = select(START, select(d.x + d.y + d.z + d.w, xs, SCALAR_LOGITS), j < row_end[r]);
                let x0 = x;
                let i = min(qt * BQ + r * WG + tid, p.l - 1u);
                if (MASKED_LOGIT || HAS_WINDOW) {
                    x = masked_logit(x, in_range(x), b, h, i, j);
                }
                let pij = prob(x, lse[r]);
                var dp = vec4<f32>(0.0);
                for (var d4 = 0u; d4 < EV4; d4++) { // unroll if UNROLL_E
                    dp += dor[r * EV4 + d4] * value_at(jj, d4);
                }
                let ds = dscore(pij, dp.x + dp.y + dp.z + dp.w, dsum[r]) * logit_grad(x0, x, b, h, i, j);
                for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
                    acc[r * E4 + d4] += ds * key_at(jj, d4);
                }
            }
        }
        release_kv();
    }

    for (var r = 0u; r < RQ; r++) { // unroll
        let i = qt * BQ + r * WG + tid;
        if (i < p.l) {
            let row = bh * p.l + i;
            for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
                store_dq(row, d4, acc[r * E4 + d4] * p.scale);
            }
        }
    }
}
