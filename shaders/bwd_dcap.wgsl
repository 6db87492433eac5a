// Backward, the gradients of the captures a user score_mod reads (`score_mod_dcapture`, see
// src/user_mod.rs): for every allowed logit, recompute it and its P and dP = dO . v from q, k,
// v, dO and the statistics, take g = dS = P (dP - D) (the loss's gradient in score_mod's
// result) and call u_score_mod_dcapture(score_mod's input, b, h, i, j, g), whose d_NAME(idx, x)
// calls record (element, x) pairs: at most CALLS per logit (the host checks the source).
//
// Deterministic, no atomics: workgroup w owns slice w of `partials` (every capture element,
// packed) and takes the chunks of 64 keys of one score row c = w, w + W, ... (W = p.total
// workgroups). Per chunk, each invocation records its logit's pairs in workgroup memory; then
// invocation t adds, in the invocations' order and each one's calls' order, the pairs whose
// element is t modulo 64 (each slot has one owner). `bwd_dcap_sum.wgsl` then adds the slices
// in order.
//
// The host prepends `Params` (src/kernels/backward.rs), common/softmax.wgsl, common/masks.wgsl,
// common/backward.wgsl, q, k, v, dout (scalar accessors q_get, ...), HAS_MASK, HAS_BIAS, CALLS
// and the user's score_mod_dcapture with its accumulators.
//
// Bindings: 0 mask, 1 bias, 2 q, 3 k, 4 v, 5 dout, 6 stats (read), 7 partials [W, cap_len]
//           (read_write), 8 params.

@group(0) @binding(7) var<storage, read_write> partials: array<f32>;

const WGT: u32 = 64u;

var<workgroup> rec_at: array<u32, 512>;
var<workgroup> rec_x: array<f32, 512>;
var<workgroup> rec_n: array<u32, WGT>;
var<private> my_n: u32;
var<private> my_base: u32;

// Called by the user's d_NAME accumulators: element `at` of the packed captures gets `x`.
fn dcap_record(at: u32, x: f32) {
    if (my_n < CALLS) {
        rec_at[my_base + my_n] = at;
        rec_x[my_base + my_n] = x;
        my_n += 1u;
    }
}

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let w = wg.x + wg.y * nwg.x;
    // Uniform per workgroup: the whole workgroup returns, before any barrier.
    if (w >= p.total) {
        return;
    }
    let slice = w * p.cap_len;
    for (var a = tid; a < p.cap_len; a += WGT) {
        partials[slice + a] = 0.0;
    }
    let per_row = (p.s + WGT - 1u) / WGT;
    let chunks = p.rows * per_row;
    my_base = tid * CALLS;
    for (var c = w; c < chunks; c += p.total) {
        my_n = 0u;
        let row = c / per_row;
        let j = (c % per_row) * WGT + tid;
        let i = row % p.l;
        let bh = row / p.l;
        let b = bh / p.heads;
        let h = bh % p.heads;
        if (j < p.s && j < key_end(b, i)) {
            let kvh = kv_head(b, h);
            var s = 0.0;
            for (var d = 0u; d < p.e; d++) {
                s += (q_get(q_base(row) + d) * p.scale) * k_get(k_base(kvh * p.s + j) + d);
            }
            let x = masked_logit(s, true, b, h, i, j);
            if (in_range(x)) {
                let pij = prob(x, lse_of(row));
                var dp = 0.0;
                for (var d = 0u; d < p.ev; d++) {
                    dp += dout_get(dout_base(row) + d) * v_get(v_base(kvh * p.s + j) + d);
                }
                let g = dscore(pij, dp, dsum_of(row));
                u_score_mod_dcapture(pre_mod(s, b, h, i, j), b, h, i + p.m.pos_q, j + p.m.pos_k, g);
            }
        }
        rec_n[tid] = my_n;
        workgroupBarrier();
        for (var t = 0u; t < WGT; t++) {
            let n = rec_n[t];
            for (var r = 0u; r < n; r++) {
                let at = rec_at[t * CALLS + r];
                if (at % WGT == tid) {
                    partials[slice + at] += rec_x[t * CALLS + r];
                }
            }
        }
        workgroupBarrier();
    }
}
