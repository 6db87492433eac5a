// What both matmul forms (matmul.wgsl, matmul_sg.wgsl) share: the operand slices of batch
// index z and the epilogue. Needs the kernel's `Params` (p), its `override HAS_BIAS`, and the
// host-generated bias_get / store_c4 (src/kernels/matmul.rs), and `override ACCUM` (add the
// product to C as it was: the backward's dK and dV sums over chunks and heads; f32 C only).

// Element offsets of batch slice z in A, B and C. B is shared by groups of query heads
// (grouped-query attention): global batch-head gz = b_z0 + z maps to kv slice
// (gz / heads) * (heads / group) + (gz % heads) / group.
fn slice_bases(z: u32) -> vec3<u32> {
    let gz = p.b_z0 + z;
    let b_slice = (gz / p.heads) * (p.heads / p.group) + (gz % p.heads) / p.group;
    return vec3<u32>(
        (p.a_z0 + z) * p.a_batch + p.a_off,
        b_slice * p.b_batch + p.b_off,
        (p.c_z0 + z) * p.c_batch + p.c_off,
    );
}

// Columns cc .. cc + 4 (those below N) of the C row starting at element `row_start`:
// alpha * acc, plus the bias, stored.
fn finish_c4(row_start: u32, cc: u32, acc: vec4<f32>) {
    var val = p.alpha * acc;
    if (HAS_BIAS) {
        for (var j = 0u; j < 4u; j++) { // unroll
            val[j] += bias_get(min(cc + j, p.n - 1u));
        }
    }
    if (ACCUM) {
        for (var j = 0u; j < 4u; j++) { // unroll
            if (cc + j < p.n) {
                val[j] += c_get(row_start + cc + j);
            }
        }
    }
    store_c4(row_start + cc, p.n - cc, val);
}
