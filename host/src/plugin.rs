//! Running plugin components: an engine, a linker with WASI 0.2 and llamabox, and one
//! fresh store per run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::{Component, InstancePre, Linker, ResourceTable};
use wasmtime::error::Context as _;
use wasmtime::{Engine, Store};
use wasmtime_wasi::p2::bindings::CommandPre;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::component::{self, LlamaCtx, LlamaCtxView, LlamaView, Limits, ModelRegistry, TokenRegistry};
use crate::worker::Tracker;

/// Store data of one plugin run.
pub struct PluginState {
    wasi: WasiCtx,
    llama: LlamaCtx,
    table: ResourceTable,
    limits: wasmtime::StoreLimits,
}

/// How often the engine's epoch advances. A plugin running wasm yields to the executor
/// at every tick, so a guest that loops forever holds no executor thread and a run's
/// deadline can always fire.
const EPOCH_TICK: Duration = Duration::from_millis(10);

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl LlamaView for PluginState {
    fn llama(&mut self) -> LlamaCtxView<'_> {
        LlamaCtxView { ctx: &mut self.llama, table: &mut self.table }
    }
}

/// Hosts plugins: compiles components and runs them against a model registry.
pub struct PluginHost {
    engine: Engine,
    /// Advances the engine's epoch while this host or any plugin it loaded lives.
    ticker: Arc<EpochTicker>,
    linker: Linker<PluginState>,
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

/// How a plugin's `wasi:cli/run` ended (a trap is an `Err` of [`Plugin::run`] instead).
#[derive(Debug, PartialEq, Eq)]
pub enum RunOutcome {
    Success,
    /// The plugin exited with this non-zero status (1 when `run` returned an error).
    Failed(i32),
    /// The run's deadline passed: its store was torn down, every native call it had
    /// running was stopped and its worker joined before this was returned.
    DeadlineExceeded,
    /// The embedder's [`RunStop`] stopped it, with the same teardown as a deadline.
    Stopped,
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
    pub fn new() -> Self {
        Self::default()
    }

    pub fn stop(&self) {
        self.0.send_replace(true);
    }

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
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Shared cancel tokens open only within their group (one per tenant, say).
    pub group: String,
    /// Stop the whole run, native work included, after this long.
    pub deadline: Option<Duration>,
    /// This run's limits (a tenant's, say) instead of the host's.
    pub limits: Option<Limits>,
    /// A handle that stops the run now (`RunOutcome::Stopped`).
    pub stop: Option<RunStop>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self { group: "default".into(), deadline: None, limits: None, stop: None }
    }
}

