#!/usr/bin/env bash
# llama.cpp's own `llama-bench`, the reference the benchmark compares prompt and
# generation speed against. Built from the llama.cpp tree vendored in the PyPI sdist
# llama-cpp-python==0.3.36 (the crate llama-cpp-sys-2 ships llama.cpp without
# tools/llama-bench), with no OpenMP and static libraries, as our crate build, and:
#   CPU=native (default): GGML_NATIVE=ON (-march=native), the way llama.cpp's users
#     build it for their machine; on a CPU with AMX, with the compiler's __AMX_*__
#     macros undefined, so ggml leaves out its AMX kernels, which die of SIGILL there
#     as in our build (scripts/cpu-flags.sh; llama-server crashed in its first prompt);
#   CPU=avx2 / CPU=portable: GGML_NATIVE=OFF with the same GGML_* extensions as our
#     build of that choice (scripts/cpu-flags.sh).
#   LLAMA_BENCH_SAME_FLAGS=1 with CPU=native: GGML_NATIVE=OFF with our native build's
#     named extensions and C flags (-mtune=native) instead: our build's flags, so that
#     a difference from it is the code's.
# Cached in ~/.cache/llamabox: the sdist, its unpacked tree and each build are reused.
# TARGET=llama-server (bench/llama-server.sh) builds llama.cpp's HTTP server instead, into
# the same build folder with -DLLAMA_BUILD_SERVER=ON added (its embedded web UI left
# empty: no npm, no download), so ggml and libllama are compiled once for both.
# GPU=vulkan: with ggml's Vulkan backend too (-DGGML_VULKAN=ON), from the headers, glslc
# and shader cache scripts/install-vulkan.sh sets up (VULKAN_SDK), into a folder of its own:
# the peer of `make GPU=vulkan bench-gpu`, same tree and flags plus Vulkan.
# Prints the binary's path; exits non-zero (with a reason on stderr) if it can't be had.
set -euo pipefail

version=0.3.36
cache="${LLAMABOX_CACHE:-$HOME/.cache/llamabox}"
# Release (-O3), as llama.cpp's own builds. LLAMA_BENCH_BUILD_TYPE=RelWithDebInfo builds
# with -O2 -g instead, as llama-cpp-sys-2 builds llama.cpp under a cargo profile with
# debug info (into its own folder).
build_type="${LLAMA_BENCH_BUILD_TYPE:-Release}"
build="$cache/llama-bench-build"
[ "$build_type" = Release ] || build="$build-$build_type"
cpu="${CPU:-native}"
# CPU=native-march (our build with -march=native) is compared with llama.cpp as its users
# build it, as CPU=native is.
[ "$cpu" = native-march ] && cpu=native
[ "$cpu" = native ] && [ -n "${LLAMA_BENCH_SAME_FLAGS:-}" ] && cpu=native-flags
case "$cpu" in
  native)
    isa=(-DGGML_NATIVE=ON); build="$build-native"
    if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
      # -U cancels a built-in macro wherever it stands, so -march=native after it does
      # not bring the kernels back (ggml compiles them under __AMX_INT8__).
      no_amx="-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
      isa+=("-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx"); build="$build-no-amx"
    fi ;;
  native-flags)
    isa=(-DGGML_NATIVE=OFF); while read -r flag; do isa+=("-D$flag"); done < <("$(dirname "$0")/../scripts/cpu-flags.sh" native)
    cflags=$("$(dirname "$0")/../scripts/cpu-flags.sh" native --cflags)
    isa+=("-DCMAKE_C_FLAGS=$cflags" "-DCMAKE_CXX_FLAGS=$cflags"); build="$build-native-flags${cflags:+-mtune}" ;;
  avx2|portable) isa=(-DGGML_NATIVE=OFF); while read -r flag; do isa+=("-D$flag"); done < <("$(dirname "$0")/../scripts/cpu-flags.sh" "$cpu"); build="$build-$cpu" ;;
  *) echo "CPU must be native, avx2 or portable, not '$cpu'" >&2; exit 2 ;;
esac
gpu=()
case "${GPU:-}" in
  "") ;;
  vulkan)
    sdk=$(LLAMABOX_VULKAN_PREFIX="${VULKAN_SDK:-$cache/vulkan-sdk}" "$(dirname "$0")/../scripts/install-vulkan.sh")
    export VULKAN_SDK="$sdk"
    gpu=(-DGGML_VULKAN=ON "-DCMAKE_PREFIX_PATH=$sdk/usr"); build="$build-vulkan" ;;
  *) echo "GPU must be empty or vulkan, not '$GPU'" >&2; exit 2 ;;
esac
target="${TARGET:-llama-bench}"
case "$target" in
  llama-bench) server=(-DLLAMA_BUILD_SERVER=OFF) ;;
  llama-server) server=(-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF) ;;
  *) echo "TARGET must be llama-bench or llama-server, not '$target'" >&2; exit 2 ;;
esac
bin="$build/bin/$target"

if [ ! -x "$bin" ]; then
  sdist="$cache/sdist/llama_cpp_python-$version.tar.gz"
  if [ ! -s "$sdist" ]; then
    echo "fetching llama-cpp-python==$version (sdist) from PyPI into $cache/sdist" >&2
    python3 -m pip download --no-deps --no-binary llama-cpp-python --only-binary ninja,cmake --quiet -d "$cache/sdist" "llama-cpp-python==$version" >&2
  fi
  src="$cache/llama_cpp_python-$version"
  if [ ! -d "$src/vendor/llama.cpp/tools/$target" ] && [ ! -d "$src/vendor/llama.cpp/tools/${target#llama-}" ]; then
    tar -xzf "$sdist" -C "$cache"
  fi
  echo "building $target ($build_type, CPU=$cpu) into $build (a few minutes, once)" >&2
  cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE="$build_type" \
    -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
    -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=OFF "${isa[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
    "${server[@]}" "${gpu[@]}" -DLLAMA_BUILD_APP=OFF >&2
  cmake --build "$build" --target "$target" -j "$(nproc)" >&2
fi
if [ "$target" != llama-bench ]; then
  echo "$bin"
  exit 0
fi
# Beside it: llama-simple, llama.cpp's plain greedy loop (the bench checks that the host's
# generation loop gives its tokens), and llama-batched-bench, N sequences of one context
# (`make bench-batch`'s peer), in the same folder.
if [ ! -x "$build/bin/llama-simple" ] || [ ! -x "$build/bin/llama-batched-bench" ]; then
  cmake -S "$cache/llama_cpp_python-$version/vendor/llama.cpp" -B "$build" -DLLAMA_BUILD_EXAMPLES=ON >&2
  cmake --build "$build" --target llama-simple llama-batched-bench -j "$(nproc)" >&2
fi
echo "$bin"
