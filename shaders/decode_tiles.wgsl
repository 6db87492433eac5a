// Split-K attention for few query rows and long key sequences, shaped for GPUs' memory system
// (`DecodeForm::GpuTiles`; `decode.wgsl` is the one-key-per-invocation form).
//
// One workgroup per (key split, query row, batch-head), like decode.wgsl, with the same params,
// bindings, masks and outputs (a split's normalised partial output and logsumexp, combined by
// `merge.wgsl`). The split's keys are taken in tiles of WG keys, two phases per tile:
//
// 1. Scores: KL adjacent invocations score each key of the tile against the query row (kept
//    in workgroup memory, `qs`: read by every invocation at the same address, a broadcast),
//    each reading every KL-th 16-byte chunk of its K row (vec4 of f32, 8 halves), so that one
//    load instruction of a subgroup reads whole stretches of K rows; their partial sums meet
//    in `scp`, and invocation t writes key t's masked logit to `sc`. (KL = 1, one invocation
//    per key reading its whole row, left lanes 256-512 bytes apart: 1.06-1.10x slower on an
//    H200.)
// 2. P V: the workgroup splits into NS = WG / EVP subsets of EVP invocations; invocation t
//    owns vec4 `t % EVP` of the output and keys `t / EVP, t / EVP + NS, ...` of the tile. The
//    invocations of a subset read one V row together, adjacent vec4s: one coalesced load per
//    key. Each keeps its online-softmax state (max, sum and one vec4 of accumulator), the same
//    in every invocation of a subset.
//
// Registers per invocation: one vec4 of accumulator and the dot product's vec4; no per-
// invocation arrays, so nothing spills at E = 256 (the one-key form keeps E + Ev floats per
// invocation). Arithmetic intensity is that of decoding (2 FLOPs per K or V element read): the
// form is built to keep enough loads in flight to reach memory bandwidth, not to reuse data.
//
// After the split's tiles, the subsets' states are merged through workgroup memory (the
// split's max, each subset rescaled to it, sums and accumulators added).
//
// Constants from the host (src/kernels/decode.rs): WG (invocations, a power of two, a multiple
// of EVP), E4, EV4, EVP (EV4 rounded up to a power of two), NS = WG / EVP, KPS = WG / NS (keys
// per subset per tile), P8, E8 (see decode.wgsl), KL (invocations per key in the scores, a
// power of two dividing E8 or E4 and WG), SCP (WG * KL, or 1), KC8 = E8 / KL,
// KC4 = E4 / KL, UNROLL, HAS_MASK, HAS_BIAS.
//
// Bindings: 0 mask, 1 bias, 2 kv_lens, 3 q, 4 k, 5 v (read);
//           6 part_out [splits][B*Hq*L][Ev], 7 part_lse [splits][B*Hq*L] (read_write); 8 params.

@group(0) @binding(7) var<storage, read_write> part_lse: array<f32>;

var<workgroup> qs: array<vec4<f32>, E4>;
var<workgroup> sc: array<f32, WG>;
var<workgroup> red_m: array<f32, NS>;
var<workgroup> red_s: array<f32, NS>;
var<workgroup> red_acc: array<vec4<f32>, WG>;
// The partial dot products of KL invocations per key (KL > 1).
var<workgroup> scp: array<f32, SCP>;
// A paged cache's V row of each key of the tile (PAGED: found once, by the key's scorer).
var<workgroup> vrow: array<u32, VR>;

