//! Plugin start-up: compiling a component on every load against loading it from the
//! compile cache (`HostOptions::compile_cache`), and starting a run from the loaded
//! plugin. A plugin compiles once per change of its bytes, wasmtime or engine settings.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, ensure, Context as _};
use llamabox::{HostOptions, Limits, ModelRegistry, PluginHost, RunOutcome};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

use crate::stats::{timed, Samples};

pub struct Startup {
    pub label: String,
    pub bytes: usize,
    /// `load` with no cache: a compile every time.
    pub compile: Samples,
    /// `load` by a new host with a warm cache folder.
    pub cached: Samples,
    /// Each run of the loaded plugin to its end, when measured here (a large plugin
    /// given with an argument it rejects: new store, instantiate, the language's own
    /// start-up, its argument check).
    pub run: Option<Samples>,
}

/// The argument a start-up probe run passes: no plugin knows it, so it exits at its
/// argument check, before it opens a model.
const PROBE_ARG: &str = "--llamabox-bench-start-up-probe";

/// Time runs of `plugin` that exit at their argument check. A non-zero exit is what the
/// probe expects; a trap, or a plugin that goes on to succeed, is an error.
fn probe_runs(plugin: &llamabox::Plugin, runs: usize) -> anyhow::Result<Samples> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let run = || -> anyhow::Result<()> {
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(MemoryOutputPipe::new(1 << 16)).stderr(MemoryOutputPipe::new(1 << 16));
        wasi.args(&["plugin", PROBE_ARG]);
        match runtime.block_on(plugin.run(wasi)).context("the plugin trapped")? {
            RunOutcome::Failed(_) => Ok(()),
            other => bail!("a start-up probe ended with {other:?}, not at its argument check"),
        }
    };
    run()?; // warm-up
    let mut times = Samples::default();
    for _ in 0..runs {
        let (t, out) = timed(run);
        out?;
        times.push(t);
    }
    Ok(times)
}

/// `runs` loads of `wasm` each way, alternating; each cached load is a new host (as a new
/// process would be) over one cache folder under `dir`. `probe`: also time runs that
/// exit at the plugin's argument check ([`probe_runs`]).
pub fn measure(
    wasm: &Path,
    label: &str,
    dir: &Path,
    runs: usize,
    probe: bool,
) -> anyhow::Result<Startup> {
    let bytes = std::fs::read(wasm).with_context(|| format!("reading {}", wasm.display()))?;
    let cache = dir.join("compile-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let host = |compile_cache| {
        PluginHost::with_options(ModelRegistry::new(), Limits::default(), {
            let mut options = HostOptions::default();
            options.compile_cache = compile_cache;
            options
        })
    };
    let first = host(Some(cache.clone()))?.load_bytes(&bytes)?; // fills the cache
    let run = probe.then(|| probe_runs(&first, runs)).transpose()?;
    let (mut compile, mut cached) = (Samples::default(), Samples::default());
    for _ in 0..runs {
        let uncached = host(None)?;
        let (t, loaded) = timed(|| uncached.load_bytes(&bytes));
        loaded?;
        compile.push(t);
        let warm = host(Some(cache.clone()))?;
        let (t, loaded) = timed(|| warm.load_bytes(&bytes));
        loaded?;
        cached.push(t);
        ensure!(
            warm.compile_cache_stats().is_some_and(|s| s.hits == 1),
            "a cached load compiled instead"
        );
    }
    let _ = std::fs::remove_dir_all(&cache);
    Ok(Startup { label: label.to_string(), bytes: bytes.len(), compile, cached, run })
}

pub fn table(out: &mut String, rows: &[Startup], instantiation: &Samples) {
    let _ = writeln!(out, "## Plugin start-up, ms\n");
    let _ = writeln!(out, "| plugin | size | load, compiling | load, from the compile cache | cached vs compiling | then each run: new store + instantiate (to its end) |");
    let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- |");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {:.0} KiB | {} | {} | {:.0}× faster | {} |",
            r.label,
            r.bytes as f64 / 1024.0,
            r.compile.ms(),
            r.cached.ms(),
            r.compile.median() / r.cached.median(),
            r.run.as_ref().unwrap_or(instantiation).ms()
        );
    }
    let _ = writeln!(
        out,
        "\n`PluginHost::load_bytes` timed by the host; every cached load is a new host over the same cache \
         folder, as a new process would be. Large plugins (CPython or a JS engine inside, 12–18 MB) spend \
         seconds compiling; loading them from the cache costs what reading and mapping the file costs. \
         A run of the Rust plugin returns at once; a large plugin's run is given an argument it rejects \
         (`{PROBE_ARG}`), so it ends at its own argument check: instantiation, the language's start-up \
         and the plugin's first lines, before any model is opened.\n"
    );
}
