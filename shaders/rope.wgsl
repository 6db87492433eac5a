// Rotary position embedding (RoPE) of token rows, and the paged KV cache's append.
//
//   dst row of (token t, head h) = the src row, its first D elements rotated by token t's
//   angles: pairs (k, k + D/2) in the half-split style (NeoX/Llama, Hugging Face's
//   rotate_half) or (2k, 2k + 1) interleaved (GPT-J), each pair (x0, x1) becoming
//   (x0 cos - x1 sin, x1 cos + x0 sin), k < D/2.
//
// The host computes the angles in f64 (position times theta^(-2k/D)), so positions far past
// [-pi, pi] keep their accuracy (WGSL's cos and sin promise none there): `aux` holds
// (cos, sin) as f32 bits for each (token, k) from word p.ang_off, and, for an append, each
// token's destination row (cache block * block_size + slot) from word p.slot_off; in a head-major
// cache (p.hm_bs, the block size, not 0) that slot's row of head h is found in its block.
//
// The host (src/kernels/rope.rs) prepends `Params` (rows = T * H, heads H, e, d, half,
// copy_rest, has_slots, and the word offsets), src and dst in their formats (dst element by
// element: atomics for half formats, whose rows may share a word) and `load(i)`: src's element
// i, or dst's when rotating in place (src then unbound).
//
// Bindings: 0 src (read), 1 dst (read_write), 2 aux (read), 3 params.

@group(0) @binding(2) var<storage, read> aux: array<u32>;

const WG: u32 = 64u;

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let r = (wg.x + wg.y * nwg.x) * WG + tid;
    if (r >= p.rows) {
        return;
    }
    let t = r / p.heads;
    let h = r % p.heads;
    let sb = r * p.e;
    var drow = t;
    if (p.has_slots != 0u) {
        drow = aux[p.slot_off + t];
    }
    var db = (drow * p.heads + h) * p.e;
    if (p.hm_bs != 0u) {
        // A head-major cache [NB, H, BS, E]: slot drow is block drow / BS, token drow % BS.
        db = ((drow / p.hm_bs * p.heads + h) * p.hm_bs + drow % p.hm_bs) * p.e;
    }
    let hd = p.d / 2u;
    for (var k = 0u; k < hd; k++) {
        let i0 = select(2u * k, k, p.half != 0u);
        let i1 = select(2u * k + 1u, k + hd, p.half != 0u);
        let x0 = load(sb + i0);
        let x1 = load(sb + i1);
        let a = p.ang_off + 2u * (t * hd + k);
        let c = bitcast<f32>(aux[a]);
        let s = bitcast<f32>(aux[a + 1u]);
        dst_set(db + i0, x0 * c - x1 * s);
        dst_set(db + i1, x1 * c + x0 * s);
    }
    if (p.copy_rest != 0u) {
        for (var i = p.d; i < p.e; i++) {
            dst_set(db + i, load(sb + i));
        }
    }
}
