// Fused attention, the register-tiled GPU form (FusedForm::GpuTiles): FlashAttention-2's
// forward for GPUs without matrix units, built the way a good SIMT matmul is. One workgroup per
// (tile of BM query rows, head, batch), WG = NY x NX invocations.
//
// The host (src/kernels/flash.rs) prepends the same Params, shared snippets (common/softmax.wgsl,
// common/masks.wgsl), I/O and score4 as flash.wgsl, and the constants:
//   const E4, EV4: u32 -- head dims in vec4s (rounded up, zero padded)
//   const BM: u32      -- query rows per workgroup (NY * TM)
//   const BN: u32      -- keys per tile (NX * TN)
//   const TM, TN: u32  -- query rows and keys per invocation (4 or 8); TMN = TM * TN
//   const SCALAR_LOGITS: bool -- logits summed as scalars by score_fma, else as vec4 partials
//                      (score4) added at the end
//   const PREFETCH: bool -- the next K/V tile's loads issued before this tile's arithmetic
//   const NX, NY: u32  -- invocations along keys and along rows; WG = NX * NY
//   const EVT: u32     -- output vec4 columns per invocation: ceil(EV4 / NX); TM_EVT = 4 EVT
//   const NPK, NPV: u32 -- vec4s of the K and V tiles each invocation loads:
//                      ceil(BN E4 / WG), ceil(BN NX EVT / WG)
//   const SG_ROWS: bool -- each row's max and sum are reduced across its NX invocations (NX
//                      adjacent lanes of one subgroup: the host checks NX divides the
//                      subgroup size) by subgroup shuffles, not through workgroup memory: one
//                      barrier per tile fewer (the host then defines row_max_sg and row_sum_sg:
//                      a butterfly of subgroupShuffleXor, every lane getting the same bits;
//                      otherwise stubs, never called: a WebGPU compiler rejects subgroup
//                      built-ins in a module without the `subgroups` extension)
//   const RED_LEN: u32 -- the length of red (1 where unused)
//
// Per tile of BN keys, invocation (ty, tx) owns the TM x TN block of logits of rows
// ty + NY r (r < TM) and keys tx + NX t (t < TN): each vec4 of q and k read from workgroup
// memory serves TN or TM logits (8 FMAs per load, against 4 in flash.wgsl's GPU form, and a
// quarter of its registers). The rows' new max is reduced by subgroup shuffles (SG_ROWS) or
// through workgroup memory (`red`), the weights P go to workgroup memory (`p_tile`), and the
// same invocation accumulates
// O += P V for its TM rows and the vec4 columns tx + NX k (k < EVT): each V vec4 serves TM
// rows. Each row's sum stays split over the NX invocations of its rows until the end.
// Strided rows and keys, and the Q/K tiles' padded row stride QS, keep the invocations of a
// subgroup on distinct banks. Registers per invocation: TM * TN logits (scalars summed by
// FMAs where SCALAR_LOGITS, the GPU default: 16; else vec4 partials, 64), TM * EVT vec4
// accumulators, TM max and sum, and with PREFETCH NPK + NPV vec4s of the next K/V tile (about
// 60 floats at E = Ev = 64, BN = 32, without the prefetch; measured on an H200, the scalar
// logits and no prefetch ran c_h8_s4096_causal 1.06x (f32) and 1.12x (f16) faster, and
// TM x TN = 8 x 4, 4 x 8, 8 x 8 2-4.5x slower; with SG_ROWS, 1.07-1.10x faster again).
// Arithmetic intensity from workgroup memory: Q K^T does TM * TN vec4 FMAs (8 FLOP each) per
// TM + TN vec4 loads, 2 vec4 FMAs per load at TM = TN = 4 (flash.wgsl's
// GPU form: 1); P V does 4 * EVT * TM vec4 FMAs per TM + 4 * EVT loads (1.6 at EVT = 2).
//
// Semantics are flash.wgsl's (the same helpers): masked logits START, rows with no allowed key
// write 0 and logsumexp -inf, NaN propagates, tiles past the workgroup's last allowed key
// skipped.
//
// Bindings: as flash.wgsl (0 mask, 1 bias, 2 kv_lens, 3 q, 4 k, 5 v, 6 out, 7 lse; 8 params).

const WG: u32 = NX * NY;
// Padded row stride (vec4s) of the Q and K tiles.
const QS: u32 = E4 + 1u;
// Row stride (vec4s) of the V tile: every column an invocation owns exists (zero padded).
const VS: u32 = NX * EVT;
// Padded row stride (vec4s of 4 keys) of the P tile.
const PS: u32 = BN / 4u + 1u;

@group(0) @binding(7) var<storage, read_write> lse: array<f32>;

var<workgroup> q_tile: array<vec4<f32>, BM * QS>;
var<workgroup> k_tile: array<vec4<f32>, BN * QS>;
var<workgroup> v_tile: array<vec4<f32>, BN * VS>;
var<workgroup> p_tile: array<vec4<f32>, BM * PS>;
var<workgroup> red: array<f32, RED_LEN>;

