// Fused attention (FlashAttention-2 style forward), one workgroup per (64-query tile, head, batch).
//
// The host prepends the specialisation constants (naga cannot size function-scope arrays by
// `override`):
//   const E4: u32   -- head dim E in vec4s, rounded up (zero padded)
//   const EV4: u32  -- value head dim Ev in vec4s, rounded up
//   const BK: u32   -- keys per tile; BK * (E4 + EV4) * 16 bytes of workgroup memory
//   const WG: u32   -- invocations per workgroup
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
// Bindings: 0 q, 1 k, 2 v, 3 mask (u32 bits), 4 bias, 5 kv_lens (read);
//           6 out, 7 lse (read_write); 8 params (uniform).

struct Params {
    l: u32,
    s: u32,
    e: u32,
    ev: u32,
    heads: u32,
    group: u32,
    q_tiles: u32,
    total: u32,
    scale: f32,
    has_causal: u32,
    causal_off: i32,
    has_mask: u32,
    has_bias: u32,
    has_lens: u32,
    mask_b: u32,
    mask_h: u32,
    mask_l: u32,
    bias_b: u32,
    bias_h: u32,
    bias_l: u32,
    bias_s: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const BQ: u32 = WG * RQ;
const MASKED: f32 = -3.0e38;
const START: f32 = -3.4e38;

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> mask: array<u32>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> kv_lens: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
@group(0) @binding(7) var<storage, read_write> lse: array<f32>;
@group(0) @binding(8) var<uniform> p: Params;

var<workgroup> k_tile: array<vec4<f32>, BK * E4>;
var<workgroup> v_tile: array<vec4<f32>, BK * EV4>;
var<workgroup> wg_end: u32;

// Load 4 consecutive elements of `row` (of width `width`) starting at column 4 * c4, zero padded.
fn load_k(base: u32, c4: u32, width: u32) -> vec4<f32> {
    var r = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) {
        if (c4 * 4u + c < width) {
            r[c] = k[base + c4 * 4u + c];
        }
    }
    return r;
}

