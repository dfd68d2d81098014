#!/usr/bin/env bash
# The ggml x86 extensions for a CPU choice, one `GGML_X=ON|OFF` line each; the Makefile
# exports them (llama-cpp-sys-2 passes GGML_* variables to llama.cpp's CMake) and
# scripts/ggml-config.sh checks the configured build against them.
#   native    every extension this machine's CPU has (from /proc/cpuinfo): AVX-512 and
#             its VBMI/VNNI/BF16 parts and AVX-VNNI where present, but never AMX (below),
#             and C flags (`--cflags`) that compile ggml with -march=native, as
#             GGML_NATIVE=ON does for llama.cpp's users: the extensions alone left
#             prompt processing of an f32 model ~3.5% behind (llama-bench built both
#             ways, 2 threads, Sapphire Rapids: 3426 vs 3552 t/s; -march=native also
#             tunes for the CPU and brings AVX512-FP16). llama-cpp-sys-2 sets
#             GGML_NATIVE=ON only under RUSTFLAGS=-C target-cpu=native, which would
#             rebuild all Rust code (and the wasm guests) too, so the flag goes to the C
#             compiler instead (cc's CFLAGS_<target>, which the cmake crate passes on).
#             The build runs here and on CPUs with the same extensions.
#   avx2      x86-64-v3: SSE4.2 AVX AVX2 BMI2 FMA F16C (Intel Haswell, AMD Excavator and
#             later). What .cargo/config.toml sets for a plain `cargo build`.
#   portable  baseline x86-64 (SSE2): runs on any x86-64 CPU.
# AMX is always OFF: ggml 0.26.0's AMX matmul (the extra buffer type for quantized
# weights) dies of SIGILL on an AMX Xeon here (`tilezero` on a tile its config never set
# up, in the first batched decode of a Q4_1 model; seen 2026-12-01, Sapphire Rapids VM,
# kernel 6.18). Upstream's open PR 26954 says why: the tile config on the stack is
# optimised away, and XTILEDATA permission is asked for one thread only. AVX512-VNNI
# does that work instead.
#   extensions  native's extensions, named one by one, without -march=native (the build
#             before -march=native): on the project's earlier AMD EPYC VM this one ran
#             prompt processing of the f32 model 22% faster than -march=native
#             (llama-bench built both ways, 1 thread), on the Sapphire Rapids VM 3.5%
#             slower. Measure both on your CPU (`make bench CPU=...`).
# Usage: scripts/cpu-flags.sh native|extensions|avx2|portable [--cflags]
#   --cflags: the C/C++ flags of the choice on one line instead (empty but for native).
set -euo pipefail
base="SSE42 AVX AVX2 BMI2 FMA F16C"
extra="AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AVX_VNNI"
never="AMX_TILE AMX_INT8 AMX_BF16"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2 || true)
has() { for f in "$@"; do [[ " $flags " == *" $f "* ]] || return 1; done; }
# The /proc/cpuinfo flags each ggml option compiles for (AVX512 is ggml's F+CD+VL+DQ+BW).
cpu_has() {
  case "$1" in
    SSE42) has sse4_2 ;; AVX) has avx ;; AVX2) has avx2 ;; BMI2) has bmi2 ;; FMA) has fma ;; F16C) has f16c ;;
    AVX512) has avx512f avx512cd avx512vl avx512dq avx512bw ;;
    AVX512_VBMI) has avx512f avx512vbmi ;; AVX512_VNNI) has avx512f avx512_vnni ;;
    AVX512_BF16) has avx512f avx512_bf16 ;; AVX_VNNI) has avx_vnni ;;
    *) return 1 ;;
  esac
}
if [ "${2:-}" = --cflags ]; then
  case "${1:-}" in
    # -U cancels a built-in macro wherever it stands, so -march=native does not bring
    # ggml's AMX kernels back (they compile under __AMX_INT8__).
    native) echo "-march=native$(has amx_tile && echo ' -U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__')" ;;
    extensions|avx2|portable) echo ;;
    *) echo "usage: $0 native|extensions|avx2|portable [--cflags]" >&2; exit 2 ;;
  esac
  exit 0
fi
case "${1:-}" in
  native|extensions) for x in $base $extra; do if cpu_has "$x"; then echo "GGML_$x=ON"; else echo "GGML_$x=OFF"; fi; done ;;
  avx2) for x in $base; do echo "GGML_$x=ON"; done; for x in $extra; do echo "GGML_$x=OFF"; done ;;
  portable) for x in $base $extra; do echo "GGML_$x=OFF"; done ;;
  *) echo "usage: $0 native|extensions|avx2|portable" >&2; exit 2 ;;
esac
for x in $never; do echo "GGML_$x=OFF"; done
