//! Cancelling a plugin's native work from outside the call: another task of a WASI 0.3
//! guest (token or dropped future), the embedder's own token, another instance through
//! a shared capability (groups keep tenants apart), and a deadline that tears the store
//! down with no worker left running.

use std::time::Duration;

use llamabox::{
    CancelFlag, Limits, ModelRegistry, Plugin, PluginHost, RunOptions, RunOutcome, RunStop,
};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

use crate::common;

fn host() -> (PluginHost, Plugin) {
    let registry = ModelRegistry::new();
    registry.register("slow", common::slow_model());
    let host = PluginHost::new(registry, Limits::default()).unwrap();
    let plugin = host.load(common::demo_plugin()).unwrap();
    (host, plugin)
}

/// The test suite's plugin on `host`: the decoding, tokenizing and looping runs.
fn test_plugin(host: &PluginHost) -> Plugin {
    host.load(common::test_plugin()).unwrap()
}

async fn run(
    plugin: &Plugin,
    group: &str,
    deadline: Option<Duration>,
    args: &[&str],
) -> (RunOutcome, String) {
    let out = MemoryOutputPipe::new(1 << 16);
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(out.clone()).stderr(out.clone());
    wasi.args(&std::iter::once("demo").chain(args.iter().copied()).collect::<Vec<_>>());
    let mut options = RunOptions::default().group(group);
    options.deadline = deadline;
    let outcome = plugin.run_with(&options, wasi).await.unwrap();
    let text = String::from_utf8(out.contents().to_vec()).unwrap();
    print!("{text}");
    (outcome, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedder_cancels_a_plugins_decode_with_its_own_token() {
    let (host, plugin) = host();
    let flag = CancelFlag::new();
    let capability = host.tokens().share("tenant", &flag).expect("a capability");
    // Deterministic: the embedder's token trips after the decode's 20th graph node.
    flag.trip_after(20);
    let (outcome, out) =
        run(&plugin, "tenant", None, &["--model", "slow", "--token", &capability]).await;
    assert_eq!(outcome, RunOutcome::Success);
    assert_eq!(common::field(&out, "shared-decode"), "cancelled");
    assert_eq!(flag.polls(), 20, "stopped at the tripping node, in flight");
    assert_eq!(common::field(&out, "memory-after"), "seq-pos-max=-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_cancels_a_blocking_decode_through_a_shared_capability() {
    let (host, plugin) = host();
    let flag = CancelFlag::new();
    let capability = host.tokens().share("tenant", &flag).expect("a capability");
    // A decodes under the shared token until it is cancelled: only B can end it,
    // whether B lands before A's first decode, between two, or in the middle of one.
    let a_args = ["decode-until-stopped", "--model", "slow", "--token", &capability];
    let b_args = ["--cancel-shared", &capability];
    let decoder = test_plugin(&host);
    let decoding = run(&decoder, "tenant", None, &a_args);
    let cancelling = run(&plugin, "tenant", None, &b_args);
    let ((a, a_out), (b, b_out)) = tokio::join!(decoding, cancelling);
    assert_eq!((a, b), (RunOutcome::Success, RunOutcome::Success));
    assert_eq!(common::field(&b_out, "cancel-shared"), "ok");
    assert!(a_out.contains("stopped: cancelled"), "{a_out}");
    assert_eq!(
        common::field(&a_out, "memory-after"),
        "seq-pos-max=-1",
        "a cancelled decode leaves no trace"
    );
    assert!(flag.is_cancelled());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_other_group_capabilities_are_refused() {
    let (host, plugin) = host();
    let flag = CancelFlag::new();
    let capability = host.tokens().share("tenant-a", &flag).expect("a capability");
    let (_, other_group) = run(&plugin, "tenant-b", None, &["--cancel-shared", &capability]).await;
    let (_, forged) =
        run(&plugin, "tenant-a", None, &["--cancel-shared", "0123456789abcdef0123456789abcdef"])
            .await;
    for out in [other_group, forged] {
        assert!(
            common::field(&out, "cancel-shared")
                .starts_with("invalid-argument: no token is shared"),
            "{out}"
        );
    }
    assert!(!flag.is_cancelled());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_stops_native_work_and_joins_every_worker() {
    let (host, plugin) = host();
    let flag = CancelFlag::new(); // never cancelled: only the deadline stops the decode
    let capability = host.tokens().share("tenant", &flag).expect("a capability");
    // Decodes until stopped: only the deadline ends it.
    let args =
        ["decode-until-stopped", "--model", "slow", "--token", &capability, "--long-tokens", "512"];
    let (outcome, _) =
        run(&test_plugin(&host), "tenant", Some(Duration::from_millis(300)), &args).await;
    assert_eq!(outcome, RunOutcome::DeadlineExceeded);
    assert_eq!(host.live_workers(), 0, "no worker may outlive its store");
    assert!(
        !flag.is_cancelled(),
        "the deadline stops the call without cancelling the caller's token"
    );
    // The host keeps serving: the same plugin runs again at once.
    let (again, out) =
        run(&plugin, "tenant", None, &["--model", "slow", "--cancel-shared", &capability]).await;
    assert_eq!((again, common::field(&out, "cancel-shared")), (RunOutcome::Success, "ok"));
}

/// Tokenizing cannot be stopped midway: the caps on its input bound it, the executor
/// stays free, and the run still returns only once the tokenizer thread is done. On
/// the generated model and on SmolLM2 (BPE, whose special tokens are slow to split).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_a_run_that_is_tokenizing_the_slowest_text_it_may() {
    for (name, path) in [("tiny", common::tiny_model()), ("smollm2", common::real_model())] {
        let registry = ModelRegistry::new();
        registry.register(name, path);
        let host = PluginHost::new(registry, Limits::default()).unwrap();
        let plugin = test_plugin(&host);
        let deadline = Duration::from_millis(300);
        let started = std::time::Instant::now();
        let (outcome, out) =
            run(&plugin, "tenant", Some(deadline), &["tokenize-until-stopped", "--model", name])
                .await;
        let overshoot = started.elapsed().saturating_sub(deadline);
        assert_eq!(outcome, RunOutcome::DeadlineExceeded, "{out}");
        assert_eq!(host.live_workers(), 0, "the tokenizer thread ended before the run returned");
        println!(
            "{name}: deadline overshoot while tokenizing: {overshoot:?} (a figure, not a gate)"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_loops_forever_is_stopped_by_its_deadline() {
    let (host, _) = host();
    let (outcome, out) =
        run(&test_plugin(&host), "tenant", Some(Duration::from_millis(200)), &["spin"]).await;
    assert_eq!(outcome, RunOutcome::DeadlineExceeded);
    assert!(out.contains("spinning"));
}

/// The epoch ticker lives as long as any plugin: a plugin kept after its host is dropped
/// still has its deadlines (a looping guest only yields at epoch ticks).
#[test]
fn a_plugin_that_outlives_its_host_still_meets_its_deadline() {
    let (host, _) = host();
    let plugin = test_plugin(&host);
    drop(host);
    // On a thread of its own: without ticks the guest never yields, and the run (and its
    // runtime) would never end; the test then fails after a minute instead of hanging.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _ = tx.send(runtime.block_on(run(
            &plugin,
            "tenant",
            Some(Duration::from_millis(200)),
            &["spin"],
        )));
    });
    let (outcome, out) =
        rx.recv_timeout(Duration::from_secs(60)).expect("the deadline never fired");
    assert_eq!(outcome, RunOutcome::DeadlineExceeded);
    assert!(out.contains("spinning"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_cannot_take_more_memory_than_its_limit() {
    let (host, _) = host();
    let plugin = test_plugin(&host);
    let out = MemoryOutputPipe::new(1 << 16);
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(out.clone()).stderr(out.clone());
    wasi.args(&["test-plugin", "hog-memory"]);
    // The default limit is 256 MiB of linear memory: the guest's allocator fails (a
    // trap in Rust) well before the host notices anything.
    let result = plugin.run_with(&RunOptions::default(), wasi).await;
    let text = String::from_utf8(out.contents().to_vec()).unwrap();
    let hoarded = text.lines().filter(|l| l.starts_with("hoarded")).count();
    assert!(
        result.is_err() || result.as_ref().is_ok_and(|o| *o != RunOutcome::Success),
        "{result:?}"
    );
    assert!((1..=16).contains(&hoarded), "stopped at the 256 MiB limit, after {hoarded} × 16 MiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasi_0_3_guest_tasks_cancel_in_flight_by_token_or_by_dropping_the_future() {
    let (outcome, out) = common::run_plugin(
        common::async_demo_plugin(),
        &[("slow", common::slow_model())],
        &[],
        &["slow", "512"],
    )
    .await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    for (field, expected) in [
        // Each scenario stops its decode at once: queued or running, never finished,
        // and leaves no trace.
        ("async-spawn", "cancelled"),
        ("async-join", "cancelled"),
        ("async-drop", "dropped"),
        ("memory-after-spawn", "seq-pos-max=-1"),
        ("memory-after-join", "seq-pos-max=-1"),
        ("memory-after-drop", "seq-pos-max=-1"),
        ("async-two-contexts", "kept ok, stopped cancelled"),
        ("memory-after-two", "seq-pos-max=511 and -1"),
        // WASI 0.3 calls count against max-pending-calls.
        ("async-over-cap", "1 refused: max-pending-calls: this plugin already holds 16"),
        ("async-complete", "ok"),
        ("memory-after-complete", "seq-pos-max=511"),
        ("async-generation", "4 tokens"),
        ("async-generation-drop", "dropped"),
        ("async-generation-after-drop", "cancelled"),
        ("memory-after-generation-drop", "seq-pos-max=-1"),
    ] {
        assert_eq!(common::field(&out, field), expected, "{field}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_list_evaluation_stopped_at_any_stage_leaves_memory_as_it_was() {
    let registry = ModelRegistry::new();
    registry.register("tiny", common::tiny_model());
    registry.register_projector("eyes", common::tiny_vision());
    // Stop points at fixed work, not paced by measured speed: the same polls every run.
    let mut limits = Limits::default();
    limits.media.encode_fixed_chunk_work = llamabox_native::chunker::CHUNK_WORK;
    let host = PluginHost::new(registry, limits).unwrap();
    let plugin = host.load(common::demo_plugin()).unwrap();
    let args = |cap: &str| {
        ["--model", "tiny", "--media", "eyes", "--cancel-after-ms", "100000", "--token", cap]
            .map(String::from)
    };
    let run_with = |flag: CancelFlag| {
        let capability = host.tokens().share("tenant", &flag).expect("a capability");
        let plugin = &plugin;
        async move {
            let args = args(&capability);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(plugin, "tenant", None, &args).await.1
        }
    };
    // Count the polls of a whole evaluation: the text chunk's decode nodes, the image
    // encode's boundaries, the embeddings' decode nodes, the last text chunk's nodes.
    let counter = CancelFlag::counting();
    let out = run_with(counter.clone()).await;
    assert_eq!(common::field(&out, "media-eval-shared"), "ok");
    let total = counter.polls();
    assert!(total > 20, "{total}");
    // Stop it after the first text chunk was decoded, in the middle, and at the last node.
    for k in [total / 3, total / 2, total - 1] {
        let flag = CancelFlag::new();
        flag.trip_after(k);
        let out = run_with(flag.clone()).await;
        assert_eq!(
            common::field(&out, "media-eval-shared"),
            "cancelled",
            "stopped at poll {k} of {total}"
        );
        assert_eq!(
            common::field(&out, "media-eval-shared-memory"),
            "seq-pos-max=-1",
            "poll {k}: earlier stages must be undone"
        );
        assert_eq!(flag.polls(), k);
    }
}

/// The embedder's stop handle ends a run whatever the guest does (here it loops in wasm
/// and never calls the host), with the deadline's teardown; a stop made before the run
/// starts ends it at once. No thread of the run is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedders_stop_handle_ends_a_run_now() {
    let (host, _) = host();
    let plugin = test_plugin(&host);
    let stop = RunStop::new();
    let options = RunOptions::default().group("tenant").stop(stop.clone());
    let out = MemoryOutputPipe::new(1 << 16);
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(out.clone()).args(&["test-plugin", "spin"]);
    let run = plugin.run_with(&options, wasi);
    let stopper = async {
        // Stop once the guest has started looping.
        while !String::from_utf8_lossy(&out.contents()).contains("spinning") {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.stop();
    };
    let (outcome, ()) = tokio::join!(run, stopper);
    assert_eq!(outcome.unwrap(), RunOutcome::Stopped);
    assert_eq!(host.live_workers(), 0);

    let mut wasi = WasiCtxBuilder::new();
    wasi.args(&["test-plugin", "spin"]);
    assert!(stop.is_stopped());
    assert_eq!(
        plugin.run_with(&options, wasi).await.unwrap(),
        RunOutcome::Stopped,
        "already stopped: ends at once"
    );
}

/// Limits per run: one plugin, compiled once, runs for two tenants with different caps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_run_can_have_its_own_limits() {
    let (_host, plugin) = host();
    let args = ["--model", "slow", "--prompt", "per-run limits", "--generate", "2"];
    let mut none = Limits::default();
    none.context.max_contexts = 0;
    let tight = RunOptions::default().limits(none);
    let out = MemoryOutputPipe::new(1 << 16);
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(out.clone()).stderr(out.clone());
    wasi.args(&std::iter::once("demo").chain(args).collect::<Vec<_>>());
    assert_eq!(plugin.run_with(&tight, wasi).await.unwrap(), RunOutcome::Failed(1));
    let text = String::from_utf8_lossy(&out.contents()).into_owned();
    assert!(text.contains("max-contexts"), "{text}");
    let (outcome, out) = run(&plugin, "tenant", None, &args).await;
    assert_eq!(
        (outcome, common::field(&out, "generated-tokens")),
        (RunOutcome::Success, "2"),
        "the host's own limits for the next run"
    );
}
