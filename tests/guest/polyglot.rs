//! Plugins in other languages, built from guest/ with their pinned toolchains
//! (installed from the package registries into a cache outside the clone when
//! missing) and run under the host: each does what the Rust demo does, and its greedy
//! output equals the Rust demo's for the same model and prompt.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use llamabox::{CompileCacheStats, HostOptions, Limits, ModelRegistry, PluginHost, RunOutcome};

use crate::common;

/// The prompt every language's plugin (and guest/compat-*) generates from.
pub(crate) const PROMPT: &str = "The llama in the box";

/// Build a plugin with `script` (which installs its toolchain if missing). A toolchain
/// that cannot be installed fails the test, loudly.
fn build(script: &str, name: &str, extra: &[&Path]) -> PathBuf {
    let out = common::repo_root().join("target/guest/polyglot").join(name);
    let status = Command::new(common::repo_root().join("scripts").join(script))
        .arg(&out)
        .args(extra)
        .status();
    match status {
        Ok(s) if s.success() => out,
        other => panic!("scripts/{script} failed ({other:?}): the {name} toolchain could not be installed or the plugin did not build"),
    }
}

fn python_plugin() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    CELL.get_or_init(|| build("build-python-plugin.sh", "python-plugin.wasm", &[]))
}

fn js_plugin() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    CELL.get_or_init(|| build("build-js-plugin.sh", "js-plugin.wasm", &[]))
}

/// The C plugin: Debian's clang and wasi-libc make a WASI preview 1 module (a reactor),
/// which wasmtime's preview 1 reactor adapter (from the crate wasmtime publishes it in,
/// the release the host runs) turns into a WASI 0.2 component.
fn c_plugin() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    CELL.get_or_init(|| {
        let adapter =
            common::repo_root().join("target/guest/polyglot/wasi_snapshot_preview1.reactor.wasm");
        std::fs::create_dir_all(adapter.parent().unwrap()).unwrap();
        std::fs::write(
            &adapter,
            wasi_preview1_component_adapter_provider::WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER,
        )
        .unwrap();
        build("build-c-plugin.sh", "c-plugin.wasm", &[&adapter])
    })
}

/// A host whose compile cache outlives the test run, so an unchanged plugin (18 MB for
/// Python) is compiled once per machine, not once per run.
fn cached_host(models: &[(&str, &Path)]) -> PluginHost {
    let registry = ModelRegistry::new();
    for (name, path) in models {
        registry.register(*name, *path);
    }
    let options =
        HostOptions::with_compile_cache(common::repo_root().join("target/compile-cache-polyglot"));
    PluginHost::with_options(registry, Limits::default(), options).unwrap()
}

/// Runs `plugin` twice on fresh hosts: the second load must come from the compile
/// cache. Prints both start-up times (not gating: the first is a compile only when
/// the plugin's bytes changed). Returns the second run's output.
async fn run_twice(plugin: &Path, models: &[(&str, &Path)], args: &[&str]) -> String {
    for round in ["first", "cached"] {
        let host = cached_host(models);
        let started = Instant::now();
        host.load(plugin).unwrap();
        eprintln!(
            "{} start-up ({round}): {:.2} s",
            plugin.display(),
            started.elapsed().as_secs_f64()
        );
        if round == "cached" {
            assert_eq!(
                host.compile_cache_stats(),
                Some(CompileCacheStats { hits: 1, misses: 0 }),
                "loaded, not compiled"
            );
            let (outcome, out) = common::run_on(&host, plugin, args).await;
            assert_eq!(outcome, RunOutcome::Success, "{out}");
            return out;
        }
    }
    unreachable!()
}

