// What the backward kernels share (bwd_dq.wgsl, bwd_dkv.wgsl, bwd_dbias.wgsl, bwd_ds.wgsl):
// the statistics buffer `stats` (binding 6, written by bwd_prep.wgsl) and the recomputed
// softmax weight. Layout of `stats` (f32 words): the rows' logsumexp [0, rows), their
// D = rowsum(dO ∘ O) [rows, 2 rows), then the auxiliary words at lens_off (written by the
// host): the B key lengths, then the Hq ALiBi slopes (f32 bits), so that no kernel needs a
// ninth storage binding.

@group(0) @binding(6) var<storage, read> stats: array<f32>;

// Auxiliary word i (common/masks.wgsl's kv_len and alibi_slope read them).
fn aux_word(i: u32) -> u32 {
    return bitcast<u32>(stats[p.lens_off + i]);
}

// The logsumexp of score row `row` (b * Hq * L + h * L + i).
fn lse_of(row: u32) -> f32 {
    return stats[row];
}

// D = rowsum(dO ∘ O) of score row `row`.
fn dsum_of(row: u32) -> f32 {
    return stats[p.rows + row];
}

// The softmax weight P = exp(x - lse) of logit `x` in a row with logsumexp `lse`: 0 for a
// masked logit and in a row with no allowed key (lse = -inf); NaN propagates.
fn prob(x: f32, lse: f32) -> f32 {
    return select(exp(x - lse), 0.0, x < MASKED || is_empty_lse(lse));
}

// dS = P (dP - D), 0 where P is 0 (a masked key's dP may be anything, NaN included); a NaN P
// propagates.
fn dscore(pij: f32, dp: f32, d: f32) -> f32 {
    return select(0.0, pij * (dp - d), pij != 0.0 || is_nan_bits(pij));
}
