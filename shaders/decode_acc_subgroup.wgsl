// decode.wgsl's accumulator reduction when the workgroup is one subgroup: each vec4 of the
// accumulator scaled by `f` summed by subgroupAdd, the row (times `inv`) stored at `orow`.
fn store_acc(tid: u32, f: f32, inv: f32, orow: u32) {
    for (var d4 = 0u; d4 < EV4; d4++) { // unroll
        let t = subgroupAdd(acc[d4] * f);
        if (tid == 0u) {
            store_out(orow, d4, t * inv);
        }
    }
}
