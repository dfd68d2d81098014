//! Running plugin components: an engine, a linker with WASI 0.2 and llamabox, and one
//! fresh store per run.

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

use crate::component::{self, LlamaCtx, LlamaCtxView, LlamaView, Limits, ModelRegistry, TokenRegistry};
use crate::error::{Error, Result};
use crate::native::Meter;
use crate::worker::Tracker;

/// Store data of one plugin run. Host functions the embedder adds (see
/// [`PluginHost::with_linker`]) get it, with the run's [`RunOptions::embedder`] state.
pub struct PluginState {
    wasi: WasiCtx,
    http: WasiHttpCtx,
    no_outgoing: NoOutgoingRequests,
    llama: LlamaCtx,
    table: ResourceTable,
    limits: RunLimiter,
    embedder: Option<Arc<dyn Any + Send + Sync>>,
}

impl PluginState {
    /// The embedder's state for this run ([`RunOptions::embedder`]), if it is a `T`.
    pub fn embedder<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.embedder.as_deref()?.downcast_ref()
    }

    /// The run's resource table, for the embedder's own resources.
    pub fn table(&mut self) -> &mut ResourceTable {
        &mut self.table
    }

    /// The run's tenant ([`RunOptions::group`]).
    pub fn group(&self) -> &str {
        self.llama.group()
    }
}

/// The run's wasm limits, remembering which one refused a growth: the guest sees a
/// failed `memory.grow` and usually traps, and the trap is then reported as that limit.
struct RunLimiter {
    limits: wasmtime::StoreLimits,
    refused: Option<&'static str>,
}

impl wasmtime::ResourceLimiter for RunLimiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let allowed = self.limits.memory_growing(current, desired, maximum)?;
        if !allowed {
            self.refused.get_or_insert("max-wasm-memory");
        }
        Ok(allowed)
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let allowed = self.limits.table_growing(current, desired, maximum)?;
        if !allowed {
            self.refused.get_or_insert("max-wasm-table-elements");
        }
        Ok(allowed)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
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

impl WasiHttpView for PluginState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView { ctx: &mut self.http, table: &mut self.table, hooks: &mut self.no_outgoing }
    }
}

/// `wasi:http` hooks of a served plugin. `outgoing-handler` is never linked (a plugin
/// makes no requests), so `send_request` is unreachable; it refuses all the same.
struct NoOutgoingRequests;

