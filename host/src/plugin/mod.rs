//! Running plugin components: an engine, a linker with WASI 0.2 and llamabox, and one
//! fresh store per run.
//!
//! - `state`: what a run's store holds (WASI, wasi-http, llamabox, limits).
//! - `link`: naming every import a plugin needs that the linker lacks.
//! - `epoch`: the ticker that lets deadlines interrupt running wasm.
//! - `grant`: which llamabox interfaces a plugin may import, checked at load.
//! - `run`: a compiled plugin and one run of it, start to end.

mod epoch;
mod link;
mod run;
mod state;

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument as _;

use wasmtime::component::{Component, InstancePre, Linker, ResourceTable};
use wasmtime::{Engine, Store};
use wasmtime_wasi::p2::bindings::CommandPre;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::p2::bindings::http::types::ErrorCode;
use wasmtime_wasi_http::p2::bindings::ProxyPre;
use wasmtime_wasi_http::p2::body::{HyperIncomingBody, HyperOutgoingBody};
use wasmtime_wasi_http::{WasiHttp, WasiHttpCtx, WasiHttpCtxView, WasiHttpView};

use crate::component::{
    self, Limits, LlamaCtx, LlamaCtxView, LlamaView, ModelRegistry, TokenRegistry,
};
use crate::engine::Claim;
use crate::engine::Meter;
use crate::error::{Error, Result};
use crate::worker::Tracker;

use crate::grant::Grant;
use epoch::EpochTicker;
use link::unresolved_imports;
use run::PreInstance;
pub use run::{HttpResponse, Plugin, ResponseSender};
pub use state::PluginState;

/// Hosts plugins: compiles components and runs them against a model registry.
pub struct PluginHost {
    engine: Engine,
    /// Advances the engine's epoch while this host or any plugin it loaded lives.
    ticker: Arc<EpochTicker>,
    linker: Linker<PluginState>,
    /// Shared with every plugin loaded here: registrations made later reach their runs.
    registry: Arc<ModelRegistry>,
    tokens: Arc<TokenRegistry>,
    limits: Limits,
    /// Every native thread of every store this host runs.
    workers: Tracker,
    /// The engine's compile cache (shared counters), if any.
    cache: Option<wasmtime::Cache>,
}

/// What the compile cache did for a host's `load`s since it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompileCacheStats {
    /// Components loaded from the cache, not compiled.
    pub hits: usize,
    /// Components compiled (and written to the cache).
    pub misses: usize,
}

/// How a plugin's `wasi:cli/run` ended (a trap or a wasm limit is an [`Error`] of
/// [`Plugin::run`] instead).
#[derive(Debug, PartialEq, Eq)]
pub enum RunOutcome {
    /// `run` returned `ok` (exit status 0), or an HTTP handler returned.
    Success,
    /// The plugin exited with this non-zero status (1 when `run` returned an error).
    Failed(i32),
    /// The run's deadline passed: its store was torn down, every native call it had
    /// running was stopped and its worker joined before this was returned.
    DeadlineExceeded,
    /// The embedder's [`RunStop`] stopped it, with the same teardown as a deadline.
    Stopped,
}

/// What one run used, counted on its native threads. Counts what ran, even if the run
/// was then stopped or ended by a deadline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunUsage {
    /// Rows `llama_decode` computed: prompt and generated tokens, media embeddings, and
    /// tokens decoded for embeddings (a cancelled decode's rows are not counted).
    pub tokens_decoded: u64,
    /// Tokens the host's generation loop (`generate` interface) delivered.
    pub tokens_generated: u64,
    /// Time the run's native threads spent in calls (context and media workers,
    /// tokenizing), summed over threads; not the time calls waited in a queue.
    pub native_time: Duration,
    /// Most KV cells (n-ctx × layers over all contexts) the run held at once.
    pub peak_kv_cells: u64,
    /// Native calls on text and media contexts that ended cancelled (by a token, a
    /// dropped call, the deadline or a stop), whether they had started computing or not.
    pub cancels: u64,
    /// Prompt tokens not decoded because an idle context from an earlier run of the
    /// group already held them ([`ModelRegistry::keep_idle_contexts`]).
    pub tokens_reused: u64,
}

