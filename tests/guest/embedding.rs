//! The embedder's API: typed errors, the live model registry, usage and tracing per
//! run, and the product's own host functions next to llamabox's. The components made
//! from WAT here are as small as a test of the host's side needs.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use llamabox::wasmtime::StoreContextMut;
use llamabox::wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use llamabox::wasmtime_wasi::WasiCtxBuilder;
use llamabox::{
    Error, Limits, ModelRegistry, OpenError, PluginHost, PluginState, RunOptions, RunOutcome,
    RunReport,
};

use crate::common;

/// A WASI command whose `run` is `body` (core wasm returning 0 for success), with
/// `imports` (component-level) and `core_imports` (how the core module gets them).
fn command(
    imports: &str,
    lowered: &str,
    core_imports: &str,
    body: &str,
    instantiate_with: &str,
) -> Vec<u8> {
    let wat = format!(
        r#"(component
            {imports}
            {lowered}
            (core module $m
                {core_imports}
                (memory 1)
                (func (export "run") (result i32) {body}))
            {instantiate_with}
            (func $run (result (result)) (canon lift (core func $i "run")))
            (instance $cli (export "run" (func $run)))
            (export "wasi:cli/run@0.2.0" (instance $cli)))"#
    );
    wat.into_bytes()
}

fn plain_command(body: &str) -> Vec<u8> {
    command("", "", "", body, "(core instance $i (instantiate $m))")
}

