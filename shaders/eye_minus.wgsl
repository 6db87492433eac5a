// For each m x m matrix X of the batch: Y = c I - X (a step of the Nyström pseudo-inverse
// iteration, src/variants/record.rs). One invocation per element; the 1-D grid
// folds over x and y.
//
// The host prepends `Params` (src/kernels/pinv.rs: m, total = batch * m * m, c).
// Bindings: 0 x (read, f32), 1 y (read_write, f32), 2 params.

const WG: u32 = 256u;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let idx = (wg.x + wg.y * nwg.x) * WG + tid;
    if (idx >= p.total) {
        return;
    }
    let e = idx % (p.m * p.m);
    let diag = select(0.0, p.c, e / p.m == e % p.m);
    y[idx] = diag - x[idx];
}
