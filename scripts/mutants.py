#!/usr/bin/env python3
"""Hand-picked mutants of the cancel code (native cancel, chunker, eval-callback scope,
worker): each is applied to the tree, the native tests are run, and the mutant must be
killed (a test fails or hangs). Prints killed / total. Restores every file.

Why by hand and not cargo-mutants: each mutant here is a way the cancel contract can
silently break (from the design's list), and running them against the existing target
directory takes about a minute each instead of a cold build of wasmtime and llama.cpp.
"""
import os, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The library's unit tests, then the decode and media modules of the native test binary
# (name filters apply to every binary of a run, hence two runs).
CARGO_TEST = ["cargo", "test", "--release", "-p", "llamabox"]
TESTS = [CARGO_TEST + ["-p", "llamabox-native", "--lib", "--", "--test-threads=1"],
         CARGO_TEST + ["--test", "native", "--", "--test-threads=1", "decode::", "media_encode::"]]

MUTANTS = [
    ("abort callback always false", "native/src/cancel.rs",
     "Some(stop) => stop.requested(),", "Some(_stop) => false,"),
    ("call flag ignored by Stop", "native/src/cancel.rs",
     "self.token.poll() || self.call.is_some_and(CancelFlag::poll)", "self.token.poll()"),
    ("trip wire never trips", "native/src/cancel.rs",
     "if trip_at != 0 && state.polls.fetch_add(1, Relaxed) + 1 >= trip_at {", "if false {"),
    ("no entry check in decode", "native/src/context.rs",
     "        if stop.is_some_and(|s| s.is_set()) {\n            return Err(Error::Cancelled);\n        }\n        self.check_batch(batch)?;",
     "        self.check_batch(batch)?;"),
    ("memory not restored after a failed decode", "native/src/context.rs",
     "unsafe { sys::llama_memory_seq_rm(self.memory(), seq, end + 1, -1) };", "let _ = (seq, end);"),
    ("idle eval callback asks", "native/src/media.rs",
     "return !ask; // outside a scope", "return true; // outside a scope"),
    ("no entry check in encode", "native/src/media.rs",
     "        if stop.is_some_and(|s| s.is_set()) {\n            return Err(Error::Cancelled);\n        }\n        let ret = match stop {",
     "        let ret = match stop {"),
    ("no thread-local scope", "native/src/media.rs",
     "let ptr = (&*state as *const ScopeState<'a>).cast::<ScopeState<'static>>();",
     "let ptr = std::ptr::null::<ScopeState<'static>>(); let _ = &state;"),
    ("status ignores observed cancel", "native/src/media.rs",
     "                if scope.stopped() {\n                    return Err(Error::Cancelled);\n                }\n",
     ""),
    ("boundary after MUL_MAT", "native/src/chunker.rs",
     "matches!(op, sys::GGML_OP_FLASH_ATTN_EXT | sys::GGML_OP_SOFT_MAX)",
     "matches!(op, sys::GGML_OP_FLASH_ATTN_EXT | sys::GGML_OP_SOFT_MAX | sys::GGML_OP_MUL_MAT)"),
    ("cancel waits for a boundary", "native/src/chunker.rs",
     "node.boundary_allowed && (cancelled || self.spent >= self.budget)",
     "node.boundary_allowed && self.spent >= self.budget"),
    ("budget never reset", "native/src/chunker.rs",
     "        self.spent = 0;\n        !cancelled", "        !cancelled"),
    ("worker drop does not stop the running call", "host/src/worker.rs",
     "            if let Some(call) = &running.call {\n                call.cancel();\n            }\n", ""),
    ("dropped call not abandoned", "host/src/worker.rs",
     "        if !self.done {\n            self.abandoned.cancel();\n        }", "        let _ = self.done;"),
]

def main():
    env = dict(os.environ, CMAKE_C_COMPILER_LAUNCHER="ccache", CMAKE_CXX_COMPILER_LAUNCHER="ccache")
    only = sys.argv[1:]  # optional substrings of mutant names to run
    chosen = [m for m in MUTANTS if not only or any(o in m[0] for o in only)]
    killed = 0
    for name, path, old, new in chosen:
        full = os.path.join(ROOT, path)
        original = open(full).read()
        if original.count(old) != 1:
            print(f"SKIPPED (pattern not found once): {name}")
            continue
        open(full, "w").write(original.replace(old, new))
        try:
            outcome = "SURVIVED"
            for tests in TESTS:
                run = subprocess.run(tests, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
                build_failed = "error[" in run.stderr and "test result" not in run.stdout
                if build_failed or run.returncode != 0:
                    outcome = "build failed" if build_failed else "killed"
                    break
        except subprocess.TimeoutExpired:
            outcome = "killed (hung)"
        finally:
            open(full, "w").write(original)
        killed += outcome.startswith("killed")
        print(f"{outcome}: {name}", flush=True)
    print(f"mutants: {killed} killed of {len(chosen)}")
    return 0 if killed == len(chosen) else 1

if __name__ == "__main__":
    sys.exit(main())
