// Split-K attention for few query rows and long key sequences (KV-cache decoding).
//
// One workgroup per (key split, query row, batch-head): it scores the split's keys against one
// query row (each invocation a strided subset of keys, masks applied inside), finds the split's
// max and sum with workgroup reductions, and writes the split's normalised partial output and
// logsumexp. `merge.wgsl` then combines the splits by the logsumexp rule. A split with no
// allowed key writes 0 and logsumexp -inf.
//
// The host prepends `const CHUNK: u32` (keys per split, at most 1024).
//
// Bindings: 0 q, 1 k, 2 v, 3 mask, 4 bias, 5 kv_lens (read);
//           6 part_out [splits][B*Hq*L][Ev], 7 part_lse [splits][B*Hq*L] (read_write); 8 params.

struct Params {
    l: u32,
    s: u32,
    e: u32,
    ev: u32,
    heads: u32,
    group: u32,
    splits: u32,
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

const WG: u32 = 64u;
const MASKED: f32 = -3.0e38;
const START: f32 = -3.4e38;

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> mask: array<u32>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> kv_lens: array<u32>;
@group(0) @binding(6) var<storage, read_write> part_out: array<f32>;
@group(0) @binding(7) var<storage, read_write> part_lse: array<f32>;
@group(0) @binding(8) var<uniform> p: Params;

var<workgroup> weights: array<f32, CHUNK>;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let wid = wg.x + wg.y * nwg.x;
    if (wid >= p.total) {
        return;
    }
    let split = wid % p.splits;
    let row = wid / p.splits; // (bh, i) flattened
    let i = row % p.l;
    let bh = row / p.l;
    let b = bh / p.heads;
    let h = bh % p.heads;
    let kvh = b * (p.heads / p.group) + h / p.group;

    // Allowed keys of this row within the split: [j_begin, j_end).
    let j_begin = split * CHUNK;
    var j_end = min(p.s, j_begin + CHUNK);
    if (p.has_lens != 0u) {
        j_end = min(j_end, kv_lens[b]);
    }
    if (p.has_causal != 0u) {
        j_end = min(j_end, u32(clamp(i32(i) + p.causal_off + 1, 0, i32(p.s))));
    }

    let qbase = row * p.e;
    var m = START;
    for (var jj = tid; jj < CHUNK; jj += WG) {
        let j = j_begin + jj;
        var x = START;
        if (j < j_end) {
            let kbase = (kvh * p.s + j) * p.e;
            var d = 0.0;
            for (var c = 0u; c < p.e; c++) {
                d += q[qbase + c] * k[kbase + c];
            }
            x = d * p.scale;
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
        weights[jj] = x;
        m = max(m, x);
    }
    red[tid] = m;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (tid < stride) {
            red[tid] = max(red[tid], red[tid + stride]);
        }
        workgroupBarrier();
    }
    let row_max = red[0];
    workgroupBarrier();

    var s = 0.0;
    for (var jj = tid; jj < CHUNK; jj += WG) {
        let x = weights[jj];
        var w = 0.0;
        if (!(x < MASKED)) {
            w = exp(x - row_max);
        }
        weights[jj] = w;
        s += w;
    }
    red[tid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (tid < stride) {
            red[tid] = red[tid] + red[tid + stride];
        }
        workgroupBarrier();
    }
    let row_sum = red[0];

    let rows = p.total / p.splits;
    let obase = (split * rows + row) * p.ev;
    if (row_sum == 0.0) {
        for (var d = tid; d < p.ev; d += WG) {
            part_out[obase + d] = 0.0;
        }
        if (tid == 0u) {
            var bits = 0xff800000u;
            part_lse[split * rows + row] = bitcast<f32>(bits);
        }
        return;
    }
    let inv = 1.0 / row_sum;
    let n = select(0u, j_end - j_begin, j_end > j_begin);
    for (var d = tid; d < p.ev; d += WG) {
        var o = 0.0;
        for (var jj = 0u; jj < n; jj++) {
            o += weights[jj] * v[(kvh * p.s + j_begin + jj) * p.ev + d];
        }
        part_out[obase + d] = o * inv;
    }
    if (tid == 0u) {
        part_lse[split * rows + row] = row_max + log(row_sum);
    }
}
