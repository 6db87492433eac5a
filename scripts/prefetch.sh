# Sourced by scripts/test.sh: what the later passes fetch or build for themselves, started at the
# beginning in the background, so that it overlaps the build and the Vulkan tests: network waits,
# and compiling at the lowest CPU priority (nice 19), which takes only the cycles the foreground
# leaves idle (the examples, the documentation tests, the end of each test pass).
#
#   packages  the Debian packages the GL, browser and MPI passes need, installed when missing
#             (unpacking and configuring them overlaps the build: 45 s of a cold run when the
#             passes installed their own); each pass still installs what it lacks (apt_install)
#   bindgen   the wasm32 target and wasm-bindgen-cli (scripts/web.sh bindgen), for the browser
#             passes
#   coop      Mesa 26.1's lavapipe in ~/.cache (scripts/coopmat_driver.sh), for the matrix
#             units' pass
#
# prefetch_start PASS...: start what the passes PASS... need; prefetch_wait NAME: wait for one
# (its output is printed then; a failure is reported, and the pass itself then installs what it
# lacks and fails if it cannot).

PREFETCH_LOGS=target/prefetch
declare -A PREFETCH_PIDS=()

# As root, or through sudo without a password prompt (in the background there is no one to
# answer it): else nothing is installed here, and the passes install as they would have.
prefetch_as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi
}

# prefetch_packages PKG...: install the packages of PKG... that are not installed.
prefetch_packages() {
  local missing=() p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ "${#missing[@]}" = 0 ] && return 0
  echo "== installing ${missing[*]}"
  prefetch_as_root apt-get update -qq &&
    prefetch_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${missing[@]}"
}

prefetch_start() {
  local pkgs=() b
  for b in "$@"; do
    case $b in
      gl) pkgs+=(libegl1 libegl-mesa0 libgles2 libgl1-mesa-dri) ;;
      browser | web-demo) pkgs+=(chromium chromium-driver) ;;
      mpi) pkgs+=(openmpi-bin libopenmpi-dev libclang-dev) ;;
    esac
  done
  mkdir -p "$PREFETCH_LOGS"
  if [ "${#pkgs[@]}" -gt 0 ] && command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
    prefetch_packages "${pkgs[@]}" >"$PREFETCH_LOGS/packages.log" 2>&1 &
    PREFETCH_PIDS[packages]=$!
  fi
  case " $* " in *" browser "* | *" web-demo "*)
    nice -n 19 ./scripts/web.sh bindgen >"$PREFETCH_LOGS/bindgen.log" 2>&1 &
    PREFETCH_PIDS[bindgen]=$!
    ;;
  esac
  case " $* " in *" coop "*)
    ./scripts/coopmat_driver.sh >"$PREFETCH_LOGS/coop.log" 2>&1 &
    PREFETCH_PIDS[coop]=$!
    ;;
  esac
  echo "== started in the background: ${!PREFETCH_PIDS[*]} (logs in $PREFETCH_LOGS/)"
}

prefetch_wait() {
  local name=$1 pid=${PREFETCH_PIDS[$1]:-} t0=$SECONDS status=0
  [ -n "$pid" ] || return 0
  wait "$pid" || status=$?
  unset "PREFETCH_PIDS[$name]"
  echo "== background $name: done ($((SECONDS - t0)) s waited, status $status)"
  sed 's/^/   /' "$PREFETCH_LOGS/$name.log"
  return 0
}
