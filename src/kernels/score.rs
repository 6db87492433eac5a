//! The score hook: how a query row and a key row make a logit, before the scale, the bias and
//! the masks. One seam, assembled into the kernels' sources by the host the way the masks are
//! (`mask_consts` and `shaders/common/masks.wgsl`):
//!
//! - the fused kernels (`shaders/flash.wgsl`, `shaders/flash_tiles.wgsl`) call
//!   `score4(q, k, d4)`, the four terms of vec4 block `d4` that they sum, or
//!   `score_fma(acc, q, k, d4)`, the logit so far plus those terms (the register-tiled form's
//!   scalar logits), which the hook defines ([`Score::fused_wgsl`]), and bind what the hook
//!   declares after their own inputs ([`Score::fused_spec`]);
//! - the matmul (the unfused path's scores) takes the same terms in its inner product (its
//!   `ADDITIVE` override, `shaders/common/matmul.wgsl`), with the hook's input in its bias slot;
//! - the decode kernel has no hook: [`Score::decode`] says why a score cannot run there.
//!
//! The API, the plan and the recorders pass one value: [`Score`] (pure, what plans and
//! pipeline keys see) or [`ScoreInput`] (with the buffers the hook binds).
//!
//! | score | the term of block d4 | binds | paths |
//! |---|---|---|---|
//! | [`Score::Dot`] | `q * k` | nothing | every path |
//! | [`Score::Additive`] | `u[d4] * tanh(q + k)`, Bahdanau's (q and k are the projections, the scale folded into u) | u: 256 f32, a uniform array | fused, unfused |
//!
//! Programmable attention (user `score_mod` and `mask_mod` functions with captured tensors)
//! adds its variants here: a WGSL source of its own and its captures as the hook's bindings.

use super::{flash, Binding, KernelSpec};
use crate::error::{Error, Result};

/// How q and k make a logit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(crate) enum Score {
    /// The dot product `Σ q_d k_d`.
    #[default]
    Dot,
    /// Bahdanau's additive score `Σ_a u_a tanh(q_a + k_a)`.
    Additive,
}

/// Bytes of the additive score's u as the fused kernel binds it: 256 f32 (A ≤ 256 like every
/// head dim of the fused kernel), zero-padded.
pub(crate) const ADDITIVE_U_BYTES: u64 = 1024;

const DOT: &str = "fn score4(q: vec4<f32>, k: vec4<f32>, d4: u32) -> vec4<f32> {\n    return q * k;\n}\n\
fn score_fma(acc: f32, q: vec4<f32>, k: vec4<f32>, d4: u32) -> f32 {\n    \
return dot_fma(acc, q, k);\n}\n";

/// u (binding 8, a uniform array of 64 vec4s: WebGPU allows 8 storage buffers per stage and the
/// fused kernel has 8 already) and the four terms `u_a tanh(q_a + k_a)` of vec4 block `d4` (the
/// argument clamped to ±15, where tanh is 1 in f32: drivers may compute tanh by exponentials
/// that overflow).
const ADDITIVE: &str = "@group(0) @binding(8) var<uniform> u4: array<vec4<f32>, 64>;\n\
fn score4(q: vec4<f32>, k: vec4<f32>, d4: u32) -> vec4<f32> {\n    \
return u4[d4] * tanh(clamp(q + k, vec4<f32>(-15.0), vec4<f32>(15.0)));\n}\n\
fn score_fma(acc: f32, q: vec4<f32>, k: vec4<f32>, d4: u32) -> f32 {\n    \
let t = score4(q, k, d4);\n    return acc + ((t.x + t.y) + (t.z + t.w));\n}\n";

/// The fused kernel with the additive score: its source, one more input before the params.
pub(crate) const ADDITIVE_SPEC: KernelSpec = KernelSpec {
    name: "flash_additive",
    source: flash::SPEC.source,
    common: flash::SPEC.common,
    bindings: &[
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::Read,
        Binding::ReadWrite,
        Binding::ReadWrite,
        Binding::Uniform,
        Binding::Params,
    ],
    params: flash::SPEC.params,
    trusted: false,
};