impl wasmtime_wasi_http::WasiHttpHooks for NoOutgoingRequests {
    fn send_request(
        &mut self,
        _request: http::Request<wasmtime_wasi_http::WasiBody>,
        _options: Option<wasmtime_wasi_http::RequestOptions>,
        _fut: Box<dyn std::future::Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
    ) -> Box<
        dyn std::future::Future<
                Output = Result<
                    (
                        http::Response<wasmtime_wasi_http::WasiBody>,
                        Box<dyn std::future::Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
                    ),
                    wasmtime_wasi_http::Error,
                >,
            > + Send,
    > {
        Box::new(std::future::ready(Err(wasmtime_wasi_http::Error::HttpRequestDenied)))
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
pub struct RunReport {
    pub outcome: RunOutcome,
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
        Self { group: "default".into(), deadline: None, limits: None, models: None, stop: None, embedder: None }
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
    pub fn new(registry: ModelRegistry, limits: Limits) -> Result<Self> {
        Self::with_options(registry, limits, HostOptions::default())
    }

    pub fn with_options(registry: ModelRegistry, limits: Limits, options: HostOptions) -> Result<Self> {
        Self::build(registry, limits, options).map_err(Error::Host)
    }

    fn build(registry: ModelRegistry, limits: Limits, options: HostOptions) -> wasmtime::Result<Self> {
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
        self.cache.as_ref().map(|c| CompileCacheStats { hits: c.cache_hits(), misses: c.cache_misses() })
    }

    /// Shared cancel tokens. The embedder shares its own [`crate::CancelFlag`] here,
    /// hands the capability to a plugin (an argument, say) and cancels the flag itself
    /// (client gone, deadline hit) to stop the plugin's native calls in flight.
    pub fn tokens(&self) -> &Arc<TokenRegistry> {
        &self.tokens
    }

    /// Compile a plugin and check it can link against this host.
    pub fn load(&self, path: &Path) -> Result<Plugin> {
        if !path.is_file() {
            return Err(Error::NotFound(path.to_path_buf()));
        }
        let component = Component::from_file(&self.engine, path).map_err(Error::NotAComponent)?;
        self.load_component(component)
    }

    pub fn load_bytes(&self, bytes: &[u8]) -> Result<Plugin> {
        self.load_component(Component::new(&self.engine, bytes).map_err(Error::NotAComponent)?)
    }

    /// `load` off the async executor: compiling takes CPU-seconds for a large plugin.
    pub async fn load_async(self: &Arc<Self>, path: &Path) -> Result<Plugin> {
        let (host, path) = (self.clone(), path.to_path_buf());
        match tokio::task::spawn_blocking(move || host.load(&path)).await {
            Ok(loaded) => loaded,
            Err(join) => Err(Error::Host(wasmtime::Error::msg(format!("the compile thread failed: {join}")))),
        }
    }

    /// A component the embedder compiled (or deserialized) itself with this host's
    /// [`PluginHost::engine`].
    pub fn load_component(&self, component: Component) -> Result<Plugin> {
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|source| Error::Link { missing: unresolved_imports(&self.linker, &component, &source), source })?;
        let entry = match CommandPre::new(pre.clone()) {
            Ok(command) => PreInstance::Command(command),
            Err(e) => match ProxyPre::new(pre.clone()) {
                Ok(handler) => PreInstance::Http(handler),
                Err(_) if component.get_export_index(None, "run").is_some() => PreInstance::AsyncRun(pre),
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

/// Every top-level import of `component` that `linker` cannot satisfy (absent, or of
/// another type), by name. wasmtime's check stops at the first one (`error`), so each
/// one found is stubbed in a scratch copy of the linker and the check runs again.
fn unresolved_imports(linker: &Linker<PluginState>, component: &Component, error: &wasmtime::Error) -> Vec<String> {
    let (engine, ty) = (component.engine(), component.component_type());
    let mut probe = linker.clone();
    probe.allow_shadowing(true);
    let mut missing: Vec<String> = Vec::new();
    let mut next = first_unresolved(error);
    while let Some(name) = next.take() {
        if missing.contains(&name) {
            break; // stubbing it did not satisfy the check: report what was found
        }
        let stubbed = ty.get_import(engine, &name).is_some_and(|import| stub(&mut probe.root(), &name, &import.ty, engine).is_ok());
        missing.push(name);
        if !stubbed || missing.len() >= ty.imports(engine).len() {
            break;
        }
        if let Err(e) = probe.instantiate_pre(component) {
            next = first_unresolved(&e);
        }
    }
    missing
}

/// The import named in `instantiate_pre`'s error: "component imports instance `NAME`,
/// but a matching implementation was not found in the linker".
fn first_unresolved(error: &wasmtime::Error) -> Option<String> {
    error.chain().find_map(|cause| {
        let text = cause.to_string();
        let rest = text.strip_prefix("component imports ")?;
        Some(rest.split('`').nth(1)?.to_string())
    })
}

/// A resource type for stubs; never instantiated.
struct StubResource;

/// Define `name` (of type `item`) in `linker` with functions that fail if called: only
/// to let the link check go on past it.
fn stub(
    linker: &mut wasmtime::component::LinkerInstance<'_, PluginState>,
    name: &str,
    item: &wasmtime::component::types::ComponentItem,
    engine: &Engine,
) -> wasmtime::Result<()> {
    use wasmtime::component::types::ComponentItem;
    match item {
        ComponentItem::ComponentFunc(func) if func.async_() => {
            linker.func_new_concurrent(name, |_, _, _, _| Box::pin(async { wasmtime::bail!("a link-check stub") }))
        }
        ComponentItem::ComponentFunc(_) => linker.func_new(name, |_, _, _, _| wasmtime::bail!("a link-check stub")),
        ComponentItem::Resource(_) => {
            linker.resource(name, wasmtime::component::ResourceType::host::<StubResource>(), |_, _| Ok(()))
        }
        ComponentItem::ComponentInstance(instance) => {
            let mut inner = linker.instance(name)?;
            instance.exports(engine).try_for_each(|(export, item)| stub(&mut inner, export, &item.ty, engine))
        }
        // Types need no definition; modules and components are not imported by plugins.
        ComponentItem::Type(_) => Ok(()),
        _ => wasmtime::bail!("{name}: not a kind of import the link check can stub"),
    }
}

/// wasmtime's compile cache in `dir` (made if missing; wasmtime wants an absolute path).
fn compile_cache(dir: &Path) -> wasmtime::Result<wasmtime::Cache> {
    let io = |what: &str, e: std::io::Error| wasmtime::Error::msg(format!("{what} {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(|e| io("creating the compile cache folder", e))?;
    let dir = dir.canonicalize().map_err(|e| io("resolving", e))?;
    let mut config = wasmtime::CacheConfig::new();
    config.with_directory(dir);
    wasmtime::Cache::new(config)
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
enum PreInstance {
    /// A WASI 0.2 command: `wasi:cli/run`.
    Command(CommandPre<PluginState>),
    /// A WASI 0.3 plugin (`plugin-async` world): an async `run` export, called
    /// concurrently so its tasks can await async imports.
    AsyncRun(InstancePre<PluginState>),
    /// A `wasi:http` incoming handler (`http-plugin` world): one `handle` per request.
    Http(ProxyPre<PluginState>),
}

impl PreInstance {
    /// What kind of plugin this is, for errors.
    fn kind(&self) -> &'static str {
        match self {
            PreInstance::Command(_) | PreInstance::AsyncRun(_) => "a command (wasi:cli/run or run)",
            PreInstance::Http(_) => "an HTTP handler (wasi:http/incoming-handler)",
        }
    }

    fn engine(&self) -> &Engine {
        match self {
            PreInstance::Command(pre) => pre.engine(),
            PreInstance::AsyncRun(pre) => pre.engine(),
            PreInstance::Http(pre) => pre.engine(),
        }
    }
}

/// What a run calls in its fresh instance.
enum Invocation {
    /// The plugin's main: `wasi:cli/run`, or `run` of a WASI 0.3 plugin.
    Main,
    /// `wasi:http/incoming-handler.handle` with this request; the response the plugin
    /// sets goes to `respond`.
    Http { request: Box<hyper::Request<HyperIncomingBody>>, respond: ResponseSender },
}

/// The response a served plugin sets: status, headers and a body that streams as the
/// plugin writes it (or the `wasi:http` error code it answered with instead).
pub type HttpResponse = hyper::Response<HyperOutgoingBody>;

/// Where [`Plugin::serve_http`] sends the plugin's response.
pub type ResponseSender = tokio::sync::oneshot::Sender<Result<HttpResponse, ErrorCode>>;

/// A compiled plugin, ready to run any number of times.
pub struct Plugin {
    entry: PreInstance,
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
    pub async fn run(&self, wasi: WasiCtxBuilder) -> Result<RunOutcome> {
        self.run_with(&RunOptions::default(), wasi).await
    }

    /// `run` with a group for shared tokens, this run's limits, a deadline and a stop
    /// handle.
    ///
    /// Returns only once every native call the run started has stopped and its memory
    /// is freed: dropping the store (at the end, on a trap, or at the deadline) stops
    /// every worker's call without blocking the executor, and the run then awaits its
    /// threads.
    pub async fn run_with(&self, options: &RunOptions, wasi: WasiCtxBuilder) -> Result<RunOutcome> {
        Ok(self.run_report(options, wasi).await?.outcome)
    }

    /// `run_with`, returning what the run used with its outcome. The run (and every
    /// native thread working for it, so llama.cpp's log lines from its calls) is in a
    /// `tracing` span `llamabox_run` with its `group` and `run` id.
    pub async fn run_report(&self, options: &RunOptions, wasi: WasiCtxBuilder) -> Result<RunReport> {
        if let PreInstance::Http(_) = self.entry {
            return Err(Error::WrongKind { wanted: "a command", found: self.entry.kind() });
        }
        self.run_call(options, wasi, Invocation::Main).await
    }

    /// Whether this plugin is an HTTP handler (`http-plugin` world), to serve with
    /// [`Plugin::serve_http`], rather than a command to [`Plugin::run`].
    pub fn serves_http(&self) -> bool {
        matches!(self.entry, PreInstance::Http(_))
    }

    /// Serve one HTTP request in a fresh instance (the `http-plugin` world): the
    /// plugin's `wasi:http/incoming-handler.handle` gets `request`, and the response it
    /// sets goes to `respond` at once, with a body that streams as the plugin writes it.
    /// Returns when the handler has returned (or the deadline or a stop ended it) and
    /// every native call it started has stopped, like [`Plugin::run_report`]. If the
    /// plugin never set a response, `respond` is dropped unsent.
    ///
    /// A client that hangs up is the embedder's to notice: stop the run with
    /// [`RunOptions::stop`] and its native work stops in flight (`llamabox serve` does).
    pub async fn serve_http<B>(
        &self,
        options: &RunOptions,
        wasi: WasiCtxBuilder,
        request: hyper::Request<B>,
        respond: ResponseSender,
    ) -> Result<RunReport>
    where
        B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
        B::Error: Into<wasmtime_wasi_http::Error>,
    {
        use http_body_util::BodyExt as _;
        if !self.serves_http() {
            return Err(Error::WrongKind { wanted: "an HTTP handler", found: self.entry.kind() });
        }
        let request = request.map(|body| body.map_err(Into::into).boxed_unsync());
        self.run_call(options, wasi, Invocation::Http { request: Box::new(request), respond }).await
    }

    async fn run_call(&self, options: &RunOptions, wasi: WasiCtxBuilder, call: Invocation) -> Result<RunReport> {
        static NEXT_RUN: AtomicU64 = AtomicU64::new(1);
        let run_id = NEXT_RUN.fetch_add(1, Relaxed);
        let span = tracing::info_span!("llamabox_run", group = %options.group, run = run_id);
        let (workers, meter) = (self.workers.child(), Arc::new(Meter::new()));
        let outcome = self.run_to_end(options, wasi, call, workers.clone(), meter.clone()).instrument(span).await?;
        let usage = RunUsage {
            tokens_decoded: meter.decoded(),
            tokens_generated: meter.generated(),
            native_time: workers.busy(),
            peak_kv_cells: meter.peak_kv_cells(),
            cancels: meter.cancels(),
            tokens_reused: meter.reused(),
        };
        tracing::debug!(run = run_id, ?outcome, ?usage, "llamabox run ended");
        Ok(RunReport { outcome, usage, run_id })
    }

    async fn run_to_end(&self, options: &RunOptions, wasi: WasiCtxBuilder, call: Invocation, workers: Tracker, meter: Arc<Meter>) -> Result<RunOutcome> {
        let limits = options.limits.as_ref().unwrap_or(&self.limits);
        let run = self.run_in_store(options, limits, wasi, call, workers.clone(), meter);
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
        // The guest runs inside the poll of `run`: a stop that came while it ran, and
        // ended it (a write to a departed client's body fails), is still a stop.
        let stopped_meanwhile = options.stop.as_ref().is_some_and(RunStop::is_stopped);
        let outcome = match outcome {
            Ok(RunOutcome::Success | RunOutcome::Failed(_)) if stopped_meanwhile => Ok(RunOutcome::Stopped),
            other => other,
        };
        workers.all_stopped().await;
        outcome
    }

    async fn run_in_store(
        &self,
        options: &RunOptions,
        limits: &Limits,
        mut wasi: WasiCtxBuilder,
        call: Invocation,
        workers: Tracker,
        meter: Arc<Meter>,
    ) -> Result<RunOutcome> {
        let models = options.models.clone().unwrap_or_else(|| self.registry.clone());
        let llama = LlamaCtx::new(models, self.tokens.clone(), options.group.as_str(), limits.clone());
        let state = PluginState {
            wasi: wasi.build(),
            http: WasiHttpCtx::new(),
            no_outgoing: NoOutgoingRequests,
            llama: llama.tracked_by(workers).metered_by(meter),
            table: ResourceTable::new(),
            limits: RunLimiter { limits: limits.store_limits(), refused: None },
            embedder: options.embedder.clone(),
        };
        let mut store = Store::new(self.entry.engine(), state);
        store.limiter(|state| &mut state.limits);
        store.epoch_deadline_async_yield_and_update(1);
        let ended = match (&self.entry, call) {
            (PreInstance::Http(pre), Invocation::Http { request, respond }) => match pre.instantiate_async(&mut store).await {
                Ok(proxy) => Self::handle(&mut store, &proxy, *request, respond).await,
                Err(e) => Err(e),
            },
            (PreInstance::Http(_), Invocation::Main) => return Err(Error::WrongKind { wanted: "a command", found: self.entry.kind() }),
            (_, Invocation::Http { .. }) => return Err(Error::WrongKind { wanted: "an HTTP handler", found: self.entry.kind() }),
            (PreInstance::Command(pre), Invocation::Main) => match pre.instantiate_async(&mut store).await {
                Ok(command) => command.wasi_cli_run().call_run(&mut store).await,
                Err(e) => Err(e),
            },
            (PreInstance::AsyncRun(pre), Invocation::Main) => match pre.instantiate_async(&mut store).await {
                Ok(instance) => match instance.get_typed_func::<(), (Result<(), ()>,)>(&mut store, "run") {
                    Ok(run) => store
                        .run_concurrent(async |accessor| run.call_concurrent(accessor, ()).await)
                        .await
                        .and_then(|r| r)
                        .map(|(r,)| r),
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            },
        };
        match ended {
            Ok(Ok(())) => Ok(RunOutcome::Success),
            Ok(Err(())) => Ok(RunOutcome::Failed(1)),
            Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
                Some(wasmtime_wasi::I32Exit(0)) => Ok(RunOutcome::Success),
                Some(wasmtime_wasi::I32Exit(code)) => Ok(RunOutcome::Failed(*code)),
                None => Err(match store.data().limits.refused {
                    Some(limit) => Error::Limit { limit, source: e },
                    None => Error::Trap { code: e.downcast_ref::<wasmtime::Trap>().copied(), source: e },
                }),
            },
        }
    }

    /// Invocation the handler with `request`; its response goes to `respond`. The `Ok(())`
    /// is the shape of a command's result: a handler has no exit status.
    async fn handle(
        store: &mut Store<PluginState>,
        proxy: &wasmtime_wasi_http::p2::bindings::Proxy,
        request: hyper::Request<HyperIncomingBody>,
        respond: ResponseSender,
    ) -> wasmtime::Result<Result<(), ()>> {
        let mut http = store.data_mut().http();
        let request = http.new_incoming_request(wasmtime_wasi_http::p2::bindings::http::types::Scheme::Http, request)?;
        let response = http.new_response_outparam(respond)?;
        proxy.wasi_http_incoming_handler().call_handle(&mut *store, request, response).await?;
        Ok(Ok(()))
    }
}
