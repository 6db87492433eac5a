//! Tuning knobs for the GPU forms, read once from the environment variable
//! `WGPU_ATTENTION_TUNE` (native targets): `key=value,...` with keys
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
//! defaults are what it measured. Unknown keys and bad values are reported once on stderr and
//! ignored. CPU forms are not affected (but by `coop`).

use std::sync::OnceLock;

/// The value of knob `key`, if set.
pub(crate) fn knob(key: &str) -> Option<u32> {
    static KNOBS: OnceLock<Vec<(String, u32)>> = OnceLock::new();
    KNOBS
        .get_or_init(|| {
            #[cfg(not(target_arch = "wasm32"))]
            if let Ok(s) = std::env::var("WGPU_ATTENTION_TUNE") {
                return parse(&s);
            }
            Vec::new()
        })
        .iter()
        .find(|(k, _)| k == key)
        .map(|&(_, v)| v)
}

#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
const KEYS: &[&str] = &[
    "fused_wg",
    "fused_rq",
    "fused_kg",
    "bwd_wg",
    "bwd_rows",
    "bwd_unroll",
    "decode_wg",
    "decode_target",
    "decode_klanes",
    "tiles_bm",
    "tiles_bn",
    "tiles_tm",
    "tiles_tn",
    "scalar_logits",
    "tiles_prefetch",
    "tiles_sg",
    "wg_memory",
    "matmul_tiles",
    "unchecked",
    "softcap_form",
    "cascade_splits",
    "coop",
];

#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
fn parse(s: &str) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part
            .split_once('=')
            .map(|(k, v)| (k.trim(), v.trim().parse::<u32>()))
        {
            Some((k, Ok(v))) if KEYS.contains(&k) => out.push((k.to_string(), v)),
            _ => eprintln!(
                "wgpu-attention: ignoring WGPU_ATTENTION_TUNE part {part:?} (keys: {})",
                KEYS.join(", ")
            ),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_known_keys_and_skips_others() {
        let k = super::parse("fused_wg=128, bogus=1, decode_wg=x,bwd_unroll=1");
        assert_eq!(
            k,
            vec![("fused_wg".to_string(), 128), ("bwd_unroll".to_string(), 1)]
        );
    }
}
