// Strided 4-D copy: dst (contiguous, dims [n0, n1, n2, n3]) from src with any element strides,
//
//   dst[i0][i1][i2][i3] = src[off + i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3]
//
// Splits projections [B, L, H, d] into heads [B, H, L, d] and merges them back; a stride of 0
// broadcasts (a learned constant query shared by the batch). One invocation per pair of
// consecutive dst elements (whole words in half formats); the 1-D grid folds over x and y.
//
// The host prepends `Params`, generated from the Rust struct in src/kernels/permute.rs, and
// src and dst in their storage formats with `store_pair(i, x)` (src/kernels/access.rs).
//
// Bindings: 0 src (read), 1 dst (read_write), 2 params (uniform).

const WG: u32 = 256u;

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let idx = 2u * ((wg.x + wg.y * nwg.x) * WG + tid);
    if (idx >= p.total) {
        return;
    }
    var x = vec2<f32>(0.0);
    for (var e = 0u; e < 2u; e++) {
        let i = idx + e;
        if (i < p.total) {
            let i3 = i % p.n3;
            let r = i / p.n3;
            let i2 = r % p.n2;
            let r2 = r / p.n2;
            let i1 = r2 % p.n1;
            let i0 = r2 / p.n1;
            x[e] = src_get(p.off + i0 * p.s0 + i1 * p.s1 + i2 * p.s2 + i3 * p.s3);
        }
    }
    store_pair(idx, x);
}
