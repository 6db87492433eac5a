// Backward, first kernel: the statistics of every score row (common/backward.wgsl),
//
//   stats[row] = lse[row],  stats[rows + row] = D = sum_c dO[row][c] * O[row][c],
//
// one invocation per row, accumulated in f32. The key lengths that follow in `stats` are
// written by the host.
//
// The host prepends `Params` (src/kernels/backward.rs) and o, dout in their storage formats
// (src/kernels/access.rs).
//
// Bindings: 0 o, 1 dout, 2 lse (read), 3 stats (read_write), 4 params.

@group(0) @binding(2) var<storage, read> lse: array<f32>;
@group(0) @binding(3) var<storage, read_write> stats: array<f32>;

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let row = (wg.x + wg.y * nwg.x) * 64u + tid;
    if (row >= p.rows) {
        return;
    }
    var d = 0.0;
    for (var c = 0u; c < p.ev; c++) {
        d += o_get(o_base(row) + c) * dout_get(dout_base(row) + c);
    }
    stats[row] = lse[row];
    stats[p.rows + row] = d;
}
