//! Property test: random small shapes, masks and options agree with the reference.

mod common;

use common::{ctx, Case, TOL};
use proptest::prelude::*;
use wgpu_attention::{Causal, Path};

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]
    #[test]
    fn random_problems_match_reference(
        b in 1usize..3, hkv in 1usize..3, group in 1usize..4, l in 1usize..40, s in 1usize..40,
        e in 1usize..70, ev in 1usize..70, causal in 0u8..3, mask in any::<bool>(),
        bias in any::<bool>(), lens in any::<bool>(), seed in any::<u64>(),
    ) {
        let Some(ctx) = ctx() else { return Ok(()) };
        let mut case = Case::random((b, hkv * group, hkv, l, s, e, ev), seed)
            .with_causal([Causal::None, Causal::TopLeft, Causal::BottomRight][causal as usize]);
        if mask { case = case.with_random_mask(seed ^ 1); }
        if bias { case = case.with_random_bias(seed ^ 2); }
        if lens { case = case.with_kv_lens(); }
        for path in Path::ALL {
            case.check(ctx, path, TOL, &format!("{path:?}"));
        }
    }
}
