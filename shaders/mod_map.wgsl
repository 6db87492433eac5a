// The mask_mod block map (see common/masks.wgsl, mod_map_block): for each block of MAP_BLOCK
// queries x MAP_BLOCK keys of each (batch, query head), whether the user's mask_mod allows
// some pair (bit 0) and every pair (bit 1); pairs past L or S count as allowed. One invocation
// per word of 16 blocks (2 bits each, the keys' blocks fastest), evaluating mask_mod on every
// pair of them: FlexAttention's block mask, built on the GPU, once per source, captures and
// shape (the host caches it).
//
// The host prepends `Params` (src/kernels/mod_map.rs), common/softmax.wgsl, common/masks.wgsl
// (with the user's functions), HAS_MASK = HAS_BIAS = false and the auxiliary words (binding 2:
// the capture table and values).
//
// Bindings: 0 mask (unused), 1 bias (unused), 2 auxiliary words (read), 3 map (read_write),
//           4 params.

@group(0) @binding(3) var<storage, read_write> map: array<u32>;

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let w = (wg.x + wg.y * nwg.x) * 64u + tid;
    if (w >= p.words) {
        return;
    }
    let lb = (p.l + MAP_BLOCK - 1u) / MAP_BLOCK;
    let sb = (p.s + MAP_BLOCK - 1u) / MAP_BLOCK;
    var word = 0u;
    for (var x = 0u; x < 16u; x++) {
        let e = w * 16u + x;
        if (e >= p.entries) {
            break;
        }
        let kb = e % sb;
        let qb = (e / sb) % lb;
        let bh = e / (sb * lb);
        let b = bh / p.heads;
        let h = bh % p.heads;
        var any = false;
        var all = true;
        for (var i = qb * MAP_BLOCK; i < min(qb * MAP_BLOCK + MAP_BLOCK, p.l); i++) {
            for (var j = kb * MAP_BLOCK; j < min(kb * MAP_BLOCK + MAP_BLOCK, p.s); j++) {
                let ok = u_mask_mod(b, h, i + p.m.pos_q, j + p.m.pos_k);
                any = any || ok;
                all = all && ok;
            }
        }
        word |= (select(0u, 1u, any) | select(0u, 2u, all)) << (2u * x);
    }
    map[w] = word;
}
