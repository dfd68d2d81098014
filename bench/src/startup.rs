//! Plugin start-up: compiling a component on every load against loading it from the
//! compile cache (`HostOptions::compile_cache`), and starting a run from the loaded
//! plugin. A plugin compiles once per change of its bytes, wasmtime or engine settings.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{ensure, Context as _};
use llamabox::{HostOptions, Limits, ModelRegistry, PluginHost};

use crate::stats::{timed, Samples};

pub struct Startup {
    pub label: String,
    pub bytes: usize,
    /// `load` with no cache: a compile every time.
    pub compile: Samples,
    /// `load` by a new host with a warm cache folder.
    pub cached: Samples,
}

/// `runs` loads of `wasm` each way, alternating; each cached load is a new host (as a new
/// process would be) over one cache folder under `dir`.
pub fn measure(wasm: &Path, label: &str, dir: &Path, runs: usize) -> anyhow::Result<Startup> {
    let bytes = std::fs::read(wasm).with_context(|| format!("reading {}", wasm.display()))?;
    let cache = dir.join("compile-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let host = |compile_cache| {
        PluginHost::with_options(ModelRegistry::new(), Limits::default(), HostOptions { compile_cache })
    };
    host(Some(cache.clone()))?.load_bytes(&bytes)?; // fills the cache
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
        ensure!(warm.compile_cache_stats().is_some_and(|s| s.hits == 1), "a cached load compiled instead");
    }
    let _ = std::fs::remove_dir_all(&cache);
    Ok(Startup { label: label.to_string(), bytes: bytes.len(), compile, cached })
}

pub fn table(out: &mut String, rows: &[Startup], instantiation: &Samples) {
    let _ = writeln!(out, "## Plugin start-up, ms\n");
    let _ = writeln!(out, "| plugin | size | load, compiling | load, from the compile cache | cached vs compiling | then each run: new store + instantiate |");
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
            instantiation.ms()
        );
    }
    let _ = writeln!(
        out,
        "\n`PluginHost::load_bytes` timed by the host; every cached load is a new host over the same cache \
         folder, as a new process would be. Large plugins (CPython or a JS engine inside, 12–18 MB) spend \
         seconds compiling; loading them from the cache costs what reading and mapping the file costs.\n"
    );
}