/// The register-tiled GPU form with the additive score (bindings as [`ADDITIVE_SPEC`]).
pub(crate) const TILES_ADDITIVE_SPEC: KernelSpec = KernelSpec {
    name: "flash_tiles_additive",
    source: flash::TILES_SPEC.source,
    common: flash::SPEC.common,
    bindings: ADDITIVE_SPEC.bindings,
    params: flash::SPEC.params,
    trusted: false,
};

impl Score {
    /// The fused kernels' `score4` and the hook's declarations.
    pub(crate) fn fused_wgsl(self) -> &'static str {
        match self {
            Score::Dot => DOT,
            Score::Additive => ADDITIVE,
        }
    }

    /// The fused kernel's spec (its bindings: the kernel's, then the hook's), of the
    /// register-tiled GPU form when `tiles`.
    pub(crate) fn fused_spec(self, tiles: bool) -> &'static KernelSpec {
        match (self, tiles) {
            (Score::Dot, false) => &flash::SPEC,
            (Score::Dot, true) => &flash::TILES_SPEC,
            (Score::Additive, false) => &ADDITIVE_SPEC,
            (Score::Additive, true) => &TILES_ADDITIVE_SPEC,
        }
    }

    /// Whether the matmul's terms are the additive score's (its `ADDITIVE` override).
    pub(crate) fn matmul_additive(self) -> bool {
        self == Score::Additive
    }

    /// Whether the decode path can run this score, or why not.
    pub(crate) fn decode(self) -> std::result::Result<(), &'static str> {
        match self {
            Score::Dot => Ok(()),
            Score::Additive => Err("the additive score runs on the fused and unfused paths"),
        }
    }
}

/// A score with the buffers its hook binds.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) enum ScoreInput<'a> {
    /// The dot product.
    #[default]
    Dot,
    /// The additive score with its u (f32, zero-padded to [`ADDITIVE_U_BYTES`] and a multiple
    /// of 64 elements; the scale folded in), bound by the caller before recording: `None` in a
    /// call that is only planned.
    Additive(Option<&'a wgpu::Buffer>),
}

impl<'a> ScoreInput<'a> {
    /// The score, without its buffers.
    pub(crate) fn score(self) -> Score {
        match self {
            ScoreInput::Dot => Score::Dot,
            ScoreInput::Additive(_) => Score::Additive,
        }
    }

    /// What the hook binds (after the fused kernel's own inputs, in the matmul's bias slot).
    pub(crate) fn binding(self) -> Result<Option<wgpu::BufferBinding<'a>>> {
        match self {
            ScoreInput::Dot => Ok(None),
            ScoreInput::Additive(Some(u)) => Ok(Some(u.as_entire_buffer_binding())),
            ScoreInput::Additive(None) => Err(Error::Internal("the additive score's u is not bound".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every score defines the fused kernels' `score4`, binds its inputs after the kernel's
    /// own (the params last), and says where it runs; an unbound input is an error.
    #[test]
    fn each_hook_defines_score4_and_binds_after_the_kernel() {
        for score in [Score::Dot, Score::Additive] {
            assert!(score
                .fused_wgsl()
                .contains("fn score4(q: vec4<f32>, k: vec4<f32>, d4: u32) -> vec4<f32>"));
            for tiles in [false, true] {
                let (own, base) = (
                    score.fused_spec(tiles).bindings,
                    Score::Dot.fused_spec(tiles).bindings,
                );
                assert_eq!(own.len(), base.len() + usize::from(score == Score::Additive));
                assert_eq!(own[..base.len() - 1], base[..base.len() - 1]);
                assert_eq!(own.last(), Some(&Binding::Params));
            }
            assert_eq!(score.matmul_additive(), score == Score::Additive);
        }
        assert!(Score::Dot.decode().is_ok() && Score::Additive.decode().is_err());
        assert!(ScoreInput::Additive(None).binding().is_err());
        assert!(ScoreInput::Dot.binding().unwrap().is_none());
        assert_eq!(ScoreInput::Additive(None).score(), Score::Additive);
    }
}
