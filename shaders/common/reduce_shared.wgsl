// Reductions across a workgroup of WG invocations (a power of two) through workgroup memory
// (any device). Every invocation calls them, in uniform control flow; every one gets the result.

var<workgroup> red: array<f32, WG>;

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
