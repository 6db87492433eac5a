// Sink logits (HAS_SINKS): one per query head, added to each row's denominator.

// The sink logit of query head h (HAS_SINKS): auxiliary word sink_off + h, as f32 bits.
fn sink_logit(h: u32) -> f32 {
    return bitcast<f32>(aux_word(p.m.sink_off + h));
}

// A row's final state (max `m`, sum `s` of exp(logit - m)) with head h's sink logit added to
// the denominator (HAS_SINKS): vec3(max', sum', f), where an accumulator kept under `m` moves
// to max' by the factor f. A row with no allowed key (m = START, s = 0) gets sum' = 1 and
// f = 0: output 0, logsumexp the sink logit.
fn with_sink(m: f32, s: f32, h: u32) -> vec3<f32> {
    if (!HAS_SINKS) {
        return vec3<f32>(m, s, 1.0);
    }
    let sk = sink_logit(h);
    let m2 = max(m, sk);
    let f = rescale(m, m2);
    return vec3<f32>(m2, s * f + exp(sk - m2), f);
}
