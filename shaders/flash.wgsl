// Fused attention (FlashAttention-2 style forward), one workgroup per (query tile, head, batch).
//
// The host (src/kernels/flash.rs) prepends `Params` (generated from the Rust struct:
// l, s, e, ev, heads, group, q_tiles, total, scale, and the masks `m`), the shared snippets
// common/softmax.wgsl (sentinels, online-softmax step) and common/masks.wgsl (mask bindings
// and tests), the input/output bindings (common/io_vec4.wgsl when E and Ev are multiples of 4,
// else common/io_scalar.wgsl: q, k, v, out and load_q/load_k/load_v/store_out), and the
// specialisation constants (naga cannot size function-scope arrays by `override`):
//   const E4: u32   -- head dim E in vec4s, rounded up (zero padded)
//   const EV4: u32  -- value head dim Ev in vec4s, rounded up
//   const BK: u32   -- keys per tile; BK * (E4 + EV4) * 16 bytes of workgroup memory unless
//                      SG_KV
//   const WG: u32   -- invocations per workgroup
//   const KG: u32   -- keys per unrolled step; NG = BK / KG steps per tile
//   const SG_KV: bool -- the K/V tile lives in registers, one key per invocation, and is read
//                      by subgroup shuffles (CPU adapters whose subgroup is exactly the
//                      workgroup, BK = WG); else it is staged in workgroup memory. The prelude
//                      declares the tile with stage_kv / release_kv / key_at / value_at
//                      accordingly (flash_kv_*.wgsl, shared with bwd_dq.wgsl).
//   const HAS_MASK: bool, HAS_BIAS: bool -- a boolean mask / an additive bias is bound
//   fn score4(q, k, d4) -- the terms of vec4 block d4 of the score: q * k (scaled dot product),
//                      or u[d4] * tanh(q + k) (Bahdanau's additive score, with u at binding 8
//                      before the params; q and k are then the projections)
//   const UNROLL: bool -- unroll the loops marked `// unroll` (src/kernels/unroll.rs), so that
//                      every index into a private array is a constant
//   const RQ: u32   -- query rows per invocation (rows tid, tid + WG, ...): each K/V element
//                      read from workgroup memory serves RQ rows. GPUs use RQ = 1, WG = 64;
//                      CPU adapters (lavapipe), where every memory access is costly, more rows.
//
// Each invocation owns RQ query rows: their scaled q and output accumulators stay in
// registers. K and V tiles are streamed through workgroup memory. Per tile, a row computes its
// BK logits (mask bits, bias, causal limit and key length applied inside), then the online
// softmax update: new max, rescale the accumulator and running sum once, add p_j * v_j.
// The L x S matrix is never written. Key tiles past the workgroup's last allowed key (causal
// limit of its last row, key length) are skipped whole.
// Outputs: O = acc / sum and the row logsumexp max + log(sum); a row with no allowed key
// writes 0 and logsumexp = -inf. NaN logits propagate through the sum.
//
// Bindings: 0 mask (u32 bits), 1 bias, 2 kv_lens (common/masks.wgsl), 3 q, 4 k, 5 v (read),
//           6 out (common/io_*.wgsl), 7 lse (read_write); 8 params.

const BQ: u32 = WG * RQ;

@group(0) @binding(7) var<storage, read_write> lse: array<f32>;

