// The matmul's GPU form (`matmul::Form::GpuTiles`): the same product, params, bindings and
// epilogue as matmul.wgsl (see there), shaped for GPUs.
//
// One workgroup of 16 x 16 invocations computes a 128 x 128 tile of C; each invocation an 8 x 8
// block in registers: rows 4 ty .. 4 ty + 3 and 64 + 4 ty .. 64 + 4 ty + 3, columns likewise
// from tx (two vec4s 64 apart, so that the 16 invocations of a row of the workgroup read 16
// adjacent vec4s of the B tile: no bank conflicts). K advances in steps of 8 through
// workgroup memory (2 x 4 KiB, m and n fastest). Per step each invocation reads 4 vec4s of
// workgroup memory for 64 FMAs (the 64 x 64 form: 2 for 16), and the next step's A and B
// values are loaded from global memory into registers before this step's products (one
// buffer in workgroup memory, double-buffered through registers).
//
// Registers per invocation: 64 accumulators, 16 operand values, 8 prefetched values.
// Arithmetic intensity per workgroup step: 2 x 128 x 128 x 8 FLOPs for 2 x 128 x 8 elements
// read from global memory (64 FLOPs per element; the 64 x 64 form: 32).
//
// Loads are bounds-checked (zeros past M, N, K); the products are not (the zeros make them
// exact). The host sets UNROLL (its loops unrolled at the source).

override TRANS_B: bool = true;
override HAS_BIAS: bool = false;
override ACCUM: bool = false;

const BM: u32 = 128u;
const BN: u32 = 128u;
const BK: u32 = 8u;

// [BK][BM / 4]: a row of 4 consecutive m (or n) per vec4.
var<workgroup> a_tile: array<vec4<f32>, 256>;
var<workgroup> b_tile: array<vec4<f32>, 256>;

// This invocation's 4 A values and 4 B values of the tile at k0 (see the layout in main).
var<private> a_next: vec4<f32>;
var<private> b_next: vec4<f32>;

// Invocation li loads 4 consecutive k of row li / 2 of the A tile (k 4 (li % 2) ..), and of
// B' either likewise (TRANS_B: B's rows are n) or 4 consecutive n of k row li / 32.
fn load_next(a_base: u32, b_base: u32, row0: u32, col0: u32, k0: u32, li: u32) {
    let r = li / 2u;
    let kq = k0 + 4u * (li % 2u);
    let gr = row0 + r;
    for (var c = 0u; c < 4u; c++) { // unroll
        var x = 0.0;
        if (gr < p.m && kq + c < p.k) {
            x = a_get(a_base + gr * p.a_row + kq + c);
        }
        a_next[c] = x;
    }
    if (TRANS_B) {
        let gc = col0 + r;
        for (var c = 0u; c < 4u; c++) { // unroll
            var x = 0.0;
            if (gc < p.n && kq + c < p.k) {
                x = b_get(b_base + gc * p.b_row + kq + c);
            }
            b_next[c] = x;
        }
    } else {
        let gk = k0 + li / 32u;
        let gc = col0 + 4u * (li % 32u);
        for (var c = 0u; c < 4u; c++) { // unroll
            var x = 0.0;
            if (gk < p.k && gc + c < p.n) {
                x = b_get(b_base + gk * p.b_row + gc + c);
            }
            b_next[c] = x;
        }
    }
}

fn store_next(li: u32) {
    let r = li / 2u;
    let kq = 4u * (li % 2u);
    for (var c = 0u; c < 4u; c++) { // unroll
        a_tile[(kq + c) * (BM / 4u) + r / 4u][r % 4u] = a_next[c];
    }
    if (TRANS_B) {
        for (var c = 0u; c < 4u; c++) { // unroll
            b_tile[(kq + c) * (BN / 4u) + r / 4u][r % 4u] = b_next[c];
        }
    } else {
        b_tile[(li / 32u) * (BN / 4u) + li % 32u] = b_next;
    }
}

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

    // acc[2 i + h]: row (i < 4: 4 ty + i; else 64 + 4 ty + i - 4), columns 64 h + 4 tx .. + 3.
    var acc: array<vec4<f32>, 16>;
    for (var i = 0u; i < 16u; i++) { // unroll
        acc[i] = vec4<f32>(0.0);
    }

    load_next(a_base, b_base, row0, col0, 0u, li);
    store_next(li);
    workgroupBarrier();
    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        let more = k0 + BK < p.k;
        if (more) {
            load_next(a_base, b_base, row0, col0, k0 + BK, li);
        }
        for (var kk = 0u; kk < BK; kk++) { // unroll
            let a0 = a_tile[kk * (BM / 4u) + ty];
            let a1 = a_tile[kk * (BM / 4u) + 16u + ty];
            let b0 = b_tile[kk * (BN / 4u) + tx];
            let b1 = b_tile[kk * (BN / 4u) + 16u + tx];
            let k = k0 + kk;
            for (var i = 0u; i < 4u; i++) { // unroll
                acc[2u * i] += term4(a0[i], b0, k);
                acc[2u * i + 1u] += term4(a0[i], b1, k);
                acc[8u + 2u * i] += term4(a1[i], b0, k);
                acc[8u + 2u * i + 1u] += term4(a1[i], b1, k);
            }
        }
        workgroupBarrier();
        if (more) {
            store_next(li);
        }
        workgroupBarrier();
    }

    for (var i = 0u; i < 8u; i++) { // unroll
        let r = row0 + 64u * (i / 4u) + 4u * ty + i % 4u;
        if (r < p.m) {
            for (var h = 0u; h < 2u; h++) { // unroll
                let cc = col0 + 64u * h + 4u * tx;
                if (cc < p.n) {
                    finish_c4(c_base + r * p.c_row, cc, acc[2u * i + h]);
                }
            }
        }
    }
}