/// The Rust demo's output for the same model and prompt, greedy on the host and in wasm.
pub(crate) async fn rust_demo(model: &Path, generate: &str) -> String {
    let (outcome, out) = common::run_demo(
        &[("slow", model)],
        &["--model", "slow", "--prompt", PROMPT, "--generate", generate, "--host-generate"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    out
}

/// Asserts that `out` prints the same `key` as `reference` (the Rust demo's output).
pub(crate) fn assert_same_field(out: &str, reference: &str, key: &str, why: &str) {
    assert_eq!(common::field(out, key), common::field(reference, key), "{why}");
}

/// What every language's plugin prints, checked the same way. Returns its output.
async fn check_like_the_rust_demo(plugin: &Path) -> String {
    let model = common::slow_model();
    let args = [
        "--model",
        "slow",
        "--prompt",
        PROMPT,
        "--generate",
        "8",
        "--long-tokens",
        "512",
        "--cancel-after-ms",
        "0",
    ];
    let out = run_twice(plugin, &[("slow", model)], &args).await;
    let rust = rust_demo(model, "8").await;
    assert_same_field(
        &out,
        &rust,
        "host-generated-ids",
        "greedy output differs from the Rust demo's",
    );
    // Cancelled at once from the plugin's event loop (a 0 ms timer against a 512-token
    // decode, as in guest::plugin): `cancelled`, and memory untouched.
    assert_eq!(common::field(&out, "long-decode"), "cancelled");
    assert_eq!(common::field(&out, "memory-after"), "seq-pos-max=-1");
    assert_eq!(common::field(&out, "bad-model"), "model-not-found: no-such-model");
    assert!(
        common::field(&out, "bad-batch").starts_with("invalid-argument: batch columns differ"),
        "{out}"
    );
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_plugin_does_what_the_rust_demo_does() {
    check_like_the_rust_demo(python_plugin()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn javascript_plugin_does_what_the_rust_demo_does() {
    check_like_the_rust_demo(js_plugin()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_plugin_does_what_the_rust_demo_does() {
    let out = check_like_the_rust_demo(c_plugin()).await;
    // Its own greedy loop in wasm too (decode, last-logits, argmax): the Rust demo's.
    let rust = rust_demo(common::slow_model(), "8").await;
    assert_same_field(
        &out,
        &rust,
        "generated-ids",
        "the C argmax loop differs from the Rust demo's",
    );
    assert_eq!(
        common::field(&out, "prompt-tokens").split(',').count().to_string(),
        common::field(&rust, "prompt-tokens")
    );
    // A batch over the context's n-batch: named, and nothing kept.
    assert!(
        common::field(&out, "too-long")
            .starts_with("invalid-argument: batch of 513 tokens is larger than n-batch 512"),
        "{out}"
    );
    assert_eq!(common::field(&out, "memory-after-too-long"), "seq-pos-max=-1");
}

/// Every code block under a `<!-- snippet: PATH -->` line in docs/plugins/ must
/// appear verbatim in PATH, a guest the suite builds and runs; every guide has some.
#[test]
fn the_plugin_guides_quote_the_tested_guests() {
    let root = common::repo_root();
    for guide in ["rust.md", "python.md", "javascript.md", "c.md"] {
        let text = std::fs::read_to_string(root.join("docs/plugins").join(guide)).unwrap();
        let mut quoted = 0;
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            let Some(path) =
                line.strip_prefix("<!-- snippet: ").and_then(|l| l.strip_suffix(" -->"))
            else {
                continue;
            };
            let fence = lines.next().unwrap_or_default();
            assert!(
                fence.starts_with("```"),
                "{guide}: a snippet marker must be followed by a code block"
            );
            let block: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
            let source = std::fs::read_to_string(root.join(path))
                .unwrap_or_else(|e| panic!("{guide}: {path}: {e}"));
            let block = block.join("\n");
            assert!(
                source.contains(&block),
                "{guide}: this block is no longer in {path}:\n{block}"
            );
            quoted += 1;
        }
        assert!(quoted >= 3, "{guide} quotes only {quoted} blocks from tested guests");
    }
}

/// `wasm-tools component wit` (the Bytecode Alliance's tool, pinned, from PyPI) shows each
/// built plugin's interface: llamabox's imports, with their doc comments' items, and the
/// command export, in every language.
#[test]
fn wasm_tools_shows_each_plugins_interface() {
    let wasm_tools = common::script_path("wasm-tools.sh", &[]);
    for plugin in [common::demo_plugin(), python_plugin(), js_plugin(), c_plugin()] {
        let out = Command::new(&wasm_tools)
            .args(["component", "wit"])
            .arg(plugin)
            .output()
            .expect("running wasm-tools");
        let wit = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}: {}",
            plugin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        for expected in [
            &format!("import llamabox:inference/llm@{};", llamabox::WIT_VERSION),
            &format!("import llamabox:inference/generate@{};", llamabox::WIT_VERSION),
            "export wasi:cli/run@0.2",
            "resource cancel-token",
            "resource generation",
        ] {
            assert!(
                wit.contains(expected),
                "{} does not show {expected:?}:\n{wit}",
                plugin.display()
            );
        }
    }
}
