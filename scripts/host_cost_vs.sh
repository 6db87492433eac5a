#!/usr/bin/env bash
# The host cost of a generation loop's calls (examples/host_cost.rs) against the build of 15bedb7
# (scripts/host_cost_15bedb7.rs: the same calls through that build's API), interleaved: old,
# new, old, new ... for ROUNDS rounds, each run its own process, then each call's per-round
# ratios (old / new). The old build is made in a git worktree with a target folder of its own.
#
#   scripts/host_cost_vs.sh [ROUNDS] [CALLS]        (defaults 3 and 200)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
calls=${2:-200}
old=${OLD_TREE:-/tmp/wgpu-attention-15bedb7}
if [ ! -d "$old" ]; then
  git worktree add -f "$old" 15bedb7 >/dev/null
fi
cp scripts/host_cost_15bedb7.rs "$old/examples/host_cost.rs"
(cd "$old" && CARGO_TARGET_DIR="$old/target" cargo build --release --example host_cost >/dev/null)
cargo build --release --example host_cost >/dev/null
declare -A first
for r in $(seq 1 "$rounds"); do
  for who in old new; do
    if [ "$who" = old ]; then bin="$old/target/release/examples/host_cost"; else bin=target/release/examples/host_cost; fi
    while read -r name us _; do
      case $name in *_record | kv_step_per_layer) ;; *) continue ;; esac
      if [ "$who" = old ]; then
        first[$name]=$us
      else
        printf '%-18s round %d: old %8.1f us, new %8.1f us, old/new %5.2fx\n' "$name" "$r" "${first[$name]}" "$us" \
          "$(echo "${first[$name]} / $us" | bc -l)"
      fi
    done < <("$bin" --calls "$calls" 2>/dev/null)
  done
done