/// How a run ended and what it used.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// How the run ended.
    pub outcome: RunOutcome,
    /// What it used, counted on its native threads.
    pub usage: RunUsage,
    /// The run's id in its `tracing` span (`llamabox_run`), unique in this process.
    pub run_id: u64,
}

/// Stops a run now, native work in flight included, whatever the plugin passed its
/// calls (a client gone, an operator's kill). Clone it into `RunOptions::stop` before
/// the run and keep a clone to call [`RunStop::stop`] from anywhere; a stop before the
/// run starts ends it at once.
#[derive(Clone, Debug)]
pub struct RunStop(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for RunStop {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::watch::Sender::new(false)))
    }
}

impl RunStop {
    /// A handle that has not stopped anything yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stop the run now (or at its start, if it has not started); idempotent.
    pub fn stop(&self) {
        self.0.send_replace(true);
    }

    /// Whether `stop` was called.
    pub fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once `stop` was called.
    async fn stopped(&self) {
        let mut seen = self.0.subscribe();
        // The sender lives in `self`, so this only ends by a stop.
        let _ = seen.wait_for(|stopped| *stopped).await;
    }
}

/// How to run a plugin.
///
/// `#[non_exhaustive]`: build it from [`RunOptions::default`] with the setters
/// (`RunOptions::default().group("tenant").deadline(d)`), so that an option added later
/// does not break an embedder's code.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RunOptions {
    /// Shared cancel tokens open only within their group (one per tenant, say).
    pub group: String,
    /// Stop the whole run, native work included, after this long.
    pub deadline: Option<Duration>,
    /// Its share of a batch's step rows beside other runs (a tenant's weight; 1 by
    /// default): a run of weight 3 gets three times the prompt rows of one of weight 1
    /// while both wait for rows.
    pub weight: u32,
    /// Its priority class in a batch: a higher class's prompt rows go before any lower
    /// one's (0 by default).
    pub priority: u8,
    /// This run's limits (a tenant's, say) instead of the host's.
    pub limits: Option<Limits>,
    /// The models this run may open instead of the host's [`PluginHost::models`] (a
    /// [`ModelRegistry::subset`] of them, say, which shares their loaded weights).
    pub models: Option<Arc<ModelRegistry>>,
    /// A handle that stops the run now (`RunOutcome::Stopped`).
    pub stop: Option<RunStop>,
    /// The embedder's state for this run, for the host functions it added with
    /// [`PluginHost::with_linker`] ([`PluginState::embedder`]).
    pub embedder: Option<Arc<dyn Any + Send + Sync>>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            group: "default".into(),
            deadline: None,
            weight: 1,
            priority: 0,
            limits: None,
            models: None,
            stop: None,
            embedder: None,
        }
    }
}

impl RunOptions {
    /// The group for shared tokens and prompt reuse.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// Stop the whole run, native work included, after `deadline`.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Its share of a batch's step rows (at least 1).
    pub fn weight(mut self, weight: u32) -> Self {
        self.weight = weight.max(1);
        self
    }

    /// Its priority class in a batch.
    pub fn priority(mut self, priority: u8) -> Self {
        self.priority = priority;
        self
    }

    /// This run's limits instead of the host's.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = Some(limits);
        self
    }

    /// The models this run may open instead of the host's.
    pub fn models(mut self, models: Arc<ModelRegistry>) -> Self {
        self.models = Some(models);
        self
    }

    /// A handle that stops the run now.
    pub fn stop(mut self, stop: RunStop) -> Self {
        self.stop = Some(stop);
        self
    }

    /// The embedder's state for this run ([`PluginState::embedder`]).
    pub fn embedder(mut self, state: Arc<dyn Any + Send + Sync>) -> Self {
        self.embedder = Some(state);
        self
    }
}

/// Settings of a host's engine.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct HostOptions {
    /// A folder for compiled plugins (wasmtime's compile cache), or `None` to compile a
    /// plugin on every `load`. Entries are keyed by the component's bytes, the wasmtime
    /// version and the engine settings, so a changed plugin or host is compiled afresh.
    /// Compiling an 18 MB plugin (CPython inside) takes seconds; loading its entry takes
    /// milliseconds.
    ///
    /// What is in this folder is loaded as native code without verification: it must be
    /// writable by the host's user only (as wasmtime's own cache folder is).
    pub compile_cache: Option<PathBuf>,
}

