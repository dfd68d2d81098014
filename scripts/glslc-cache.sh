#!/usr/bin/env bash
# glslc behind a cache: ggml-vulkan compiles ~1,400 shader variants at build time, and
# ccache knows only C and C++. A variant's output is cached under the hash of glslc's
# version, its arguments (all but the output path) and the preprocessed source, so an
# edit to any included file, define or flag compiles afresh. Used as $VULKAN_SDK/bin/glslc
# (scripts/install-vulkan.sh); LLAMABOX_GLSLC_CACHE moves the cache.
set -euo pipefail
real=/usr/bin/glslc
cache="${LLAMABOX_GLSLC_CACHE:-$HOME/.cache/llamabox/glslc}"

out="" args=() prev=""
for a in "$@"; do
  # The input's path says nothing its preprocessed text does not (and differs between clones).
  if [ "$prev" = "-o" ]; then out="$a"; elif [ -f "$a" ]; then args+=("${a##*/}"); else args+=("$a"); fi
  prev="$a"
done
# Probes (`glslc --version`, feature tests without -o) and depfile runs pass straight on.
case " $* " in *" -M"*|*" -MD "*) exec "$real" "$@" ;; esac
if [ -z "$out" ] || [ "$out" = "-" ]; then exec "$real" "$@"; fi

# The preprocessed source (-E): includes expanded, defines applied.
drop_o=() skip=""
for a in "$@"; do
  if [ -n "$skip" ]; then skip=""; continue; fi
  if [ "$a" = "-o" ]; then skip=1; continue; fi
  drop_o+=("$a")
done
if ! pre=$("$real" -E "${drop_o[@]}" 2>/dev/null); then exec "$real" "$@"; fi
key=$( { "$real" --version; printf '%s\n' "${args[@]}"; printf '%s' "$pre"; } | sha256sum | cut -c1-40)
hit="$cache/${key:0:2}/$key"
if [ -f "$hit" ]; then
  cp "$hit" "$out"
  exit 0
fi
"$real" "$@"
mkdir -p "${hit%/*}"
cp "$out" "$hit.$$" && mv "$hit.$$" "$hit"
