//! Property test: random small shapes, masks and options agree with the reference.

mod common;

use common::{random_problem, thread_ctx, TOL};
use proptest::prelude::*;
use wgpu_attention::Path;

/// Head dims drawn from a fixed set (multiples of 4 and not, 1 and past 64), so that the
/// kernels' pipelines are reused across cases; the shapes, masks and options stay random.
const DIMS: [usize; 5] = [1, 7, 16, 33, 64];

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]
    #[test]
    fn random_problems_match_reference(
        b in 1usize..3, hkv in 1usize..3, group in 1usize..4, l in 1usize..40, s in 1usize..40,
        e in prop::sample::select(&DIMS[..]), ev in prop::sample::select(&DIMS[..]), causal in 0u8..3,
        mask in any::<bool>(), bias in any::<bool>(), lens in any::<bool>(), seed in any::<u64>(),
    ) {
        check(b, hkv, group, l, s, e, ev, causal, mask, bias, lens, seed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]
    /// Fully random head dims (each case compiles its own pipelines, so fewer cases).
    #[test]
    fn random_head_dims_match_reference(
        b in 1usize..3, hkv in 1usize..3, group in 1usize..4, l in 1usize..40, s in 1usize..40,
        e in 1usize..70, ev in 1usize..70, causal in 0u8..3, mask in any::<bool>(),
        bias in any::<bool>(), lens in any::<bool>(), seed in any::<u64>(),
    ) {
        check(b, hkv, group, l, s, e, ev, causal, mask, bias, lens, seed);
    }
}

#[allow(clippy::too_many_arguments)]
fn check(
    b: usize,
    hkv: usize,
    group: usize,
    l: usize,
    s: usize,
    e: usize,
    ev: usize,
    causal: u8,
    mask: bool,
    bias: bool,
    lens: bool,
    seed: u64,
) {
    let Some(ctx) = thread_ctx() else { return };
    let case = random_problem((b, hkv, group, l, s, e, ev), causal, mask, bias, lens, seed);
    let want = case.reference();
    for path in Path::ALL {
        case.check_against(&want, ctx, path, TOL, &format!("{path:?}"));
    }
}
