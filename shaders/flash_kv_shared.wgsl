// flash.wgsl's K/V tile access when the tile is staged in workgroup memory: vec4 block `d4`
// of key `j` of the tile.
fn key_at(j: u32, d4: u32) -> vec4<f32> {
    return k_tile[j * E4 + d4];
}

fn value_at(j: u32, d4: u32) -> vec4<f32> {
    return v_tile[j * EV4 + d4];
}
