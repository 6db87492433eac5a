//! Tuning knobs for the GPU forms: a [`Tuning`] value each [`Context`](crate::Context)
//! carries with its capabilities ([`Caps::tuning`](crate::Caps::tuning)), read from the
//! environment variable `WGPU_ATTENTION_TUNE` (native targets) when the context is created
//! and settable per context ([`Context::with_tuning`](crate::Context::with_tuning)). Its text
//! form is `key=value,...` with keys
//!
//! - `fused_wg`, `fused_rq`, `fused_kg`: the fused forward's GPU form (invocations per
//!   workgroup, query rows per invocation, keys per unrolled step);
//! - `bwd_wg`, `bwd_rows`, `bwd_unroll` (0 or 1): the fused backward's GPU form;
//! - `decode_wg`, `decode_target`: the decode kernel's GPU forms (invocations, the number of
//!   workgroups its split aims for);
//! - `decode_klanes` (1, 2, 4, 8 or 16): invocations that score one key together in the decode
//!   kernel's GPU-tiled form;
//! - `tiles_bm`, `tiles_bn`: the register-tiled GPU form's query rows and keys per tile
//!   (multiples of 4, among the sizes it knows);
//! - `tiles_tm`, `tiles_tn` (4 or 8): its query rows and keys per invocation;
//! - `tiles_prefetch` (0 or 1): 1 issues the next K/V tile's loads before this tile's
//!   arithmetic (registers for latency), 0 (the default) loads each tile when it is used;
//! - `tiles_sg` (0 or 1): 0 reduces its rows' max and sum through workgroup memory, not by
//!   subgroup shuffles (the default where the subgroup size allows);
//! - `scalar_logits` (0 or 1): 0 has the GPU forms of the fused forward and backward keep
//!   their logits as vec4 partials (the CPU forms' arithmetic) instead of scalars summed by
//!   FMAs (the default: a quarter of the registers);
//! - `wg_memory`: workgroup memory the GPU forms may use, bytes (at most the device's limit);
//! - `matmul_tiles` (0 or 1): 0 runs the matmul's 64 x 64 form on GPUs instead of its
//!   128 x 128 GPU form (to compare them);
//! - `unchecked` (0 or 1): 1 creates every kernel's shader module with wgpu's runtime checks
//!   off (`create_shader_module_trusted`: no injected bounds checks, no loop bounding), 0 none;
//!   unset, the kernels marked trusted run without them on GPUs (the fused forward).
//! - `softcap_form` (0, 1 or 2): how the kernels take the softcap's tanh: 0 (the default) a
//!   Taylor polynomial below 1/4 and `1 - 2 / (e^2x + 1)` above, 1 `(1 - e^-2x) / (1 + e^-2x)`
//!   alone (6% faster on an H200, absolute error ~1e-7 near 0), 2 WGSL's built-in `tanh`;
//! - `cascade_splits`: the runs a shared prefix's keys are read in (`PagedAttention`; default:
//!   1 on CPU adapters, enough for 512 workgroups on GPUs);
//!
//! - `coop` (0 or 1): 1 makes the matrix units' forms the default for f16 on CPU adapters too
//!   (where they run slower than the scalar forms: for tests on Mesa 26.1's lavapipe), 0 keeps
//!   them off by default on GPUs (to compare); pinned forms are not affected.
//!
//! A developer's aid for measuring a new GPU (`scripts/gpu_report.sh` sweeps them); the plan's
//! defaults are what it measured. In the environment variable, unknown keys and bad values are
//! reported once on stderr and ignored; [`Tuning::parse`] refuses them. CPU forms are not
//! affected (but by `coop`).

use std::sync::OnceLock;

use crate::error::{Error, Result};

