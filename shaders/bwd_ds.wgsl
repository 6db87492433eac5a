// Backward of the unfused path, elementwise over one chunk of the scores [nz heads, lc rows, S]
// (rows i0.. of batch-heads z0..): from the raw scores scale * Q K^T (`sc`, the matmul's) and
// dP = dO V^T (`dp`), recompute P = exp(masked logit - lse) with every mask, and write
// dS = P (dP - D) over dp (for dQ = scale * dS K), and P^T and dS^T (for dV = P^T dO and
// dK = scale * dS^T Q) in the group-transposed layout: local head zl = u * gw + hl, element
// ((u * S + j) * gw * lc + hl * lc + ii), so that the gw query heads of one kv head form one
// [S, gw * lc] operand whose product with their stacked [gw * lc, d] rows sums over the group.
//
// The host prepends `Params` (src/kernels/backward.rs), common/softmax.wgsl, common/masks.wgsl,
// common/backward.wgsl, and HAS_MASK, HAS_BIAS.
//
// Bindings: 0 mask, 1 bias, 2 sc (read), 3 dp, 4 pt, 5 dst (read_write), 6 stats (read),
//           7 params.

@group(0) @binding(2) var<storage, read> sc: array<f32>;
@group(0) @binding(3) var<storage, read_write> dp: array<f32>;
@group(0) @binding(4) var<storage, read_write> pt: array<f32>;
@group(0) @binding(5) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let t = (wg.x + wg.y * nwg.x) * 64u + tid;
    if (t >= p.total) {
        return;
    }
    let j = t % p.s;
    let ii = (t / p.s) % p.lc;
    let zl = t / (p.s * p.lc);
    let bh = p.z0 + zl;
    let b = bh / p.heads;
    let h = bh % p.heads;
    let i = p.i0 + ii;
    let row = bh * p.l + i;
    let x = masked_logit(sc[t], j < key_end(b, i), b, h, i, j);
    let pij = prob(x, lse_of(row));
    // dS of the logit; dQ and dK take it through the softcap and a user score_mod (d(bias) is
    // bwd_dbias.wgsl's).
    let ds = dscore(pij, dp[t], dsum_of(row)) * logit_grad(sc[t], x, b, h, i, j);
    dp[t] = ds;
    let u = zl / p.gw;
    let hl = zl % p.gw;
    let tt = (u * p.s + j) * p.gw * p.lc + hl * p.lc + ii;
    pt[tt] = pij;
    dst[tt] = ds;
}