impl HostOptions {
    /// Keep compiled plugins in `dir` (see [`HostOptions::compile_cache`]).
    pub fn with_compile_cache(dir: impl Into<PathBuf>) -> Self {
        Self { compile_cache: Some(dir.into()) }
    }

    /// The per-user default folder for compiled plugins: `$XDG_CACHE_HOME/llamabox/compiled`,
    /// else `$HOME/.cache/llamabox/compiled`; `None` where neither is set.
    pub fn default_compile_cache() -> Option<PathBuf> {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
        Some(base.join("llamabox").join("compiled"))
    }
}

impl PluginHost {
    /// A host that compiles every plugin it loads (no compile cache).
    pub fn new(registry: ModelRegistry, limits: Limits) -> Result<Self> {
        Self::with_options(registry, limits, HostOptions::default())
    }

    /// A host with `options` (a compile cache, say).
    pub fn with_options(
        registry: ModelRegistry,
        limits: Limits,
        options: HostOptions,
    ) -> Result<Self> {
        Self::build(registry, limits, options).map_err(Error::Host)
    }

    fn build(
        registry: ModelRegistry,
        limits: Limits,
        options: HostOptions,
    ) -> wasmtime::Result<Self> {
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        // WASI 0.3 guests: `async func` imports (`llamabox:inference/async-calls`).
        config.wasm_component_model_async(true);
        let cache = options.compile_cache.as_deref().map(compile_cache).transpose()?;
        config.cache(cache.clone());
        let engine = Engine::new(&config)?;
        let ticker = Arc::new(EpochTicker::start(&engine)?);
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        // WASI 0.3's clock (async `wait-for`), for async guests' timers.
        wasmtime_wasi::p3::clocks::add_to_linker(&mut linker)?;
        // `wasi:http/types` for served plugins (`http-plugin`): requests and responses
        // the server hands in. Not `outgoing-handler`: plugins get no network.
        let http_options = wasmtime_wasi_http::p2::bindings::LinkOptions::default();
        wasmtime_wasi_http::p2::bindings::http::types::add_to_linker::<_, WasiHttp>(
            &mut linker,
            &http_options.into(),
            PluginState::http,
        )?;
        component::add_to_linker(&mut linker)?;
        Ok(Self {
            engine,
            ticker,
            linker,
            registry: Arc::new(registry),
            tokens: Arc::new(TokenRegistry::new()),
            limits,
            workers: Tracker::new(),
            cache,
        })
    }

    /// Native threads (context and media workers, blocking tokenizer calls) that this
    /// host's plugin runs have alive now: 0 whenever no run is in progress.
    pub fn live_workers(&self) -> usize {
        self.workers.live()
    }

    /// The wasmtime engine plugins are compiled with (for [`PluginHost::load_component`]).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Add the product's own host interfaces next to WASI and llamabox's, before loading
    /// the plugins that import them: `add` gets the linker (bindgen's `add_to_linker`
    /// for the product's WIT, or `linker.instance(..)?.func_wrap(..)`), and its
    /// functions reach the run's state through [`PluginState::embedder`]. Defining a
    /// function that is already defined is an error (no shadowing of WASI or llamabox).
    pub fn with_linker(
        &mut self,
        add: impl FnOnce(&mut Linker<PluginState>) -> wasmtime::Result<()>,
    ) -> Result<&mut Self> {
        add(&mut self.linker).map_err(Error::Host)?;
        Ok(self)
    }

    /// The models plugins may open, shared with every plugin this host loaded: register,
    /// replace or unload models here while runs go on. A run that opened a model keeps
    /// it until its handles and contexts are gone.
    pub fn models(&self) -> &Arc<ModelRegistry> {
        &self.registry
    }

    /// Hits and misses of the compile cache, if this host has one.
    pub fn compile_cache_stats(&self) -> Option<CompileCacheStats> {
        self.cache
            .as_ref()
            .map(|c| CompileCacheStats { hits: c.cache_hits(), misses: c.cache_misses() })
    }

