#!/usr/bin/env bash
# The ggml x86 extensions for a CPU choice, one `GGML_X=ON|OFF` line each; the Makefile
# exports them (llama-cpp-sys-2 passes GGML_* variables to llama.cpp's CMake) and
# scripts/ggml-config.sh checks the configured build against them.
#   native    every extension this machine's CPU has (from /proc/cpuinfo): AVX-512 and
#             its VBMI/VNNI/BF16 parts and AVX-VNNI where present, but never AMX (below),
#             named one by one, with code scheduled for this CPU (-mtune=native, from
#             `--cflags`: tuning picks no instructions, so the build still runs on any
#             CPU with the same extensions). On a Sapphire Rapids VM (2026-12-01,
#             llama-bench built three ways, 4 rotating rounds) named + -mtune=native
#             against -march=native: f32 pp512 +4.9% (1 thread), +0.0% (2 threads),
#             SmolLM2 Q4_1 pp512 +1.0%, +1.0%, tg128 f32 +9.0%, +3.3%, SmolLM2 +5.3%,
#             +13.7%; named without -mtune: pp512 f32 -2.0%, -2.9%; named +
#             -mavx512fp16 (the half-precision kernels -march=native adds here): f32
#             pp512 -3.0%, SmolLM2 -2.2%. So the tuning, not the instructions, was what
#             -march=native had over the named build.
#   native-march  the same, and ggml compiled with -march=native (C flags from
#             `--cflags`), as GGML_NATIVE=ON builds llama.cpp for its users. llama-cpp-sys-2
#             sets GGML_NATIVE=ON only under RUSTFLAGS=-C target-cpu=native, which would
#             rebuild all Rust code (and the wasm guests) too, so the flag goes to the C
#             compiler instead (cc's CFLAGS_<target>, which the cmake crate passes on).
#             Not the default: on the same VM, against the named extensions without
#             -mtune, it ran f32 prompt processing 3.5% faster (2 threads: 3552 vs 3426
#             t/s) but `llamabox serve` with two 1-thread contexts 8-17% slower (SmolLM2
#             Q4_1, tokens/s at concurrency 1/4/8: 44.2/88.7/91.3 vs 48.0/97.4/109.8); on
#             the earlier AMD EPYC VM the named extensions ran f32 prompt processing 22%
#             faster. Measure both on your CPU.
#   avx2      x86-64-v3: SSE4.2 AVX AVX2 BMI2 FMA F16C (Intel Haswell, AMD Excavator and
#             later). What .cargo/config.toml sets for a plain `cargo build`.
#   portable  baseline x86-64 (SSE2): runs on any x86-64 CPU.
# AMX is always OFF: ggml 0.26.0's AMX matmul (the extra buffer type for quantized
# weights) dies of SIGILL on an AMX Xeon here (`tilezero` on a tile its config never set
# up, in the first batched decode of a Q4_1 model; seen 2026-12-01, Sapphire Rapids VM,
# kernel 6.18). Upstream's open PR 26954 says why: the tile config on the stack is
# optimised away, and XTILEDATA permission is asked for one thread only. AVX512-VNNI
# does that work instead.
# Usage: scripts/cpu-flags.sh native|native-march|avx2|portable [--cflags]
#   --cflags: the C/C++ flags of the choice on one line instead (empty for avx2 and
#   portable, which run on other CPUs and keep the compiler's generic tuning).
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
    native-march) echo "-march=native$(has amx_tile && echo ' -U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__')" ;;
    native) echo "-mtune=native" ;;
    avx2|portable) echo ;;
    *) echo "usage: $0 native|native-march|avx2|portable [--cflags]" >&2; exit 2 ;;
  esac
  exit 0
fi
case "${1:-}" in
  native|native-march) for x in $base $extra; do if cpu_has "$x"; then echo "GGML_$x=ON"; else echo "GGML_$x=OFF"; fi; done ;;
  avx2) for x in $base; do echo "GGML_$x=ON"; done; for x in $extra; do echo "GGML_$x=OFF"; done ;;
  portable) for x in $base $extra; do echo "GGML_$x=OFF"; done ;;
  *) echo "usage: $0 native|native-march|avx2|portable" >&2; exit 2 ;;
esac
for x in $never; do echo "GGML_$x=OFF"; done
