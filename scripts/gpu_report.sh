#!/usr/bin/env bash
# One command for a machine with a GPU: the adapter and its limits, the test suite on it
# (WGPU_ATTENTION_REQUIRE_GPU=1: a missing adapter fails), `bench --gpu-time` over every shape x
# path x storage format with the backward and the multi-head layers, and PyTorch's
# scaled_dot_product_attention on the same shapes in the same run when torch with CUDA or MPS
# is importable. Writes docs/gpu/<adapter>.md (tables, FLOP/s, share of PyTorch's) and leaves
# the raw logs in $REPORT_DIR (default target/gpu_report).
#
#   scripts/gpu_report.sh            the full report
#   scripts/gpu_report.sh --quick    a short form (one small shape, debug build, no tests, no
#                                    PyTorch; the page goes to $REPORT_DIR): what CI runs on
#                                    lavapipe so the script keeps working
#
# Binaries: built with cargo when it is installed; on a machine without Rust, build here
# (`scripts/gpu_report.sh --build-only` leaves them in target/gpu_bin) and set
# GPU_REPORT_BIN=<that folder> there. GPU_REPORT_STEPS picks steps (default "tests bench torch";
# the adapter is always printed), GPU_REPORT_BENCH replaces the bench arguments. Vulkan loader: installed with apt (Debian libvulkan1)
# when missing, or unpacked from .gl/*.deb when that folder holds the packages.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=full
case "${1:-}" in
--quick) mode=quick ;;
--build-only) mode=build ;;
"") ;;
*) echo "usage: $0 [--quick|--build-only]" >&2; exit 2 ;;
esac
out=${REPORT_DIR:-target/gpu_report}
mkdir -p "$out"
tests="forms sdpa views golden backward storage mha mha_backward variants errors coop"

if [[ -z "${GPU_REPORT_BIN:-}" ]]; then
  bin=target/gpu_bin
  mkdir -p "$bin"
  if [[ $mode == quick ]]; then
    cargo build --locked --quiet -p wgpu-attention-cli
    cp target/debug/wgpu-attention "$bin/"
  else
    cargo build --release --locked --quiet -p wgpu-attention-cli
    cp target/release/wgpu-attention "$bin/"
  fi
  if [[ $mode != quick ]]; then
    args=()
    for t in $tests; do args+=(--test "$t"); done
    cargo test --release --locked --no-run "${args[@]}" --message-format=json 2>/dev/null |
      python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        shutil.copy(m["executable"], sys.argv[1] + "/test_" + m["target"]["name"])
' "$bin"
  fi
  [[ $mode == build ]] && { ls -la "$bin"; exit 0; }
else
  bin=$GPU_REPORT_BIN
fi

# The Vulkan loader.
if ! ldconfig -p | grep -q libvulkan.so.1; then
  if compgen -G ".gl/*.deb" >/dev/null; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
  elif command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends libvulkan1 >/dev/null
  fi
fi
# NVIDIA's ICD where the driver keeps it outside the loader's search path.
nv_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[[ -z "${VK_DRIVER_FILES:-}" && -f $nv_icd ]] && export VK_DRIVER_FILES=$nv_icd
export WGPU_BACKEND=${WGPU_BACKEND:-vulkan}

"$bin/wgpu-attention" info 2>&1 | grep -v XDG_RUNTIME | tee "$out/info.txt"
adapter=$(sed -n 's/^  name: *//p' "$out/info.txt" | head -1)

steps=${GPU_REPORT_STEPS:-tests bench torch}
[[ $mode == quick ]] && steps=bench
has() { [[ " $steps " == *" $1 "* ]]; }
if has tests; then
  : >"$out/tests.txt"
  for t in $tests; do
    echo "== tests/$t.rs" | tee -a "$out/tests.txt"
    WGPU_ATTENTION_REQUIRE_GPU=1 "$bin/test_$t" 2>&1 | grep -v XDG_RUNTIME |
      tee -a "$out/tests.txt" | grep -E "^test result|FAILED|panicked" || true
  done
fi
if [[ $mode == full ]]; then
  bench_args=(--shapes all --storage f32,f16,bf16 --iters 10 --warmup 2)
else
  bench_args=(--shapes small_h4_s128 --paths fused,fused-bwd --storage f32 --iters 1 --warmup 1 --no-matmul)
fi
[[ -n "${GPU_REPORT_BENCH:-}" ]] && read -r -a bench_args <<<"$GPU_REPORT_BENCH"
if has bench; then
  "$bin/wgpu-attention" bench --gpu-time "${bench_args[@]}" 2>&1 | grep -v XDG_RUNTIME | tee "$out/bench.txt"
fi

: >"$out/torch.txt"
if has torch && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() or torch.backends.mps.is_available() else 1)' 2>/dev/null; then
  python3 scripts/torch_sdpa.py --iters 20 2>&1 | tee "$out/torch.txt"
fi

doc_dir=docs/gpu
[[ $mode == quick ]] && doc_dir=$out
python3 scripts/gpu_report.py "$out" "$adapter" "$doc_dir"
if [[ $mode == quick ]]; then
  # The short form must have produced its rows, GPU times included where the adapter has them.
  grep -q "^small_h4_s128 *fused " "$out/bench.txt" || { echo "gpu_report: no bench rows" >&2; exit 1; }
  if grep -q "TIMESTAMP_QUERY *yes" "$out/info.txt"; then
    awk '$1 == "small_h4_s128" && $2 == "fused" && $10 !~ /^[0-9.]+$/ { bad = 1 } END { exit bad }' \
      "$out/bench.txt" || { echo "gpu_report: no GPU time in a row" >&2; exit 1; }
  fi
fi
