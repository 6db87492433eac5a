#!/usr/bin/env bash
# The project's test command: installs Mesa's software Vulkan driver when the machine has no
# Vulkan driver at all (Debian/Ubuntu), then rustfmt, clippy (-D warnings) and the test suite.
# Set WGPU_ATTENTION_REQUIRE_GPU=1 to make GPU tests fail instead of skipping without an adapter.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

if [ "$(uname -s)" = Linux ]; then
  have_icd=0
  for d in /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d; do
    ls "$d"/*.json >/dev/null 2>&1 && have_icd=1
  done
  if [ "$have_icd" = 0 ] || ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
    if command -v apt-get >/dev/null; then
      echo "== no Vulkan driver found: installing Mesa's software Vulkan driver (lavapipe)"
      as_root apt-get update -qq
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        mesa-vulkan-drivers libvulkan1
    else
      echo "== no Vulkan driver found and no apt-get: GPU tests will skip (or fail with WGPU_ATTENTION_REQUIRE_GPU=1)"
    fi
  fi
fi

if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust first (https://rustup.rs: curl --proto '=https' -sSf https://sh.rustup.rs | sh)" >&2
  exit 1
fi
if command -v rustup >/dev/null; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi

echo "== rustfmt"
cargo fmt --all -- --check
echo "== clippy"
cargo clippy --all-targets --locked -- -D warnings
echo "== tests"
cargo test --locked
# The fused kernel has several forms. On lavapipe the suite above runs the unrolled CPU form
# whose K/V tile is shared by subgroup shuffles (needs a fixed subgroup size of 8), with one
# query row per invocation for small problems and first uses and several for large ones. Run the
# attention tests again forcing each of the others on every problem: that form with 2 rows per
# invocation (small tiles); the unrolled GPU form (64 invocations, one row each, K/V staged in
# workgroup memory) with the decode kernel's GPU form (64 invocations, unrolled, reductions
# through workgroup memory); and the loop form (CPU adapters without a fixed subgroup size),
# with 3 rows per invocation.
echo "== attention tests, fused kernel forced to the unrolled subgroup form, 2 rows per invocation"
WGPU_ATTENTION_FLASH=8,2,4,1,1 cargo test --locked --test sdpa --test golden --test mha
echo "== attention tests, fused and decode kernels forced to their GPU forms (workgroup memory)"
WGPU_ATTENTION_FLASH=64,1,4,1,0 WGPU_ATTENTION_DECODE=64,0,1 cargo test --locked --test sdpa --test golden --test mha
echo "== attention tests, fused kernel forced to the loop form (workgroup memory), 3 rows"
WGPU_ATTENTION_FLASH=8,3,2,0,0 cargo test --locked --test sdpa --test golden --test mha
