// Scaled masked softmax, one workgroup per score row, in place.
//
// Input: a chunk of raw logits `scale * q.k` laid out [nz][rows][S] (batch-head z0 + z,
// query row i0 + r). For each row it adds the bias, applies the causal limit, the boolean
// mask (packed 32 keys per u32, bit set = may attend) and the key length, then writes
//   p_j = exp(x_j - max) / sum_j' exp(x_j' - max)
// over the allowed keys and 0 elsewhere, plus the row's logsumexp `max + log(sum)`.
// A row with no allowed key (or only -inf logits) gives all zeros and logsumexp = -inf.
// NaN logits propagate (they fail every comparison and poison the sum), as in PyTorch.
// Each invocation keeps a running (max, sum) over its strided keys; the workgroup merges them.
//
// Bindings: 0 scores (read_write), 1 mask (read), 2 bias (read), 3 kv_lens (read),
// 4 lse (read_write, [B * Hq, L]), 5 params (uniform).

struct Params {
    rows: u32,
    total: u32,
    s: u32,
    l: u32,
    z0: u32,
    i0: u32,
    heads: u32,
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
}

const WG: u32 = 128u;
// Logits below this count as -inf (masked); a finite start value keeps exp() NaN-free.
const MASKED: f32 = -3.0e38;
const START: f32 = -3.4e38;

@group(0) @binding(0) var<storage, read_write> scores: array<f32>;
@group(0) @binding(1) var<storage, read> mask: array<u32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read> kv_lens: array<u32>;
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;

var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_s: array<f32, WG>;

// The logit of key j (bias added), or START (< MASKED) when the boolean mask forbids it.
fn logit(row_base: u32, b: u32, h: u32, i: u32, j: u32) -> f32 {
    if (p.has_mask != 0u) {
        let w = mask[b * p.mask_b + h * p.mask_h + i * p.mask_l + j / 32u];
        if ((w & (1u << (j % 32u))) == 0u) {
            return START;
        }
    }
    var x = scores[row_base + j];
    if (p.has_bias != 0u) {
        x += bias[b * p.bias_b + h * p.bias_h + i * p.bias_l + j * p.bias_s];
    }
    return x;
}

@compute @workgroup_size(128, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let row = wg.x + wg.y * nwg.x;
    if (row >= p.total) {
        return;
    }
    let z = row / p.rows;
    let i = p.i0 + row % p.rows;
    let bh = p.z0 + z;
    let b = bh / p.heads;
    let h = bh % p.heads;
    let row_base = row * p.s;

    // Keys [0, jend) may be allowed; the rest are masked by causality or key length.
    var jend = p.s;
    if (p.has_causal != 0u) {
        let lim = i32(i) + p.causal_off + 1;
        jend = u32(clamp(lim, 0, i32(p.s)));
    }
    if (p.has_lens != 0u) {
        jend = min(jend, kv_lens[b]);
    }

    var m = START;
    var s = 0.0;
    for (var j = tid; j < jend; j += WG) {
        let x = logit(row_base, b, h, i, j);
        if (x < MASKED) {
            continue;
        }
        if (x > m) {
            s = s * exp(m - x) + 1.0;
            m = x;
        } else {
            s += exp(x - m);
        }
    }
    red_m[tid] = m;
    red_s[tid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (tid < stride) {
            let m1 = red_m[tid];
            let m2 = red_m[tid + stride];
            let mm = max(m1, m2);
            red_s[tid] = red_s[tid] * exp(m1 - mm) + red_s[tid + stride] * exp(m2 - mm);
            red_m[tid] = mm;
        }
        workgroupBarrier();
    }
    let row_max = red_m[0];
    let row_sum = red_s[0];

    if (row_sum == 0.0) {
        // Fully masked row.
        for (var j = tid; j < p.s; j += WG) {
            scores[row_base + j] = 0.0;
        }
        if (tid == 0u) {
            var bits = 0xff800000u;
            lse[bh * p.l + i] = bitcast<f32>(bits);
        }
        return;
    }
    let inv = 1.0 / row_sum;
    for (var j = tid; j < p.s; j += WG) {
        var w = 0.0;
        if (j < jend) {
            let x = logit(row_base, b, h, i, j);
            if (!(x < MASKED)) {
                w = exp(x - row_max) * inv;
            }
        }
        scores[row_base + j] = w;
    }
    if (tid == 0u) {
        lse[bh * p.l + i] = row_max + log(row_sum);
    }
}
