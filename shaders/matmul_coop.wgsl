// The matmul's matrix-unit form (`Form::Coop`): the same product, params, bindings and
// epilogue as matmul.wgsl (see there), its inner products on the GPU's matrix units through
// cooperative matrices: T x T tiles of f16 operands accumulated in f32.
//
// One workgroup of WG invocations (a multiple of every subgroup size the adapter may run it
// with) computes a BM x BN = 4T x 4T block of C, 16 tiles of T x T; subgroup s of the
// workgroup's nsg takes tiles s, s + nsg, .. (nsg and s as the kernel sees them at run time, so
// AMD's 32 or 64 lanes both work). K advances in steps of BK = 2T: the A block [BM][BK] and the
// B' block [BK][BN] are converted to f16 in workgroup memory, zero past M, N and K, so every
// cooperative load reads in range by construction and the tails are exact. The accumulators
// live in workgroup memory too ([BM][BN] f32): cooperative matrices have no element access,
// and a subgroup's tile count is known only at run time. The epilogue (alpha, bias,
// accumulate, the store in C's format) is the scalar one of common/matmul.wgsl.
//
// Every cooperative value is a typed `var` (naga 30 writes invalid SPIR-V for a `let`), and
// every lane of a subgroup runs the cooperative operations (the tile loop is uniform across a
// subgroup). The host prepends the `enable` directives, `TILE`, `WG` and the aliases AT, BT, CT
// of the A, B and C matrix types.

override TRANS_B: bool = true;
override HAS_BIAS: bool = false;
override ACCUM: bool = false;

const BM: u32 = 4u * TILE;
const BN: u32 = 4u * TILE;
const BK: u32 = 2u * TILE;

var<workgroup> a_blk: array<f16, BM * BK>; // [BM][BK]
var<workgroup> b_blk: array<f16, BK * BN>; // [BK][BN]
var<workgroup> c_blk: array<f32, BM * BN>; // [BM][BN]

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
) {
    let bases = slice_bases(wg.z);
    let row0 = wg.y * BM;
    let col0 = wg.x * BN;
    for (var e = li; e < BM * BN; e += WG) {
        c_blk[e] = 0.0;
    }
    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        for (var e = li; e < BM * BK; e += WG) {
            let r = e / BK;
            let kk = e % BK;
            var x = 0.0;
            if (row0 + r < p.m && k0 + kk < p.k) {
                x = a_get(bases.x + (row0 + r) * p.a_row + k0 + kk);
            }
            a_blk[e] = f16(x);
        }
        for (var e = li; e < BK * BN; e += WG) {
            // k fastest when B is read transposed (its rows are n), n fastest otherwise.
            var kk = e / BN;
            var cc = e % BN;
            if (TRANS_B) {
                kk = e % BK;
                cc = e / BK;
            }
            var x = 0.0;
            if (col0 + cc < p.n && k0 + kk < p.k) {
                if (TRANS_B) {
                    x = b_get(bases.y + (col0 + cc) * p.b_row + k0 + kk);
                } else {
                    x = b_get(bases.y + (k0 + kk) * p.b_row + col0 + cc);
                }
            }
            b_blk[kk * BN + cc] = f16(x);
        }
        workgroupBarrier();
        for (var t = sg; t < 16u; t += nsg) {
            let c_at = (t / 4u) * TILE * BN + (t % 4u) * TILE;
            var acc: CT = coopLoadT<CT>(&c_blk[c_at], BN);
            for (var kk = 0u; kk < BK; kk += TILE) {
                var a: AT = coopLoadT<AT>(&a_blk[(t / 4u) * TILE * BK + kk], BK);
                var b: BT = coopLoadT<BT>(&b_blk[kk * BN + (t % 4u) * TILE], BN);
                acc = coopMultiplyAdd(a, b, acc);
            }
            coopStoreT(acc, &c_blk[c_at], BN);
        }
        workgroupBarrier();
    }
    for (var e = li; e < BM * BN / 4u; e += WG) {
        let r = e / (BN / 4u);
        let cc = (e % (BN / 4u)) * 4u;
        if (row0 + r < p.m && col0 + cc < p.n) {
            let i = r * BN + cc;
            let v = vec4<f32>(c_blk[i], c_blk[i + 1u], c_blk[i + 2u], c_blk[i + 3u]);
            finish_c4(bases.z + (row0 + r) * p.c_row, col0 + cc, v);
        }
    }
}
