// Merge partial attention results over disjoint key sets by the logsumexp rule:
//   M = max_s lse_s,  w_s = exp(lse_s - M),  o = sum_s w_s o_s / sum_s w_s,
//   lse = M + log(sum_s w_s).
// Parts with lse = -inf (no allowed key) weigh 0; if every part is empty the row is 0 with
// lse -inf. One workgroup per row.
//
// The host prepends `Params` (generated from src/kernels/decode.rs: rows, splits, ev),
// common/softmax.wgsl (sentinels), and the declarations of part_out (binding 0) and out
// (binding 2) in their storage formats with `store2(row0, d, x)`, which stores elements d and
// d + 1 of the out row starting at row0 (d + 1 only when d + 1 < Ev: whole words, or element by
// element), and `out_base(row)`, where out's row starts (dense, or the output's view `p.x.o`)
// (src/kernels/access.rs).
// Each invocation computes pairs of elements, so half outputs are stored in whole words.
//
// Bindings: 0 part_out [splits][rows][Ev], 1 part_lse [splits][rows] (read);
//           2 out [rows][Ev], 3 lse [rows] (read_write); 4 params.

const WG: u32 = 64u;

@group(0) @binding(1) var<storage, read> part_lse: array<f32>;
@group(0) @binding(3) var<storage, read_write> lse: array<f32>;

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let row = wg.x + wg.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    var mx = START;
    var any = false;
    for (var s = 0u; s < p.splits; s++) {
        let l = part_lse[s * p.rows + row];
        if (!is_empty_lse(l)) {
            mx = max(mx, l);
            any = true;
        }
    }
    if (!any) {
        for (var d = 2u * tid; d < p.ev; d += 2u * WG) {
            store2(out_base(row), d, vec2<f32>(0.0));
        }
        if (tid == 0u) {
            lse[row] = neg_inf();
        }
        return;
    }
    var total = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        let l = part_lse[s * p.rows + row];
        if (!is_empty_lse(l)) {
            total += exp(l - mx);
        }
    }
    for (var d = 2u * tid; d < p.ev; d += 2u * WG) {
        var o = vec2<f32>(0.0);
        let d1 = min(d + 1u, p.ev - 1u);
        for (var s = 0u; s < p.splits; s++) {
            let l = part_lse[s * p.rows + row];
            if (!is_empty_lse(l)) {
                let base = (s * p.rows + row) * p.ev;
                o += exp(l - mx) * vec2<f32>(part_out_get(base + d), part_out_get(base + d1));
            }
        }
        store2(out_base(row), d, o / total);
    }
    if (tid == 0u) {
        lse[row] = mx + log(total);
    }
}
