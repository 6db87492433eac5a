// ALiBi (HAS_ALIBI): the slopes and the linear bias by distance from the diagonal.

// The ALiBi slope of query head h (HAS_ALIBI): auxiliary word alibi_off + h, as f32 bits.
fn alibi_slope(h: u32) -> f32 {
    return bitcast<f32>(aux_word(p.m.alibi_off + h));
}

// The ALiBi term of (b, h, i, j): -slope[h] |i + S - L - j| (S the batch's key length with key
// lengths, like the window's diagonal).
fn alibi_term(b: u32, h: u32, i: u32, j: u32) -> f32 {
    let c = i32(i) + window_offset(b);
    return -alibi_slope(h) * abs(f32(c - i32(j)));
}