macro_rules! tuning {
    ($($(#[$doc:meta])* $key:ident,)*) => {
        /// The tuning knobs of the GPU forms (the keys are described in the
        /// module docs of `src/forms/tune.rs`): `None` is the plan's default. A
        /// developer's aid for measuring a new GPU, read by the plans and kernels of the
        /// [`Context`](crate::Context) that carries it, never from a process-global.
        #[non_exhaustive]
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
        pub struct Tuning {
            $($(#[$doc])* pub $key: Option<u32>,)*
        }

        impl Tuning {
            /// Every knob's key.
            pub const KEYS: &'static [&'static str] = &[$(stringify!($key)),*];

            /// Set knob `key` to `value` ([`Error::UnknownName`] for an unknown key).
            pub fn set(&mut self, key: &str, value: u32) -> Result<()> {
                match key {
                    $(stringify!($key) => self.$key = Some(value),)*
                    _ => {
                        return Err(Error::UnknownName {
                            kind: "tuning knob",
                            name: key.to_string(),
                            expected: "a key of Tuning::KEYS (src/forms/tune.rs)",
                        })
                    }
                }
                Ok(())
            }

            /// The knobs that are set, as `key=value` pairs in [`Tuning::KEYS`]' order.
            pub fn to_pairs(&self) -> Vec<(&'static str, u32)> {
                let mut out = Vec::new();
                $(if let Some(v) = self.$key {
                    out.push((stringify!($key), v));
                })*
                out
            }
        }
    };
}

tuning! {
    /// The fused forward's GPU form: invocations per workgroup.
    fused_wg,
    /// The fused forward's GPU form: query rows per invocation.
    fused_rq,
    /// The fused forward's GPU form: keys per unrolled step.
    fused_kg,
    /// The fused backward's GPU form: invocations per workgroup.
    bwd_wg,
    /// The fused backward's GPU form: rows per invocation.
    bwd_rows,
    /// The fused backward's GPU form: 0 does not unroll.
    bwd_unroll,
    /// The decode kernel's GPU forms: invocations per workgroup.
    decode_wg,
    /// The decode kernel's GPU forms: the workgroups its split aims for.
    decode_target,
    /// Invocations that score one key together in the decode kernel's GPU-tiled form (1, 2,
    /// 4, 8 or 16).
    decode_klanes,
    /// The register-tiled GPU form's query rows per tile (a multiple of 4 it knows).
    tiles_bm,
    /// The register-tiled GPU form's keys per tile (a multiple of 4 it knows).
    tiles_bn,
    /// The register-tiled GPU form's query rows per invocation (4 or 8).
    tiles_tm,
    /// The register-tiled GPU form's keys per invocation (4 or 8).
    tiles_tn,
    /// 0: the GPU forms keep their logits as vec4 partials instead of scalars summed by FMAs.
    scalar_logits,
    /// 1: the register-tiled form issues the next K/V tile's loads before this tile's
    /// arithmetic.
    tiles_prefetch,
    /// 0: the register-tiled form reduces its rows through workgroup memory, not subgroups.
    tiles_sg,
    /// Workgroup memory the GPU forms may use, bytes (at most the device's limit).
    wg_memory,
    /// 0: the matmul's 64 x 64 form on GPUs instead of its 128 x 128 GPU form.
    matmul_tiles,
    /// 1: every kernel without wgpu's runtime checks (but for unproved user code); 0: none.
    unchecked,
    /// How the kernels take the softcap's tanh (0, 1 or 2).
    softcap_form,
    /// The runs a shared prefix's keys are read in ([`PagedAttention`](crate::PagedAttention)).
    cascade_splits,
    /// 1: the matrix units' forms are the f16 default on CPU adapters too; 0: off by default
    /// on GPUs.
    coop,
}

impl Tuning {
    /// The knobs of `text`, `key=value,...` ([`Error::UnknownName`] for an unknown key,
    /// [`Error::InvalidModifier`] for a value that is not a number).
    pub fn parse(text: &str) -> Result<Tuning> {
        let mut t = Tuning::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                return Err(Error::InvalidModifier {
                    modifier: "tuning",
                    reason: format!("{part:?} is not key=value"),
                });
            };
            let v = v.trim().parse::<u32>().map_err(|_| Error::InvalidModifier {
                modifier: "tuning",
                reason: format!("{part:?}: the value is not a non-negative integer"),
            })?;
            t.set(k.trim(), v)?;
        }
        Ok(t)
    }

    /// The knobs of the environment variable `WGPU_ATTENTION_TUNE` (none on the web), read
    /// once per process: what a new [`Context`](crate::Context) carries. Unknown keys and bad
    /// values are reported once on stderr and skipped.
    pub fn from_env() -> Tuning {
        static ENV: OnceLock<Tuning> = OnceLock::new();
        *ENV.get_or_init(|| {
            #[cfg(not(target_arch = "wasm32"))]
            if let Ok(s) = std::env::var("WGPU_ATTENTION_TUNE") {
                return lenient(&s);
            }
            Tuning::default()
        })
    }
}

/// [`Tuning::parse`] that reports and skips what it cannot take (the environment variable's).
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
fn lenient(s: &str) -> Tuning {
    let mut t = Tuning::default();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match Tuning::parse(part).map(|one| one.to_pairs()) {
            Ok(pairs) => pairs.into_iter().for_each(|(k, v)| {
                let _ = t.set(k, v);
            }),
            Err(e) => eprintln!(
                "wgpu-attention: ignoring WGPU_ATTENTION_TUNE part {part:?} ({e}; keys: {})",
                Tuning::KEYS.join(", ")
            ),
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::Tuning;

    #[test]
    fn parses_known_keys_and_skips_others_from_the_environment() {
        let t = super::lenient("fused_wg=128, bogus=1, decode_wg=x,bwd_unroll=1");
        assert_eq!(t.to_pairs(), vec![("fused_wg", 128), ("bwd_unroll", 1)]);
        assert_eq!(t.fused_wg, Some(128));
        assert_eq!(t.decode_wg, None);
    }

    #[test]
    fn parse_refuses_what_it_cannot_take() {
        assert!(matches!(
            Tuning::parse("bogus=1"),
            Err(crate::error::Error::UnknownName { .. })
        ));
        assert!(Tuning::parse("fused_wg=x").is_err());
        assert!(Tuning::parse("fused_wg").is_err());
        let t = Tuning::parse("coop=1, wg_memory=32768").unwrap();
        assert_eq!((t.coop, t.wg_memory), (Some(1), Some(32768)));
        assert_eq!(Tuning::parse("").unwrap(), Tuning::default());
    }
}
