# Sourced by scripts/web.sh and scripts/mpi.sh: clippy's lints (-D warnings) in their builds.
#
# `cargo clippy` is `cargo check` with clippy's driver as the workspace's rustc wrapper
# (RUSTC_WORKSPACE_WRAPPER) and its arguments in CLIPPY_ARGS, separated by __CLIPPY_HACKERY__.
# The same wrapper on `cargo build` / `cargo test` lints every crate of this workspace while it
# compiles it, so that a pass whose build is its own (the browser's wasm32, the MPI feature) does
# not also check everything for clippy first (for wasm32 a whole check of the dependencies:
# 139 s on the CI machine of 2026-11-26). Dependencies are not linted (cargo wraps workspace
# members only). Every build of one pass must use it alike, or the workspace's crates are
# compiled again. The native pass keeps `cargo clippy`: rustdoc needs the dependencies checked
# anyway, and reuses clippy's.

# cargo_linted ARGS...: cargo ARGS with clippy's driver as the workspace wrapper (a note on
# stderr and no lints where clippy is not installed).
cargo_linted() {
  local driver=""
  if command -v rustup >/dev/null; then driver=$(rustup which clippy-driver 2>/dev/null || true); fi
  [ -n "$driver" ] || driver=$(command -v clippy-driver || true)
  if [ -z "$driver" ]; then
    echo "== clippy-driver not found (rustup component add clippy): building without clippy's lints" >&2
    cargo "$@"
    return
  fi
  RUSTC_WORKSPACE_WRAPPER=$driver CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__" cargo "$@"
}