// Load this invocation's share of the K and V tiles of keys j0 .. j0 + BN of kv head `kvh`
// (keys past kv_end and padding columns zero) into registers.
fn fetch_kv(
    kvh: u32,
    j0: u32,
    kv_end: u32,
    tid: u32,
    kp: ptr<function, array<vec4<f32>, NPK>>,
    vp: ptr<function, array<vec4<f32>, NPV>>,
) {
    let kh = k_head(kvh);
    let vh = v_head(kvh);
    for (var n = 0u; n < NPK; n++) { // unroll
        let t = tid + n * WG;
        let jj = t / E4;
        var x = vec4<f32>(0.0);
        if (t < BN * E4 && j0 + jj < kv_end) {
            x = load_kb(k_at(kh, j0 + jj), t % E4);
        }
        (*kp)[n] = x;
    }
    for (var n = 0u; n < NPV; n++) { // unroll
        let t = tid + n * WG;
        let jj = t / VS;
        let c4 = t % VS;
        var x = vec4<f32>(0.0);
        if (t < BN * VS && j0 + jj < kv_end && c4 < EV4) {
            x = load_vb(v_at(vh, j0 + jj), c4);
        }
        (*vp)[n] = x;
    }
}

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
    let tile = query_tile(wid, p.q_tiles);
    let qt = tile.qt;
    let bh = tile.bh;
    let b = tile.b;
    let h = tile.h;
    let kvh = tile.kvh;
    let tx = tid % NX;
    let ty = tid / NX;
    let i0 = qt * BM;

    // Keys before kv_begin (past the sink tokens) are outside every row's window.
    let keys = tile_keys(b, i0, BM, tid);
    let kv_begin = keys.x;
    let kv_end = keys.y;
    // The documents of this tile's rows (HAS_DOCS): key tiles holding none are skipped.
    var qd = vec2<i32>(0);
    if (HAS_DOCS) {
        qd = query_docs(b, i0, i0 + BM);
    }

    // The scaled Q tile (rows past L zero).
    for (var t = tid; t < BM * E4; t += WG) {
        let rr = t / E4;
        let d4 = t % E4;
        var x = vec4<f32>(0.0);
        if (i0 + rr < p.l) {
            x = load_q(bh * p.l + i0 + rr, d4) * p.scale;
        }
        q_tile[rr * QS + d4] = x;
    }

    var acc: array<vec4<f32>, TM * EVT>;
    var m: array<f32, TM>;
    var sum: array<f32, TM>;
    var row_end: array<u32, TM>;
    var row_begin: array<u32, TM>;
    for (var r = 0u; r < TM; r++) { // unroll
        let i = i0 + r * NY + ty;
        var end = select(0u, kv_end, i < p.l);
        if (p.m.has_causal != 0u) {
            end = min(end, causal_end(b, i));
        }
        // The window by each row's key range [row_begin, row_end) and the sink tokens.
        if (HAS_WINDOW) {
            end = min(end, key_end(b, min(i, p.l - 1u)));
            row_begin[r] = key_begin(b, min(i, p.l - 1u));
        }
        row_end[r] = end;
        m[r] = START;
        sum[r] = 0.0;
        for (var k = 0u; k < EVT; k++) { // unroll
            acc[r * EVT + k] = vec4<f32>(0.0);
        }
    }

    // With PREFETCH, K/V tiles are double-buffered through registers: the next tile's loads
    // are issued before this tile's arithmetic, and land in workgroup memory after it.
    var kp: array<vec4<f32>, NPK>;
    var vp: array<vec4<f32>, NPV>;
    let j_first = next_key_tile(b, h, 0u, kv_begin, BN, kv_end, qd, i0, BM, tid, WG);
    var j_next = j_first;
    for (var j0 = j_first; j0 < kv_end; j0 = j_next) {
        set_mod_full(b, h, i0, BM, j0, BN);
        if (j0 == j_first || !PREFETCH) {
            fetch_kv(kvh, j0, kv_end, tid, &kp, &vp);
        }
        for (var n = 0u; n < NPK; n++) { // unroll
            let t = tid + n * WG;
            if (t < BN * E4) {
                k_tile[(t / E4) * QS + t % E4] = kp[n];
            }
        }
        for (var n = 0u; n < NPV; n++) { // unroll
            let t = tid + n * WG;
            if (t < BN * VS) {
                v_tile[t] = vp[n];
            }
        }
        workgroupBarrier();
        j_next = next_key_tile(b, h, j0 + BN, kv_begin, BN, kv_end, qd, i0, BM, tid, WG);
        if (PREFETCH && j_next < kv_end) {
            fetch_kv(kvh, j_next, kv_end, tid, &kp, &vp);
        }

        // The TM x TN logits: scalars summed by FMAs, or (as flash.wgsl) vec4 partials, then
        // their sum.
        var d: array<vec4<f32>, TMN>;
        var ds: array<f32, TMN>;
        for (var c = 0u; c < TMN; c++) { // unroll
            d[c] = vec4<f32>(0.0);
            ds[c] = 0.0;
        }
        for (var d4 = 0u; d4 < E4; d4++) { // unroll
            var qv: array<vec4<f32>, TM>;
            for (var r = 0u; r < TM; r++) { // unroll
                qv[r] = q_tile[(r * NY + ty) * QS + d4];
            }
            for (var t = 0u; t < TN; t++) { // unroll
                let kv = k_tile[(t * NX + tx) * QS + d4];
                for (var r = 0u; r < TM; r++) { // unroll
                    if (SCALAR_LOGITS) {
                        ds[r * TN + t] = score_fma(ds[r * TN + t], qv[r], kv, d4);
                    } else {
                        d[r * TN + t] += score4(qv[r], kv, d4);
                    }
                }
            }
        }
        var sc: array<f32, TM * TN>;
        var rmax: array<f32, TM>;
        for (var c = 0u; c < TMN; c++) { // unroll
            let dd = d[c];
            sc[c] = select(dd.x + dd.y + dd.z + dd.w, ds[c], SCALAR_LOGITS);
        }
        for (var r = 0u; r < TM; r++) { // unroll
            var pm = START;
            for (var t = 0u; t < TN; t++) { // unroll
                let j = j0 + t * NX + tx;
                var ok = j < row_end[r];
                if (HAS_WINDOW) {
                    ok = ok && (j >= row_begin[r] || j < p.m.win_sinks);
                }
                var x = select(START, sc[r * TN + t], ok);
                if (MASKED_LOGIT) {
                    let i = min(i0 + r * NY + ty, p.l - 1u);
                    x = masked_logit(x, in_range(x), b, h, i, j);
                }
                sc[r * TN + t] = x;
                pm = max(pm, x);
            }
            rmax[r] = pm;
            if (SG_ROWS) {
                rmax[r] = row_max_sg(pm);
            } else {
                red[(r * NY + ty) * NX + tx] = pm;
            }
        }
        // The row maxima through workgroup memory (by subgroup shuffles, no barrier).
        if (!SG_ROWS) {
            workgroupBarrier();
        }

        // Each row's new max (every invocation of the row reduces the same values in the same
        // order), the rescale factor, the weights into the P tile, this invocation's part of
        // the sum.
        var alpha: array<f32, TM>;
        for (var r = 0u; r < TM; r++) { // unroll
            let rr = r * NY + ty;
            var mx = max(m[r], rmax[r]);
            if (!SG_ROWS) {
                for (var x = 0u; x < NX; x++) { // unroll
                    mx = max(mx, red[rr * NX + x]);
                }
            }
            alpha[r] = rescale(m[r], mx);
            m[r] = mx;
            var s = 0.0;
            for (var t = 0u; t < TN; t++) { // unroll
                let pj = weight(sc[r * TN + t], mx);
                s += pj;
                let kk = t * NX + tx;
                p_tile[rr * PS + kk / 4u][kk % 4u] = pj;
            }
            sum[r] = sum[r] * alpha[r] + s;
        }
        workgroupBarrier();

        // O = O alpha + P V for this invocation's rows and columns.
        for (var c = 0u; c < TM_EVT; c++) { // unroll
            acc[c] *= alpha[c / EVT];
        }
        for (var j4 = 0u; j4 < BN / 4u; j4++) {
            var pv: array<vec4<f32>, TM>;
            for (var r = 0u; r < TM; r++) { // unroll
                pv[r] = p_tile[(r * NY + ty) * PS + j4];
            }
            for (var u = 0u; u < 4u; u++) { // unroll
                for (var k = 0u; k < EVT; k++) { // unroll
                    let v = v_tile[(j4 * 4u + u) * VS + k * NX + tx];
                    for (var r = 0u; r < TM; r++) { // unroll
                        acc[r * EVT + k] += pv[r][u] * v;
                    }
                }
            }
        }
        workgroupBarrier();
    }

    // Each row's sum: the NX invocations' parts, added in the same order by all of them.
    var totals: array<f32, TM>;
    if (SG_ROWS) {
        for (var r = 0u; r < TM; r++) { // unroll
            totals[r] = row_sum_sg(sum[r]);
        }
    } else {
        for (var r = 0u; r < TM; r++) { // unroll
            red[(r * NY + ty) * NX + tx] = sum[r];
        }
        workgroupBarrier();
        for (var r = 0u; r < TM; r++) { // unroll
            let rr = r * NY + ty;
            var total = 0.0;
            for (var x = 0u; x < NX; x++) { // unroll
                total += red[rr * NX + x];
            }
            totals[r] = total;
        }
    }
    for (var r = 0u; r < TM; r++) { // unroll
        let rr = r * NY + ty;
        let i = i0 + rr;
        // The sink logit joins the denominator (HAS_SINKS; as it was otherwise).
        let st = with_sink(m[r], totals[r], h);
        let total = st.y;
        if (i < p.l) {
            let row = bh * p.l + i;
            let inv = select(st.z / total, 0.0, total == 0.0);
            for (var k = 0u; k < EVT; k++) { // unroll
                let c4 = k * NX + tx;
                if (c4 < EV4) {
                    store_out(row, c4, select(acc[r * EVT + k] * inv, vec4<f32>(0.0), total == 0.0));
                }
            }
            if (tx == 0u) {
                lse[row] = row_lse(st.x, total);
            }
        }
    }
}
