//! A complete embedder: a tokio app that loads a model once, compiles two plugins once
//! (the demo, and the test suite's plugin that misbehaves on purpose) and runs them for
//! three tenants at once, each run with its own captured output, limits and way of
//! ending:
//!
//! - `alpha` runs to the end (prompt, generation, a cancelled long decode) and reports
//!   its usage;
//! - `beta` decodes until the embedder cancels the token it shared with the plugin
//!   (the plugin passes the capability to its decode calls);
//! - `gamma` (its own limits) has a run that never yields ended by its deadline, and a
//!   run whose native decode the embedder stops with a `RunStop`, whatever the plugin
//!   passed.
//!
//! Run it with `cargo run --release -p llamabox --example embedder -- [MODEL.gguf
//! [DEMO.wasm TEST-PLUGIN.wasm]]` (without a model it writes a small generated one; the
//! plugins default to the ones `make guest` builds). `make test` runs it
//! (tests/guest/embedder_example.rs).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use llamabox::wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use llamabox::wasmtime_wasi::WasiCtxBuilder;
use llamabox::{
    CancelFlag, Limits, ModelRegistry, Plugin, PluginHost, RunOptions, RunReport, RunStop,
};

/// One run's report and everything it printed.
pub struct Finished {
    pub tenant: &'static str,
    pub report: RunReport,
    pub output: String,
}

/// Run `plugin` for `options.group` with `args`, capturing its stdout and stderr (a
/// plugin's output goes nowhere unless the embedder gives it a place).
async fn run(
    plugin: &Plugin,
    tenant: &'static str,
    options: RunOptions,
    args: &[&str],
) -> Result<Finished, llamabox::Error> {
    let output = MemoryOutputPipe::new(64 << 10); // at most 64 KiB kept per run
    let mut wasi = WasiCtxBuilder::new();
    wasi.stdout(output.clone()).stderr(output.clone());
    wasi.args(&std::iter::once("plugin").chain(args.iter().copied()).collect::<Vec<_>>());
    let report = plugin.run_report(&options, wasi).await?;
    Ok(Finished {
        tenant,
        report,
        output: String::from_utf8_lossy(&output.contents()).into_owned(),
    })
}

/// Everything the example does; returns each run's result, in the order above.
pub async fn run_tenants(
    model: &Path,
    demo: &Path,
    misbehaving: &Path,
) -> anyhow::Result<Vec<Finished>> {
    let registry = ModelRegistry::new();
    registry.register("m", model);
    // One host for all tenants: one engine, each plugin compiled once, one loaded model.
    let host = Arc::new(PluginHost::new(registry, Limits::default())?);
    let demo = host.load_async(demo).await?;
    let misbehaving = host.load_async(misbehaving).await?;

    // beta: the embedder shares its own token in beta's group and cancels it itself
    // (a client went away, say). Unshare it when done: the registry holds it until then.
    let beta_token = CancelFlag::new();
    let capability = host.tokens().share("beta", &beta_token)?;

    // gamma: its own limits (it may not share its tokens with anyone), and a stop
    // handle the embedder keeps.
    let mut gamma_limits = Limits::default();
    gamma_limits.cancel.max_shares = 0;
    let gamma = |deadline, stop| {
        let mut options = RunOptions::default().group("gamma").limits(gamma_limits.clone());
        (options.deadline, options.stop) = (deadline, stop);
        options
    };
    let gamma_stop = RunStop::new();

    let alpha_run = run(&demo, "alpha", RunOptions::default().group("alpha"), &["--model", "m"]);
    let beta_args = ["decode-until-stopped", "--model", "m", "--token", &capability];
    let beta_run = run(&misbehaving, "beta", RunOptions::default().group("beta"), &beta_args);
    let beta_cancel = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        beta_token.cancel();
    };
    let gamma_spin =
        run(&misbehaving, "gamma", gamma(Some(Duration::from_millis(200)), None), &["spin"]);
    let gamma_decode = run(
        &misbehaving,
        "gamma",
        gamma(None, Some(gamma_stop.clone())),
        &["decode-until-stopped", "--model", "m", "--long-tokens", "512"],
    );
    let gamma_kill = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        gamma_stop.stop();
    };

    let (alpha, beta, (), gamma_spin, gamma_decode, ()) =
        tokio::join!(alpha_run, beta_run, beta_cancel, gamma_spin, gamma_decode, gamma_kill);
    host.tokens().unshare(&capability);
    // Every run returned only after its native threads ended.
    anyhow::ensure!(host.live_workers() == 0, "native threads outlived their runs");
    Ok(vec![alpha?, beta?, gamma_spin?, gamma_decode?])
}

/// A model for the example when none is given: a small generated one (random weights).
fn generated_model() -> anyhow::Result<PathBuf> {
    let path =
        std::env::temp_dir().join(format!("llamabox-embedder-example-{}.gguf", std::process::id()));
    llamabox_native::TextModelSpec::tiny().write(&path)?;
    Ok(path)
}

#[allow(dead_code)] // a test calls `run_tenants` instead
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let mut args = std::env::args_os().skip(1).map(PathBuf::from);
    let (model, generated) = match args.next() {
        Some(model) => (model, false),
        None => (generated_model()?, true),
    };
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/guest/wasm32-wasip2/release");
    let demo = args.next().unwrap_or_else(|| built.join("llamabox-demo.wasm"));
    let misbehaving = args.next().unwrap_or_else(|| built.join("llamabox-test-plugin.wasm"));
    let finished = run_tenants(&model, &demo, &misbehaving).await;
    if generated {
        let _ = std::fs::remove_file(&model);
    }
    for f in finished? {
        println!("== {} (run {}): {:?}", f.tenant, f.report.run_id, f.report.outcome);
        println!("   usage: {:?}", f.report.usage);
        for line in f.output.lines().take(8) {
            println!("   | {line}");
        }
    }
    Ok(())
}
