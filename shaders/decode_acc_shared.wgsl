// decode.wgsl's accumulator reduction through workgroup memory: every invocation's
// accumulator scaled by `f` is summed over the workgroup in blocks of RB vec4s (NRB = EV4 / RB
// rounds of one tree each, not one tree per vec4), and the row (times `inv`) is stored at `orow`
// of the partial outputs.
var<workgroup> red4: array<vec4<f32>, WG * RB>;

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
