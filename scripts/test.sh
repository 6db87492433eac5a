#!/usr/bin/env bash
# The project's test command: rustfmt, a build of every target linted by clippy as it compiles
# (-D warnings, scripts/lint_in_builds.sh; the browser and MPI passes lint their own builds the
# same way), rustdoc, then the test suite on three real
# backends, installing what a Debian/Ubuntu machine lacks:
#   vulkan   the whole suite on the default adapter (Mesa's software Vulkan driver, lavapipe, is
#            installed when the machine has no Vulkan driver at all)
#   coop     the matrix units' forms and tests on Mesa 26.1's lavapipe (cooperative matrices),
#            downloaded into ~/.cache by scripts/coopmat_driver.sh
#   gl       the attention, golden, MHA, error and form-matrix tests on wgpu's GL backend
#            (WGPU_BACKEND=gl; Mesa's llvmpipe through EGL, installed when missing)
#   browser  the browser suite in headless Chromium's WebGPU (scripts/web.sh test; Debian's
#            chromium and chromium-driver, wasm-bindgen-cli from crates.io)
#   web-demo the demo page built and loaded in headless Chromium, which must say "check: PASS"
#   mpi      the ring over MPI ranks (scripts/mpi.sh; Open MPI installed when missing)
# WGPU_ATTENTION_BACKENDS picks among them (default: all six, in that order).
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

# suite ARGS...: cargo's test selection (and name filters after --) through cargo-nextest where
# it is installed (every machine of the project's kind has it): one process per test, scheduled
# over every binary at once, the slowest first (.config/nextest.toml), so that both cores stay
# busy to the end; elsewhere `cargo test` with the same arguments.
have_nextest=0
cargo nextest --version >/dev/null 2>&1 && have_nextest=1
suite() {
  if [ "$have_nextest" = 1 ]; then
    cargo nextest run --profile ci --no-tests=fail "$@"
  else
    cargo test "$@"
  fi
}

stage() { # stage <name> <command...>: run a stage and print its wall time
  local name=$1 t0=$SECONDS; shift
  echo "== $name"
  "$@"
  echo "== $name: $((SECONDS - t0)) s"
}

BACKENDS=${WGPU_ATTENTION_BACKENDS:-vulkan coop gl burn browser web-demo mpi}
for b in $BACKENDS; do
  case $b in vulkan | coop | gl | burn | browser | web-demo | mpi) ;; *)
    echo "WGPU_ATTENTION_BACKENDS: unknown pass '$b' (vulkan, coop, gl, burn, browser, web-demo, mpi)" >&2
    exit 2
    ;;
  esac
