// The batched matrix product of matmul.wgsl (same params, bindings, batching, bias epilogue
// and storage formats) in the form for CPU adapters whose workgroup is one subgroup of 8
// (lavapipe): no workgroup memory, no barriers; the operands are shared by subgroup shuffles.
//
//   C[z][m][n] = alpha * sum_k A[z][m][k] * B'[z][k][n]  (+ bias[n])
//
// A workgroup of 8 invocations computes a tile of 8 * RQ rows by 8 * NB columns of C. Invocation l
// owns RQ rows (l, l + 8, ...). For each step of 4 k and block of 8 columns, the workgroup loads
// the 4 x 8 block of B' with one vec4 load per invocation (`load_b_lane`: when TRANS_B, where B
// is [N, K], invocation l holds column l's 4 k; otherwise row k + l % 4, columns 4 (l / 4) ..
// + 4), and `b_column(b, j)` gathers column j's 4 values by shuffles (broadcasts: the loops are
// unrolled, the lanes constants). Each step does 8 * RQ dot products of 4 per invocation.
// KC4 steps per unrolled chunk.
//
// The host prepends `Params` (src/kernels/matmul.rs), the declarations of a, b, bias and c
// with `store_c4`, `load_a(z_base, row, k)` (4 consecutive k), `load_b_lane` and `b_column`
// (zero past M, N or K; src/kernels/matmul.rs), and the constants RQ, NB, NB2 = 2 * NB, ACC = RQ * NB2, KC4, UNROLL.

override TRANS_B: bool = true;
override HAS_BIAS: bool = false;
override ACCUM: bool = false;

@compute @workgroup_size(8, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let bases = slice_bases(wg.z);
    let a_base = bases.x;
    let b_base = bases.y;
    let c_base = bases.z;
    let row0 = wg.y * (8u * RQ) + lane;
    let col0 = wg.x * (8u * NB);

    // acc[(r * NB + nb) * 2 + j / 4][j % 4]: row r, column 8 nb + j of the tile.
    var acc: array<vec4<f32>, ACC>;
    for (var r = 0u; r < ACC; r++) { // unroll
        acc[r] = vec4<f32>(0.0);
    }
    var a_reg: array<vec4<f32>, RQ * KC4>;
    var b_reg: array<vec4<f32>, KC4>;
    for (var k0 = 0u; k0 < p.k; k0 += 4u * KC4) {
        for (var c = 0u; c < KC4; c++) { // unroll
            for (var r = 0u; r < RQ; r++) { // unroll
                a_reg[r * KC4 + c] = load_a(a_base, row0 + 8u * r, k0 + 4u * c);
            }
        }
        for (var nb = 0u; nb < NB; nb++) { // unroll
            for (var c = 0u; c < KC4; c++) { // unroll
                b_reg[c] = load_b_lane(b_base, col0 + 8u * nb, k0 + 4u * c, lane);
            }
            for (var c = 0u; c < KC4; c++) { // unroll
                for (var j = 0u; j < 8u; j++) { // unroll
                    let bj = b_column(b_reg[c], j);
                    for (var r = 0u; r < RQ; r++) { // unroll
                        acc[(r * NB + nb) * 2u + j / 4u][j % 4u] += term_dot4(a_reg[r * KC4 + c], bj, k0 + 4u * c);
                    }
                }
            }
        }
    }

    for (var r = 0u; r < RQ; r++) { // unroll
        let row = row0 + 8u * r;
        for (var h = 0u; h < NB2; h++) { // unroll
            let cc = col0 + 4u * h;
            if (row < p.m && cc < p.n) {
                finish_c4(c_base + row * p.c_row, cc, acc[r * NB2 + h]);
            }
        }
    }
}
