#!/usr/bin/env bash
# The GPU check on a machine with a real GPU and NVIDIA's (or any) Vulkan driver, but no
# Rust toolchain, no Vulkan loader and no network: build here, carry a bundle, run there.
#
#   scripts/device-check.sh bundle [DIR]   # here: build and pack DIR (default
#                                          # target/device-bundle) as DIR.tar.xz
#   scripts/device-check.sh run [BUNDLE] [OUT]  # there: unpack, run the GPU rows
#                                          # (bench/src/gpu.rs) in under 8 minutes,
#                                          # write OUT/GPU.md (default $OUT or .)
#
# The bundle: `llamabox` and `llamabox-bench` built with `--features vulkan`, llama.cpp's
# `llama-bench` built for Vulkan from the same tree with the same flags
# (bench/llama-bench.sh GPU=vulkan), all stripped, and the Vulkan loader with the GL
# dispatch libraries NVIDIA's ICD needs (Debian's .debs from apt, unpacked). First run on
# an H200: bench/GPU.md. No model travels: the bench writes its generated models
# there (SmolLM2 Q4_1, 94 MiB, is over what a device run may carry).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"

bundle() {
  local dir="${1:-$here/target/device-bundle}"
  rm -rf "$dir" && mkdir -p "$dir/bin" "$dir/loader"
  (cd "$here" && make -s GPU=vulkan build build-bench >&2)
  local llama_bench
  llama_bench=$(cd "$here" && GPU=vulkan CPU=native LLAMA_BENCH_SAME_FLAGS=1 bench/llama-bench.sh)
  for bin in "$here/target/release/llamabox" "$here/target/release/llamabox-bench" "$llama_bench"; do
    strip -o "$dir/bin/$(basename "$bin")" "$bin"
  done
  # The Vulkan loader, and the GL dispatch libraries NVIDIA's ICD (libGLX_nvidia) links
  # against: a CUDA image has the driver but not these (without them the loader finds
  # no device). Unpacked into the bundle, found through LD_LIBRARY_PATH, never into /.
  (cd "$dir/loader" && apt-get download -qq libvulkan1 libglvnd0 libglx0 libgl1 libegl1 2>/dev/null \
    && for deb in ./*.deb; do dpkg -x "$deb" .; done && rm -f ./*.deb)
  cp "$0" "$dir/device-check.sh"
  tar -C "$(dirname "$dir")" -cJf "$dir.tar.xz" "$(basename "$dir")"
  du -h "$dir.tar.xz" >&2
  echo "$dir.tar.xz"
}

run() {
  local bundle="${1:-$here/target/device-bundle.tar.xz}" out="${2:-${OUT:-.}}"
  local work
  work=$(mktemp -d)
  tar -C "$work" -xJf "$bundle"
  local dir="$work/$(basename "${bundle%.tar.xz}")"
  export LD_LIBRARY_PATH="$dir/loader/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # NVIDIA's ICD where the container runtime put it (the H200 machine has it there, and
  # a copy under /usr/share that the loader did not use), and only the GPU: lavapipe,
  # if present, is no GPU figure.
  local icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ]; then
    export VK_DRIVER_FILES="$icd"
  fi
  export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES-0}"
  mkdir -p "$out"
  "$dir/bin/llamabox" info | tee "$out/info.txt"
  grep -q "^device Vulkan" "$out/info.txt" || { echo "no Vulkan device found (see info.txt)" >&2; exit 1; }
  local threads
  threads=$(nproc)
  # 512/128 tokens as llama-bench's defaults; 5 rounds and 20 cancels fit in 8 minutes
  # on a GPU (RUNS, CANCELS, PROMPT_TOKENS, GEN_TOKENS shrink them for lavapipe).
  timeout "${TIMEOUT_S:-450}" "$dir/bin/llamabox-bench" --gpu-report "$out/GPU.md" --llama-bench "$dir/bin/llama-bench" \
    --threads "$threads" --runs "${RUNS:-5}" --cancels "${CANCELS:-20}" --prompt-tokens "${PROMPT_TOKENS:-512}" \
    --gen-tokens "${GEN_TOKENS:-128}" --model-dir "$work/models" \
    > "$out/bench.log" 2>&1 || { tail -20 "$out/bench.log" >&2; exit 1; }
  cat "$out/GPU.md"
}

case "${1:-}" in
  bundle) shift; bundle "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 bundle [DIR] | run [BUNDLE] [OUT]" >&2; exit 2 ;;
esac
