// The logit softcap (HAS_SOFTCAP): c tanh(x / c), and its derivative.

// tanh without the built-in (whose lowering may divide twice or overflow): for |x| < 1/4 its
// odd Taylor polynomial to x^9 (the next term is below 1e-8 of x), else 1 - 2 / (e^(2|x|) + 1)
// with the sign (no cancellation there: |tanh| > 0.24), saturated at |x| = 9 (1 in f32).
fn tanh_sat(x: f32) -> f32 {
    // SOFTCAP_FORM 2 (a measuring knob): the built-in.
    if (SOFTCAP_FORM == 2u) {
        return tanh(x);
    }
    let a = min(abs(x), 9.0);
    // SOFTCAP_FORM 1 (a measuring knob, src/tune.rs): one branch, absolute error ~1e-7 near 0.
    if (SOFTCAP_FORM == 1u) {
        let t = exp(-2.0 * a);
        let r = (1.0 - t) / (1.0 + t);
        return select(r, -r, x < 0.0);
    }
    // Both sides are evaluated: the polynomial's on a clamped argument (no infinities, which
    // WGSL lets a compiler assume away).
    let xs = clamp(x, -0.25, 0.25);
    let y = xs * xs;
    let poly = xs * (1.0 + y * (-1.0 / 3.0 + y * (2.0 / 15.0 + y * (-17.0 / 315.0 + y * (62.0 / 2835.0)))));
    let big = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    return select(select(big, -big, x < 0.0), poly, a < 0.25);
}

// The softcap C tanh(x / C) of scaled logit `x` (HAS_SOFTCAP; x itself otherwise). NaN stays.
fn softcapped(x: f32) -> f32 {
    if (!HAS_SOFTCAP || is_nan_bits(x)) {
        return x;
    }
    return p.m.softcap * tanh_sat(x * p.m.softcap_inv);
}

// d softcapped(x) / dx = 1 - tanh(x / C)^2 (1 without a softcap): the backward scales dS by it
// for dQ and dK (the bias is added after the softcap: its gradient is dS itself).
fn softcap_grad(x: f32) -> f32 {
    if (!HAS_SOFTCAP) {
        return 1.0;
    }
    let t = tanh_sat(x * p.m.softcap_inv);
    return 1.0 - t * t;
}
