#!/usr/bin/env bash
# The crate in the browser (WebGPU), from Debian's packages and crates.io only.
#
#   scripts/web.sh tools          install what is missing: the wasm32 target, wasm-bindgen-cli at the
#                                 wasm-bindgen version in Cargo.lock, Debian's chromium and chromium-driver
#   scripts/web.sh bindgen        only the wasm32 target and wasm-bindgen-cli (scripts/test.sh starts
#                                 it in the background, scripts/prefetch.sh)
#   scripts/web.sh test           the browser test suite (web/tests/browser.rs, wasm-bindgen-test) in
#                                 headless Chromium's WebGPU; fails when the browser finds no adapter
#                                 (test and build lint the crates for wasm32 with clippy as they
#                                 compile them: scripts/lint_in_builds.sh)
#   scripts/web.sh build          the demo site into target/web/ (index.html, the wasm and its JS glue)
#   scripts/web.sh serve [PORT]   serve target/web/ on http://127.0.0.1:PORT (default 8080)
#   scripts/web.sh check          build, serve, load the page in headless Chromium, require "check: PASS"
#                                 in #status, save a screenshot to target/web/screenshot.png; then
#                                 load it in a Chromium without WebGPU, which must read why
#   scripts/web.sh bench [SHAPES] [ITERS]
#                                 the named bench shapes (default: a,b,d,e) timed in headless Chromium
#
# Chromium's flags (WebGPU on SwiftShader when there is no GPU) are in web/webdriver.json, read by
# both wasm-bindgen-test and scripts/web_driver.py.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/apt.sh
. scripts/lint_in_builds.sh
# A target folder of its own (WEB_TARGET_DIR, default target/web-build): the wasm32 builds share
# nothing with the native ones (their host-side proc macros are built for the release profile),
# and scripts/test.sh runs the MPI pass's native build beside the browser passes (one cargo
# per target folder at a time).
WEB_TARGET=${WEB_TARGET_DIR:-$PWD/target/web-build}
wasm_bindgen_version() { awk '/^name = "wasm-bindgen"$/ { getline; gsub(/"/, "", $3); print $3 }' Cargo.lock; }
WEB_PROFILE=release

bindgen() {
  if command -v rustup >/dev/null && ! rustup target list --installed | grep -q '^wasm32-unknown-unknown$'; then
    rustup target add wasm32-unknown-unknown
  fi
  local want; want=$(wasm_bindgen_version)
  if ! wasm-bindgen --version 2>/dev/null | grep -q " $want\$"; then
    echo "== installing wasm-bindgen-cli $want (the wasm-bindgen version in Cargo.lock)"
    # --locked pins the CLI's own dependencies; when one of them has been yanked since, resolve anew.
    # Unoptimised (opt-level 0): it compiles in 69 s instead of 215 s on 2 cores, and processes
    # the browser suite's 5 MB module in 1.1 s instead of 0.3 s.
    CARGO_PROFILE_RELEASE_OPT_LEVEL=0 cargo install -q wasm-bindgen-cli --version "$want" --locked 2>/dev/null ||
      CARGO_PROFILE_RELEASE_OPT_LEVEL=0 cargo install -q wasm-bindgen-cli --version "$want"
  fi
}

tools() {
  bindgen
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt_install "Chromium and ChromeDriver for the browser tests" chromium chromium-driver || exit 1
  fi
}

build() {
  tools
  CARGO_TARGET_DIR=$WEB_TARGET cargo_linted build --locked --profile "$WEB_PROFILE" -p wgpu-attention-web \
    --target wasm32-unknown-unknown
  rm -rf target/web && mkdir -p target/web
  wasm-bindgen --target web --no-typescript --out-dir target/web \
    "$WEB_TARGET/wasm32-unknown-unknown/$WEB_PROFILE/wgpu_attention_web.wasm"
  cp web/index.html target/web/
  echo "== built target/web/ ($(du -sh target/web | cut -f1))"
}

serve() { # serve PORT: in the foreground
  echo "== serving target/web/ on http://127.0.0.1:$1/ (WebGPU needs a secure context: 127.0.0.1 or localhost)"
  exec python3 -m http.server "$1" --bind 127.0.0.1 --directory target/web
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

with_server() { # with_server CMD...: serve target/web on a free port while CMD runs ($URL set)
  local port; port=$(free_port)
  python3 -m http.server "$port" --bind 127.0.0.1 --directory target/web >/dev/null 2>&1 &
  SERVER_PID=$!
  trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
  # Wait until the server answers.
  local up=0
  for _ in $(seq 100); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && { up=1; break; }
    sleep 0.1
  done
  [ "$up" = 1 ] || { echo "the HTTP server on port $port did not answer" >&2; exit 1; }
  URL="http://127.0.0.1:$port/" "$@"
}

case "${1:-}" in
  tools) tools ;;
  bindgen) bindgen ;;
  test)
    tools
    cd web
    CARGO_TARGET_DIR=$WEB_TARGET CHROMEDRIVER=$(command -v chromedriver) \
      WASM_BINDGEN_TEST_TIMEOUT=${WASM_BINDGEN_TEST_TIMEOUT:-1800} \
      CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
      cargo_linted test --locked --profile "$WEB_PROFILE" --target wasm32-unknown-unknown --test browser -- "${@:2}"
    ;;
  build) build ;;
  serve) build; serve "${2:-8080}" ;;
  check)
    build
    with_server sh -c 'python3 scripts/web_driver.py check "$URL" --screenshot target/web/screenshot.png &&
      python3 scripts/web_driver.py no-webgpu "$URL"'
    ;;
  bench)
    build >&2
    shapes=${2:-a,b,d,e} iters=${3:-5}
    with_server sh -c "python3 scripts/web_driver.py bench \"\${URL}?bench=$shapes&iters=$iters\""
    ;;
  *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
