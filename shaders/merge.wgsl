// Merge partial attention results over disjoint key sets by the logsumexp rule:
//   M = max_s lse_s,  w_s = exp(lse_s - M),  o = sum_s w_s o_s / sum_s w_s,
//   lse = M + log(sum_s w_s).
// Parts with lse = -inf (no allowed key) weigh 0; if every part is empty the row is 0 with
// lse -inf. One workgroup per row.
//
// Bindings: 0 part_out [splits][rows][Ev], 1 part_lse [splits][rows] (read);
//           2 out [rows][Ev], 3 lse [rows] (read_write); 4 params.

struct Params {
    rows: u32,
    splits: u32,
    ev: u32,
    _pad: u32,
}

const WG: u32 = 64u;

@group(0) @binding(0) var<storage, read> part_out: array<f32>;
@group(0) @binding(1) var<storage, read> part_lse: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read_write> lse: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

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
    // -3.0e38 stands for -inf: exp(l - M) of an empty part is then 0 (or 1 if all are empty,
    // which the total == 0 test below catches through the empty check).
    var mx = -3.4e38;
    var any = false;
    for (var s = 0u; s < p.splits; s++) {
        let l = part_lse[s * p.rows + row];
        if (!(l < -3.0e38)) {
            mx = max(mx, l);
            any = true;
        }
    }
    if (!any) {
        for (var d = tid; d < p.ev; d += WG) {
            out[row * p.ev + d] = 0.0;
        }
        if (tid == 0u) {
            var bits = 0xff800000u;
            lse[row] = bitcast<f32>(bits);
        }
        return;
    }
    var total = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        let l = part_lse[s * p.rows + row];
        if (!(l < -3.0e38)) {
            total += exp(l - mx);
        }
    }
    for (var d = tid; d < p.ev; d += WG) {
        var o = 0.0;
        for (var s = 0u; s < p.splits; s++) {
            let l = part_lse[s * p.rows + row];
            if (!(l < -3.0e38)) {
                o += exp(l - mx) * part_out[(s * p.rows + row) * p.ev + d];
            }
        }
        out[row * p.ev + d] = o / total;
    }
    if (tid == 0u) {
        lse[row] = mx + log(total);
    }
}
