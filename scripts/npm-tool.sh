#!/usr/bin/env bash
# Installs npm package NAME@VERSION into the toolchain cache outside the repository
# ($LLAMABOX_CACHE/toolchains/NAME-VERSION, a scope's `@owner/` written `owner+`) when it
# is not there yet, and prints that folder: its commands are in node_modules/.bin.
# Install scripts do not run (--ignore-scripts); the platform's optional packages (a
# CLI's native binary) are installed as npm picks them. A failed install fails this
# script (and leaves no half-installed folder). Any PACKAGE@VERSION after them is
# installed beside it: a peer the tool needs but does not declare.
# Usage: scripts/npm-tool.sh NAME VERSION [PACKAGE@VERSION ...]   (e.g. @openai/codex 0.171.0)
set -euo pipefail
name="${1:?usage: npm-tool.sh NAME VERSION [PACKAGE@VERSION ...]}"
version="${2:?usage: npm-tool.sh NAME VERSION [PACKAGE@VERSION ...]}"
shift 2
cache="${LLAMABOX_CACHE:-$HOME/.cache/llamabox}/toolchains"
folder="${name#@}"
tool="$cache/${folder//\//+}-$version"
if [ ! -e "$tool/.installed" ]; then
  command -v npm >/dev/null || { echo "npm is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
  echo "installing $name@$version from npm into $tool" >&2
  mkdir -p "$cache"
  rm -rf "$tool.partial" "$tool"
  mkdir "$tool.partial"
  # A package.json of its own, so that npm installs here and not into a parent project.
  echo '{"name": "llamabox-toolchain", "private": true}' >"$tool.partial/package.json"
  npm install --ignore-scripts --no-audit --no-fund --loglevel=error \
    --prefix "$tool.partial" "$name@$version" "$@" >&2
  touch "$tool.partial/.installed"
  mv "$tool.partial" "$tool"
fi
echo "$tool"
