// What both matmul forms (matmul.wgsl, matmul_sg.wgsl) share: the operand slices of batch
// index z and the epilogue. Needs the kernel's `Params` (p), its `override HAS_BIAS`, and the
// host-generated bias_get / store_c4 (src/kernels/matmul.rs), and `override ACCUM` (add the
// product to C as it was: the backward's dK and dV sums over chunks and heads; f32 C only).

// The terms a * b[c] of one k (4 columns b).
fn term4(a: f32, b: vec4<f32>, k: u32) -> vec4<f32> {
    return a * b;
}

// The sum over 4 consecutive k (from k) of a[c] * b[c].
fn term_dot4(a: vec4<f32>, b: vec4<f32>, k: u32) -> f32 {
    return dot(a, b);
}

// Element offsets of batch slice z in A, B and C. A global slice g (z plus the operand's
// z0) is head g % heads of batch g / heads; B is shared by groups of query heads
// (grouped-query attention): query head h reads B's head h / group. `*_batch` step over
// batches, `*_head` over the heads of one (views: [B, S, H, E] and the like).
fn slice_bases(z: u32) -> vec3<u32> {
    let ga = p.a_z0 + z;
    let gb = p.b_z0 + z;
    let gc = p.c_z0 + z;
    return vec3<u32>(
        (ga / p.heads) * p.a_batch + (ga % p.heads) * p.a_head + p.a_off,
        (gb / p.heads) * p.b_batch + ((gb % p.heads) / p.group) * p.b_head + p.b_off,
        (gc / p.heads) * p.c_batch + (gc % p.heads) * p.c_head + p.c_off,
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
