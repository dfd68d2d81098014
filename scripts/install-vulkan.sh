#!/usr/bin/env bash
# What `make GPU=vulkan ...` needs, installed once and skipped when there:
# - from bookworm: the Vulkan loader (libvulkan1), glslc (ggml-vulkan compiles its
#   shaders with it at build time) and vulkan-tools (vulkaninfo);
# - from bookworm-backports: Mesa 25's lavapipe (mesa-vulkan-drivers), a real Vulkan
#   driver that runs on the CPU, for the GPU tests on machines without a GPU
#   (bookworm's own Mesa 22 is too old for ggml-vulkan's shaders);
# - from trixie, unpacked into a private prefix (the system is not touched): the Vulkan
#   headers ≥ 1.3.272 ggml-vulkan needs (bookworm's are 1.3.239) and SPIRV-Headers.
# Prints the prefix, which the Makefile hands to llama-cpp-sys-2 as VULKAN_SDK; its
# bin/glslc caches compiled shaders outside the clone (scripts/glslc-cache.sh).
set -euo pipefail

root="${LLAMABOX_VULKAN_PREFIX:-$HOME/.cache/llamabox/vulkan-sdk}"
here="$(cd "$(dirname "$0")" && pwd)"
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"

need=()
[ -e /usr/lib/x86_64-linux-gnu/libvulkan.so.1 ] || need+=(libvulkan1)
command -v glslc >/dev/null || need+=(glslc)
command -v vulkaninfo >/dev/null || need+=(vulkan-tools)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

# A private apt configuration naming one other suite: lists and sources live under
# $1, never in the system's.
suite_apt() {
  local dir="$1" suite="$2"; shift 2
  mkdir -p "$dir/lists/partial"
  [ -f "$dir/sources.list" ] || echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" >"$dir/sources.list"
  local opts=(-o "Dir::Etc::sourcelist=$dir/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$dir/lists")
  "$@" "${opts[@]}"
}

# lavapipe from bookworm-backports (Mesa 25.0.7): the system's Mesa is upgraded, since
# the loader finds drivers only where the system keeps them.
mesa=$(dpkg-query -W -f '${Version}' mesa-vulkan-drivers 2>/dev/null || true)
case "$mesa" in
  2[5-9].*) ;;
  *)
    echo "installing: mesa-vulkan-drivers from bookworm-backports" >&2
    list=/etc/apt/sources.list.d/llamabox-backports.list
    [ -f "$list" ] || echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-backports main" | $sudo tee "$list" >/dev/null
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers >/dev/null
    ;;
esac

# Headers from trixie, unpacked (dpkg -x) into the prefix.
if [ ! -f "$root/usr/include/vulkan/vulkan.hpp" ] || [ ! -d "$root/usr/share/cmake/SPIRV-Headers" ]; then
  echo "fetching: libvulkan-dev and spirv-headers from trixie into $root" >&2
  apt_dir="$root/.apt"
  mkdir -p "$root/.debs"
  suite_apt "$apt_dir" trixie apt-get update -qq
  (cd "$root/.debs" && suite_apt "$apt_dir" trixie apt-get download -qq libvulkan-dev spirv-headers)
  for deb in "$root"/.debs/*.deb; do dpkg -x "$deb" "$root"; done
fi

# The prefix as FindVulkan reads VULKAN_SDK: include/ (the trixie headers), lib/ (the
# system's loader) and bin/glslc (the system's, behind a cache of compiled shaders).
mkdir -p "$root/bin" "$root/lib"
ln -sfn usr/include "$root/include"
ln -sf /usr/lib/x86_64-linux-gnu/libvulkan.so.1 "$root/lib/libvulkan.so"
ln -sf "$here/glslc-cache.sh" "$root/bin/glslc"
echo "$root"
