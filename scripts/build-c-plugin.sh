#!/usr/bin/env bash
# Build guest/c/plugin.c into a WASI 0.2 component at $1 (world `plugin-command`):
#   wit-bindgen c  (wit-bindgen-cli, pinned to the Rust guests' wit-bindgen, installed from
#                   crates.io once into $LLAMABOX_CACHE/toolchains) writes the bindings;
#   clang          (Debian's, --target=wasm32-wasi, with Debian's wasi-libc) compiles and
#                   links a WASI preview 1 core module, a reactor: the world's
#                   `wasi:cli/run` export is the plugin's own function (a command
#                   module would run libc's destructors around every export it has,
#                   cabi_realloc's included, and flush stdout in the middle of a call);
#   wasm-tools component new --adapt  (scripts/wasm-tools.sh) wraps it with wasmtime's
#                   preview1 reactor adapter ($2: wasi_snapshot_preview1.reactor.wasm)
#                   into a component.
# A missing toolchain is installed; one that cannot be fails this script.
set -euo pipefail
out="${1:?usage: build-c-plugin.sh OUT.wasm ADAPTER.wasm}"
adapter="${2:?usage: build-c-plugin.sh OUT.wasm ADAPTER.wasm}"
version=0.60.0
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${LLAMABOX_CACHE:-$HOME/.cache/llamabox}/toolchains"
bindgen="$cache/wit-bindgen-cli-$version/bin/wit-bindgen"
if [ ! -x "$bindgen" ]; then
  echo "installing wit-bindgen-cli $version from crates.io into $cache" >&2
  cargo install --quiet --locked wit-bindgen-cli --version "$version" --root "$cache/wit-bindgen-cli-$version.partial" >&2
  rm -rf "$cache/wit-bindgen-cli-$version"
  mv "$cache/wit-bindgen-cli-$version.partial" "$cache/wit-bindgen-cli-$version"
fi
[ -e /usr/lib/wasm32-wasi/libc.a ] || { echo "build-c-plugin.sh: Debian's wasi-libc is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
wasm_tools="$("$root/scripts/wasm-tools.sh")"
mkdir -p "$(dirname "$out")"
gen="$(dirname "$out")/c-bindings"
rm -rf "$gen" && mkdir -p "$gen"
# The build lines a plugin author uses, with this repository's paths.
"$bindgen" c "$root/wit" --world plugin-command --out-dir "$gen" 2>/dev/null
clang --target=wasm32-wasi -mexec-model=reactor -O2 -Wall -Wextra -Werror -I "$gen" \
  "$root/guest/c/plugin.c" "$gen/plugin_command.c" "$gen/plugin_command_component_type.o" -o "$gen/plugin.core.wasm"
"$wasm_tools" component new "$gen/plugin.core.wasm" --adapt "wasi_snapshot_preview1=$adapter" -o "$out"
