// Split-K attention for few query rows and long key sequences (KV-cache decoding).
//
// One workgroup per (key split, query row, batch-head): it scores the split's keys against one
// query row (each invocation a strided subset of keys, masks applied inside), finds the split's
// max and sum with workgroup reductions, and writes the split's normalised partial output and
// logsumexp. `merge.wgsl` then combines the splits by the logsumexp rule. A split with no
// allowed key writes 0 and logsumexp -inf.
//
// The host (src/kernels/decode.rs) prepends `Params` (generated from the Rust struct: l, s,
// e, ev, heads, group, splits, total, scale, chunk = keys per split, and the masks `m`), the
// shared snippets common/softmax.wgsl, common/masks.wgsl, the input/output bindings
// (common/io_vec4.wgsl or common/io_scalar.wgsl; `out` is part_out, whose rows are Ev wide
// too), the workgroup reductions (common/reduce_shared.wgsl and decode_acc_shared.wgsl, or
// common/reduce_subgroup.wgsl and decode_acc_subgroup.wgsl where the workgroup is one
// subgroup), and the constants WG (invocations, a power of two), E4 and EV4 (head dims in
// vec4s), RB (a divisor of EV4, at most 8) and NRB = EV4 / RB, HAS_MASK, HAS_BIAS and UNROLL
// (see flash.wgsl), and P8 with E8 = E4 / 2, EV8 = EV4 / 2: read K and V 8 elements per load
// (load_k8/load_v8; half formats, src/kernels/decode.rs).
//
// Each invocation takes a strided subset of the split's keys and keeps its own online softmax
// state (running max, sum and accumulator over its keys, the query row in registers, vec4 loads
// of K and V). The invocations' states are then merged by the workgroup reductions: the
// split's max, each state rescaled to it, sums and accumulators added.
//
// Bindings: 0 mask, 1 bias, 2 kv_lens, 3 q, 4 k, 5 v (read);
//           6 part_out [splits][B*Hq*L][Ev], 7 part_lse [splits][B*Hq*L] (read_write); 8 params.

@group(0) @binding(7) var<storage, read_write> part_lse: array<f32>;

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
    let j_end = min(j_begin + p.chunk, key_end(b, i));

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
        if (P8) {
            for (var d8 = 0u; d8 < E8; d8++) { // unroll
                let kk = load_k8(kvrow, d8);
                d += qr[2u * d8] * kk[0] + qr[2u * d8 + 1u] * kk[1];
            }
        } else {
            for (var d4 = 0u; d4 < E4; d4++) { // unroll
                d += qr[d4] * load_k(kvrow, d4);
            }
        }
        let x = masked_logit(d.x + d.y + d.z + d.w, j < j_end, b, h, i, j);
        let m_new = max(m, x);
        let alpha = rescale(m, m_new);
        let pj = weight(x, m_new);
        sum = sum * alpha + pj;
        // Keys past the allowed end (weight 0, alpha 1) leave the accumulator as it is: their
        // V rows (a KV cache's unwritten capacity, read clamped) may hold NaN, and 0 * NaN is
        // NaN.
        if (j >= j_end) {
            m = m_new;
            continue;
        }
        if (P8) {
            for (var d8 = 0u; d8 < EV8; d8++) { // unroll
                let vv = load_v8(kvrow, d8);
                acc[2u * d8] = acc[2u * d8] * alpha + pj * vv[0];
                acc[2u * d8 + 1u] = acc[2u * d8 + 1u] * alpha + pj * vv[1];
            }
        } else {
            for (var d4 = 0u; d4 < EV4; d4++) { // unroll
                acc[d4] = acc[d4] * alpha + pj * load_v(kvrow, d4);
            }
        }
        m = m_new;
    }

    // The split's max, then every state rescaled to it and summed (common/reduce_*.wgsl,
    // decode_acc_*.wgsl).
    let row_max = wg_max(m, tid);
    let f = rescale(m, row_max);
    let row_sum = wg_sum(sum * f, tid);
    // A split with no allowed key has every weight 0: it writes 0 and logsumexp -inf.
    let inv = select(1.0 / row_sum, 0.0, row_sum == 0.0);
    let rows = p.total / p.splits;
    let orow = split * rows + row;
    store_acc(tid, f, inv, orow);
    if (tid == 0u) {
        part_lse[orow] = row_lse(row_max, row_sum);
    }
}
