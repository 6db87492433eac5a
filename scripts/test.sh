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

stage() { # stage <name> <command...>: run a stage and print its wall time
  local name=$1 t0=$SECONDS; shift
  echo "== $name"
  "$@"
  echo "== $name: $((SECONDS - t0)) s"
}

stage rustfmt cargo fmt --all -- --check
stage clippy cargo clippy --all-targets --locked -- -D warnings
# Every test with the kernels' default forms (the plan's choice on this device); tests/forms.rs
# checks the form-dependent cases (shapes with tails, every mask kind, head dims up to 256, the
# large case, decode shapes, the goldens, one MHA layer) against every other form the device
# can run, in one process with one reference per case.
stage tests cargo test --locked