    /// Shared cancel tokens. The embedder shares its own [`crate::CancelFlag`] here,
    /// hands the capability to a plugin (an argument, say) and cancels the flag itself
    /// (client gone, deadline hit) to stop the plugin's native calls in flight.
    pub fn tokens(&self) -> &Arc<TokenRegistry> {
        &self.tokens
    }

    /// Compile a plugin and check it can link against this host. It may import every
    /// llamabox interface ([`Grant::all`]); [`PluginHost::load_granted`] grants fewer.
    pub fn load(&self, path: &Path) -> Result<Plugin> {
        self.load_granted(path, Grant::all())
    }

    /// `load`, refusing a plugin that imports a llamabox interface `grant` withholds
    /// ([`Error::NotGranted`]): at load, before it ever runs.
    pub fn load_granted(&self, path: &Path, grant: Grant) -> Result<Plugin> {
        if !path.is_file() {
            return Err(Error::NotFound(path.to_path_buf()));
        }
        let component = Component::from_file(&self.engine, path).map_err(Error::NotAComponent)?;
        self.load_component_granted(component, grant)
    }

    /// `load` from a component's bytes in memory.
    pub fn load_bytes(&self, bytes: &[u8]) -> Result<Plugin> {
        self.load_component(Component::new(&self.engine, bytes).map_err(Error::NotAComponent)?)
    }

    /// `load` off the async executor: compiling takes CPU-seconds for a large plugin.
    pub async fn load_async(self: &Arc<Self>, path: &Path) -> Result<Plugin> {
        self.load_granted_async(path, Grant::all()).await
    }

    /// `load_granted` off the async executor.
    pub async fn load_granted_async(self: &Arc<Self>, path: &Path, grant: Grant) -> Result<Plugin> {
        let (host, path) = (self.clone(), path.to_path_buf());
        match tokio::task::spawn_blocking(move || host.load_granted(&path, grant)).await {
            Ok(loaded) => loaded,
            Err(join) => {
                Err(Error::Host(wasmtime::Error::msg(format!("the compile thread failed: {join}"))))
            }
        }
    }

    /// A component the embedder compiled (or deserialized) itself with this host's
    /// [`PluginHost::engine`].
    pub fn load_component(&self, component: Component) -> Result<Plugin> {
        self.load_component_granted(component, Grant::all())
    }

    /// `load_component`, refusing imports that `grant` withholds.
    pub fn load_component_granted(&self, component: Component, grant: Grant) -> Result<Plugin> {
        let ty = component.component_type();
        let imports: Vec<String> = ty.imports(&self.engine).map(|(name, _)| name.into()).collect();
        if let Some((import, interface)) = grant.first_withheld(imports.iter().map(String::as_str))
        {
            return Err(Error::NotGranted { import: import.into(), interface, grant });
        }
        let pre = self.linker.instantiate_pre(&component).map_err(|source| {
            match crate::component::first_unsupported_wit(imports.iter().map(String::as_str)) {
                Some(import) => Error::WitVersion { import: import.into(), source },
                None => Error::Link {
                    missing: unresolved_imports(&self.linker, &component, &source),
                    source,
                },
            }
        })?;
        let entry = match CommandPre::new(pre.clone()) {
            Ok(command) => PreInstance::Command(command),
            Err(e) => match ProxyPre::new(pre.clone()) {
                Ok(handler) => PreInstance::Http(handler),
                Err(_) if component.get_export_index(None, "run").is_some() => {
                    PreInstance::AsyncRun(pre)
                }
                Err(_) => return Err(Error::NoEntryPoint(e)),
            },
        };
        Ok(Plugin {
            entry,
            registry: self.registry.clone(),
            tokens: self.tokens.clone(),
            limits: self.limits.clone(),
            _ticker: self.ticker.clone(),
            workers: self.workers.clone(),
        })
    }
}

/// wasmtime's compile cache in `dir` (made if missing; wasmtime wants an absolute path).
fn compile_cache(dir: &Path) -> wasmtime::Result<wasmtime::Cache> {
    let io = |what: &str, e: std::io::Error| {
        wasmtime::Error::msg(format!("{what} {}: {e}", dir.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| io("creating the compile cache folder", e))?;
    let dir = dir.canonicalize().map_err(|e| io("resolving", e))?;
    let mut config = wasmtime::CacheConfig::new();
    config.with_directory(dir);
    wasmtime::Cache::new(config)
}
