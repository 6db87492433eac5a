// The attention kernels' inputs and output for any E and Ev: scalar rows, the last vec4
// block zero padded. Bindings 3 q, 4 k, 5 v (read), 6 out (read_write): after the masks (0-2).
@group(0) @binding(3) var<storage, read> q: array<f32>;
@group(0) @binding(4) var<storage, read> k: array<f32>;
@group(0) @binding(5) var<storage, read> v: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

// Column block `c4` (4 elements) of row `row` of q or k ([rows, E]) or v and out ([rows, Ev]).
fn load_q(row: u32, c4: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) { // unroll
        if (c4 * 4u + c < p.e) {
            x[c] = q[row * p.e + c4 * 4u + c];
        }
    }
    return x;
}

fn load_k(row: u32, c4: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) { // unroll
        if (c4 * 4u + c < p.e) {
            x[c] = k[row * p.e + c4 * 4u + c];
        }
    }
    return x;
}

fn load_v(row: u32, c4: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) { // unroll
        if (c4 * 4u + c < p.ev) {
            x[c] = v[row * p.ev + c4 * 4u + c];
        }
    }
    return x;
}

fn store_out(row: u32, c4: u32, x: vec4<f32>) {
    for (var c = 0u; c < 4u; c++) { // unroll
        if (c4 * 4u + c < p.ev) {
            out[row * p.ev + c4 * 4u + c] = x[c];
        }
    }
}
