//! The demo plugin run under the host: generation, a decode cancelled from the guest's
//! own event loop, the same logits as the native path, and bad inputs refused.

use llamabox::RunOutcome;

use crate::common;

const PROMPT: &str = "The llama in the box";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_generates_then_cancels_a_long_decode_in_flight() {
    let out =
        common::demo_generates_on_native_logits("slow", common::slow_model(), PROMPT, 512, "0")
            .await;
    // The guest's event loop cancels at once (a 0 ms timer), so the decode is queued or
    // running, never finished, however fast this machine is. Where in the graph a
    // cancel lands is pinned down by the trip-wire tests (native::decode).
    let long = common::field(&out, "long-decode");
    assert!(long.starts_with("cancelled after"), "{long}");
    assert_eq!(
        common::field(&out, "memory-after"),
        "seq-pos-max=-1",
        "a cancelled decode leaves memory empty"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_guest_inputs_get_named_errors_and_the_host_keeps_serving() {
    let (outcome, out) = common::run_test_plugin(
        &[("tiny", common::tiny_model())],
        &["bad-inputs", "--model", "tiny"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success);
    let expect = [
        ("token-too-large", "invalid-argument: token"),
        ("token-negative", "invalid-argument: token -1"),
        ("empty-batch", "invalid-argument: empty batch"),
        ("batch-too-large", "invalid-argument: batch of 513 tokens is larger than n-batch 512"),
        ("seq-out-of-range", "invalid-argument: sequence id 1 is outside [0, 1)"),
        ("position-gap", "invalid-argument: row 0: sequence 0 must continue at position 0, got 5"),
        ("columns-differ", "invalid-argument: batch columns differ"),
        ("unknown-model", "model-not-found: no-such-model"),
        ("huge-n-ctx", "limit-exceeded: n-ctx 16777216 is above this host's limit"),
        ("too-many-threads", "limit-exceeded: n-threads 1048576 is above this host's limit"),
        ("n-seq-max-above-n-ctx", "invalid-argument: n-seq-max 16 needs an n-batch of at least 16 (one output row per sequence), but n-batch is 8 (n-batch 512 is cut to n-ctx 8)"),
        ("n-seq-max-above-n-batch", "invalid-argument: n-seq-max 2 needs an n-batch of at least 2 (one output row per sequence), but n-batch is 1"),
        ("n-ubatch-above-n-batch", "invalid-argument: n-ubatch 128 is larger than n-batch 64"),
        ("zero-n-ctx", "invalid-argument: n-ctx must be at least 1"),
        ("too-many-contexts", "limit-exceeded: max-contexts"),
        ("logits-of-unrequested-row", "invalid-argument: row 0 has no logits"),
    ];
    for (case, prefix) in expect {
        let got = common::field(&out, &format!("bad-input {case}"));
        assert!(got.starts_with(prefix), "{case}: {got:?} should start with {prefix:?}");
    }
    assert_eq!(common::field(&out, "good-after-bad"), "ok");
    // model.meta (0.1.1): a key the model has, one it lacks, and a key over 256 bytes.
    assert_eq!(
        common::field(&out, "meta"),
        "architecture=llama missing=true long-key=limit-exceeded: a metadata key of 300 bytes is above 256"
    );
    let good: i32 = common::field(&out, "good-tokens").parse().unwrap();
    assert_eq!(
        common::field(&out, "memory-after"),
        format!("seq-pos-max={}", good - 1),
        "only the good batch is in memory"
    );
}

/// Regressions (issue 10): a foreign chunk made clip assert; a context charged 480 KV
/// cells held 4096; going over the token cap trapped the plugin; chunks were free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_stay_with_their_media_context_and_every_budget_is_charged_as_allocated() {
    let models = [("tiny", common::tiny_model())];
    let projectors = [("eyes", common::tiny_vision())];
    let args = ["bad-inputs", "--model", "tiny", "--media", "eyes"];
    // The test plugin's own context: n-ctx 1024 (padded as asked) x 2 layers. The padded
    // 16-sequence context needs 16 x 256 cells x 2 layers more: one cell too many.
    let mut limits = llamabox::Limits::default();
    limits.context.max_kv_cells = 1024 * 2 + 4096 * 2 - 1;
    let (outcome, out) =
        common::run_plugin_with_limits(common::test_plugin(), &models, &projectors, limits, &args)
            .await;
    assert_eq!(outcome, RunOutcome::Success);
    assert_eq!(common::field(&out, "bad-input chunk-budget"), "ok");
    for case in ["foreign-chunk-encode", "foreign-chunk-start-encode", "foreign-chunk-eval"] {
        let got = common::field(&out, &format!("bad-input {case}"));
        assert!(
            got.starts_with("invalid-argument: this chunk was made by another media context"),
            "{case}: {got}"
        );
    }
    assert_eq!(common::field(&out, "good-own-chunk-eval"), "ok");
    assert!(
        common::field(&out, "bad-input kv-cells-padded")
            .starts_with("limit-exceeded: max-kv-cells"),
        "{out}"
    );
    assert_eq!(
        common::field(&out, "bad-input too-many-tokens"),
        "limit-exceeded: max-tokens: this plugin already holds 1024 (after 1023)"
    );

    // A chunk budget smaller than one tokenized image: refused by name, nothing kept.
    let mut limits = llamabox::Limits::default();
    limits.media.max_chunk_bytes = 4096;
    let (outcome, out) =
        common::run_plugin_with_limits(common::test_plugin(), &models, &projectors, limits, &args)
            .await;
    assert_eq!(outcome, RunOutcome::Success);
    assert!(
        common::field(&out, "bad-input chunk-budget")
            .starts_with("limit-exceeded: max-chunk-bytes"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_sees_only_registered_names() {
    let (outcome, out) =
        common::run_demo(&[("tiny", common::tiny_model())], &["--model", "elsewhere"]).await;
    assert_eq!(outcome, RunOutcome::Failed(1));
    assert!(out.contains("ModelNotFound(\"elsewhere\")"), "{out}");
    let model_dir = common::tiny_model().parent().unwrap().to_str().unwrap();
    assert!(!out.contains(model_dir), "no host path may reach a plugin");
}

/// The demo's media run on the tiny model with projector `path`: an encode raced
/// against a `cancel_after_ms` timer, then encoded, evaluated and generated from.
async fn media_run(path: &std::path::Path, cancel_after_ms: &str) -> String {
    let args = ["--model", "tiny", "--media", "projector", "--cancel-after-ms", cancel_after_ms];
    let (outcome, out) =
        common::run_demo_with(&[("tiny", common::tiny_model())], &[("projector", path)], &args)
            .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_cancels_an_image_encode_in_flight_then_evaluates_the_image() {
    let out = media_run(common::slow_vision(), "0").await;
    assert_eq!(common::field(&out, "media"), "image, 2 chunks, 256 embeddings");
    // Cancelled at once from the guest's event loop (see the decode test above; the
    // trip-wire tests in native::media_encode stop it at a chosen boundary).
    let encode = common::field(&out, "media-encode");
    assert!(encode.starts_with("cancelled after"), "{encode}");
    assert!(common::field(&out, "media-full-encode").starts_with(&format!("{} floats", 256 * 64)));
    assert_eq!(common::field(&out, "media-eval-cancelled"), "Some(Error::Cancelled)");
    assert_eq!(
        common::field(&out, "media-eval-memory"),
        "seq-pos-max=-1",
        "a cancelled evaluation leaves memory empty"
    );
    let eval = common::field(&out, "media-eval");
    let n_past: i32 =
        eval.strip_prefix("n-past=").and_then(|r| r.split(',').next()).unwrap().parse().unwrap();
    assert!(n_past > 256, "prompt text plus 256 image embeddings, got {eval}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_encodes_audio_through_the_same_path() {
    let out = media_run(common::tiny_audio(), "10000").await;
    assert!(common::field(&out, "media").starts_with("audio, "), "{out}");
    assert!(common::field(&out, "media-encode").starts_with("finished before the cancel"));
    assert!(common::field(&out, "media-full-encode").starts_with(&format!("{} floats", 750 * 64)));
    assert!(common::field(&out, "media-eval").starts_with("n-past="));
}

/// A plugin compiled by one host is loaded from the compile cache by the next host with
/// the same engine settings, and runs the same; a changed component is compiled afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compiled_plugin_is_reused_from_the_compile_cache() {
    use llamabox::{CompileCacheStats, HostOptions, Limits, ModelRegistry, PluginHost};
    let dir = std::env::temp_dir().join(format!("llamabox-compile-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = HostOptions::with_compile_cache(&dir);
    let host =
        |registry| PluginHost::with_options(registry, Limits::default(), options.clone()).unwrap();
    let bytes = std::fs::read(common::demo_plugin()).unwrap();

    let first = host(ModelRegistry::new());
    first.load_bytes(&bytes).unwrap();
    assert_eq!(first.compile_cache_stats(), Some(CompileCacheStats { hits: 0, misses: 1 }));

    let registry = ModelRegistry::new();
    registry.register("tiny", common::tiny_model());
    let second = host(registry);
    let plugin = second.load_bytes(&bytes).unwrap();
    assert_eq!(
        second.compile_cache_stats(),
        Some(CompileCacheStats { hits: 1, misses: 0 }),
        "loaded, not compiled"
    );
    let mut wasi = wasmtime_wasi::WasiCtxBuilder::new();
    wasi.args(&["demo", "--model", "tiny", "--prompt", PROMPT, "--generate", "4"]);
    assert_eq!(plugin.run(wasi).await.unwrap(), RunOutcome::Success, "the cached compile runs");

    // Another component (a custom section changes its bytes, not its code) is not served
    // the first one's compile.
    let mut changed = bytes.clone();
    changed.extend_from_slice(&[0, 6, 1, b'x', 1, 2, 3, 4]);
    second.load_bytes(&changed).unwrap();
    assert_eq!(second.compile_cache_stats().unwrap().misses, 1);
    assert!(PluginHost::new(ModelRegistry::new(), Limits::default())
        .unwrap()
        .compile_cache_stats()
        .is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_call_before_its_pollable_never_traps() {
    // The order a garbage collector may choose: pending-decode, generation and
    // pending-encode each dropped while the pollable from its subscribe() lives, then
    // that pollable waited on (ready at once) and dropped.
    let (outcome, out) = common::run_plugin(
        common::test_plugin(),
        &[("tiny", common::tiny_model())],
        &[("eyes", common::slow_vision())],
        &["drop-call-first", "--model", "tiny", "--media", "eyes", "--long-tokens", "512"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    for what in ["decode", "generation", "encode"] {
        assert_eq!(common::field(&out, &format!("drop-first-{what}")), "ok", "{out}");
    }
    // The dropped decode stopped in flight or had finished: never half a batch.
    let memory = common::field(&out, "drop-first-decode-memory");
    assert!(memory == "seq-pos-max=-1" || memory == "seq-pos-max=511", "{memory}");
    // The context keeps serving.
    assert!(common::field(&out, "drop-first-after").starts_with("seq-pos-max="), "{out}");
}

#[test]
fn a_plugin_whose_imports_cannot_be_satisfied_is_refused_naming_each_one() {
    use llamabox::{Limits, ModelRegistry, PluginHost};
    // Two interfaces this host lacks, one it has but with another type, one it has.
    let component = r#"(component
        (import "wasi:http/types@0.2.0" (instance (export "handle" (func (param "x" u32)))))
        (import "wasi:clocks/monotonic-clock@0.2.0" (instance (export "now" (func (result u64)))))
        (import "wasi:cli/environment@0.2.0" (instance (export "get-arguments" (func (result u32)))))
        (import "example:missing/thing@1.0.0" (instance (export "go" (func))))
    )"#;
    let host = PluginHost::new(ModelRegistry::new(), Limits::default()).unwrap();
    let message = format!("{:#}", host.load_bytes(component.as_bytes()).err().expect("refused"));
    let listed = message
        .strip_prefix("the plugin imports what this host does not provide: ")
        .and_then(|rest| rest.split(": ").next());
    assert_eq!(
        listed,
        Some("wasi:http/types@0.2.0, wasi:cli/environment@0.2.0, example:missing/thing@1.0.0"),
        "{message}"
    );
}
