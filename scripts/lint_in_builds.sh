# Sourced by scripts/test.sh, scripts/web.sh and scripts/mpi.sh: clippy's lints (-D warnings) in
# their builds.
#
# `cargo clippy` is `cargo check` with clippy's driver as the workspace's rustc wrapper
# (RUSTC_WORKSPACE_WRAPPER) and its arguments in CLIPPY_ARGS, separated by __CLIPPY_HACKERY__.
# The same wrapper on `cargo build` / `cargo test` lints every crate of this workspace while it
# compiles it, so that a pass whose build is its own (the browser's wasm32, the MPI feature) does
# not also check everything for clippy first (for wasm32 a whole check of the dependencies:
# 139 s on the CI machine of 2026-11-26). Dependencies are not linted (cargo wraps workspace
# members only). Every build of one pass must use it alike, or the workspace's crates are
# compiled again. scripts/test.sh exports the wrapper (lint_every_build) for all of its cargo
# calls: its one native build lints every target, instead of a `cargo clippy` pass that checks
# every dependency first (154 s of a cold CI run on 2026-11-26).

# cargo_linted ARGS...: cargo ARGS with clippy's driver as the workspace wrapper (a note on
# stderr and no lints where clippy is not installed).
cargo_linted() {
  local driver
  driver=$(clippy_driver)
  if [ -z "$driver" ]; then
    echo "== clippy-driver not found (rustup component add clippy): building without clippy's lints" >&2
    cargo "$@"
    return
  fi
  RUSTC_WORKSPACE_WRAPPER=$driver CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__" cargo "$@"
}

# clippy_driver: the path of clippy's driver, or nothing.
clippy_driver() {
  local driver=""
  if command -v rustup >/dev/null; then driver=$(rustup which clippy-driver 2>/dev/null || true); fi
  [ -n "$driver" ] || driver=$(command -v clippy-driver || true)
  echo "$driver"
}

# lint_every_build: export the wrapper, so that every later cargo call of this shell (and of the
# scripts it runs) lints as it compiles; fails where clippy is not installed.
lint_every_build() {
  local driver
  driver=$(clippy_driver)
  if [ -z "$driver" ]; then
    echo "clippy-driver not found: rustup component add clippy" >&2
    return 1
  fi
  export RUSTC_WORKSPACE_WRAPPER=$driver
  export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
}
