#!/usr/bin/env bash
# Keeps the linked ggml built for the Makefile's CPU choice. llama-cpp-sys-2 configures
# llama.cpp's CMake build once per build folder and skips configuring after that (it
# turns the cmake crate's always_configure off), so a changed choice (`make CPU=portable`,
# then back) would rerun its build script and still link the old ggml. When the
# configured build differs from the choice, clean that one package: the next build
# configures afresh, and ccache keeps both builds' objects (about a minute here).
# Usage: scripts/ggml-config.sh native|portable
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  native) want=ON ;;
  portable) want=OFF ;;
  *) echo "usage: $0 native|portable" >&2; exit 2 ;;
esac
# The extensions the Makefile and .cargo/config.toml set, all on or all off.
isa="SSE42 AVX AVX2 BMI2 FMA F16C"
for cache in target/release/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt; do
  [ -e "$cache" ] || continue
  for ext in $isa; do
    if ! grep -qx "GGML_$ext:BOOL=$want" "$cache"; then
      echo "ggml was configured for another CPU choice: llama.cpp will be rebuilt for CPU=$1" >&2
      cargo clean --release --quiet -p llama-cpp-sys-2
      exit 0
    fi
  done
done
