// flash.wgsl's K/V tile access when invocation j of the workgroup (which is one subgroup)
// holds key j of the tile in registers: vec4 block `d4` of key `j`, read by shuffle. The
// callers' loops are unrolled, so `j` is a constant and the shuffle a broadcast.
fn key_at(j: u32, d4: u32) -> vec4<f32> {
    return subgroupShuffle(k_reg[d4], j);
}

fn value_at(j: u32, d4: u32) -> vec4<f32> {
    return subgroupShuffle(v_reg[d4], j);
}
