// decode.wgsl's reductions when the workgroup is exactly one subgroup (CPU adapters with a
// fixed subgroup size): subgroup operations, no workgroup memory, no barriers.
fn wg_max(x: f32, tid: u32) -> f32 {
    return subgroupMax(x);
}

fn wg_sum(x: f32, tid: u32) -> f32 {
    return subgroupAdd(x);
}

fn store_acc(tid: u32, f: f32, inv: f32, orow: u32) {
    for (var d4 = 0u; d4 < EV4; d4++) { // unroll
        let t = subgroupAdd(acc[d4] * f);
        if (tid == 0u) {
            store_out(orow, d4, t * inv);
        }
    }
}
