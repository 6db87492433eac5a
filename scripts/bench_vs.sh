#!/usr/bin/env bash
# Interleaved speed comparison against a peer: peer, ours, peer, ours ... for ROUNDS rounds per
# case, each run its own process, then each round's ratio (peer median / our median) and the
# range of the per-round ratios. The machine's speed drifts by up to 2x within minutes, so only
# same-round ratios are reported, never one sitting's best.
#
#   scripts/bench_vs.sh burn PEER_BURN_BINARY [CASES] [ROUNDS] [ITERS]
#       the peer is burn's attention (../shared/peers/burn, built outside this repository):
#       `PEER_BURN_BINARY <case> api <iters>` prints `median_ms=`
#   scripts/bench_vs.sh self OTHER_WGPU_ATTENTION_BINARY [CASES] [ROUNDS] [ITERS]
#       the peer is another build of this crate's CLI (e.g. the previous commit's), run with the
#       same `bench` arguments as ours
#   scripts/bench_vs.sh gl - [CASES] [ROUNDS] [ITERS]
#       the peer is this crate on wgpu's GL backend (WGPU_BACKEND=gl, Mesa's llvmpipe), ours the
#       default adapter (lavapipe's Vulkan): the same binary and arguments, backends interleaved
#   scripts/bench_vs.sh device - [CASES] [ROUNDS] [ITERS]
#       the peer is this crate on its own device (`bench --device crate`), ours the same binary on
#       a device made as an application makes it (`bench --device own`: Context::from_parts;
#       DEVICE=adopted: Context::from_device alone)
#   scripts/bench_vs.sh browser - [CASES] [ROUNDS] [ITERS]
#       the peer is this crate in headless Chromium's WebGPU (scripts/web.sh bench: the demo page's
#       bench mode, a fresh browser per round; the same shapes and timing rule as `bench`)
#
# CASES: letters of the benchmark shapes (default "a b c d e"): a a_h8_s1024, b
# b_h8_s1024_causal, c c_h8_s4096_causal, d d_decode_h32_s4096_e128, e e_b4_h12_s256_padmask;
# and m, the 1024^3 matmul C = A B (burn: `PEER_BURN_BINARY matmul api <iters>`; ours: the
# `matmul_1024^3_AB` row of `bench`); l, the multi-head attention layer mha_bert_base_l128 (self
# only: the forward's median of the `bench` layer row).
# MODE=bwd (burn and self only): forward + backward. Burn: `PEER_BURN_BINARY <case> bwd <iters>`
# (its autodiff backend); ours: the sum of the medians of the `auto` (forward) and `fused-bwd`
# (backward on the saved output and logsumexp) rows of one `bench` process.
# ROUNDS default 3, ITERS (timed runs per process) default 7. Ours is target/release/wgpu-attention
# (built first), `bench --shapes <shape> --paths auto --iters ITERS --storage $STORAGE` (env
# STORAGE, default f32: ours in that storage format; burn is always f32).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?"usage: $0 burn|self|gl|device|browser BINARY|- [CASES] [ROUNDS] [ITERS]"}
peer=${2:?"usage: $0 burn|self|gl|device|browser BINARY|- [CASES] [ROUNDS] [ITERS]"}
cases=${3:-"a b c d e"}
rounds=${4:-3}
iters=${5:-7}
cargo build --release --locked --quiet
ours=target/release/wgpu-attention
# Both programs' stderr (progress, harmless EGL/XDG lines) goes here.
storage=${STORAGE:-f32}
mode=${MODE:-fwd}
log=${TMPDIR:-/tmp}/bench_vs.stderr
: >"$log"

shape_of() {
  case $1 in
    a) echo a_h8_s1024 ;; b) echo b_h8_s1024_causal ;; c) echo c_h8_s4096_causal ;;
    d) echo d_decode_h32_s4096_e128 ;; e) echo e_b4_h12_s256_padmask ;; m) echo 'matmul_1024^3_AB' ;;
    l) echo mha_bert_base_l128 ;;
    *) echo "unknown case $1" >&2; exit 2 ;;
  esac
}

