#!/usr/bin/env bash
# The project's test command: rustfmt, clippy (-D warnings; the browser and MPI passes lint their
# own builds as they compile them, scripts/lint_in_builds.sh), then the test suite on three real
# backends, installing what a Debian/Ubuntu machine lacks:
#   vulkan   the whole suite on the default adapter (Mesa's software Vulkan driver, lavapipe, is
#            installed when the machine has no Vulkan driver at all)
#   gl       the attention, golden, MHA, error and form-matrix tests on wgpu's GL backend
#            (WGPU_BACKEND=gl; Mesa's llvmpipe through EGL, installed when missing)
#   browser  the browser suite in headless Chromium's WebGPU (scripts/web.sh test; Debian's
#            chromium and chromium-driver, wasm-bindgen-cli from crates.io)
#   web-demo the demo page built and loaded in headless Chromium, which must say "check: PASS"
#   mpi      the ring over MPI ranks (scripts/mpi.sh; Open MPI installed when missing)
# WGPU_ATTENTION_BACKENDS picks among them (default: all five, in that order).
# Set WGPU_ATTENTION_REQUIRE_GPU=1 to make GPU tests fail instead of skipping without an adapter
# (the GL and browser passes always fail without one).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/apt.sh

if [ "$(uname -s)" = Linux ]; then
  have_icd=0
  for d in /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d; do
    ls "$d"/*.json >/dev/null 2>&1 && have_icd=1
  done
  if [ "$have_icd" = 0 ] || ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
    if command -v apt-get >/dev/null; then
      apt_install "Mesa's software Vulkan driver (lavapipe), as no Vulkan driver was found" \
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
# With an example in the selection, so that the dev-dependencies' features are those clippy
# resolved and their checked dependencies are reused (the library alone resolves other features
# for wgpu's dependencies and checks wgpu again: 45 s).
stage rustdoc env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --lib --example own_device --locked
BACKENDS=${WGPU_ATTENTION_BACKENDS:-vulkan gl browser web-demo mpi}
for b in $BACKENDS; do
  case $b in vulkan | gl | browser | web-demo | mpi) ;; *)
    echo "WGPU_ATTENTION_BACKENDS: unknown pass '$b' (vulkan, gl, browser, web-demo, mpi)" >&2
    exit 2
    ;;
  esac
done
has() { case " $BACKENDS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# Every test with the kernels' default forms (the plan's choice on this device); tests/forms.rs
# checks the form-dependent cases (shapes with tails, every mask kind, head dims up to 256, the
# large case, decode shapes, the goldens, one MHA layer) against every other form the device
# can run, in one process with one reference per case. On Linux the backend is named, so that a
# broken Vulkan driver fails here instead of falling back to GL (every test asserts the backend
# that WGPU_BACKEND names); elsewhere wgpu's default (Metal, DX12).
if has vulkan; then
  if [ "$(uname -s)" = Linux ]; then
    stage "tests on Vulkan" env WGPU_BACKEND=vulkan cargo test --locked
    # WebGPU's rules natively: wgpu's strict WebGPU compliance (WebGPU's features only, its
    # validation) on the attention and error suites, in minutes rather than inside Chromium.
    # Without the head dims up to 256 and the large problem, whose kernels (WebGPU's forms:
    # no subgroups) take minutes to compile on a machine whose Mesa shader cache is empty; the
    # browser suite runs them, with the goldens, under the same rules in Chromium.
    stage "strict WebGPU (Vulkan)" env WGPU_BACKEND=vulkan WGPU_STRICT_WEBGPU_COMPLIANCE=1 \
      cargo test --locked --test sdpa --test errors -- --skip head_dims_up_to_256 \
      --skip large_problem_on_the_unrolled_fused_kernel
    # Subgroup forms at the subgroup sizes of real GPUs: lavapipe emulates 4, 16, 32 and 64 lanes
    # (LP_NATIVE_VECTOR_WIDTH 128, 512, 1024, 2048). Every form on shapes with tails and on
    # decode shapes; where the subgroup check (src/subgroup_probe.rs) finds the driver's
    # subgroup operations wrong (lavapipe at 32 and 64), the subgroup forms must not be used.
    stage "subgroup sizes 4, 16, 32, 64 (lavapipe)" sh -c 'for w in 128 512 1024 2048; do
        echo "-- LP_NATIVE_VECTOR_WIDTH=$w"
        LP_NATIVE_VECTOR_WIDTH=$w WGPU_BACKEND=vulkan cargo test --locked --test forms -- \
          the_forms_this_device_offers decode_shapes_in_every_decode_form shapes_with_tails_in_every_fused_form || exit 1
      done'
    # The library users' examples, each checking its result against the reference.
    stage "examples on Vulkan" sh -c 'WGPU_BACKEND=vulkan cargo run --locked --example own_device && WGPU_BACKEND=vulkan cargo run --locked --example decode_loop && WGPU_BACKEND=vulkan cargo run --locked --example layer'
    # scripts/gpu_report.sh's short form (the command for a machine with a GPU), so it keeps
    # working: adapter, bench --gpu-time rows with GPU times, the report page. With the tool
    # `cargo test` built above (a build of its own would compile wgpu again: a selection
    # without the tests' dev-dependencies resolves other features for wgpu's dependencies).
    stage "GPU report, short form" env WGPU_BACKEND=vulkan REPORT_DIR=target/gpu_report \
      GPU_REPORT_BIN=target/debug ./scripts/gpu_report.sh --quick
  else
    stage tests cargo test --locked
  fi
fi

if has gl; then
  if [ "$(uname -s)" = Linux ] && command -v dpkg >/dev/null &&
    ! dpkg -s libegl1 libegl-mesa0 libgles2 libgl1-mesa-dri >/dev/null 2>&1; then
    apt_install "Mesa's GL (llvmpipe through EGL) for wgpu's GL backend" \
      libegl1 libegl-mesa0 libgles2 libgl1-mesa-dri
  fi
  # A GL adapter has no subgroups: the plan picks the loop, tiled and cpu decode forms there,
  # and tests/forms.rs checks every form GL offers. Every test asserts the backend is GL.
  stage "tests on GL" env WGPU_BACKEND=gl WGPU_ATTENTION_REQUIRE_GPU=1 \
    cargo test --locked --test sdpa --test golden --test mha --test mha_backward --test variants --test errors --test forms --test storage
fi

if has browser; then
  stage "browser tools (installed when missing)" ./scripts/web.sh tools
  stage "tests in Chromium (WebGPU)" ./scripts/web.sh test
fi
if has web-demo; then stage "web demo in Chromium" ./scripts/web.sh check; fi
if has mpi; then stage "MPI ring (2 and 4 ranks, fault drills)" ./scripts/mpi.sh; fi
