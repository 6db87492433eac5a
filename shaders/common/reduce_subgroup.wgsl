// Reductions across a workgroup that is exactly one subgroup (CPU adapters with a fixed
// subgroup size): subgroup operations, no workgroup memory, no barriers. Same functions as
// reduce_shared.wgsl.

fn wg_max(x: f32, tid: u32) -> f32 {
    return subgroupMax(x);
}

fn wg_sum(x: f32, tid: u32) -> f32 {
    return subgroupAdd(x);
}