# The median (ms) of one `bench` process of a wgpu-attention binary (extra `bench` arguments in
# $extra).
extra=
ours_extra=
[ "$kind" = device ] && ours_extra="--device ${DEVICE:-own}"
bench_median() { # binary shape
  local m
  if [ "$2" = mha_bert_base_l128 ]; then
    m=$("$1" bench --shapes "$2" --iters "$iters" --storage "$storage" --no-matmul $extra 2>>"$log" | awk -v s="$2" '$1 == s { print $4 }')
  elif [ "$2" = 'matmul_1024^3_AB' ]; then
    m=$("$1" bench --shapes small_h4_s128 --paths fused --iters "$iters" --storage "$storage" $extra 2>>"$log" | awk -v s="$2" '$1 == s { print $5 }')
  elif [ "$mode" = bwd ]; then
    m=$("$1" bench --shapes "$2" --paths auto,fused-bwd --iters "$iters" --storage "$storage" --no-matmul $extra 2>>"$log" \
      | awk -v s="$2" '$1 == s && ($2 == "auto" || $2 == "fused-bwd") { t += $5; n++ } END { if (n == 2) printf "%.3f", t }')
  else
    m=$("$1" bench --shapes "$2" --paths auto --iters "$iters" --storage "$storage" --no-matmul $extra 2>>"$log" | awk -v s="$2" '$1 == s && $2 == "auto" { print $5 }')
  fi
  [ -n "$m" ] || { echo "no median from $1 for $2 (stderr in $log)" >&2; exit 1; }
  echo "$m"
}

peer_median() { # case
  if [ "$kind" = gl ]; then
    WGPU_BACKEND=gl bench_median "$ours" "$(shape_of "$1")"
  elif [ "$kind" = device ]; then
    extra="--device crate" bench_median "$ours" "$(shape_of "$1")"
  elif [ "$kind" = browser ]; then
    local m
    m=$(./scripts/web.sh bench "$(shape_of "$1")" "$iters" 2>>"$log" | awk -v s="$(shape_of "$1")" '$1 == s { print $(NF - 1) }')
    [ -n "$m" ] || { echo "no median from the browser for case $1 (stderr in $log)" >&2; exit 1; }
    echo "$m"
  elif [ "$kind" = burn ]; then
    local m
    local what=$1
    [ "$what" = m ] && what=matmul
    local how=api
    [ "$mode" = bwd ] && how=bwd
    m=$("$peer" "$what" "$how" "$iters" 2>>"$log" | grep -oP 'median_ms=\K[0-9.]+' || true)
    [ -n "$m" ] || { echo "no median from $peer for case $1 (stderr in $log)" >&2; exit 1; }
    echo "$m"
  else
    bench_median "$peer" "$(shape_of "$1")"
  fi
}

echo "peer: $kind ($peer); ours: $ours (storage $storage, mode $mode); $rounds rounds of (peer, ours), $iters timed runs each"
printf '%-26s %5s %12s %12s %8s\n' shape round "peer ms" "ours ms" ratio
for c in $cases; do
  shape=$(shape_of "$c")
  ratios=()
  for r in $(seq 1 "$rounds"); do
    p=$(peer_median "$c")
    o=$(extra=$ours_extra bench_median "$ours" "$shape")
    ratio=$(awk -v p="$p" -v o="$o" 'BEGIN { printf "%.2f", p / o }')
    ratios+=("$ratio")
    printf '%-26s %5s %12s %12s %8s\n' "$shape" "$r" "$p" "$o" "$ratio"
  done
  sorted=$(printf '%s\n' "${ratios[@]}" | sort -g)
  printf '%-26s ratio range %s-%s (peer ms / ours ms per round)\n' "$shape" "$(head -1 <<<"$sorted")" "$(tail -1 <<<"$sorted")"
done
