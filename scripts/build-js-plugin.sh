#!/usr/bin/env bash
# Build guest/js/plugin.js into a component (world `plugin-command`) at $1.
# componentize-js is pinned, with the preview2-shim it needs but does not declare
# (0.17.x; newer breaks the build), and installed from npm once into a cache outside
# the repository (scripts/npm-tool.sh); a failed install fails this script.
set -euo pipefail
out="${1:?usage: build-js-plugin.sh OUT.wasm}"
root="$(cd "$(dirname "$0")/.." && pwd)"
tool="$("$root/scripts/npm-tool.sh" @bytecodealliance/componentize-js 0.23.0 \
  @bytecodealliance/preview2-shim@0.17.2)"
mkdir -p "$(dirname "$out")"
out="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
cd "$root/guest/js"
# No wasi:http here: `-d http fetch-event` keeps the runtime from importing it.
"$tool/node_modules/.bin/componentize-js" plugin.js --wit "$root/wit" --world-name plugin-command \
  -d http fetch-event -o "$out"
