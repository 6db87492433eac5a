// K/V tile access of the kernels that stream key tiles past query rows (flash.wgsl,
// bwd_dq.wgsl) when the tile is staged in workgroup memory: BK keys × (E4 + EV4) vec4s.
// Needs the including kernel's E4, EV4, BK, WG, `p.s` and load_k / load_v.

var<workgroup> k_tile: array<vec4<f32>, BK * E4>;
var<workgroup> v_tile: array<vec4<f32>, BK * EV4>;

// Stage keys j0 .. j0 + BK of kv head `kvh` (zero past kv_end); every invocation calls it.
fn stage_kv(kvh: u32, j0: u32, kv_end: u32, tid: u32) {
    let kh = k_head(kvh);
    let vh = v_head(kvh);
    for (var t = tid; t < BK * E4; t += WG) {
        let j = j0 + t / E4;
        var x = vec4<f32>(0.0);
        if (j < kv_end) {
            x = load_kb(k_at(kh, j), t % E4);
        }
        k_tile[t] = x;
    }
    for (var t = tid; t < BK * EV4; t += WG) {
        let j = j0 + t / EV4;
        var x = vec4<f32>(0.0);
        if (j < kv_end) {
            x = load_vb(v_at(vh, j), t % EV4);
        }
        v_tile[t] = x;
    }
    workgroupBarrier();
}

// The end of a tile's use: the next stage_kv may overwrite it.
fn release_kv() {
    workgroupBarrier();
}

// vec4 block `d4` of key `j` of the tile.
fn key_at(j: u32, d4: u32) -> vec4<f32> {
    return k_tile[j * E4 + d4];
}

fn value_at(j: u32, d4: u32) -> vec4<f32> {
    return v_tile[j * EV4 + d4];
}
