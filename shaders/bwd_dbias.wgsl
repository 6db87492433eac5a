// Backward, d(bias): one invocation per element of the bias in its own (broadcast) shape
// [db_b, db_h, db_l, db_s]. It sums dS = P (dP - D) over every (b, h, i, j) of the scores that
// reads that element (the dimensions where the bias is broadcast), recomputing the logit, P
// and dP = dO . v for each from q, k, v, dO and the statistics. Masked entries add 0.
//
// The host prepends `Params` (src/kernels/backward.rs), common/softmax.wgsl, common/masks.wgsl,
// common/backward.wgsl, q, k, v, dout (scalar accessors q_get, ...), dbias with dbias_set(i, x)
// in the bias's format, and HAS_MASK, HAS_BIAS (true).
//
// Bindings: 0 mask, 1 bias, 2 q, 3 k, 4 v, 5 dout, 6 stats (read), 7 dbias (read_write), 8 params.

@compute @workgroup_size(64, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let t = (wg.x + wg.y * nwg.x) * 64u + tid;
    if (t >= p.total) {
        return;
    }
    let tj = t % p.db_s;
    let ti = (t / p.db_s) % p.db_l;
    let th = (t / (p.db_s * p.db_l)) % p.db_h;
    let tb = t / (p.db_s * p.db_l * p.db_h);
    // Each dimension: the bias's own index, or all of the scores' where it is broadcast.
    let nb = select(1u, p.batch, p.db_b == 1u);
    let nh = select(1u, p.heads, p.db_h == 1u);
    let nl = select(1u, p.l, p.db_l == 1u);
    let ns = select(1u, p.s, p.db_s == 1u);
    var total = 0.0;
    for (var xb = 0u; xb < nb; xb++) {
        let b = select(tb, xb, p.db_b == 1u);
        for (var xh = 0u; xh < nh; xh++) {
            let h = select(th, xh, p.db_h == 1u);
            let bh = b * p.heads + h;
            let kvh = kv_head(b, h);
            for (var xi = 0u; xi < nl; xi++) {
                let i = select(ti, xi, p.db_l == 1u);
                let row = bh * p.l + i;
                let end = key_end(b, i);
                let lse = lse_of(row);
                let dsum = dsum_of(row);
                for (var xj = 0u; xj < ns; xj++) {
                    let j = select(tj, xj, p.db_s == 1u);
                    if (j < end) {
                        var s = 0.0;
                        for (var c = 0u; c < p.e; c++) {
                            s += (q_get(q_base(row) + c) * p.scale) * k_get(k_base(kvh * p.s + j) + c);
                        }
                        let x = masked_logit(s, true, b, h, i, j);
                        let pij = prob(x, lse);
                        var dp = 0.0;
                        for (var c = 0u; c < p.ev; c++) {
                            dp += dout_get(dout_base(row) + c) * v_get(v_base(kvh * p.s + j) + c);
                        }
                        total += dscore(pij, dp, dsum) * mod_grad(s, x, b, h, i, j);
                    }
                }
            }
        }
    }
    dbias_set(t, total);
}
