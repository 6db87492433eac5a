// decode.wgsl's reductions across the workgroup through workgroup memory (any device).
var<workgroup> red: array<f32, WG>;
var<workgroup> red4: array<vec4<f32>, WG * RB>;

fn wg_max(x: f32, tid: u32) -> f32 {
    red[tid] = x;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (tid < stride) {
            red[tid] = max(red[tid], red[tid + stride]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn wg_sum(x: f32, tid: u32) -> f32 {
    red[tid] = x;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (tid < stride) {
            red[tid] = red[tid] + red[tid + stride];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// Sum every invocation's accumulator scaled by `f`, in blocks of RB vec4s, and store the row
// (times `inv`) at `orow` of the partial outputs.
fn store_acc(tid: u32, f: f32, inv: f32, orow: u32) {
    for (var rb = 0u; rb < NRB; rb++) { // unroll
        for (var c = 0u; c < RB; c++) { // unroll
            red4[tid * RB + c] = acc[rb * RB + c] * f;
        }
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
            if (tid < stride) {
                for (var c = 0u; c < RB; c++) { // unroll
                    red4[tid * RB + c] += red4[(tid + stride) * RB + c];
                }
            }
            workgroupBarrier();
        }
        if (tid < RB) {
            store_out(orow, rb * RB + tid, red4[tid] * inv);
        }
        workgroupBarrier();
    }
}
