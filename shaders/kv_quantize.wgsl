// The 8-bit KV cache's append: each (token, kv head) row of the new K or V, K rotated by RoPE
// first (as shaders/rope.wgsl rotates it), written into the step's cache slot as codes, four
// to a word (src/quant.rs holds the same rules on the host):
//
//   int8: scale = max |x| / 127 (written to the row's scale, the element index / E), code =
//         round(x / scale) to nearest even within ±127 (0 where the scale is 0);
//   fp8:  code = e4m3(clamp(x / scale, -448, 448)) rounded to nearest even, scale the kv
//         head's (read).
//
// One invocation per row: the rows are whole words (E a multiple of 4), so no two invocations
// share a word. The host (src/kernels/rope.rs) prepends the rope kernel's `Params`, `src` in
// its format, and `INT8` (else fp8).
//
// Bindings: 0 src (read), 1 dst codes (read_write), 2 aux (read: angles and slots),
// 3 scales (read_write: int8 writes them, fp8 reads them), 4 params.

@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@group(0) @binding(2) var<storage, read> aux: array<u32>;
@group(0) @binding(3) var<storage, read_write> scales: array<f32>;

const WG: u32 = 64u;

// Element i of token t's row starting at sb, rotated where i < p.d.
fn value(sb: u32, t: u32, i: u32) -> f32 {
    let x = src_get(sb + i);
    if (i >= p.d) {
        return x;
    }
    let hd = p.d / 2u;
    var k: u32;
    var partner: u32;
    var first: bool;
    if (p.half != 0u) {
        first = i < hd;
        k = select(i - hd, i, first);
        partner = select(i - hd, i + hd, first);
    } else {
        first = (i & 1u) == 0u;
        k = i / 2u;
        partner = i ^ 1u;
    }
    let a = p.ang_off + 2u * (t * hd + k);
    let c = bitcast<f32>(aux[a]);
    let s = bitcast<f32>(aux[a + 1u]);
    let y = src_get(sb + partner);
    return select(x * c + y * s, x * c - y * s, first);
}

fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn int8_code(x: f32, scale: f32) -> u32 {
    if (scale == 0.0) {
        return 0u;
    }
    return bitcast<u32>(i32(clamp(round(x / scale), -127.0, 127.0))) & 0xffu;
}

fn fp8_code(x: f32, scale: f32) -> u32 {
    let bits = bitcast<u32>(x);
    let sign = (bits >> 24u) & 0x80u;
    let v = x / scale;
    if (is_nan(v)) {
        return sign | 0x7fu; // x NaN, or a zero scale over zero
    }
    let a = min(abs(v), 448.0);
    // The spacing of e4m3 values at a's binade (2^-9 below the normal range).
    let e = max(i32((bitcast<u32>(a) >> 23u) & 0xffu) - 127, -6);
    let r = ldexp(round(ldexp(a, 3 - e)), e - 3);
    if (r < 0.015625) {
        return sign | u32(r * 512.0);
    }
    let rb = bitcast<u32>(r);
    let er = i32((rb >> 23u) & 0xffu) - 127;
    return sign | (u32(er + 7) << 3u) | ((rb >> 20u) & 7u);
}

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
    let drow = aux[p.slot_off + t];
    var db = (drow * p.heads + h) * p.e;
    if (p.hm_bs != 0u) {
        db = ((drow / p.hm_bs * p.heads + h) * p.hm_bs + drow % p.hm_bs) * p.e;
    }
    var scale: f32;
    if (INT8) {
        var amax = 0.0;
        for (var i = 0u; i < p.e; i++) {
            let x = value(sb, t, i);
            // A NaN makes the row's scale NaN (it reads back as NaN, as a float cache would).
            amax = select(max(amax, abs(x)), x, is_nan(x) || is_nan(amax));
        }
        scale = amax / 127.0;
        scales[db / p.e] = scale;
    } else {
        scale = scales[h];
    }
    for (var w = 0u; w < p.e / 4u; w++) {
        var word = 0u;
        for (var c = 0u; c < 4u; c++) {
            let x = value(sb, t, 4u * w + c);
            var code: u32;
            if (INT8) {
                code = int8_code(x, scale);
            } else {
                code = fp8_code(x, scale);
            }
            word |= code << (8u * c);
        }
        dst[db / 4u + w] = word;
    }
}
