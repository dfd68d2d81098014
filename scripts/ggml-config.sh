#!/usr/bin/env bash
# Keeps the linked ggml built for the Makefile's CPU choice. llama-cpp-sys-2 configures
# llama.cpp's CMake build once per build folder and skips configuring after that (it
# turns the cmake crate's always_configure off), so a changed choice (`make CPU=portable`,
# then back) would rerun its build script and still link the old ggml. When the
# configured build differs from the choice, clean that one package: the next build
# configures afresh, and ccache keeps every build's objects (about a minute here).
# The choice's C flags (CFLAGS_x86_64_unknown_linux_gnu, which the Makefile exports from
# `scripts/cpu-flags.sh CPU --cflags`) are checked the same way against CMAKE_C_FLAGS.
# Usage: scripts/ggml-config.sh GGML_X=ON|OFF ...   (scripts/cpu-flags.sh prints them)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 GGML_X=ON|OFF ..." >&2; exit 2; }
cflags="${CFLAGS_x86_64_unknown_linux_gnu:-}"
rebuild() {
  echo "ggml was configured with $1, the CPU choice wants $2: llama.cpp will be rebuilt" >&2
  cargo clean --release --quiet -p llama-cpp-sys-2
  exit 0
}
for cache in target/release/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt; do
  [ -e "$cache" ] || continue
  have=$(grep -m1 "^CMAKE_C_FLAGS:STRING=" "$cache" | cut -d= -f2- || true)
  # cc appends CFLAGS_<target> after its own flags: the choice's come last.
  if [ -n "$cflags" ] && [[ "$have" != *" $cflags" ]]; then rebuild "C flags '$have'" "'$cflags' last"; fi
  if [ -z "$cflags" ] && [[ "$have" == *-m*=native* ]]; then rebuild "C flags '$have'" "none for this machine"; fi
  for flag in "$@"; do
    # An option never set in the cache is OFF in ggml's CMake.
    have=$(grep -m1 "^${flag%%=*}:BOOL=" "$cache" | cut -d= -f2 || true)
    [ "${have:-OFF}" = "${flag#*=}" ] || rebuild "${flag%%=*}=${have:-OFF}" "$flag"
  done
done
