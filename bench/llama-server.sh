#!/usr/bin/env bash
# llama.cpp's own HTTP server, `llama-server`, the reference `make bench-server`
# (bench/server_bench.py) compares `llamabox serve` against. Built by bench/llama-bench.sh
# with TARGET=llama-server: the same vendored llama.cpp tree (PyPI sdist
# llama-cpp-python==0.3.36), the same CPU choices (CPU=native: GGML_NATIVE=ON), no OpenMP,
# static libraries, ccache, LLAMA_CURL and LLAMA_OPENSSL off, into the same cached build
# folder as llama-bench. Prints the binary's path.
exec env TARGET=llama-server "$(dirname "$0")/llama-bench.sh" "$@"
