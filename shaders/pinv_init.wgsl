// The Nyström pseudo-inverse's starting point (Nyströmformer, Xiong et al. 2021): for each
// m x m matrix A of the batch,
//
//   Z0 = A^T / (max_j sum_i |A_ij| * max_i sum_j |A_ij|)
//
// (the largest column sum times the largest row sum of |A|), which makes the iteration
// Z <- 1/4 Z (13 I - A Z (15 I - A Z (7 I - A Z))) converge to pinv(A).
// One workgroup per matrix: each invocation sums whole columns and rows, a tree reduction in
// workgroup memory takes the maxima, then the transpose is written scaled.
//
// The host prepends `Params` (src/kernels/pinv.rs: m, batch). The 1-D grid folds over x and y.
// Bindings: 0 a (read, f32 [batch, m, m]), 1 z (read_write, f32 [batch, m, m]), 2 params.

const WG: u32 = 64u;

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> z: array<f32>;

var<workgroup> red: array<vec2<f32>, WG>;

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let mat = wg.x + wg.y * nwg.x;
    if (mat >= p.batch) {
        return;
    }
    let m = p.m;
    let base = mat * m * m;
    var col_max = 0.0;
    var row_max = 0.0;
    for (var t = tid; t < m; t += WG) {
        var col = 0.0;
        var row = 0.0;
        for (var i = 0u; i < m; i++) {
            col += abs(a[base + i * m + t]);
            row += abs(a[base + t * m + i]);
        }
        col_max = max(col_max, col);
        row_max = max(row_max, row);
    }
    red[tid] = vec2<f32>(col_max, row_max);
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (tid < s) {
            red[tid] = max(red[tid], red[tid + s]);
        }
        workgroupBarrier();
    }
    let norms = red[0];
    let inv = 1.0 / (norms.x * norms.y);
    for (var e = tid; e < m * m; e += WG) {
        let i = e / m;
        let j = e % m;
        z[base + j * m + i] = a[base + e] * inv;
    }
}
