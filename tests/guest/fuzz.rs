//! The fuzz plugin (guest/fuzz) under the host, in-process: random sequences of WIT
//! calls from each seed, biased to boundary values, with handles of other contexts,
//! media contexts and models, and drops in unusual orders. Every run must end with the
//! plugin's own summary (no trap), no native thread left, and the host still serving.
//!
//! `make test` runs a short seeded pass; `make fuzz` runs many seeds with more calls
//! (`LLAMABOX_FUZZ_SEEDS`, `LLAMABOX_FUZZ_CALLS`, `LLAMABOX_FUZZ_SEED` for the first)
//! and more hostile grammars (`LLAMABOX_FUZZ_GRAMMARS` per seed).

use std::time::Duration;

use llamabox::{Limits, ModelRegistry, PluginHost, RunOptions, RunOutcome};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

use crate::common;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The fuzz plugin, loaded on a host over `registry` whose contexts run one thread each.
fn fuzz_plugin(registry: ModelRegistry) -> (PluginHost, llamabox::Plugin) {
    let mut limits = Limits::default();
    (limits.context.max_threads, limits.context.default_threads) = (1, 1);
    let host = PluginHost::new(registry, limits).unwrap();
    let plugin = host.load(&common::guest_plugin("llamabox-fuzz.wasm")).unwrap();
    (host, plugin)
}

/// Run the fuzz plugin once; its output.
async fn fuzz_run(
    host: &PluginHost,
    plugin: &llamabox::Plugin,
    seed: u64,
    calls: u64,
) -> (RunOutcome, String) {
    fuzz_run_with(host, plugin, seed, &["--calls", &calls.to_string()]).await
}

async fn fuzz_run_with(
    host: &PluginHost,
    plugin: &llamabox::Plugin,
    seed: u64,
    args: &[&str],
) -> (RunOutcome, String) {
    let out = MemoryOutputPipe::new(1 << 20);
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(out.clone()).stderr(out.clone());
    let seed = seed.to_string();
    wasi.args(&[
        "fuzz",
        "--seed",
        &seed,
        "--models",
        "tiny,tiny-again",
        "--projectors",
        "eyes,ears",
    ]);
    wasi.args(args);
    // Generous: a run that hangs is a finding too, and fails here instead of hanging.
    let options = RunOptions::default().deadline(Duration::from_secs(120));
    let outcome = plugin
        .run_with(&options, wasi)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: the plugin trapped: {e:?}"));
    assert_eq!(host.live_workers(), 0, "seed {seed}: native threads outlived the run");
    (outcome, String::from_utf8_lossy(&out.contents()).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_wit_call_sequences_through_a_real_guest_never_crash_the_host() {
    let registry = ModelRegistry::new();
    // The same file under two names: two loaded models, so handles of "another
    // model" are real.
    registry.register("tiny", common::tiny_model()).register("tiny-again", common::tiny_model());
    registry
        .register_projector("eyes", common::tiny_vision())
        .register_projector("ears", common::tiny_audio());
    // Each seed's run leaves contexts for the next one: their calls meet parked
    // contexts with leftover tokens (reused, cut or removed by whatever comes first).
    registry.keep_idle_contexts(4);
    let (host, plugin) = fuzz_plugin(registry);
    let first = env("LLAMABOX_FUZZ_SEED", 1);
    let seeds = env("LLAMABOX_FUZZ_SEEDS", 6);
    let calls = env("LLAMABOX_FUZZ_CALLS", 150);
    let mut total_calls = 0;
    for seed in first..first + seeds {
        let (outcome, out) = fuzz_run(&host, &plugin, seed, calls).await;
        assert_eq!(outcome, RunOutcome::Success, "seed {seed}:\n{out}");
        let executed: u64 = common::field(&out, "fuzz-calls").parse().unwrap();
        println!("seed {seed}: {executed} calls: {}", common::field(&out, "fuzz-outcomes"));
        for line in out.lines().filter(|l| l.starts_with("fuzz-backend")) {
            println!("seed {seed}: {line}");
        }
        total_calls += executed;
    }
    println!("guest fuzz: {seeds} seeds from {first}, {total_calls} calls, 0 crashes, {} contexts left idle", host.models().idle_contexts());
    assert!(total_calls >= seeds * calls / 2, "most steps make a call");
}

/// Hostile grammars (guest/fuzz/src/grammars.rs: the attacks that stalled or crashed
/// llama.cpp's matcher, nesting hidden after CR, repetition floods, escapes, random
/// mutations) through `sampler.create`, `accept` and `generate.start`: every call
/// answers `ok` or a named error, and the slowest stays far below any deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_grammars_through_a_real_guest_are_bounded() {
    let registry = ModelRegistry::new();
    registry.register("tiny", common::tiny_model()).register("tiny-again", common::tiny_model());
    let (host, plugin) = fuzz_plugin(registry);
    let first = env("LLAMABOX_FUZZ_SEED", 1);
    let seeds = env("LLAMABOX_FUZZ_SEEDS", 2);
    let cases = env("LLAMABOX_FUZZ_GRAMMARS", 40).to_string();
    let mut slowest = 0;
    for seed in first..first + seeds {
        let (outcome, out) =
            fuzz_run_with(&host, &plugin, seed, &["--calls", "0", "--grammars", &cases]).await;
        assert_eq!(outcome, RunOutcome::Success, "seed {seed}:\n{out}");
        assert!(
            out.lines().all(|l| !l.starts_with("fuzz-backend")),
            "seed {seed}: a grammar reached a backend error:\n{out}"
        );
        let ms: u64 = common::field(&out, "fuzz-grammar-slowest-ms").parse().unwrap();
        println!(
            "seed {seed}: {cases} grammars, slowest call {ms} ms: {}",
            common::field(&out, "fuzz-outcomes")
        );
        slowest = slowest.max(ms);
    }
    // A bound, not a benchmark: the attacks this replays took 14 s to minutes per call.
    assert!(slowest < 5_000, "a grammar call took {slowest} ms");
}
