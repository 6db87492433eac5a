// Backward, d(sink logits): dsink[h] = -sum over the score rows of head h (every batch, every
// query) of exp(sink[h] - lse[row]) D[row], the sink's softmax weight in the row times
// D = rowsum(dO ∘ O) (the forward's logsumexp counts the sink, so the weight is at most 1;
// a row with no allowed key has O = 0, D = 0). One workgroup per query head: each invocation
// sums a strided share of the rows in row order, then the workgroup adds the shares by a
// fixed tree: the same bits every run, no atomics.
//
// The host prepends `Params` (src/kernels/backward.rs) and common/softmax.wgsl.
//
// Bindings: 0 stats (read: lse, D, then the auxiliary words, the sink logits at
//           lens_off + m.sink_off), 1 dsink [Hq] (read_write), 2 params.

@group(0) @binding(0) var<storage, read> stats: array<f32>;
@group(0) @binding(1) var<storage, read_write> dsink: array<f32>;

var<workgroup> part: array<f32, 256>;

@compute @workgroup_size(256, 1, 1)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let h = wg.x + wg.y * nwg.x;
    // Uniform per workgroup: the whole workgroup returns, before any barrier.
    if (h >= p.heads) {
        return;
    }
    let sk = stats[p.lens_off + p.m.sink_off + h];
    let n = p.batch * p.l;
    var acc = 0.0;
    for (var t = tid; t < n; t += 256u) {
        let row = ((t / p.l) * p.heads + h) * p.l + t % p.l;
        acc += exp(sk - stats[row]) * stats[p.rows + row];
    }
    part[tid] = acc;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w = w / 2u) {
        if (tid < w) {
            part[tid] += part[tid + w];
        }
        workgroupBarrier();
    }
    if (tid == 0u) {
        dsink[h] = -part[0];
    }
}
