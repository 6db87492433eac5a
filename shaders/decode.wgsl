// Split-K attention for few query rows and long key sequences (KV-cache decoding).
//
// One workgroup per (key split, query row, batch-head): it scores the split's keys against one
// query row (each invocation a strided subset of keys, masks applied inside), finds the split's
// max and sum with workgroup reductions, and writes the split's normalised partial output and
// logsumexp. `merge.wgsl` then combines the splits by the logsumexp rule. A split with no
// allowed key writes 0 and logsumexp -inf.
//
// The host prepends the constants WG (invocations, a power
// of two), E4 and EV4 (head dims in vec4s), RB (a divisor of EV4, at most 8) and NRB = EV4 / RB, HAS_MASK, HAS_BIAS and UNROLL (see flash.wgsl), and the input/output bindings
// (flash_io_vec4.wgsl or flash_io_scalar.wgsl; `out` is part_out, whose rows are Ev wide too).
//
// Each invocation takes a strided subset of the split's keys and keeps its own online softmax
// state (running max, sum and accumulator over its keys, the query row in registers, vec4 loads
// of K and V). The invocations' states are then merged through workgroup memory: the split's max,
// each state rescaled to it, sums and accumulators added (the accumulator in blocks of RB vec4s).
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
    chunk: u32, // keys per split
    _pad1: u32,
    _pad2: u32,
}

const MASKED: f32 = -3.0e38;
const START: f32 = -3.4e38;

@group(0) @binding(3) var<storage, read> mask: array<u32>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> kv_lens: array<u32>;
@group(0) @binding(7) var<storage, read_write> part_lse: array<f32>;
@group(0) @binding(8) var<uniform> p: Params;

// This invocation's accumulator over its keys.
var<private> acc: array<vec4<f32>, EV4>;

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
    let split = wid % p.splits;
    let row = wid / p.splits; // (bh, i) flattened
    let i = row % p.l;
    let bh = row / p.l;
    let b = bh / p.heads;
    let h = bh % p.heads;
    let kvh = b * (p.heads / p.group) + h / p.group;

    // Allowed keys of this row within the split: [j_begin, j_end).
    let j_begin = split * p.chunk;
    var j_end = min(p.s, j_begin + p.chunk);
    if (p.has_lens != 0u) {
        j_end = min(j_end, kv_lens[b]);
    }
    if (p.has_causal != 0u) {
        j_end = min(j_end, u32(clamp(i32(i) + p.causal_off + 1, 0, i32(p.s))));
    }

    var qr: array<vec4<f32>, E4>;
    for (var d4 = 0u; d4 < E4; d4++) { // unroll
        qr[d4] = load_q(row, d4) * p.scale;
    }
    for (var d4 = 0u; d4 < EV4; d4++) { // unroll
        acc[d4] = vec4<f32>(0.0);
    }
    var m = START;
    var sum = 0.0;
    for (var jj = tid; jj < p.chunk; jj += WG) {
        let j = j_begin + jj;
        // Rows past the allowed keys are read in bounds (clamped) and masked.
        let kvrow = kvh * p.s + min(j, p.s - 1u);
        var d = vec4<f32>(0.0);
        for (var d4 = 0u; d4 < E4; d4++) { // unroll
            d += qr[d4] * load_k(kvrow, d4);
        }
        var x = d.x + d.y + d.z + d.w;
        var keep = j < j_end;
        if (HAS_MASK) {
            let w = mask[b * p.mask_b + h * p.mask_h + i * p.mask_l + min(j, p.s - 1u) / 32u];
            keep = keep && (w & (1u << (j % 32u))) != 0u;
        }
        if (HAS_BIAS) {
            x += bias[b * p.bias_b + h * p.bias_h + i * p.bias_l + min(j, p.s - 1u) * p.bias_s];
        }
        // Masked-out keys ignore the bias; a -inf bias masks.
        x = select(START, x, keep && !(x < MASKED));
        let m_new = max(m, x);
        let alpha = exp(m - m_new);
        let pj = select(exp(x - m_new), 0.0, x < MASKED);
        sum = sum * alpha + pj;
        for (var d4 = 0u; d4 < EV4; d4++) { // unroll
            acc[d4] = acc[d4] * alpha + pj * load_v(kvrow, d4);
        }
        m = m_new;
    }

    // The split's max, then every state rescaled to it and summed (the prelude's wg_max,
    // wg_sum and store_acc: workgroup-memory trees, or subgroup reductions).
    let row_max = wg_max(m, tid);
    let f = exp(m - row_max);
    let row_sum = wg_sum(sum * f, tid);
    // A split with no allowed key has every weight 0: it writes 0 and logsumexp -inf.
    let inv = select(1.0 / row_sum, 0.0, row_sum == 0.0);
    let rows = p.total / p.splits;
    let orow = split * rows + row;
    store_acc(tid, f, inv, orow);
    if (tid == 0u) {
        part_lse[orow] = select(row_max + log(row_sum), bitcast<f32>(0xff800000u), row_sum == 0.0);
    }
}