// The dot product of the query row (`qs`, scaled) with the K row at element `kb`, over the 16-byte chunks
// `lane, lane + KL, ...` (all of them when KL = 1).
fn key_dot(kb: u32, lane: u32) -> f32 {
    var d = vec4<f32>(0.0);
    if (P8) {
        for (var c = 0u; c < KC8; c++) { // unroll
            let d8 = c * KL + lane;
            let kk = load_kb8(kb, d8);
            d += qs[2u * d8] * kk[0] + qs[2u * d8 + 1u] * kk[1];
        }
    } else {
        for (var c = 0u; c < KC4; c++) { // unroll
            let d4 = c * KL + lane;
            d += qs[d4] * load_kb(kb, d4);
        }
    }
    return d.x + d.y + d.z + d.w;
}

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    // Every invocation reaches every barrier: a workgroup past the grid's end does no work but
    // returns only after them (its row is clamped, its keys empty, its stores skipped).
    let wid = wg.x + wg.y * nwg.x;
    let live = wid < p.total;
    let split = wid % p.splits;
    let row = min(wid, p.total - 1u) / p.splits; // (bh, i) flattened
    let i = row % p.l;
    let bh = row / p.l;
    let b = bh / p.heads;
    let h = bh % p.heads;
    let kvh = kv_head(b, h);
    // The kv head's part of its rows' addresses (a paged cache's table row), once.
    let kh = k_head(kvh);
    let vh = v_head(kvh);

    // Allowed keys of this row within the split: [j_begin, j_end).
    let j_begin = split * p.chunk;
    var j_end = min(j_begin + p.chunk, key_end(b, i));
    if (!live) {
        j_end = j_begin;
    }
    // Keys before the window's first (past the sink tokens) are skipped.
    let j_start = min(first_key(b, i, j_begin), max(j_end, j_begin));

    for (var d4 = tid; d4 < E4; d4 += WG) {
        qs[d4] = load_q(row, d4) * p.scale;
    }
    workgroupBarrier();

    let slot = tid % EVP;
    let sub = tid / EVP;
    var acc = vec4<f32>(0.0);
    var m = START;
    var sum = 0.0;
    for (var t0 = j_start; t0 < j_end; t0 += WG) {
        // 1. Scores: key t0 + tid. Keys past the allowed end are not read.
        var x = START;
        let j = t0 + tid;
        if (KL == 1u) {
            if (j < j_end) {
                x = masked_logit(key_dot(k_at(kh, j), 0u), true, b, h, i, j);
            }
        } else {
            // KL adjacent invocations score one key together, each a strided share of its
            // 16-byte chunks: one load instruction reads KL adjacent chunks of a K row, not
            // one chunk of each of 32 rows. Their partial sums meet in `scp`.
            let lane = tid % KL;
            for (var r = 0u; r < KL; r++) { // unroll
                let jr = t0 + r * (WG / KL) + tid / KL;
                var part = 0.0;
                if (jr < j_end) {
                    part = key_dot(k_at(kh, jr), lane);
                }
                scp[r * WG + tid] = part;
            }
            workgroupBarrier();
            if (j < j_end) {
                var dot = 0.0;
                for (var c = 0u; c < KL; c++) { // unroll
                    dot += scp[tid * KL + c];
                }
                x = masked_logit(dot, true, b, h, i, j);
            }
        }
        sc[tid] = x;
        if (PAGED) {
            vrow[tid] = v_at(vh, min(j, p.s - 1u));
        }
        workgroupBarrier();

        // 2. P V over this subset's keys of the tile. Keys past the allowed end leave the
        // state as it is (their V rows, a KV cache's unwritten capacity, may hold NaN, read
        // clamped in bounds; 0 * NaN is NaN).
        let n = j_end - t0;
        if (slot < EV4) {
            for (var c = 0u; c < KPS; c++) { // unroll
                let k = sub + c * NS;
                var vb: u32;
                if (PAGED) {
                    vb = vrow[k];
                } else {
                    vb = v_at(vh, min(t0 + k, p.s - 1u));
                }
                let vv = load_vb(vb, slot);
                let xk = sc[k];
                let m_new = max(m, xk);
                let alpha = rescale(m, m_new);
                let pk = weight(xk, m_new);
                let inside = k < n;
                sum = select(sum, sum * alpha + pk, inside);
                acc = select(acc, acc * alpha + pk * vv, inside);
                m = select(m, m_new, inside);
            }
        }
        workgroupBarrier();
    }

    // The split's max over the subsets, each subset's state rescaled to it and summed.
    if (slot == 0u) {
        red_m[sub] = m;
    }
    workgroupBarrier();
    var row_max = START;
    for (var s = 0u; s < NS; s++) { // unroll
        row_max = max(row_max, red_m[s]);
    }
    let f = rescale(m, row_max);
    if (slot == 0u) {
        red_s[sub] = sum * f;
    }
    red_acc[tid] = acc * f;
    workgroupBarrier();
    if (!live || tid >= EV4) {
        return;
    }
    var sum0 = 0.0;
    var total = vec4<f32>(0.0);
    for (var s = 0u; s < NS; s++) { // unroll
        sum0 += red_s[s];
        total += red_acc[s * EVP + tid];
    }
    // The first split takes the sink logit into its denominator (HAS_SINKS): the merge's
    // logsumexp rule then counts it once.
    var st = vec3<f32>(row_max, sum0, 1.0);
    if (split == 0u) {
        st = with_sink(row_max, sum0, h);
    }
    let row_sum = st.y;
    // A split with no allowed key has every weight 0: it writes 0 and logsumexp -inf.
    let inv = select(st.z / row_sum, 0.0, row_sum == 0.0);
    let rows = p.total / p.splits;
    let orow = split * rows + row;
    store_out(orow, tid, total * inv);
    if (tid == 0u) {
        part_lse[orow] = row_lse(st.x, row_sum);
    }
}