done
has() { case " $BACKENDS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# The later passes' Debian packages (installed) and wasm-bindgen-cli (compiled at the lowest
# priority) in the background from here on, overlapping the build and the Vulkan tests
# (scripts/prefetch.sh); each pass waits for its part.
. scripts/prefetch.sh
# shellcheck disable=SC2086
prefetch_start $BACKENDS

stage rustfmt cargo fmt --all -- --check
# Clippy (-D warnings) lints this workspace's crates as cargo compiles them, in every cargo call
# below (scripts/lint_in_builds.sh): one build of every target (the library, the CLI, tests,
# examples and the benchmark), which the passes below reuse, instead of `cargo clippy` checking
# every dependency first.
. scripts/lint_in_builds.sh
lint_every_build
stage "build, linted by clippy" cargo test --locked --all-targets --no-run
# The library's documentation, every warning an error (broken links, missing docs). The library
# alone: its dependencies are checked for it (rustdoc needs their metadata, not the build's
# libraries), and with an example in the selection every dev-dependency would be too (51 s
# against 81 s in a fresh target folder).
stage rustdoc env RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --lib --locked
# Every test with the kernels' default forms (the plan's choice on this device); tests/forms.rs
# checks the form-dependent cases (shapes with tails, every mask kind, head dims up to 256, the
# large case, decode shapes, the goldens, one MHA layer) against every other form the device
# can run, in one process with one reference per case. On Linux the backend is named, so that a
# broken Vulkan driver fails here instead of falling back to GL (every test asserts the backend
# that WGPU_BACKEND names); elsewhere wgpu's default (Metal, DX12).
if has vulkan; then
  if [ "$(uname -s)" = Linux ]; then
    export WGPU_BACKEND=vulkan
    stage "tests on Vulkan" suite --locked
    # cargo-nextest does not run documentation tests.
    if [ "$have_nextest" = 1 ]; then
      stage "documentation tests" cargo test --locked --doc
    fi
    # WebGPU's rules natively: wgpu's strict WebGPU compliance (WebGPU's features only, its
    # validation) on the attention and error suites, in minutes rather than inside Chromium.
    # Without the head dims up to 256 and the large problem, whose kernels (WebGPU's forms:
    # no subgroups) take minutes to compile on a machine whose Mesa shader cache is empty, and
    # without the score modifiers and user functions (their code is masks.wgsl's, the same on
    # every kernel); the browser suite runs them, with the goldens, under the same rules in
    # Chromium.
    strict_webgpu() {
      WGPU_STRICT_WEBGPU_COMPLIANCE=1 suite --locked --test sdpa --test errors -- \
        --skip head_dims_up_to_256 --skip large_problem_on_the_unrolled_fused_kernel \
        --skip modifiers_on_every_path --skip user_functions_on_every_path --skip mask_mod_block_map
    }
    stage "strict WebGPU (Vulkan)" strict_webgpu
    # Subgroup forms at the subgroup sizes of real GPUs: lavapipe emulates 4, 16, 32 and 64 lanes
    # (LP_NATIVE_VECTOR_WIDTH 128, 512, 1024, 2048). Every form on shapes with tails (with and
    # without masks) and on decode shapes; where the subgroup check (src/subgroup_probe.rs) finds
    # the driver's subgroup operations wrong (lavapipe at 32 and 64), the subgroup forms must
    # not be used.
    subgroup_sizes() {
      local w
      for w in 128 512 1024 2048; do
        echo "-- LP_NATIVE_VECTOR_WIDTH=$w"
        LP_NATIVE_VECTOR_WIDTH=$w suite --locked --test forms -- the_forms_this_device_offers \
          decode_shapes_in_every_decode_form shapes_with_tails || return 1
      done
    }
    stage "subgroup sizes 4, 16, 32, 64 (lavapipe)" subgroup_sizes
    # The library users' examples, each checking its result against the reference.
    examples() {
      cargo run --locked --example own_device && cargo run --locked --example decode_loop &&
        cargo run --locked --example layer &&
        cargo run --locked --example generate
    }
    stage "examples on Vulkan" examples
    # scripts/gpu_report.sh's short form (the command for a machine with a GPU), so it keeps
    # working: adapter, bench --gpu-time rows with GPU times, the report page. With the tool
    # `cargo test` built above (a build of its own would compile wgpu again: a selection
    # without the tests' dev-dependencies resolves other features for wgpu's dependencies).
    stage "GPU report, short form" env REPORT_DIR=target/gpu_report \
      GPU_REPORT_BIN=target/debug ./scripts/gpu_report.sh --quick
    unset WGPU_BACKEND
  else
    stage tests suite --locked
  fi
fi

# The matrix units: Mesa 26.1's lavapipe, which has cooperative matrices (8 x 8 x 8 f16), in a
# folder of its own (scripts/coopmat_driver.sh downloads it; nothing is installed system-wide),
# the test binaries started through its own dynamic loader. WGPU_ATTENTION_REQUIRE_COOP=1: a
# device without the units fails the tests instead of serving them in the scalar forms. The
# kernels' stage tests and their naga and spirv-val checks, the coop tests (the fused forward
# and backward with every mask kind, modifier, user function and head dim, FlashAttention's
# accuracy rule for f16; the matmul), and the f16 paths that take the units by default (the
# goldens, the layer, half-format paged caches, the half-format backward). No
# process-spawning tests here: a spawned process would use the system's loader.
if has coop; then
  prefetch_wait coop
  if [ "$(uname -s)" = Linux ] && grep -q avx2 /proc/cpuinfo; then
    coop_tests() (
      local env_lines
      env_lines=$(./scripts/coopmat_driver.sh) || exit 1
      eval "$env_lines"
      # coop=1: the units' forms are the default for f16 here too (on CPU adapters they are
      # opt-in: slower than the scalar forms), so the suites below run them unpinned.
      export WGPU_BACKEND=vulkan WGPU_ATTENTION_REQUIRE_COOP=1 WGPU_ATTENTION_TUNE=coop=1
      suite --locked --lib --test coop --test mha --test golden --test paged --test backward -- coop half f16 \
        every_path_matches_pytorch_goldens &&
        # The 16 x 16 tile (NVIDIA's, AMD's), which lavapipe runs but does not list: a test-only
        # override that the output names.
        WGPU_ATTENTION_TEST_UNLISTED_TILES=16 suite --locked --lib -- coop_matmul
    )
    stage "matrix units (Mesa 26.1 lavapipe)" coop_tests
  else
    echo "== matrix units: this machine cannot run Mesa 26.1's lavapipe (Linux with AVX2 needed)" >&2
    exit 1
  fi
fi

if has gl; then
  prefetch_wait packages
  if [ "$(uname -s)" = Linux ] && command -v dpkg >/dev/null &&
    ! dpkg -s libegl1 libegl-mesa0 libgles2 libgl1-mesa-dri >/dev/null 2>&1; then
    apt_install "Mesa's GL (llvmpipe through EGL) for wgpu's GL backend" \
      libegl1 libegl-mesa0 libgles2 libgl1-mesa-dri
  fi
  # A GL adapter has no subgroups: the plan picks the loop, tiled and cpu decode forms there,
  # and tests/forms.rs checks every form GL offers. Every test asserts the backend is GL.
  # What this pass adds to the Vulkan one is naga's GLSL and the GL driver, so every kernel, form
  # and I/O variant runs here, but not every case of the suites (measured on a cold run: the
  # pass 257 s). Left out:
  # - the form matrix's head dims at the limit (E = 256, and 255 with Ev = 129, in every form:
  #   258 s of a cold GL pass, compiling): tests/sdpa.rs runs them on GL in the default forms;
  # - the split of more than 65535 batch-heads over dispatches (68 s): host logic, run on Vulkan;
  # - the goldens in every form (79 s): tests/golden.rs runs them on every path here, and the
  #   form matrix's shapes with tails every form with every mask kind;
  # - the grids of shapes and masks on every path, in f32 and in half formats (60 s and 58 s):
  #   the form matrix runs those shapes and masks in every fused form, the goldens every path,
  #   tests/storage.rs's other cases the half formats' I/O (odd dims, vec4, decode, large);
  # - the form matrix's shapes with tails without masks (21 s): the same shapes run in every
  #   form with every mask kind (the kernels differ in the mask code only, compiled out);
  # - the form matrix's windows and score modifiers (about 80 s): tests/sdpa.rs runs them on
  #   every path here in the default forms, and the Vulkan pass in every form;
  # - the 8-bit caches under every mask and modifier (15 s on Vulkan): their loads run here in
  #   every other 8-bit test, the PyTorch goldens included.
  gl_tests() {
    WGPU_BACKEND=gl WGPU_ATTENTION_REQUIRE_GPU=1 suite --locked --test sdpa --test golden \
      --test mha --test mha_backward --test variants --test errors --test forms --test storage \
      --test quant \
      -- --skip head_dims_25 --skip every_mask_and_modifier_over_8_bit_caches --skip batch_times_heads_over_65535 --skip pytorch_goldens_in_every_form \
      --skip grid_of_shapes_and_masks --skip shapes_with_tails_in_every_fused_form \
      --skip windows_in_every_form --skip modifiers_in_every_form
  }
  stage "tests on GL" gl_tests
fi

# The burn crate (burn/, not a default member: burn's build is long and turns wgpu's default
# features back on): its tests on Vulkan (the forward against burn's attention and the
# reference, gradients through burn's autodiff, a tiny model's training, misuse), its example,
# and its benchmark built (not run: `cargo bench -p wgpu-attention-burn` times it). Its rustdoc
# is not built here: `cargo doc` checks every dependency again (burn's tree twice over); the
# crate's `#![deny(missing_docs)]` holds in the build above.
if has burn; then
  burn_tests() {
    WGPU_BACKEND=vulkan suite --locked -p wgpu-attention-burn &&
      cargo build --locked -p wgpu-attention-burn --benches &&
      WGPU_BACKEND=vulkan cargo run --locked -p wgpu-attention-burn --example from_burn
  }
  stage "burn crate (burn 0.22 on Vulkan)" burn_tests
fi

# The MPI pass runs beside the browser passes when both are asked for: the browser suite keeps
# the two cores about 60% busy (Chromium's GPU process compiles and runs one kernel at a time),
# and the MPI pass's build fills the rest. Its output is printed when it ends; the browser
# passes build in a target folder of their own (scripts/web.sh), so the two cargos do not wait
# for each other's lock.
mpi_pid=
if has mpi; then
  prefetch_wait packages
  if has browser || has web-demo; then
    echo "== MPI ring (2 and 4 ranks, fault drills): started beside the browser passes"
    mpi_t0=$SECONDS
    ( ./scripts/mpi.sh >target/mpi.log 2>&1; echo "$?" >target/mpi.status ) &
    mpi_pid=$!
  else
    stage "MPI ring (2 and 4 ranks, fault drills)" ./scripts/mpi.sh
  fi
fi
if has browser || has web-demo; then
  prefetch_wait packages
  prefetch_wait bindgen
fi
if has browser; then
  stage "browser tools (installed when missing)" ./scripts/web.sh tools
  stage "tests in Chromium (WebGPU)" ./scripts/web.sh test
fi
if has web-demo; then stage "web demo in Chromium" ./scripts/web.sh check; fi
if [ -n "$mpi_pid" ]; then
  t0=$SECONDS
  wait "$mpi_pid" || true
  echo "== MPI ring (2 and 4 ranks, fault drills): output"
  sed 's/^/   /' target/mpi.log
  echo "== MPI ring (2 and 4 ranks, fault drills): $((SECONDS - mpi_t0)) s, $((SECONDS - t0)) s of it waited for"
  [ "$(cat target/mpi.status 2>/dev/null)" = 0 ] || { echo "== MPI ring failed" >&2; exit 1; }
fi
