// The attention kernels' inputs and output when E and Ev are multiples of 4: vec4 rows, one
// load each. Bindings 3 q, 4 k, 5 v (read), 6 out (read_write): after the masks (0-2).
@group(0) @binding(3) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> k: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> v: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> out: array<vec4<f32>>;

// Column block `c4` (4 elements) of row `row` of q or k ([rows, E]) or v and out ([rows, Ev]).
fn load_q(row: u32, c4: u32) -> vec4<f32> {
    return q[row * E4 + c4];
}

fn load_k(row: u32, c4: u32) -> vec4<f32> {
    return k[row * E4 + c4];
}

fn load_v(row: u32, c4: u32) -> vec4<f32> {
    return v[row * EV4 + c4];
}

fn store_out(row: u32, c4: u32, x: vec4<f32>) {
    out[row * EV4 + c4] = x;
}
