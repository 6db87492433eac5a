// Scaled masked softmax, one workgroup per score row, in place.
//
// Input: a chunk of raw logits `scale * q.k` laid out [nz][rows][S] (batch-head z0 + z,
// query row i0 + r). For each row it applies the masks (common/masks.wgsl: causal limit and
// key length, boolean mask, bias), then writes
//   p_j = exp(x_j - max) / sum_j' exp(x_j' - max)
// over the allowed keys and 0 elsewhere, plus the row's logsumexp `max + log(sum)`. The first
// pass stores each masked logit in place; the second reads it back.
// A row with no allowed key (or only -inf logits) gives all zeros and logsumexp = -inf.
// NaN logits propagate (they fail every comparison and poison the sum), as in PyTorch.
// Each invocation keeps an online-softmax state (common/softmax.wgsl) over its strided keys;
// the workgroup then takes the row's max and the sum of the rescaled sums
// (common/reduce_shared.wgsl).
//
// The host (src/kernels/softmax.rs) prepends `Params` (generated: rows, total, s, l, z0, i0,
// heads and the masks `m`), HAS_MASK and HAS_BIAS, and the shared snippets.
//
// Bindings: 0 mask, 1 bias, 2 kv_lens (read; common/masks.wgsl), 3 scores (read_write),
// 4 lse (read_write, [B * Hq, L]), 5 params.

const WG: u32 = 128u;

@group(0) @binding(3) var<storage, read_write> scores: array<f32>;
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let row = wg.x + wg.y * nwg.x;
    // Uniform per workgroup: the whole workgroup returns, before any barrier.
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
    let jend = key_end(b, i);

    var m = START;
    var s = 0.0;
    for (var j = tid; j < jend; j += WG) {
        let x = masked_logit(scores[row_base + j], true, b, h, i, j);
        // Kept for the second pass (the same invocation's keys), so that the masks and a user
        // score_mod run once per logit.
        scores[row_base + j] = x;
        let m_new = max(m, x);
        s = s * rescale(m, m_new) + weight(x, m_new);
        m = m_new;
    }
    let max0 = wg_max(m, tid);
    let sum0 = wg_sum(s * rescale(m, max0), tid);
    // The sink logit joins the denominator (HAS_SINKS; as it was otherwise).
    let st = with_sink(max0, sum0, h);
    let row_max = st.x;
    let row_sum = st.y;

    // A fully masked row has row_sum = 0: zeros, logsumexp -inf.
    let inv = select(1.0 / row_sum, 0.0, row_sum == 0.0);
    for (var j = tid; j < p.s; j += WG) {
        var w = 0.0;
        if (j < jend) {
            // A masked key weighs 0 even in a NaN row (0 * NaN would be NaN).
            let x = scores[row_base + j];
            w = select(weight(x, row_max) * inv, 0.0, x < MASKED);
        }
        scores[row_base + j] = w;
    }
    if (tid == 0u) {
        lse[bh * p.l + i] = row_lse(row_max, row_sum);
    }
}
