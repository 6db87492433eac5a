// Batched, tiled, register-blocked matrix product with strides:
//
//   C[z][m][n] = alpha * sum_k A[z][m][k] * B'[z][k][n]  (+ bias[n])
//
// where B' = B^T when TRANS_B (scores: S = scale * Q K^T; projections: X W^T) and B' = B
// otherwise (value weighting: O = P V). One workgroup computes a 64 x 64 tile of C; each of
// its 16 x 16 invocations a 4 x 4 block held in registers. K advances in steps of 16 through
// workgroup memory (8 KiB). Every load and store is bounds-checked, so M, N, K need not be
// multiples of the tile.
//
// Batch index z (the grid's z axis) selects the operand slices (slice_bases in
// common/matmul.wgsl, which also holds the epilogue finish_c4; B is shared by groups of query
// heads under grouped-query attention).
//
// The host prepends `Params`, generated from the Rust struct in src/kernels/matmul.rs, and
// the declarations of a, b, bias and c in their storage formats (src/kernels/access.rs) with
// `store_c4(i, n_left, x)`, which stores the first min(n_left, 4) elements of x at element i
// of c (whole words where the layout allows, else element by element).
//
// Bindings: 0 a (read), 1 b (read), 2 bias (read), 3 c (read_write), 4 params (uniform).

override TRANS_B: bool = true;
override HAS_BIAS: bool = false;
override ACCUM: bool = false;

const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 16u;

// [BK][BM / 4] and [BK][BN / 4]: a row of 4 consecutive m (or n) per vec4.
var<workgroup> a_tile: array<vec4<f32>, 256>;
var<workgroup> b_tile: array<vec4<f32>, 256>;

@compute @workgroup_size(16, 16, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let bases = slice_bases(wg.z);
    let a_base = bases.x;
    let b_base = bases.y;
    let c_base = bases.z;
    let row0 = wg.y * BM;
    let col0 = wg.x * BN;
    let tx = lid.x;
    let ty = lid.y;

    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i++) {
        acc[i] = vec4<f32>(0.0);
    }

    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        // A tile: 64 rows x 16 k, four elements per invocation, k fastest.
        for (var t = 0u; t < 4u; t++) {
            let e = li + t * 256u;
            let r = e / BK;
            let kk = e % BK;
            let gr = row0 + r;
            let gk = k0 + kk;
            var val = 0.0;
            if (gr < p.m && gk < p.k) {
                val = a_get(a_base + gr * p.a_row + gk);
            }
            a_tile[kk * (BM / 4u) + r / 4u][r % 4u] = val;
        }
        // B' tile: 16 k x 64 n.
        for (var t = 0u; t < 4u; t++) {
            let e = li + t * 256u;
            var cc: u32;
            var kk: u32;
            if (TRANS_B) {
                cc = e / BK;
                kk = e % BK;
            } else {
                cc = e % BN;
                kk = e / BN;
            }
            let gc = col0 + cc;
            let gk = k0 + kk;
            var val = 0.0;
            if (gc < p.n && gk < p.k) {
                if (TRANS_B) {
                    val = b_get(b_base + gc * p.b_row + gk);
                } else {
                    val = b_get(b_base + gk * p.b_row + gc);
                }
            }
            b_tile[kk * (BN / 4u) + cc / 4u][cc % 4u] = val;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let av = a_tile[kk * (BM / 4u) + ty];
            let bv = b_tile[kk * (BN / 4u) + tx];
            let k = k0 + kk;
            acc[0] += term4(av.x, bv, k);
            acc[1] += term4(av.y, bv, k);
            acc[2] += term4(av.z, bv, k);
            acc[3] += term4(av.w, bv, k);
        }
        workgroupBarrier();
    }

    for (var i = 0u; i < 4u; i++) {
        let r = row0 + ty * 4u + i;
        if (r >= p.m) {
            break;
        }
        let cc = col0 + tx * 4u;
        if (cc < p.n) {
            finish_c4(c_base + r * p.c_row, cc, acc[i]);
        }
    }
}
