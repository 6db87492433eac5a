// The softmax rules every attention kernel shares: the sentinels and the online-softmax step.
//
// A row's state is its running max `m` (START before any key) and its sum `s` of
// exp(logit - m). Adding logits under a new max m' multiplies the old sum (and any
// accumulator) by rescale(m, m'); each logit contributes weight(x, m'). A row that saw no
// allowed key ends with s = 0: its output is 0 and its logsumexp -inf.

// Logits below MASKED count as -inf (masked). START is the masked logit and the running max
// before any key: finite, so exp(START - START) and exp(START - m) stay NaN-free.
const MASKED: f32 = -3.0e38;
const START: f32 = -3.4e38;

// Whether x is NaN, by its bits: WGSL lets compilers assume no NaNs, and CPU adapters compile
// float comparisons as ordered ones, so `x != x` is false for NaN there and `!(x < c)` may be
// folded to `x >= c` (false for NaN).
fn is_nan_bits(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// -inf, made at run time: a constant expression whose value is infinite is a shader-creation
// error (Tint refuses `bitcast<f32>(0xff800000u)`; naga accepts it), a private variable is not
// a constant expression.
var<private> NEG_INF_BITS: u32 = 0xff800000u;

fn neg_inf() -> f32 {
    return bitcast<f32>(NEG_INF_BITS);
}

// The GPU-shaped forms' logit (forward and backward alike, SCALAR_LOGITS): the running dot
// product `acc` plus q . k by four FMAs in a fixed order, so that the forward's logsumexp and
// the backward's recomputed logits agree to the bit (explicit FMAs leave the driver no
// contraction to choose: the H100 once gave a rolled and an unrolled loop different ones). The CPU forms keep vec4 partials summed
// at the end (fewer dependent operations for LLVM), the same in their forward and backward.
fn dot_fma(acc: f32, q: vec4<f32>, k: vec4<f32>) -> f32 {
    return fma(q.w, k.w, fma(q.z, k.z, fma(q.y, k.y, fma(q.x, k.x, acc))));
}

// The weight exp(x - m) of logit `x` under the running max `m`; 0 for a masked logit.
fn weight(x: f32, m: f32) -> f32 {
    return select(exp(x - m), 0.0, x < MASKED);
}

// The factor that moves a sum or accumulator kept under max `m_old` to max `m_new`.
fn rescale(m_old: f32, m_new: f32) -> f32 {
    return exp(m_old - m_new);
}

// The logsumexp of a row with max `m` and sum `s`: -inf when no key was allowed (s = 0).
fn row_lse(m: f32, s: f32) -> f32 {
    return select(m + log(s), neg_inf(), s == 0.0);
}

// Whether a logsumexp stands for a row (or part) with no allowed key.
fn is_empty_lse(l: f32) -> bool {
    return l < MASKED;
}
