#!/usr/bin/env bash
# The matrix units' forms against the scalar forms on this machine's adapter, interleaved in one
# sitting (scalar, coop, scalar, coop, ...: the per-round ratios are what to report), with GPU
# times: `bench --gpu-time` with WGPU_ATTENTION_MATRIX_UNITS=off, then with the units on (and
# WGPU_ATTENTION_TUNE=coop=1, so that a CPU adapter that has them uses them unpinned too).
#
#   scripts/coop_vs_scalar.sh [ROUNDS [BENCH ARGS...]]
#
# Default: 3 rounds of the matrix-unit targets' rows in f16 (the fused forward and backward at
# c_h8_s4096_causal and prefill_h32_s4096_e128, a, gpt2, the forks read once and per fork,
# the multi-head layers, and the 1024^3 matmul). GPU_REPORT_BIN: a folder holding a built
# `wgpu-attention` (else it is built here). On Mesa 26.1's lavapipe:
# eval "$(scripts/coopmat_driver.sh)" first, and WGPU_ATTENTION_RUNNER="$CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER".
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
if [[ -n "${GPU_REPORT_BIN:-}" ]]; then
  bin=$GPU_REPORT_BIN/wgpu-attention
else
  cargo build --release --locked --quiet -p wgpu-attention-cli
  bin=target/release/wgpu-attention
fi
args=("$@")
if [[ ${#args[@]} == 0 ]]; then
  args=(--shapes c_h8_s4096_causal,prefill_h32_s4096_e128,a_h8_s1024,gpt2_h12_t1024_causal,cascade64,cascade64_unshared,mha_bert_base_l512,mha_gqa_h32_kv8_d128_l128
    --paths fused,fused-bwd --storage f16 --iters 10 --gpu-time)
fi
# shellcheck disable=SC2086
run() { ${WGPU_ATTENTION_RUNNER:-} "$bin" "$@"; }
run info | sed -n '/matrix units/,$p'
for r in $(seq "$rounds"); do
  echo "== round $r: scalar forms"
  WGPU_ATTENTION_MATRIX_UNITS=off run bench "${args[@]}"
  echo "== round $r: matrix units"
  WGPU_ATTENTION_TUNE=coop=1 run bench "${args[@]}"
done
