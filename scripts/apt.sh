# Sourced by scripts/test.sh and scripts/web.sh: installing Debian/Ubuntu packages a pass needs.

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

# apt_install WHAT PKG...: install PKG... (WHAT says what for); fails, saying so, without apt-get.
apt_install() {
  local what=$1
  shift
  if ! command -v apt-get >/dev/null; then
    echo "== $what needs $* (no apt-get here to install them)" >&2
    return 1
  fi
  echo "== installing $what: $*"
  # Each step checked here: a caller's `|| ...` turns off `set -e` inside this function.
  as_root apt-get update -qq || return 1
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}