fn host() -> PluginHost {
    PluginHost::new(ModelRegistry::new(), Limits::default()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_errors_say_what_is_wrong() {
    let host = host();
    let missing = std::path::Path::new("/nonexistent/plugin.wasm");
    assert!(matches!(host.load(missing), Err(Error::NotFound(p)) if p == missing));
    assert!(matches!(host.load_bytes(b"not wasm"), Err(Error::NotAComponent(_))));

    // Two interfaces the host lacks, a function of another type in one it has, and one
    // it has as the plugin expects: the first three are listed, in import order.
    let imports_unknown = br#"(component
        (import "nope:missing/thing@1.0.0" (instance (export "f" (func))))
        (import "wasi:cli/environment@0.2.0" (instance (export "get-arguments" (func (result u32)))))
        (import "wasi:cli/exit@0.2.0" (instance (export "exit" (func (param "status" (result))))))
        (import "nope:missing/other@1.0.0" (instance (export "g" (func (param "x" u32)))))
    )"#;
    match host.load_bytes(imports_unknown) {
        Err(Error::Link { missing, .. }) => {
            assert_eq!(
                missing,
                [
                    "nope:missing/thing@1.0.0",
                    "wasi:cli/environment@0.2.0",
                    "nope:missing/other@1.0.0"
                ]
            )
        }
        other => panic!("expected a link error, got {:?}", other.err()),
    }
    assert!(matches!(host.load_bytes(b"(component)"), Err(Error::NoEntryPoint(_))));
    assert!(
        host.load_bytes(&plain_command("i32.const 0")).is_ok(),
        "the test's own command is well formed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trap_carries_its_code_and_an_exit_status_is_an_outcome() {
    let host = host();
    let trapping = host.load_bytes(&plain_command("unreachable")).unwrap();
    let error = trapping.run(WasiCtxBuilder::new()).await.unwrap_err();
    assert_eq!(
        error.trap_code(),
        Some(llamabox::wasmtime::Trap::UnreachableCodeReached),
        "{error:?}"
    );

    let failing = host.load_bytes(&plain_command("i32.const 1")).unwrap();
    assert_eq!(failing.run(WasiCtxBuilder::new()).await.unwrap(), RunOutcome::Failed(1));
    assert_eq!(host.live_workers(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growing_past_the_runs_memory_limit_is_a_limit_error() {
    let host = host();
    // Grows by 100 pages (6.4 MB); traps if the growth failed.
    let body =
        "(if (i32.eq (memory.grow (i32.const 100)) (i32.const -1)) (then unreachable)) i32.const 0";
    let plugin = host.load_bytes(&plain_command(body)).unwrap();
    assert_eq!(
        plugin.run(WasiCtxBuilder::new()).await.unwrap(),
        RunOutcome::Success,
        "the default limit allows it"
    );
    let mut small = Limits::default();
    small.wasm.max_memory_mib = 1;
    let tight = RunOptions::default().limits(small);
    match plugin.run_with(&tight, WasiCtxBuilder::new()).await {
        Err(Error::Limit { limit, .. }) => assert_eq!(limit, "max-memory-mib"),
        other => panic!("expected the memory limit, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_products_own_host_function_reaches_its_run_state() {
    let mut host = host();
    host.with_linker(|linker| {
        linker.instance("product:host/counter@0.1.0")?.func_wrap(
            "bump",
            |store: StoreContextMut<'_, PluginState>, (n,): (u32,)| {
                let calls = store
                    .data()
                    .embedder::<AtomicU32>()
                    .ok_or_else(|| llamabox::wasmtime::Error::msg("no counter"))?;
                calls.fetch_add(1, SeqCst);
                Ok((n + 1,))
            },
        )
    })
    .unwrap();
    let bytes = command(
        r#"(import "product:host/counter@0.1.0" (instance $host (export "bump" (func (param "n" u32) (result u32)))))"#,
        r#"(core func $bump (canon lower (func $host "bump")))
           (core instance $host_core (export "bump" (func $bump)))"#,
        r#"(import "host" "bump" (func $bump (param i32) (result i32)))"#,
        "(if (i32.ne (call $bump (i32.const 41)) (i32.const 42)) (then unreachable)) i32.const 0",
        r#"(core instance $i (instantiate $m (with "host" (instance $host_core))))"#,
    );
    let plugin = host.load_bytes(&bytes).unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let options = RunOptions::default().embedder(calls.clone());
    assert_eq!(
        plugin.run_with(&options, WasiCtxBuilder::new()).await.unwrap(),
        RunOutcome::Success
    );
    assert_eq!(calls.load(SeqCst), 1, "the guest called the product's function once");
    // Without the embedder's state the function fails, and the plugin with it.
    assert!(matches!(plugin.run(WasiCtxBuilder::new()).await, Err(Error::Trap { code: None, .. })));
}

fn bench_plugin() -> std::path::PathBuf {
    common::guest_plugin("llamabox-bench-plugin.wasm")
}

/// Run `plugin` with `args`; its report and its stdout and stderr.
async fn run_reported(
    plugin: &llamabox::Plugin,
    options: &RunOptions,
    args: &[&str],
) -> (RunReport, String) {
    let (stdout, stderr) = (MemoryOutputPipe::new(1 << 20), MemoryOutputPipe::new(1 << 20));
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(stdout.clone()).stderr(stderr.clone());
    wasi.args(&std::iter::once("bench").chain(args.iter().copied()).collect::<Vec<_>>());
    let report = plugin.run_report(options, wasi).await.unwrap();
    let text = String::from_utf8([stdout.contents(), stderr.contents()].concat()).unwrap();
    print!("{text}");
    (report, text)
}

const DECODE_16X3: &[&str] =
    &["decode", "--model", "m", "--tokens", "16", "--runs", "3", "--ctx", "64", "--batch", "16"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_added_replaced_and_unloaded_while_the_host_lives() {
    let host = host();
    let plugin = host.load(&bench_plugin()).unwrap();
    let options = RunOptions::default();
    let (report, out) = run_reported(&plugin, &options, DECODE_16X3).await;
    assert_eq!(report.outcome, RunOutcome::Failed(1));
    assert!(out.contains("ModelNotFound(\"m\")"), "{out}");

    host.models().register("m", common::tiny_model());
    let (report, _) = run_reported(&plugin, &options, DECODE_16X3).await;
    assert_eq!(report.outcome, RunOutcome::Success, "a model registered after the load is seen");

    // Replacing a name: an open model stays the one it was; the next open loads the new file.
    let models = host.models();
    let old = models.open("m").await.unwrap();
    models.register("m", common::slow_model());
    assert!(!models.is_loaded("m"), "a replacement is loaded on its first open");
    let new = models.open("m").await.unwrap();
    assert!(!Arc::ptr_eq(&old, &new));
    let (tiny, slow) =
        (llamabox_native::TextModelSpec::tiny(), llamabox_native::TextModelSpec::slow());
    assert_ne!(tiny.n_layer, slow.n_layer, "the test tells the two models apart by their layers");
    assert_eq!((old.n_layer(), new.n_layer()), (tiny.n_layer, slow.n_layer));

    assert!(models.unload("m"));
    assert!(matches!(models.open("m").await, Err(OpenError::NotFound(_))));
    assert_eq!(old.n_layer(), tiny.n_layer, "a model in use stays loaded after its name is gone");
    let (report, out) = run_reported(&plugin, &options, DECODE_16X3).await;
    assert_eq!(report.outcome, RunOutcome::Failed(1));
    assert!(out.contains("ModelNotFound(\"m\")"), "{out}");
    assert!(!models.unload("m"), "nothing left to unload");
    assert_eq!(host.live_workers(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_reports_what_it_decoded_generated_and_held() {
    let registry = ModelRegistry::new();
    registry.register("m", common::tiny_model());
    let host = PluginHost::new(registry, Limits::default()).unwrap();
    let plugin = host.load(&bench_plugin()).unwrap();

    let (report, _) = run_reported(&plugin, &RunOptions::default(), DECODE_16X3).await;
    assert_eq!(report.outcome, RunOutcome::Success);
    let usage = report.usage;
    assert_eq!(usage.tokens_decoded, 3 * 16);
    assert_eq!((usage.tokens_generated, usage.cancels), (0, 0));
    let model = llamabox_native::Model::load(common::tiny_model()).unwrap();
    let params = llamabox_native::ContextParams {
        n_ctx: 64,
        n_batch: 16,
        n_ubatch: 16,
        n_seq_max: 1,
        n_threads: 1,
    };
    assert_eq!(
        usage.peak_kv_cells,
        params.allocated_n_ctx().unwrap() as u64 * model.n_layer() as u64
    );
    assert!(!usage.native_time.is_zero());

    let args = [
        "host-generate",
        "--model",
        "m",
        "--tokens",
        "4",
        "--runs",
        "1",
        "--ctx",
        "64",
        "--batch",
        "16",
    ];
    let (report, out) = run_reported(&plugin, &RunOptions::default(), &args).await;
    assert_eq!(report.outcome, RunOutcome::Success);
    let generated: u64 = common::field(&out, "run")
        .split(' ')
        .find_map(|f| f.strip_prefix("generated="))
        .unwrap()
        .parse()
        .unwrap();
    // A one-token warm-up generation, then the measured one.
    assert_eq!(report.usage.tokens_generated, 1 + generated);
    assert!(report.usage.tokens_decoded >= report.usage.tokens_generated);
    assert_ne!(report.run_id, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_calls_are_counted() {
    let registry = ModelRegistry::new();
    registry.register("slow", common::slow_model());
    let host = PluginHost::new(registry, Limits::default()).unwrap();
    let plugin = host.load(common::demo_plugin()).unwrap();
    let (stdout, stderr) = (MemoryOutputPipe::new(1 << 20), MemoryOutputPipe::new(1 << 20));
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(stdout.clone()).stderr(stderr.clone());
    let args = [
        "demo",
        "--model",
        "slow",
        "--prompt",
        "a",
        "--generate",
        "2",
        "--long-tokens",
        "512",
        "--cancel-after-ms",
        "0",
    ];
    wasi.args(&args);
    let report = plugin.run_report(&RunOptions::default(), wasi).await.unwrap();
    let out = String::from_utf8([stdout.contents(), stderr.contents()].concat()).unwrap();
    assert_eq!(report.outcome, RunOutcome::Success, "{out}");
    assert!(common::field(&out, "long-decode").starts_with("cancelled after"), "{out}");
    // The guest SDK's decode_with_timeout, at a deadline of 0 ms: cancelled in flight,
    // memory as before.
    assert_eq!(common::field(&out, "timed-decode"), "cancelled", "{out}");
    assert_eq!(
        common::field(&out, "memory-after-timed"),
        common::field(&out, "memory-after"),
        "{out}"
    );
    assert!(report.usage.cancels >= 2, "{:?}", report.usage);
}

/// Counts llama.cpp's log events by whether a `llamabox_run` span encloses them.
struct LlamaLogs {
    in_run: Arc<AtomicUsize>,
    outside_run_on_workers: Arc<AtomicUsize>,
}

impl<S> tracing_subscriber::Layer<S> for LlamaLogs
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != "llama_cpp" {
            return;
        }
        let in_run = ctx
            .event_scope(event)
            .is_some_and(|mut scope| scope.any(|span| span.name() == "llamabox_run"));
        let on_worker = std::thread::current().name().is_some_and(|n| n.starts_with("llamabox-"));
        if in_run {
            self.in_run.fetch_add(1, SeqCst);
        } else if on_worker {
            self.outside_run_on_workers.fetch_add(1, SeqCst);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_cpp_logs_from_a_runs_threads_carry_its_span() {
    use tracing_subscriber::layer::SubscriberExt as _;
    let (in_run, outside) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let layer = LlamaLogs { in_run: in_run.clone(), outside_run_on_workers: outside.clone() };
    let subscriber = tracing_subscriber::registry().with(layer);
    // Global: the logs come from the run's worker threads.
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let registry = ModelRegistry::new();
    registry.register("m", common::tiny_model());
    let host = PluginHost::new(registry, Limits::default()).unwrap();
    let plugin = host.load(&bench_plugin()).unwrap();
    let options = RunOptions::default().group("tenant-a");
    let (report, _) = run_reported(&plugin, &options, DECODE_16X3).await;
    assert_eq!(report.outcome, RunOutcome::Success);
    // Loading the model and creating the context log at llama.cpp's INFO level.
    assert!(in_run.load(SeqCst) > 0, "no llama.cpp log line was attributed to the run");
    assert_eq!(
        outside.load(SeqCst),
        0,
        "a llama.cpp log line from a worker thread had no run span"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_context_keeps_its_model_when_the_name_is_replaced() {
    let host = host();
    host.models().register("m", common::tiny_model());
    let plugin = host.load(common::demo_plugin()).unwrap();
    let decoder = host.load(common::test_plugin()).unwrap();
    let flag = llamabox::CancelFlag::new();
    let capability = host.tokens().share("t", &flag).unwrap();
    let options = RunOptions::default().group("t");
    let start = |args: &[&str]| {
        let output = MemoryOutputPipe::new(1 << 20);
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(output.clone()).stderr(output.clone());
        wasi.args(&std::iter::once("demo").chain(args.iter().copied()).collect::<Vec<_>>());
        (wasi, output)
    };
    let text = |pipe: &MemoryOutputPipe| String::from_utf8_lossy(&pipe.contents()).into_owned();

    // A decodes on the tiny model until the embedder cancels its token.
    let (wasi, a_out) = start(&[
        "decode-until-stopped",
        "--model",
        "m",
        "--token",
        &capability,
        "--long-tokens",
        "64",
    ]);
    let a = decoder.run_report(&options, wasi);
    let replace_then_cancel = async {
        // Waits for A's line (not a timing: the bound only turns a broken A into a failure).
        for _ in 0..12_000 {
            if text(&a_out).contains("decoding until stopped") {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(
            text(&a_out).contains("decoding until stopped"),
            "A never started decoding: {}",
            text(&a_out)
        );
        // A's context is live now: the name moves to another model under it.
        host.models().register("m", common::slow_model());
        flag.cancel();
    };
    let (a, ()) = tokio::join!(a, replace_then_cancel);
    let a_text = text(&a_out);
    assert_eq!(a.unwrap().outcome, RunOutcome::Success, "{a_text}");
    let tiny = llamabox_native::TextModelSpec::tiny();
    assert!(
        common::field(&a_text, "model").ends_with(&format!("embd {})", tiny.n_embd)),
        "{a_text}"
    );
    assert!(
        a_text.contains("stopped: cancelled"),
        "A's context kept working on the old model: {a_text}"
    );

    // A new run opens the new model under the same name.
    let (wasi, b_out) = start(&["--model", "m", "--token", &capability]);
    assert_eq!(plugin.run_report(&options, wasi).await.unwrap().outcome, RunOutcome::Success);
    let slow = llamabox_native::TextModelSpec::slow();
    assert!(
        common::field(&text(&b_out), "model").ends_with(&format!("embd {})", slow.n_embd)),
        "{}",
        text(&b_out)
    );
    host.tokens().unshare(&capability);
    assert_eq!(host.live_workers(), 0);
}

/// Contexts a run dropped are kept for later runs of its group
/// (`ModelRegistry::keep_idle_contexts`): the next run skips creating one and reuses
/// the prompt they share, with the same answer; another group never gets them; they
/// are not a run's live threads; a lowered setting or a replaced model lets them go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_contexts_serve_later_runs_of_their_group_only() {
    let registry = ModelRegistry::new();
    registry.register("tiny", common::tiny_model()).keep_idle_contexts(2);
    let host = PluginHost::new(registry, Limits::default()).unwrap();
    let plugin = host.load(common::demo_plugin()).unwrap();
    let args = [
        "--model",
        "tiny",
        "--prompt",
        "the same prompt on every run",
        "--generate",
        "8",
        "--host-generate",
    ];
    let run = |group: &str| {
        let options = RunOptions::default().group(group);
        let plugin = &plugin;
        async move {
            let (report, out) = run_reported(plugin, &options, &args).await;
            assert_eq!(report.outcome, RunOutcome::Success, "{out}");
            (report.usage, out)
        }
    };
    let prompt_tokens = |out: &str| -> u64 {
        common::field(out, "host-usage").split(' ').nth(1).unwrap().parse().unwrap()
    };

    let (first, first_out) = run("a").await;
    assert_eq!(first.tokens_reused, 0);
    assert_eq!(
        (host.models().idle_contexts(), host.live_workers()),
        (1, 0),
        "kept, and not counted as a run's thread"
    );
    let (again, again_out) = run("a").await;
    let n = prompt_tokens(&first_out);
    assert_eq!(again.tokens_reused, n - 1, "all of the prompt but its last token is reused");
    assert_eq!(again.tokens_decoded, first.tokens_decoded - (n - 1));
    for ids in ["sampler-ids", "host-generated-ids"] {
        assert_eq!(common::field(&again_out, ids), common::field(&first_out, ids), "{ids}");
    }
    assert_eq!(host.models().idle_contexts(), 1, "taken, then kept again");

    let (other, _) = run("b").await;
    assert_eq!(other.tokens_reused, 0, "another group's context is never handed over");
    assert_eq!(host.models().idle_contexts(), 2);
    run("c").await;
    assert_eq!(host.models().idle_contexts(), 2, "the least recently kept goes past the setting");
    let (a_again, _) = run("a").await;
    assert_eq!(a_again.tokens_reused, 0, "group a's context was the one let go");

    host.models().keep_idle_contexts(1);
    assert_eq!(host.models().idle_contexts(), 1);
    // Replacing the model frees its idle contexts, and with them the old weights.
    let old = Arc::downgrade(&host.models().open("tiny").await.unwrap());
    host.models().register("tiny", common::tiny_model());
    assert_eq!(host.models().idle_contexts(), 0);
    for _ in 0..1000 {
        if old.strong_count() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(old.strong_count(), 0, "an idle context kept the replaced model's weights");
    assert_eq!(host.live_workers(), 0);
}
