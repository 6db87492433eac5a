// K/V tile access of the kernels that stream key tiles past query rows (flash.wgsl,
// bwd_dq.wgsl) when invocation j of the workgroup (which is one subgroup, BK = WG) holds key j
// of the tile in registers and the others read it by shuffle. The callers' loops are
// unrolled, so `j` is a constant and the shuffle a broadcast. No workgroup memory, no barriers.

var<private> k_reg: array<vec4<f32>, E4>;
var<private> v_reg: array<vec4<f32>, EV4>;

// Load key j0 + tid of kv head `kvh` (zero past kv_end) into this invocation's registers.
fn stage_kv(kvh: u32, j0: u32, kv_end: u32, tid: u32) {
    let j = j0 + tid;
    let kb = k_row(kvh, min(j, p.s - 1u));
    let vb = v_row(kvh, min(j, p.s - 1u));
    for (var d4 = 0u; d4 < E4; d4++) { // unroll if UNROLL_E
        k_reg[d4] = select(vec4<f32>(0.0), load_kb(kb, d4), j < kv_end);
    }
    for (var d4 = 0u; d4 < EV4; d4++) { // unroll if UNROLL_E
        v_reg[d4] = select(vec4<f32>(0.0), load_vb(vb, d4), j < kv_end);
    }
}

fn release_kv() {}

// vec4 block `d4` of key `j` of the tile.
fn key_at(j: u32, d4: u32) -> vec4<f32> {
    return subgroupShuffle(k_reg[d4], j);
}

fn value_at(j: u32, d4: u32) -> vec4<f32> {
    return subgroupShuffle(v_reg[d4], j);
}
