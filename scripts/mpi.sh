#!/usr/bin/env bash
# The ring over MPI (cargo feature `mpi`): installs Open MPI when missing, builds with the feature
# (clippy linting as it compiles), then runs examples/ring_mpi.rs with 2 and 4 ranks on this machine (each rank
# checks its rows against one device, rank 0 the backward by FlashAttention's rule), the CLI's
# `run --mpi` and `backward --mpi` against one device (cli/tests/cli.rs), and three fault drills (a rank with a different problem, a
# rank that stalls past the timeout, a rank that dies) that must end the job with an error,
# never hang it. Every mpirun runs under a time limit, stopped with SIGINT (which cleans up
# Open MPI's shared-memory files; SIGTERM leaves them).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/apt.sh
. scripts/lint_in_builds.sh

if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null ||
  { command -v dpkg >/dev/null && ! dpkg -s libclang-dev >/dev/null 2>&1; }; then
  apt_install "Open MPI (and libclang for rsmpi's bindings) for the MPI ring" \
    openmpi-bin libopenmpi-dev libclang-dev
fi
# Root may run mpirun (CI containers); more ranks than cores share them.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN=(mpirun --oversubscribe)

# The library's feature for the library and the example, the tool's (which forwards to it) for the
# tool: it is its own package (cli/). One selection for the build and the test, with the
# examples' and tests' dev-dependencies in it as in `cargo test`, so that wgpu and naga are
# compiled once for this pass (the `mpi` crate's dependencies change some of their features),
# not once per selection as with one cargo call per target; clippy lints the MPI code as it
# compiles it
# (scripts/lint_in_builds.sh).
targets=(-p wgpu-attention -p wgpu-attention-cli --features wgpu-attention/mpi,wgpu-attention-cli/mpi
  --example ring_mpi --test cli)
cargo_linted build --locked "${targets[@]}" --bin wgpu-attention
EX=target/debug/examples/ring_mpi
CLI=target/debug/wgpu-attention

# run_mpi LIMIT_S NP ARGS...: mpirun under a time limit; prints the output, returns its status.
run_mpi() {
  local limit=$1 np=$2
  shift 2
  timeout -s INT "$limit" "${MPIRUN[@]}" -np "$np" "$@" 2>&1 | grep -v XDG_RUNTIME_DIR
  return "${PIPESTATUS[0]}"
}

for np in 2 4; do
  echo "-- ring_mpi, $np ranks: forward and backward, checked"
  run_mpi 300 "$np" "$EX" --seq 300 --heads 2 --dim 16 --causal --backward
done

echo "-- the CLI: run and backward with --mpi (under mpirun) and --devices against one device"
cargo_linted test --locked "${targets[@]}" -- run_on_a_ring backward_writes

echo "-- fault drill: rank 1 has a different problem; every rank must say so"
set +e
out=$(run_mpi 60 4 "$EX" --seq 64 --mismatch-rank 1)
status=$?
set -e
echo "$out" | grep 'wgpu-attention: rank' || true
[ "$status" -ne 0 ] && [ "$(echo "$out" | grep -o 'differs from rank' | wc -l)" -eq 4 ] ||
  { echo "mismatch drill: expected 4 ranks to fail with a mismatch (status $status)"; exit 1; }

echo "-- fault drill: rank 2 stalls past the 3 s timeout; the others must fail, not wait"
set +e
t0=$SECONDS
out=$(run_mpi 60 4 "$EX" --seq 64 --stall-rank 2 --stall-secs 30 --timeout 3)
status=$?
set -e
echo "$out" | grep 'wgpu-attention: rank' || true
[ "$status" -ne 0 ] && [ "$status" -ne 124 ] && echo "$out" | grep -q 'did not complete' ||
  { echo "stall drill: expected a timeout error (status $status)"; exit 1; }
echo "stall drill ended in $((SECONDS - t0)) s"

echo "-- fault drill: rank 1 dies; the job must end"
set +e
t0=$SECONDS
run_mpi 60 4 "$EX" --seq 64 --die-rank 1 >/dev/null
status=$?
set -e
[ "$status" -ne 0 ] && [ "$status" -ne 124 ] ||
  { echo "die drill: expected the job to end with an error (status $status)"; exit 1; }
echo "die drill ended with status $status in $((SECONDS - t0)) s"
echo "MPI ring: all checks passed"
