#!/usr/bin/env bash
# Installs PyPI package NAME==VERSION into the toolchain cache outside the repository
# ($LLAMABOX_CACHE/toolchains/NAME-VERSION) when it is not there yet, and prints that
# folder. A failed install fails this script (and leaves no half-installed folder).
# Usage: scripts/pip-tool.sh NAME VERSION
set -euo pipefail
name="${1:?usage: pip-tool.sh NAME VERSION}"
version="${2:?usage: pip-tool.sh NAME VERSION}"
cache="${LLAMABOX_CACHE:-$HOME/.cache/llamabox}/toolchains"
tool="$cache/$name-$version"
if [ ! -e "$tool/.installed" ]; then
  echo "installing $name==$version from PyPI into $tool" >&2
  mkdir -p "$cache"
  rm -rf "$tool.partial" "$tool"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$tool.partial" "$name==$version" >&2
  touch "$tool.partial/.installed"
  mv "$tool.partial" "$tool"
fi
echo "$tool"
