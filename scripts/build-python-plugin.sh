#!/usr/bin/env bash
# Build guest/python/plugin.py into a component (world `plugin-command`) at $1.
# componentize-py is pinned and installed from PyPI once, into a cache outside the
# repository ($LLAMABOX_CACHE/toolchains); a failed install fails this script.
set -euo pipefail
out="${1:?usage: build-python-plugin.sh OUT.wasm}"
version=0.25.1
root="$(cd "$(dirname "$0")/.." && pwd)"
tool="$("$root/scripts/pip-tool.sh" componentize-py "$version")"
mkdir -p "$(dirname "$out")"
out="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
cd "$root/guest/python"
# The build line a plugin author uses is `componentize-py -d wit -w plugin-command
# componentize plugin -o plugin.wasm`; the cached install has no launcher on PATH.
PYTHONPATH="$tool" python3 -c 'import sys; from componentize_py import script; sys.argv[0] = "componentize-py"; sys.exit(script())' \
  -d "$root/wit" -w plugin-command componentize plugin -o "$out"
