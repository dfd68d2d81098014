#!/usr/bin/env bash
# Build guest/js/plugin.js into a component (world `plugin-command`) at $1.
# componentize-js is pinned, with the preview2-shim it needs but does not declare
# (0.17.x; newer breaks the build), and installed from npm once into a cache outside
# the repository ($LLAMABOX_CACHE/toolchains); a failed install fails this script.
set -euo pipefail
out="${1:?usage: build-js-plugin.sh OUT.wasm}"
version=0.23.0
shim=0.17.2
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${LLAMABOX_CACHE:-$HOME/.cache/llamabox}/toolchains"
tool="$cache/componentize-js-$version"
if [ ! -x "$tool/node_modules/.bin/componentize-js" ]; then
  command -v npm >/dev/null || { echo "npm is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
  echo "installing @bytecodealliance/componentize-js@$version from npm into $tool" >&2
  rm -rf "$tool.partial"
  mkdir -p "$tool.partial"
  echo '{"name": "llamabox-js-toolchain", "private": true}' >"$tool.partial/package.json"
  (cd "$tool.partial" && npm install --no-audit --no-fund --loglevel=error \
    "@bytecodealliance/componentize-js@$version" "@bytecodealliance/preview2-shim@$shim" >&2)
  mv "$tool.partial" "$tool"
fi
mkdir -p "$(dirname "$out")"
out="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
cd "$root/guest/js"
# No wasi:http here: `-d http fetch-event` keeps the runtime from importing it.
"$tool/node_modules/.bin/componentize-js" plugin.js --wit "$root/wit" --world-name plugin-command \
  -d http fetch-event -o "$out"
