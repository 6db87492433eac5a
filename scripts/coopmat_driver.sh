#!/usr/bin/env bash
# Mesa 26.1's lavapipe, which runs cooperative matrices (8x8x8 f16) on the CPU, in a folder of
# its own: Debian trixie's userland and trixie-backports' mesa-vulkan-drivers, downloaded with a
# private apt configuration and unpacked (nothing is installed system-wide), plus spirv-val.
# Needs a 256-bit vector width (AVX2). Idempotent: a finished root is reused.
#
#   scripts/coopmat_driver.sh [ROOT]     (default ~/.cache/wgpu-attention/mesa-coopmat)
#
# Prints the environment that runs a test binary on that driver: eval "$(scripts/coopmat_driver.sh)".
# The runner starts binaries through the root's own dynamic loader, so processes they spawn
# (which use the system's) cannot load the driver: run single test binaries with it.
set -euo pipefail
root=${1:-${HOME}/.cache/wgpu-attention/mesa-coopmat}
lib=$root/usr/lib/x86_64-linux-gnu
if [[ ! -f $root/.done ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/sources" "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$root"
  cat > "$work/sources/trixie.sources" <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie trixie-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  apt_opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/sources"
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Dir::State::status=/dev/null
    -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq >&2
  pkgs=(libc6 libgcc-s1 libstdc++6 libllvm19 libedit2 libffi8 libxml2 libz3-4 libzstd1 zlib1g
    libtinfo6 libbsd0 libmd0 liblzma5 libdrm2 libexpat1 libdisplay-info2 libwayland-client0
    libx11-xcb1 libxcb1 libxau6 libxdmcp6 libxcb-dri3-0 libxcb-present0 libxcb-randr0 libxcb-shm0
    libxcb-sync1 libxcb-xfixes0 libxshmfence1 libvulkan1 libicu76 spirv-tools
    mesa-vulkan-drivers/trixie-backports)
  (cd "$work/debs" && apt-get "${apt_opts[@]}" download "${pkgs[@]}" >&2)
  for d in "$work"/debs/*.deb; do dpkg-deb -x "$d" "$root"; done
  # The driver must be 26.1 or later (trixie main's 25.0 has no cooperative matrices).
  ver=$(dpkg-deb -f "$work"/debs/mesa-vulkan-drivers_*.deb Version)
  echo "mesa-vulkan-drivers $ver" > "$root/.version"
  case $ver in 2[6-9].*|[3-9][0-9].*) ;; *) echo "mesa-vulkan-drivers $ver: 26.1 or later needed" >&2; exit 1 ;; esac
  touch "$root/.done"
fi
cat > "$root/lvp_icd.json" <<JSON
{"file_format_version": "1.0.1", "ICD": {"library_path": "$lib/libvulkan_lvp.so", "api_version": "1.4.0"}}
JSON
echo "export VK_DRIVER_FILES=$root/lvp_icd.json VK_ICD_FILENAMES=$root/lvp_icd.json VK_LOADER_LAYERS_DISABLE='~implicit~'"
echo "export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER='$lib/ld-linux-x86-64.so.2 --library-path $lib'"
echo "export WGPU_ATTENTION_SPIRV_VAL='$lib/ld-linux-x86-64.so.2 --library-path $lib $root/usr/bin/spirv-val'"
echo "# $(cat "$root/.version")"