/// Settings of a host's engine.
#[derive(Clone, Debug, Default)]
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
    pub fn new(registry: ModelRegistry, limits: Limits) -> anyhow::Result<Self> {
        Self::with_options(registry, limits, HostOptions::default())
    }

    pub fn with_options(registry: ModelRegistry, limits: Limits, options: HostOptions) -> anyhow::Result<Self> {
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

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Hits and misses of the compile cache, if this host has one.
    pub fn compile_cache_stats(&self) -> Option<CompileCacheStats> {
        self.cache.as_ref().map(|c| CompileCacheStats { hits: c.cache_hits(), misses: c.cache_misses() })
    }

    /// Shared cancel tokens. The embedder shares its own [`crate::CancelFlag`] here,
    /// hands the capability to a plugin (an argument, say) and cancels the flag itself
    /// (client gone, deadline hit) to stop the plugin's native calls in flight.
    pub fn tokens(&self) -> &Arc<TokenRegistry> {
        &self.tokens
    }

    /// Compile a plugin and check it can link against this host.
    pub fn load(&self, path: &Path) -> anyhow::Result<Plugin> {
        if !path.is_file() {
            anyhow::bail!("plugin {} not found", path.display());
        }
        let component = Component::from_file(&self.engine, path)
            .with_context(|| format!("{} is not a valid WebAssembly component", path.display()))?;
        self.load_component(component)
    }

    pub fn load_bytes(&self, bytes: &[u8]) -> anyhow::Result<Plugin> {
        self.load_component(Component::new(&self.engine, bytes).context("not a valid WebAssembly component")?)
    }

    /// `load` off the async executor: compiling takes CPU-seconds for a large plugin.
    pub async fn load_async(self: &Arc<Self>, path: &Path) -> anyhow::Result<Plugin> {
        let (host, path) = (self.clone(), path.to_path_buf());
        tokio::task::spawn_blocking(move || host.load(&path)).await.context("the compile thread panicked")?
    }

    /// A component the embedder compiled (or deserialized) itself with this host's
    /// [`PluginHost::engine`].
    pub fn load_component(&self, component: Component) -> anyhow::Result<Plugin> {
        let pre = self.linker.instantiate_pre(&component).map_err(|e| {
            let missing = crate::missing_imports::unsatisfied_imports(&self.linker, &component);
            if missing.is_empty() {
                e.context("the plugin imports something this host does not provide")
            } else {
                e.context(format!("the plugin imports what this host does not provide: {}", missing.join(", ")))
            }
        })?;
        let entry = match CommandPre::new(pre.clone()) {
            Ok(command) => Entry::Command(command),
            Err(_) if component.get_export_index(None, "run").is_some() => Entry::AsyncRun(pre),
            Err(e) => {
                let e = e.context("the plugin exports neither wasi:cli/run (a WASI 0.2 command) nor `run` (plugin-async)");
                return Err(e.into());
            }
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
fn compile_cache(dir: &Path) -> anyhow::Result<wasmtime::Cache> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating the compile cache folder {}", dir.display()))?;
    let dir = dir.canonicalize().with_context(|| format!("resolving {}", dir.display()))?;
    let mut config = wasmtime::CacheConfig::new();
    config.with_directory(dir);
    Ok(wasmtime::Cache::new(config)?)
}

/// The thread that advances an engine's epoch every `EPOCH_TICK`, so running wasm yields
/// and deadlines fire. Shared by the host and every plugin it loaded: a plugin that
/// outlives its host still has its deadlines. Stops when the last holder is dropped.
struct EpochTicker {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl EpochTicker {
    fn start(engine: &Engine) -> std::io::Result<Self> {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stopped, engine) = (stop.clone(), engine.clone());
        std::thread::Builder::new().name("llamabox-epoch".into()).spawn(move || {
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(EPOCH_TICK);
                engine.increment_epoch();
            }
        })?;
        Ok(Self { stop })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How a plugin is started.
enum Entry {
    /// A WASI 0.2 command: `wasi:cli/run`.
    Command(CommandPre<PluginState>),
    /// A WASI 0.3 plugin (`plugin-async` world): an async `run` export, called
    /// concurrently so its tasks can await async imports.
    AsyncRun(InstancePre<PluginState>),
}

/// A compiled plugin, ready to run any number of times.
pub struct Plugin {
    entry: Entry,
    registry: Arc<ModelRegistry>,
    tokens: Arc<TokenRegistry>,
    limits: Limits,
    /// Keeps the epoch advancing for this plugin's runs after its host is gone.
    _ticker: Arc<EpochTicker>,
    workers: Tracker,
}

impl Plugin {
    /// Run the plugin's `wasi:cli/run` in a fresh store. `wasi` sets its arguments and
    /// stdio (it gets no filesystem, network or environment unless given here).
    pub async fn run(&self, wasi: WasiCtxBuilder) -> anyhow::Result<RunOutcome> {
        self.run_with(&RunOptions::default(), wasi).await
    }

    /// `run` with a group for shared tokens, this run's limits, a deadline and a stop
    /// handle.
    ///
    /// Returns only once every native call the run started has stopped and its memory
    /// is freed: dropping the store (at the end, on a trap, or at the deadline) stops
    /// every worker's call without blocking the executor, and the run then awaits its
    /// threads.
    pub async fn run_with(&self, options: &RunOptions, wasi: WasiCtxBuilder) -> anyhow::Result<RunOutcome> {
        let workers = self.workers.child();
        let limits = options.limits.as_ref().unwrap_or(&self.limits);
        let run = self.run_in_store(&options.group, limits, wasi, workers.clone());
        let deadline = async {
            match options.deadline {
                Some(after) => tokio::time::sleep(after).await,
                None => std::future::pending().await,
            }
        };
        let stop = async {
            match &options.stop {
                Some(stop) => stop.stopped().await,
                None => std::future::pending().await,
            }
        };
        // Whichever ends first; the others are dropped, and dropping the run drops its
        // store: every worker's call is stopped (see `Worker::drop`).
        let outcome = tokio::select! {
            biased;
            () = stop => Ok(RunOutcome::Stopped),
            () = deadline => Ok(RunOutcome::DeadlineExceeded),
            outcome = run => outcome,
        };
        workers.all_stopped().await;
        outcome
    }

    async fn run_in_store(&self, group: &str, limits: &Limits, mut wasi: WasiCtxBuilder, workers: Tracker) -> anyhow::Result<RunOutcome> {
        let llama = LlamaCtx::new(self.registry.clone(), self.tokens.clone(), group, limits.clone());
        let state = PluginState {
            wasi: wasi.build(),
            llama: llama.tracked_by(workers),
            table: ResourceTable::new(),
            limits: limits.store_limits(),
        };
        let engine = match &self.entry {
            Entry::Command(pre) => pre.engine(),
            Entry::AsyncRun(pre) => pre.engine(),
        };
        let mut store = Store::new(engine, state);
        store.limiter(|state| &mut state.limits);
        store.epoch_deadline_async_yield_and_update(1);
        let ended = match &self.entry {
            Entry::Command(pre) => {
                let command = pre.instantiate_async(&mut store).await?;
                command.wasi_cli_run().call_run(&mut store).await
            }
            Entry::AsyncRun(pre) => {
                let instance = pre.instantiate_async(&mut store).await?;
                let run = instance.get_typed_func::<(), (Result<(), ()>,)>(&mut store, "run")?;
                store.run_concurrent(async |accessor| run.call_concurrent(accessor, ()).await).await.and_then(|r| r).map(|(r,)| r)
            }
        };
        match ended {
            Ok(Ok(())) => Ok(RunOutcome::Success),
            Ok(Err(())) => Ok(RunOutcome::Failed(1)),
            Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
                Some(wasmtime_wasi::I32Exit(0)) => Ok(RunOutcome::Success),
                Some(wasmtime_wasi::I32Exit(code)) => Ok(RunOutcome::Failed(*code)),
                None => Err(e.into()),
            },
        }
    }
}