fn load_v(base: u32, c4: u32, width: u32) -> vec4<f32> {
    var r = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) {
        if (c4 * 4u + c < width) {
            r[c] = v[base + c4 * 4u + c];
        }
    }
    return r;
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
    let qt = wid % p.q_tiles;
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
        var end = p.s;
        if (p.has_lens != 0u) {
            end = min(end, kv_lens[b]);
        }
        if (p.has_causal != 0u) {
            let last_row = min(qt * BQ + BQ, p.l) - 1u;
            end = min(end, u32(clamp(i32(last_row) + p.causal_off + 1, 0, i32(p.s))));
        }
        wg_end = end;
    }
    let kv_end = workgroupUniformLoad(&wg_end);

    for (var r = 0u; r < RQ; r++) {
        let i = qt * BQ + r * WG + tid;
        let base = (bh * p.l + i) * p.e;
        for (var d4 = 0u; d4 < E4; d4++) {
            var x = vec4<f32>(0.0);
            if (i < p.l) {
                for (var c = 0u; c < 4u; c++) {
                    if (d4 * 4u + c < p.e) {
                        x[c] = q[base + d4 * 4u + c];
                    }
                }
            }
            qr[r * E4 + d4] = x * p.scale;
        }
        for (var d4 = 0u; d4 < EV4; d4++) {
            acc[r * EV4 + d4] = vec4<f32>(0.0);
        }
        m[r] = START;
        sum[r] = 0.0;
        var end = kv_end;
        if (i >= p.l) {
            end = 0u;
        } else if (p.has_causal != 0u) {
            end = min(end, u32(clamp(i32(i) + p.causal_off + 1, 0, i32(p.s))));
        }
        row_end[r] = end;
    }

    for (var j0 = 0u; j0 < kv_end; j0 += BK) {
        for (var t = tid; t < BK * E4; t += WG) {
            let j = j0 + t / E4;
            var x = vec4<f32>(0.0);
            if (j < kv_end) {
                x = load_k((kvh * p.s + j) * p.e, t % E4, p.e);
            }
            k_tile[t] = x;
        }
        for (var t = tid; t < BK * EV4; t += WG) {
            let j = j0 + t / EV4;
            var x = vec4<f32>(0.0);
            if (j < kv_end) {
                x = load_v((kvh * p.s + j) * p.ev, t % EV4, p.ev);
            }
            v_tile[t] = x;
        }
        workgroupBarrier();

        // Logits of every (row, key) of the tile; each K element is read once for RQ rows.
        var sc: array<f32, RQ * BK>;
        for (var jj = 0u; jj < BK; jj++) {
            var d: array<vec4<f32>, RQ>;
            for (var r = 0u; r < RQ; r++) {
                d[r] = vec4<f32>(0.0);
            }
            for (var d4 = 0u; d4 < E4; d4++) {
                let kv = k_tile[jj * E4 + d4];
                for (var r = 0u; r < RQ; r++) {
                    d[r] += qr[r * E4 + d4] * kv;
                }
            }
            let j = j0 + jj;
            for (var r = 0u; r < RQ; r++) {
                var x = START;
                if (j < row_end[r]) {
                    x = d[r].x + d[r].y + d[r].z + d[r].w;
                    let i = qt * BQ + r * WG + tid;
                    if (p.has_mask != 0u) {
                        let w = mask[b * p.mask_b + h * p.mask_h + i * p.mask_l + j / 32u];
                        if ((w & (1u << (j % 32u))) == 0u) {
                            x = START;
                        }
                    }
                    if (p.has_bias != 0u && x != START) {
                        x += bias[b * p.bias_b + h * p.bias_h + i * p.bias_l + j * p.bias_s];
                    }
                    if (x < MASKED) {
                        x = START;
                    }
                }
                sc[r * BK + jj] = x;
            }
        }
        // Online softmax: new max per row, rescale once, then weights.
        for (var r = 0u; r < RQ; r++) {
            var tmax = m[r];
            for (var jj = 0u; jj < BK; jj++) {
                tmax = max(tmax, sc[r * BK + jj]);
            }
            let alpha = exp(m[r] - tmax);
            sum[r] *= alpha;
            for (var d4 = 0u; d4 < EV4; d4++) {
                acc[r * EV4 + d4] *= alpha;
            }
            var s = 0.0;
            for (var jj = 0u; jj < BK; jj++) {
                let x = sc[r * BK + jj];
                var pj = 0.0;
                if (!(x < MASKED)) {
                    pj = exp(x - tmax);
                }
                sc[r * BK + jj] = pj;
                s += pj;
            }
            sum[r] += s;
            m[r] = tmax;
        }
        // Accumulate P V; each V element read once for RQ rows.
        let jn = min(BK, kv_end - j0);
        for (var jj = 0u; jj < jn; jj++) {
            // The key's weights for each row, hoisted out of the Ev loop (constant indices inside).
            var pr: array<f32, RQ>;
            for (var r = 0u; r < RQ; r++) {
                pr[r] = sc[r * BK + jj];
            }
            for (var d4 = 0u; d4 < EV4; d4++) {
                let vv = v_tile[jj * EV4 + d4];
                for (var r = 0u; r < RQ; r++) {
                    acc[r * EV4 + d4] += pr[r] * vv;
                }
            }
        }
        workgroupBarrier();
    }

    for (var r = 0u; r < RQ; r++) {
        let i = qt * BQ + r * WG + tid;
        if (i >= p.l) {
            continue;
        }
        let obase = (bh * p.l + i) * p.ev;
        if (sum[r] == 0.0) {
            for (var d = 0u; d < p.ev; d++) {
                out[obase + d] = 0.0;
            }
            var bits = 0xff800000u;
            lse[bh * p.l + i] = bitcast<f32>(bits);
            continue;
        }
        let inv = 1.0 / sum[r];
        for (var d4 = 0u; d4 < EV4; d4++) {
            let o = acc[r * EV4 + d4] * inv;
            for (var c = 0u; c < 4u; c++) {
                if (d4 * 4u + c < p.ev) {
                    out[obase + d4 * 4u + c] = o[c];
                }
            }
        }
        lse[bh * p.l + i] = m[r] + log(sum[r]);
    }
}
