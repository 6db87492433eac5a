//! Property test: random small shapes, masks and options agree with the reference.

mod common;

use common::{random_problem, thread_ctx, SHAPES, TOL};
use proptest::prelude::*;
use wgpu_attention::Path;

/// The kernels' specialisations the random problems draw from: the head dims (E, Ev) of the
/// grid's shapes (`common::SHAPES`: 1, odd, multiples of 4, past 64) with or without a boolean
/// mask and a bias, the kernels `tests/sdpa.rs`'s grid compiles too. Compiling a specialisation
/// is most of a case's time on lavapipe; everything that is not compiled in (shapes, GQA
/// groups, causal modes, key lengths, values) stays random, and the second property test draws
/// fully random head dims.
fn specialisations() -> Vec<(usize, usize, bool, bool)> {
    let mut v = Vec::new();
    for &(_, _, _, _, _, e, ev) in SHAPES {
        for (mask, bias) in [(false, false), (true, false), (false, true), (true, true)] {
            v.push((e, ev, mask, bias));
        }
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]
    #[test]
    fn random_problems_match_reference(
        b in 1usize..3, hkv in 1usize..3, group in 1usize..4, l in 1usize..40, s in 1usize..40,
        spec in prop::sample::select(specialisations()), causal in 0u8..3,
        lens in any::<bool>(), seed in any::<u64>(),
    ) {
        let (e, ev, mask, bias) = spec;
        check(b, hkv, group, l, s, e, ev, causal, mask, bias, lens, seed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]
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
