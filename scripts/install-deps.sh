#!/usr/bin/env bash
# Install what building llamabox needs, skipping what is already there:
# cmake and a C/C++ toolchain for llama.cpp, libclang for bindgen, ccache for the C++
# objects, Rust's wasm32-wasip2 target for the guest plugins, and python3 with pip for
# the Python plugin's toolchain, node and npm for the JavaScript plugin's (the
# scripts/build-*-plugin.sh install those toolchains from PyPI and npm), curl and wrk
# for the server's tests, headless Chromium for the chat page's, lld and wasi-libc for
# the C plugin's, and docker-registry with skopeo and openssl for the
# plugins-from-a-registry tests.
set -euo pipefail

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v clang >/dev/null || need+=(clang)
command -v ccache >/dev/null || need+=(ccache)
command -v g++ >/dev/null || need+=(g++)
command -v python3 >/dev/null || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
# `llamabox serve`'s tests: curl and wrk are the real clients (tests/serve.rs).
command -v curl >/dev/null || need+=(curl)
command -v wrk >/dev/null || need+=(wrk)
# The chat page's test drives a real browser: Debian's headless Chromium.
command -v chromium-headless-shell >/dev/null || need+=(chromium-headless-shell)
# Plugins pulled from an OCI registry (tests/cli/oci.rs): Debian's distribution registry,
# run on loopback by the test, and skopeo, the real client that pushes to it.
command -v docker-registry >/dev/null || need+=(docker-registry)
command -v skopeo >/dev/null || need+=(skopeo)
# The signing keys and cosign signatures those tests make (Debian packages no cosign,
# and builds skopeo with sigstore signing disabled): OpenSSL's ECDSA P-256.
command -v openssl >/dev/null || need+=(openssl)
# The C plugin (scripts/build-c-plugin.sh): Debian's clang for wasm32-wasi, its linker,
# compiler runtime and libc.
ls /usr/lib/llvm-*/bin/wasm-ld >/dev/null 2>&1 || need+=(lld)
ls /usr/lib/llvm-*/lib/clang/*/lib/wasi/libclang_rt.builtins-wasm32.a >/dev/null 2>&1 || need+=(libclang-rt-dev-wasm32)
[ -e /usr/lib/wasm32-wasi/libc.a ] || need+=(wasi-libc)
ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 || ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2
