// Backward, the captures' gradients: element a is the sum of the p.total slices of
// `bwd_dcap.wgsl`'s partials, in slice order (the same bits every run).
//
// The host prepends `Params` (src/kernels/backward.rs).
//
// Bindings: 0 partials [W, cap_len] (read), 1 dcap [cap_len] (read_write), 2 params.

@group(0) @binding(0) var<storage, read> partials: array<f32>;
@group(0) @binding(1) var<storage, read_write> dcap: array<f32>;

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let a = (wg.x + wg.y * nwg.x) * 64u + tid;
    if (a >= p.cap_len) {
        return;
    }
    var acc = 0.0;
    for (var w = 0u; w < p.total; w++) {
        acc += partials[w * p.cap_len + a];
    }
    dcap[a] = acc;
}