var<workgroup> wg_end: u32;

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
    // Heaviest query tiles (the last, under a causal mask) first: better balance at the end.
    let qt = p.q_tiles - 1u - wid % p.q_tiles;
    let bh = wid / p.q_tiles;
    let b = bh / p.heads;
    let h = bh % p.heads;
    let kvh = b * (p.heads / p.group) + h / p.group;

    // This invocation's query rows (pre-scaled), accumulators, running max and sum, and the
    // end of each row's allowed keys.
    var qr: array<vec4<f32>, RQ * E4>;
    var acc: array<vec4<f32>, RQ * EV4>;
    var m: array<f32, RQ>;
    var sum: array<f32, RQ>;
    var row_end: array<u32, RQ>;

    // Keys [0, kv_end) can matter to some row of this tile; later tiles are skipped whole.
    if (tid == 0u) {
        let last_row = min(qt * BQ + BQ, p.l) - 1u;
        wg_end = key_end(b, last_row);
    }
    let kv_end = workgroupUniformLoad(&wg_end);

    for (var r = 0u; r < RQ; r++) { // unroll
        let i = qt * BQ + r * WG + tid;
        let valid = i < p.l;
        let qrow = bh * p.l + min(i, p.l - 1u);
        for (var d4 = 0u; d4 < E4; d4++) { // unroll
            qr[r * E4 + d4] = select(vec4<f32>(0.0), load_q(qrow, d4) * p.scale, valid);
        }
        for (var d4 = 0u; d4 < EV4; d4++) { // unroll
            acc[r * EV4 + d4] = vec4<f32>(0.0);
        }
        m[r] = START;
        sum[r] = 0.0;
        var end = select(0u, kv_end, valid);
        if (p.m.has_causal != 0u) {
            end = min(end, causal_end(b, i));
        }
        row_end[r] = end;
    }

    for (var j0 = 0u; j0 < kv_end; j0 += BK) {
        stage_kv(kvh, j0, kv_end, tid);

        // The tile in NG steps of KG keys (keys past kv_end have logit START and a zero V
        // row). Logits of every (row, key) of the step; each K element is read once for RQ rows.
        for (var g = 0u; g < NG; g++) { // unroll if SG_KV
            let jg = g * KG;
            var sc: array<f32, RQ * KG>;
            for (var jj = 0u; jj < KG; jj++) { // unroll
                var d: array<vec4<f32>, RQ>;
                for (var r = 0u; r < RQ; r++) { // unroll
                    d[r] = vec4<f32>(0.0);
                }
                for (var d4 = 0u; d4 < E4; d4++) { // unroll
                    let kv = key_at(jg + jj, d4);
                    for (var r = 0u; r < RQ; r++) { // unroll
                        d[r] += score4(qr[r * E4 + d4], kv, d4);
                    }
                }
                let j = j0 + jg + jj;
                for (var r = 0u; r < RQ; r++) { // unroll
                    let x = d[r].x + d[r].y + d[r].z + d[r].w;
                    sc[r * KG + jj] = select(START, x, j < row_end[r]);
                }
            }
            // The boolean mask and the bias (specialised away when absent: CPU adapters execute
            // both sides of every branch).
            if (HAS_MASK || HAS_BIAS) {
                for (var jj = 0u; jj < KG; jj++) { // unroll
                    let j = j0 + jg + jj;
                    for (var r = 0u; r < RQ; r++) { // unroll
                        let i = min(qt * BQ + r * WG + tid, p.l - 1u);
                        let x = sc[r * KG + jj];
                        sc[r * KG + jj] = masked_logit(x, in_range(x), b, h, i, j);
                    }
                }
            }
            // Online softmax: new max per row, the rescale factor, then weights.
            var alpha: array<f32, RQ>;
            for (var r = 0u; r < RQ; r++) { // unroll
                var smax = m[r];
                for (var jj = 0u; jj < KG; jj++) { // unroll
                    smax = max(smax, sc[r * KG + jj]);
                }
                alpha[r] = rescale(m[r], smax);
                sum[r] *= alpha[r];
                var s = 0.0;
                for (var jj = 0u; jj < KG; jj++) { // unroll
                    let x = sc[r * KG + jj];
                    let pj = weight(x, smax);
                    sc[r * KG + jj] = pj;
                    s += pj;
                }
                sum[r] += s;
                m[r] = smax;
            }
            // Rescale and accumulate P V, one vec4 column block at a time, so that each
            // accumulator is read and written once per step; each V element is read once for
            // RQ rows. Keys past kv_end have p = 0 and a zero V row.
            for (var d4 = 0u; d4 < EV4; d4++) { // unroll
                var vv: array<vec4<f32>, KG>;
                for (var jj = 0u; jj < KG; jj++) { // unroll
                    vv[jj] = value_at(jg + jj, d4);
                }
                for (var r = 0u; r < RQ; r++) { // unroll
                    var a = acc[r * EV4 + d4] * alpha[r];
                    for (var jj = 0u; jj < KG; jj++) { // unroll
                        a += sc[r * KG + jj] * vv[jj];
                    }
                    acc[r * EV4 + d4] = a;
                }
            }
        }
        release_kv();
    }

    for (var r = 0u; r < RQ; r++) { // unroll
        let i = qt * BQ + r * WG + tid;
        if (i < p.l) {
            let row = bh * p.l + i;
            if (sum[r] == 0.0) {
                for (var d4 = 0u; d4 < EV4; d4++) { // unroll
                    store_out(row, d4, vec4<f32>(0.0));
                }
                lse[row] = neg_inf();
            } else {
                let inv = 1.0 / sum[r];
                for (var d4 = 0u; d4 < EV4; d4++) { // unroll
                    store_out(row, d4, acc[r * EV4 + d4] * inv);
                }
                lse[row] = row_lse(m[r], sum[r]);
            }
        }
    }
}
