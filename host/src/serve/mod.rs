//! `llamabox serve`: plugins that are `wasi:http` incoming handlers (the `http-plugin`
//! world), served over HTTP/1.1, one fresh instance per request.
//!
//! What it adds over [`crate::Plugin::serve_http`]:
//! - **hang-ups stop native work**: each request's run has a [`RunStop`]. A guard held
//!   by the request's future and then by its response body trips it when hyper drops
//!   them early: the client closed its socket before the body ended. hyper's HTTP/1
//!   server notices EOF on a busy connection, so this holds in prefill, in generation
//!   and in an encode alike, and it stops that request only;
//! - admission (slots, a thread budget, a bounded queue: [`admission`]), deadlines
//!   (504), body limits (413);
//! - no client can stall or starve the others: a request's body is read whole, within
//!   the body timeout (408) and the body cap (413), before it takes a slot; a client
//!   that stops reading its response is taken for gone after the write-stall timeout
//!   (its run stopped, its connection closed); waiting requests are let in by fair
//!   share between tenants ([`admission`]), and each client address has only so many
//!   requests in progress at once (429, a flood guard);
//! - tenants ([`tenants`]): API keys (401), what each tenant may call (403), its quotas
//!   (429 with `Retry-After` and `x-ratelimit-*`), its own prompt cache (the run's
//!   group), its name for the plugin (`x-llamabox-tenant`), never its key;
//! - `/healthz`, `/readyz`, Prometheus `/metrics` ([`metrics`]), request ids in logs;
//! - reloads (SIGHUP, `POST /admin/reload` behind `admin_key`): the plugins are
//!   resolved, verified and compiled again from the config; requests in flight finish
//!   on the old ones, new requests go to the new ones, and a reload that fails keeps
//!   the old ones serving;
//! - a drain on shutdown: stop accepting, let requests finish within the grace period,
//!   then stop the rest in flight.

pub mod admission;
pub mod config;
pub mod metrics;
mod request;
pub mod tenants;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future as _;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt as _, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use sha2::Digest as _;
use tracing::Instrument as _;

use crate::{
    HostOptions, Limits, ModelRegistry, Plugin, PluginHost, RunOptions, RunOutcome, RunStop,
};
use admission::{Admission, Admitted, Ask, ClientPermit, Clients, Refused};
pub use config::{BatchConfig, PluginConfig, RequestLimits, RequestOverrides, ServeConfig};
use metrics::{Cause, Metrics, PluginLabels, Refusal, TenantLabels};
use request::*;
pub use tenants::TenantConfig;
use tenants::{OverQuota, Tenant, Tenants, Unauthorized};
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every response body the server sends: a plugin's stream, or its own small answers.
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// How long a client may take to send its request head.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// After the grace period, how long stopped runs may take to unwind before exit. Runs
/// stop within milliseconds (one graph node or encode chunk); this bounds a bug.
const STOP_WAIT: Duration = Duration::from_secs(10);
/// Each connection's kernel send buffer (Linux doubles the figure): what a client that
/// stopped reading can leave unread in the kernel before its response stops moving and
/// the write-stall timeout starts. Left to autotuning it may grow to tcp_wmem's 4 MiB,
/// minutes of a token stream; 64 KiB still carries 0.6 MB/s over a 100 ms round trip,
/// more than any response here needs.
const SEND_BUFFER: u32 = 64 << 10;
/// Connections the kernel may hold accepted-but-not-yet-taken (listen(2)'s backlog).
const BACKLOG: u32 = 1024;

/// Builds the server's config again for a reload: the CLI reads its file afresh and puts
/// the same flags over it.
pub type ConfigSource = Arc<dyn Fn() -> anyhow::Result<ServeConfig> + Send + Sync>;

/// A running server. Cheap to share: connections hold an `Arc` of it.
pub struct Server {
    config: ServeConfig,
    host: Arc<PluginHost>,
    /// Set once every model is loaded and every plugin compiled (`/readyz`); replaced
    /// whole by a reload. A request holds the `Arc<Served>` it was routed to, so it
    /// finishes on the plugin it started on.
    plugins: RwLock<Option<Arc<[Arc<Served>]>>>,
    /// Where a reload gets the config (`None`: a server that cannot reload).
    source: Option<ConfigSource>,
    /// One reload at a time.
    reloading: tokio::sync::Mutex<()>,
    /// When the models were loaded (Unix seconds), for the plugins' model cards.
    loaded_at: OnceLock<u64>,
    /// Each plugin name's index in `admission`, kept across reloads.
    admission_slots: Mutex<HashMap<String, usize>>,
    admission: Arc<Admission>,
    tenants: Tenants,
    /// Requests in progress per client address.
    clients: Clients,
    metrics: Metrics,
    draining: AtomicBool,
    /// Requests whose run has not ended, to stop them at shutdown.
    in_flight: Mutex<HashMap<u64, Arc<RequestState>>>,
    next_request: AtomicU64,
}

/// One plugin as served.
struct Served {
    config: PluginConfig,
    plugin: Plugin,
    /// Its digest (the manifest's for a pulled plugin, the file's SHA-256 else) and its
    /// signer's key id, if a key signed it.
    digest: String,
    signer: Option<String>,
    /// The llamabox interfaces it was granted.
    grant: crate::Grant,
    /// Its index in the server's [`Admission`].
    admission: usize,
    /// llama.cpp threads each request holds while it runs (0 when batched: every step
    /// runs on all).
    threads: u32,
    limits: Limits,
    /// What its runs may open: for tenants with a model list of their own, by name.
    access: Arc<Access>,
    tenant_access: HashMap<Arc<str>, Arc<Access>>,
}

/// The models a plugin's runs may open, and the environment that names them.
struct Access {
    models: Arc<ModelRegistry>,
    /// `LLAMABOX_MODELS`, `LLAMABOX_MODELS_LOADED_AT` (Unix seconds) and the configured
    /// environment.
    env: Vec<(String, String)>,
}

impl Served {
    fn access(&self, tenant: &Tenant) -> &Arc<Access> {
        self.tenant_access.get(&tenant.name).unwrap_or(&self.access)
    }
}

impl Server {
    /// Serve `config` until `shutdown` resolves, then drain (see the module docs).
    /// Prints `listening on http://ADDR` once bound, progress while loading, then `ready`.
    /// It cannot reload: [`Server::run_reloading`] can.
    pub async fn run(
        config: ServeConfig,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        Self::serve(config, None, shutdown).await
    }

    /// `run`, reloading its plugins from `source` on SIGHUP and on `POST /admin/reload`.
    pub async fn run_reloading(
        config: ServeConfig,
        source: ConfigSource,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        Self::serve(config, Some(source), shutdown).await
    }

    async fn serve(
        config: ServeConfig,
        source: Option<ConfigSource>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let listener =
            listen(config.listen).with_context(|| format!("listening on {}", config.listen))?;
        let addr = listener.local_addr()?;
        status_line(&format!("listening on http://{addr}"));
        let registry = ModelRegistry::new();
        for (name, path) in &config.models {
            registry.register(name.clone(), path.clone());
        }
        for (name, path) in &config.projectors {
            anyhow::ensure!(
                path.is_file(),
                "projector {name:?}: file {} not found",
                path.display()
            );
            registry.register_projector(name.clone(), path.clone());
        }
        registry.keep_idle_contexts(config.idle_contexts() as usize);
        config.offload().check()?;
        registry.offload(config.offload());
        let metrics = Metrics::new();
        registry.batch(config.batch_policy().map(|policy| crate::BatchPolicy {
            observer: Some(metrics.batch_observer()),
            ..policy
        }));
        let options = HostOptions { compile_cache: config.compile_cache.clone() };
        let host = Arc::new(PluginHost::with_options(registry, Limits::default(), options)?);
        let tenants = Tenants::new(
            &config.tenants,
            &config.trusted_proxies,
            config.requests().max_queue,
            config.metrics_key.as_deref(),
            config.admin_key.as_deref(),
        )?;
        if tenants.keyed() {
            status_line(&format!("{} tenants, each by its API key", tenants.all().len()));
        } else if !addr.ip().is_loopback() {
            status_line(&format!(
                "open: no API keys, anyone who reaches {addr} may use it (each address is a tenant of its own)"
            ));
        }
        let admin = match config.metrics_listen {
            Some(at) => {
                Some(listen(at).with_context(|| format!("listening on {at} for /metrics"))?)
            }
            None => None,
        };
        if let Some(admin) = &admin {
            status_line(&format!("metrics on http://{}/metrics", admin.local_addr()?));
        }
        let server = Arc::new(Server {
            admission: Arc::new(Admission::new(
                config.max_running(),
                config.threads,
                config.requests().max_queue,
                config.requests().queue_timeout(),
            )),
            tenants,
            clients: Clients::new(config.requests().per_client()),
            config,
            host,
            plugins: RwLock::new(None),
            source,
            reloading: tokio::sync::Mutex::new(()),
            loaded_at: OnceLock::new(),
            admission_slots: Mutex::new(HashMap::new()),
            metrics,
            draining: AtomicBool::new(false),
            in_flight: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
        });
        // SIGHUP's default action ends the process: its handler is in place before
        // anything loads.
        if server.source.is_some() {
            server.clone().reload_on_hangup()?;
        }
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        tokio::pin!(shutdown);
        {
            // Health answers while models load; plugin routes wait for `ready`.
            if let Some(admin) = admin {
                let server = server.clone();
                let connections = hyper_util::server::graceful::GracefulShutdown::new();
                tokio::spawn(
                    async move { server.accept(&admin, &connections, Listener::Admin).await },
                );
            }
            let accepting = server.clone().accept(&listener, &graceful, Listener::Main);
            tokio::pin!(accepting);
            tokio::select! {
                loaded = server.load() => {
                    let plugins = loaded?;
                    server.install(plugins);
                    status_line("ready");
                    tokio::select! {
                        () = &mut accepting => {}
                        () = &mut shutdown => {}
                    }
                }
                () = &mut shutdown => {}
            }
        }
        drop(listener);
        server.drain(graceful).await;
        Ok(())
    }

    /// Load (and warm up) every model once and compile every plugin.
    async fn load(&self) -> anyhow::Result<Vec<Arc<Served>>> {
        // Plugins from registries first: a registry that is down, a digest that does not
        // match or an artifact that is not a component stops the start before the models
        // take their time.
        let resolved = self.resolve_plugins(&self.config).await?;
        let registry = self.host.models();
        for (name, path) in &self.config.models {
            status_line(&format!("loading model {name} from {}", path.display()));
            let started = Instant::now();
            let model = registry
                .open(name)
                .await
                .map_err(|e| anyhow::anyhow!("model {name:?} ({}): {e}", path.display()))?;
            let threads = self.config.threads;
            tokio::task::spawn_blocking(move || crate::native::warm_up(model, threads))
                .await?
                .with_context(|| format!("warming up model {name:?}"))?;
            status_line(&format!(
                "loaded and warmed up model {name} in {:.2} s",
                started.elapsed().as_secs_f64()
            ));
        }
        // When the models were loaded, for the plugins' model cards (OpenAI's `created`).
        let loaded_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let _ = self.loaded_at.set(loaded_at);
        self.compile_plugins(&self.config, resolved).await
    }

    /// Where each of `config`'s plugins is on disk, pulled and verified if it comes from
    /// a registry.
    async fn resolve_plugins(
        &self,
        config: &ServeConfig,
    ) -> anyhow::Result<Vec<crate::source::Resolved>> {
        let mut resolved = Vec::new();
        for plugin in &config.plugins {
            let mut registry = config.registry.clone();
            registry.signatures = plugin.signatures.unwrap_or(registry.signatures);
            let found = crate::source::resolve(
                &plugin.path,
                &registry,
                self.config.compile_cache.as_deref(),
            )
            .await
            .with_context(|| format!("plugin {:?}", plugin.name))?;
            resolved.push(found);
        }
        Ok(resolved)
    }

    /// Compile `config`'s plugins (found at `resolved`) under their grants, into what
    /// the server routes to. The models are the server's own, loaded at start.
    async fn compile_plugins(
        &self,
        config: &ServeConfig,
        resolved: Vec<crate::source::Resolved>,
    ) -> anyhow::Result<Vec<Arc<Served>>> {
        let registry = self.host.models();
        let loaded_at = self.loaded_at.get().copied().unwrap_or_default();
        let mut plugins = Vec::new();
        for (config, resolved) in config.plugins.iter().zip(resolved) {
            let started = Instant::now();
            let grant = config.grant(&resolved)?;
            let plugin = self
                .host
                .load_granted_async(&resolved.path, grant)
                .await
                .with_context(|| format!("plugin {:?}", config.name))?;
            anyhow::ensure!(
                plugin.serves_http(),
                "plugin {:?} is not an HTTP handler: it must export wasi:http/incoming-handler (the http-plugin world)",
                config.name
            );
            let names: Vec<String> = config.models.clone().unwrap_or_else(|| {
                self.config.models.keys().chain(self.config.projectors.keys()).cloned().collect()
            });
            let access = |names: &[String]| {
                let mut env = vec![
                    ("LLAMABOX_MODELS".to_string(), names.join(",")),
                    ("LLAMABOX_MODELS_LOADED_AT".to_string(), loaded_at.to_string()),
                ];
                env.extend(config.env.iter().map(|(k, v)| (k.clone(), v.clone())));
                Arc::new(Access { models: Arc::new(registry.subset(names)), env })
            };
            let tenant_access = (self.tenants.all().iter())
                .filter_map(|tenant| {
                    let allowed = tenant.models.as_ref()?;
                    let both: Vec<String> =
                        names.iter().filter(|n| allowed.contains(n)).cloned().collect();
                    Some((tenant.name.clone(), access(&both)))
                })
                .collect();
            let (digest, signer) = match resolved.pulled {
                Some(pulled) => (pulled.digest, pulled.signer),
                None => (file_digest(&resolved.path).await?, None),
            };
            let origin = match &signer {
                Some(key) => format!(" ({digest}, signed by {key})"),
                None => format!(" ({digest})"),
            };
            status_line(&format!(
                "compiled plugin {}{origin} in {:.2} s, granted {}, serving {}",
                config.name,
                started.elapsed().as_secs_f64(),
                grant,
                config.route()
            ));
            let slots = config.max_concurrent.unwrap_or(self.config.requests().max_concurrent);
            plugins.push(Arc::new(Served {
                admission: self.admission_slot(&config.name, slots),
                // Batched requests hold no threads of their own: every step runs on all.
                threads: if self.config.batch.enabled() { 0 } else { config.threads },
                limits: self.config.plugin_limits(config),
                access: access(&names),
                tenant_access,
                plugin,
                digest,
                signer,
                grant,
                config: config.clone(),
            }));
        }
        Ok(plugins)
    }

    /// Accept connections until the listener fails for good (never, in practice).
    async fn accept(
        self: Arc<Self>,
        listener: &tokio::net::TcpListener,
        graceful: &hyper_util::server::graceful::GracefulShutdown,
        kind: Listener,
    ) {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let server = self.clone();
            let peer = Peer { ip: peer.ip(), close: Arc::new(tokio::sync::Notify::new()), kind };
            let close = peer.close.clone();
            let service = hyper::service::service_fn(move |request| {
                let (server, peer) = (server.clone(), peer.clone());
                async move { Ok::<_, Infallible>(server.route(request, peer).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let connection = graceful.watch(connection);
            tokio::spawn(async move {
                tokio::select! {
                    ended = connection => {
                        if let Err(e) = ended {
                            tracing::debug!("connection ended: {e}");
                        }
                    }
                    // Dropping the connection closes its socket, whatever hyper waits on.
                    () = close.notified() => tracing::debug!("connection closed: its client stopped reading"),
                }
            });
        }
    }

    /// Stop accepting (done by the caller), let requests finish within the grace
    /// period, stop what is left, and wait until no native work remains.
    async fn drain(&self, graceful: hyper_util::server::graceful::GracefulShutdown) {
        self.draining.store(true, Relaxed);
        let running = self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).len();
        status_line(&format!(
            "draining: {running} requests in flight, {} ms grace",
            self.config.requests().shutdown_grace_ms
        ));
        let connections = graceful.shutdown();
        tokio::pin!(connections);
        let finished =
            tokio::time::timeout(self.config.requests().shutdown_grace(), &mut connections)
                .await
                .is_ok();
        if !finished {
            let states: Vec<_> = self
                .in_flight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .cloned()
                .collect();
            status_line(&format!("grace period over: stopping {} requests", states.len()));
            for state in states {
                state.stop(Cause::Shutdown);
            }
            let _ = tokio::time::timeout(STOP_WAIT, &mut connections).await;
        }
        // Runs end (and their native threads are joined) before their bodies do, but a
        // run whose client already left may still be unwinding.
        let deadline = Instant::now() + STOP_WAIT;
        while (!self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
            || self.host.live_workers() > 0)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        status_line("stopped");
    }

    async fn route(self: Arc<Self>, request: Request<Incoming>, peer: Peer) -> Response<Body> {
        let path = request.uri().path();
        let shape = Shape::of(path);
        if request.method() == Method::GET {
            match path {
                "/healthz" => return text(StatusCode::OK, "ok\n"),
                "/readyz" => {
                    return match (self.plugins().is_some(), self.draining.load(Relaxed)) {
                        (_, true) => text(StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
                        (false, _) => text(StatusCode::SERVICE_UNAVAILABLE, "loading\n"),
                        (true, false) => text(StatusCode::OK, "ready\n"),
                    }
                }
                "/metrics" => return self.metrics_page(request.headers(), peer.kind, shape),
                _ => {}
            }
        }
        if request.method() == Method::POST && path == "/admin/reload" {
            return self.reload_page(request.headers(), shape).await;
        }
        if peer.kind == Listener::Admin {
            return error(shape, StatusCode::NOT_FOUND, "this address serves /metrics only", None);
        }
        let Some(plugins) = self.plugins() else {
            return error(
                shape,
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is loading its models",
                Some(1),
            );
        };
        match plugins.iter().find(|served| route_matches(served.config.route(), path)).cloned() {
            Some(served) => {
                let id = self.request_id(&request);
                let span = tracing::info_span!(
                    "request",
                    id = %id,
                    plugin = %served.config.name,
                    tenant = tracing::field::Empty
                );
                self.serve_plugin(served, id, request, peer, shape).instrument(span).await
            }
            None => error(shape, StatusCode::NOT_FOUND, "no plugin serves this path", None),
        }
    }

    /// `POST /admin/reload`: the operator's (`admin_key`), on either address.
    async fn reload_page(&self, headers: &http::HeaderMap, shape: Shape) -> Response<Body> {
        if !self.tenants.has_admin_key() {
            return error(
                shape,
                StatusCode::NOT_FOUND,
                "reloading over HTTP needs admin_key (SIGHUP reloads without one)",
                None,
            );
        }
        if !self.tenants.is_admin_key(headers) {
            return error(
                shape,
                StatusCode::UNAUTHORIZED,
                "/admin/reload needs the admin key",
                None,
            );
        }
        match self.reload().await {
            Ok(plugins) => {
                let plugins: Vec<_> = plugins
                    .iter()
                    .map(|served| {
                        serde_json::json!({
                            "plugin": served.config.name,
                            "route": served.config.route(),
                            "digest": served.digest,
                            "signer": served.signer,
                            "grant": served.grant.to_string(),
                        })
                    })
                    .collect();
                let body = serde_json::json!({ "reloaded": plugins });
                let mut response = Response::new(full(body.to_string()));
                response
                    .headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                response
            }
            Err(e) => error(
                shape,
                StatusCode::UNPROCESSABLE_ENTITY,
                &format!("reload refused, the old plugins keep serving: {e:#}"),
                None,
            ),
        }
    }

    /// The plugins served now (`None` while the server loads).
    fn plugins(&self) -> Option<Arc<[Arc<Served>]>> {
        self.plugins.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Serve `plugins` from now on (longest route first, so `/a/b` wins over `/a` and
    /// `/`), and show their digests in `/metrics`.
    fn install(&self, mut plugins: Vec<Arc<Served>>) {
        plugins.sort_by_key(|served| std::cmp::Reverse(served.config.route().len()));
        self.metrics.plugin_info.clear();
        for served in &plugins {
            self.metrics
                .plugin_info
                .get_or_create(&metrics::PluginInfoLabels {
                    plugin: served.config.name.clone(),
                    digest: served.digest.clone(),
                    signer: served.signer.clone().unwrap_or_default(),
                })
                .set(1);
        }
        *self.plugins.write().unwrap_or_else(|p| p.into_inner()) = Some(plugins.into());
    }

    /// The admission index of the plugin `name`: the one it had before a reload, with
    /// its slots set to `slots`, or a new one.
    fn admission_slot(&self, name: &str, slots: u32) -> usize {
        let mut known = self.admission_slots.lock().unwrap_or_else(|p| p.into_inner());
        match known.get(name) {
            Some(&index) => {
                self.admission.set_plugin_slots(index, slots);
                index
            }
            None => {
                let index = self.admission.add_plugin(slots);
                known.insert(name.to_string(), index);
                index
            }
        }
    }

    /// Build the config again from its source and serve its plugins: each resolved,
    /// pulled, verified and compiled before any is swapped in. Only `[[plugins]]` and
    /// `[registry]` take effect; the rest (models, tenants, limits of the server) is
    /// what the server started with. On any error the old plugins keep serving.
    async fn reload(&self) -> anyhow::Result<Arc<[Arc<Served>]>> {
        let Some(source) = &self.source else {
            anyhow::bail!("this server was started without a config to reload");
        };
        let _one = self.reloading.lock().await;
        anyhow::ensure!(self.plugins().is_some(), "the server is still loading");
        let source = source.clone();
        let config = tokio::task::spawn_blocking(move || source()).await??;
        for plugin in &config.plugins {
            for model in plugin.models.iter().flatten() {
                anyhow::ensure!(
                    self.config.models.contains_key(model)
                        || self.config.projectors.contains_key(model),
                    "plugin {:?}: model {model:?} was not loaded at start (models change with a restart)",
                    plugin.name
                );
            }
        }
        let resolved = self.resolve_plugins(&config).await?;
        let plugins = self.compile_plugins(&config, resolved).await?;
        self.install(plugins);
        let served = self.plugins().unwrap_or_else(|| Arc::from(Vec::new()));
        let names: Vec<String> =
            served.iter().map(|s| format!("{} {}", s.config.name, s.digest)).collect();
        status_line(&format!("reloaded: {}", names.join(", ")));
        Ok(served)
    }

    /// Reload on each SIGHUP; a reload that fails is logged and changes nothing.
    fn reload_on_hangup(self: Arc<Self>) -> anyhow::Result<()> {
        let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("installing the SIGHUP handler")?;
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                status_line("SIGHUP: reloading the plugins");
                if let Err(e) = self.reload().await {
                    status_line(&format!("reload refused, the old plugins keep serving: {e:#}"));
                }
            }
        });
        Ok(())
    }

    /// `GET /metrics`: on its own address if it has one; else behind `metrics_key` if
    /// set; else open on an open server and refused on a server with tenants (the
    /// counts of every plugin and tenant are the operator's, not a tenant's).
    fn metrics_page(
        &self,
        headers: &http::HeaderMap,
        kind: Listener,
        shape: Shape,
    ) -> Response<Body> {
        let allowed = match (kind, &self.config.metrics_listen, &self.config.metrics_key) {
            (Listener::Admin, ..) => Ok(()),
            (Listener::Main, Some(_), _) => {
                return error(
                    shape,
                    StatusCode::NOT_FOUND,
                    "/metrics is served on metrics_listen",
                    None,
                )
            }
            (Listener::Main, None, Some(_)) if self.tenants.is_metrics_key(headers) => Ok(()),
            (Listener::Main, None, Some(_)) => Err("/metrics needs the metrics key"),
            (Listener::Main, None, None) if self.tenants.keyed() => Err(
                "/metrics is closed on a server with tenants: set metrics_key or metrics_listen",
            ),
            (Listener::Main, None, None) => Ok(()),
        };
        if let Err(message) = allowed {
            return error(shape, StatusCode::UNAUTHORIZED, message, None);
        }
        self.metrics.queue_depth.set(self.admission.queued().into());
        self.metrics.live_workers.set(self.host.live_workers() as i64);
        self.metrics.idle_contexts.set(self.host.models().idle_contexts() as i64);
        let mut response = Response::new(full(self.metrics.encode()));
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(metrics::CONTENT_TYPE));
        response
    }

    /// The client's `x-request-id` if it is short and printable, else a new one.
    fn request_id(&self, request: &Request<Incoming>) -> String {
        let given = request.headers().get("x-request-id").and_then(|v| v.to_str().ok());
        match given {
            Some(id)
                if !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_graphic()) =>
            {
                id.to_string()
            }
            _ => format!("{:016x}", self.next_request.fetch_add(1, Relaxed)),
        }
    }

    async fn serve_plugin(
        self: Arc<Self>,
        served: Arc<Served>,
        id: String,
        request: Request<Incoming>,
        peer: Peer,
        shape: Shape,
    ) -> Response<Body> {
        let name = served.config.name.as_str();
        let path = request.uri().path().to_string();
        let retry_after = self.config.requests().queue_timeout().as_secs().max(1);
        let error = |status, message: &str, retry_after| error(shape, status, message, retry_after);
        if self.draining.load(Relaxed) {
            self.metrics.refuse(name, Refusal::Draining);
            return self.answer(
                name,
                &id,
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the server is shutting down",
                    Some(retry_after),
                ),
            );
        }
        let max_body = self.config.requests().max_body_bytes;
        let too_large = || {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("the request body is over {max_body} bytes"),
                None,
            )
        };
        if request.body().size_hint().lower() > max_body {
            self.metrics.refuse(name, Refusal::BodyTooLarge);
            return self.answer(name, &id, closing(too_large()));
        }
        // Who is asking, before anything is read or held.
        let tenant = match self.tenants.identify(request.headers(), peer.ip) {
            Ok(tenant) => tenant,
            Err(why) => {
                self.metrics.refuse(name, Refusal::Unauthorized);
                let message = match why {
                    Unauthorized::NoKey => {
                        "no API key: send `authorization: Bearer KEY` or `x-api-key: KEY`"
                    }
                    Unauthorized::WrongKey => "the API key is not valid",
                };
                return self.answer(
                    name,
                    &id,
                    closing(error(StatusCode::UNAUTHORIZED, message, None)),
                );
            }
        };
        tracing::Span::current().record("tenant", tracing::field::display(&tenant.name));
        if !tenant.may_call(name) {
            self.metrics.refuse(name, Refusal::Forbidden);
            let message = format!("tenant {} may not call plugin {name}", tenant.name);
            return self.answer(name, &id, closing(error(StatusCode::FORBIDDEN, &message, None)));
        }
        // OpenAI's `x-ratelimit-*` on every answer of a tenant with budgets, as they
        // stand when it is sent.
        let add_limits = |headers: &mut http::HeaderMap| {
            for (header, value) in tenant.rate_limit_headers() {
                if let Ok(value) = HeaderValue::from_str(&value) {
                    headers.insert(header, value);
                }
            }
        };
        let with_limits = |mut response: Response<Body>| {
            add_limits(response.headers_mut());
            response
        };
        let tenant_place = match tenant.enter() {
            Ok(place) => place,
            Err(over) => {
                self.metrics.refuse(name, Refusal::TenantQuota);
                let (message, kind, wait) = match over {
                    OverQuota::Concurrent(max) => (
                        format!("tenant {} already has {max} requests in progress", tenant.name),
                        "requests",
                        retry_after,
                    ),
                    OverQuota::PerMinute { what, per_minute, retry_after } => (
                        format!(
                            "tenant {} is over its {per_minute} {what} per minute",
                            tenant.name
                        ),
                        what,
                        retry_after.as_secs_f64().ceil() as u64,
                    ),
                };
                let refusal = rate_limited(shape, &message, kind, wait.max(1));
                return self.answer(name, &id, closing(with_limits(refusal)));
            }
        };
        // Held from here to the end of the run: reading the body, queued and running.
        let address = self.tenants.client_address(request.headers(), peer.ip);
        let client = match self.clients.enter(address) {
            Ok(permit) => permit,
            Err(max) => {
                self.metrics.refuse(name, Refusal::ClientLimit);
                let message = format!("this client address already has {max} requests in progress");
                let refusal = rate_limited(shape, &message, "requests", retry_after);
                return self.answer(name, &id, closing(refusal));
            }
        };
        // The whole body before a slot: a client that stalls mid-body holds no slot.
        let (parts, body) = request.into_parts();
        let timeout = self.config.requests().body_timeout();
        let reading = Reading::new(&self.metrics.reading_bodies);
        let body = match tokio::time::timeout(
            timeout,
            Limited::new(body, usize::try_from(max_body).unwrap_or(usize::MAX)).collect(),
        )
        .await
        {
            Ok(Ok(body)) => body.to_bytes(),
            Ok(Err(e)) if e.is::<LengthLimitError>() => {
                self.metrics.refuse(name, Refusal::BodyTooLarge);
                return self.answer(name, &id, closing(too_large()));
            }
            Ok(Err(e)) => {
                // The client hung up mid-body (or sent a malformed chunk).
                tracing::debug!("reading the request body failed: {e}");
                return self.answer(
                    name,
                    &id,
                    closing(error(
                        StatusCode::BAD_REQUEST,
                        "the request body could not be read",
                        None,
                    )),
                );
            }
            Err(_) => {
                self.metrics.refuse(name, Refusal::BodyTimeout);
                let message =
                    format!("the request body did not arrive within {} ms", timeout.as_millis());
                return self.answer(
                    name,
                    &id,
                    closing(error(StatusCode::REQUEST_TIMEOUT, &message, None)),
                );
            }
        };
        drop(reading);
        // The tenant first: prompts are reused, and shared tokens opened, only within
        // one tenant's group (across plugins only where their config names the same
        // group), and within one `cache_salt` where the request gives one.
        let mut group = format!("{}/{}", tenant.name, served.config.group());
        if let Some(salt) = cache_salt(&parts.headers, &body) {
            group += &format!("/salt-{salt}");
        }
        let deadline = Duration::from_millis(served.config.deadline_ms);
        let ask = Ask {
            tenant: tenant.name.clone(),
            weight: tenant.weight,
            priority: tenant.priority,
            max_queued: tenant.max_queued,
            deadline: Instant::now() + deadline,
            plugin: served.admission,
            threads: served.threads,
        };
        let admitted = match self.admission.admit(ask).await {
            Ok(admitted) => admitted,
            Err(Refused::TenantQueueFull(max)) => {
                self.metrics.refuse(name, Refusal::TenantQuota);
                let message = format!("tenant {} already has {max} requests waiting", tenant.name);
                let refusal = rate_limited(shape, &message, "requests", retry_after);
                return self.answer(name, &id, with_limits(refusal));
            }
            Err(refused) => {
                let (reason, message) = match refused {
                    Refused::QueueFull => (Refusal::QueueFull, "the server's queue is full"),
                    _ => (Refusal::QueueTimeout, "no slot came free in time"),
                };
                self.metrics.refuse(name, reason);
                return self.answer(
                    name,
                    &id,
                    error(StatusCode::SERVICE_UNAVAILABLE, message, Some(retry_after)),
                );
            }
        };
        self.metrics
            .tenant_requests
            .get_or_create(&TenantLabels { tenant: tenant.label.to_string() })
            .inc();
        let state = Arc::new(RequestState::new());
        let key = self.next_request.fetch_add(1, Relaxed);
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).insert(key, state.clone());
        self.metrics.in_flight.inc();
        // From here on a drop of this future (the client left) stops the run.
        let mut hang_up = HangUp {
            server: self.clone(),
            plugin: served.clone(),
            state: state.clone(),
            answered: false,
            completed: false,
        };
        let request = for_plugin(
            Request::from_parts(parts, body),
            served.config.route(),
            self.config.listen,
            &tenant.name,
        );
        let (respond, response) = tokio::sync::oneshot::channel();
        let (ended, run_ended) = tokio::sync::oneshot::channel();
        let replies = Replies { respond, ended };
        let place = ClientPlace(Arc::new(Mutex::new(client)));
        let holds = Holds {
            _admitted: admitted,
            _place: tenant_place,
            tenant: tenant.clone(),
            group,
            client: place.clone(),
        };
        let run = tokio::spawn(
            self.clone()
                .run_request(served.clone(), key, state.clone(), holds, request, replies)
                .in_current_span(),
        );
        let response = match response.await {
            Ok(Ok(response)) => response,
            Ok(Err(code)) => {
                // The plugin's own answer: its run goes on to its end (or deadline).
                tracing::warn!("the plugin answered with an error: {code:?}");
                (hang_up.answered, hang_up.completed) = (true, true);
                let message = format!("the plugin failed: {code:?}");
                return self.answer(
                    name,
                    &id,
                    error(StatusCode::INTERNAL_SERVER_ERROR, &message, None),
                );
            }
            Err(_) => {
                // The run ended without a response: why decides the status.
                let ended = run.await.unwrap_or(RunEnd::Failed);
                hang_up.answered = true;
                let response = match ended {
                    RunEnd::Outcome(RunOutcome::DeadlineExceeded) => {
                        error(StatusCode::GATEWAY_TIMEOUT, "the request's deadline passed", None)
                    }
                    RunEnd::Outcome(RunOutcome::Stopped) => error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the server is shutting down",
                        Some(retry_after),
                    ),
                    RunEnd::Outcome(RunOutcome::Success | RunOutcome::Failed(_)) => error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the plugin returned without a response",
                        None,
                    ),
                    RunEnd::Failed => {
                        error(StatusCode::INTERNAL_SERVER_ERROR, "the plugin failed", None)
                    }
                };
                return self.answer(name, &id, response);
            }
        };
        hang_up.answered = true;
        let (mut parts, body) = response.into_parts();
        log_reason(&mut parts);
        add_limits(&mut parts.headers);
        let progress = Arc::new(Progress::new());
        watch_for_stall(
            progress.clone(),
            state,
            peer.close,
            self.config.requests().write_stall_timeout(),
        );
        let body = GuardedBody {
            hang_up: Some(hang_up),
            inner: body,
            inner_ended: false,
            run_ended,
            stream: EventStream::of(&path, &parts.headers),
            closed_with_error: false,
            progress: Watched(progress),
            client: place,
        };
        self.answer(name, &id, Response::from_parts(parts, body.boxed_unsync()))
    }

    /// Count the response's status and tag it with the request id.
    ///
    /// (A plugin's own reason for an error goes to the log first: [`log_reason`].)
    fn answer(&self, plugin: &str, id: &str, mut response: Response<Body>) -> Response<Body> {
        self.metrics.answered(plugin, response.status().as_u16());
        tracing::info!(status = response.status().as_u16(), "answered");
        if let Ok(id) = HeaderValue::from_str(id) {
            response.headers_mut().insert("x-request-id", id);
        }
        response
    }

    /// The run of one request, on its own task: it outlives the response head (the
    /// body streams from it) and ends before its native threads are gone.
    async fn run_request(
        self: Arc<Self>,
        served: Arc<Served>,
        key: u64,
        state: Arc<RequestState>,
        holds: Holds,
        request: Request<PluginBody>,
        replies: Replies,
    ) -> RunEnd {
        let tenant = holds.tenant.clone();
        let access = served.access(&tenant);
        let options = RunOptions {
            group: holds.group.clone(),
            deadline: Some(Duration::from_millis(served.config.deadline_ms)),
            weight: tenant.weight,
            priority: tenant.priority,
            limits: Some(served.limits.clone()),
            models: Some(access.models.clone()),
            stop: Some(state.run.clone()),
            embedder: None,
        };
        let mut wasi = wasmtime_wasi::WasiCtxBuilder::new();
        wasi.envs(&access.env).inherit_stderr();
        let started = Instant::now();
        let report = served.plugin.serve_http(&options, wasi, request, replies.respond).await;
        state.finished.store(true, Relaxed);
        // Given back before the body can end: a client that sends its next request as
        // soon as it has the last byte finds its place free.
        drop(holds);
        // Whether a body that ended was the plugin's whole body: only if its handler
        // returned by itself (a stopped run's body ends when its store is dropped).
        let _ = replies.ended.send(match &report {
            Ok(r) if matches!(r.outcome, RunOutcome::Success | RunOutcome::Failed(_)) => {
                BodyEnd::Whole
            }
            Ok(r) if r.outcome == RunOutcome::DeadlineExceeded => BodyEnd::Cut {
                code: "deadline_exceeded",
                message: format!(
                    "the request's deadline of {} ms passed: the answer was cut short here",
                    served.config.deadline_ms
                ),
            },
            Ok(_) => match state.cause.get() {
                Some(Cause::Shutdown) => BodyEnd::Cut {
                    code: "server_shutdown",
                    message: "the server shut down: the answer was cut short here".into(),
                },
                _ => BodyEnd::Cut {
                    code: "stopped",
                    message: "the request was stopped: the answer was cut short here".into(),
                },
            },
            Err(_) => BodyEnd::Cut {
                code: "plugin_failed",
                message: "the plugin failed: the answer was cut short here".into(),
            },
        });
        let elapsed = started.elapsed();
        let labels = PluginLabels { plugin: served.config.name.clone() };
        let metrics = &self.metrics;
        metrics.in_flight.dec();
        metrics.request_seconds.get_or_create(&labels).observe(elapsed.as_secs_f64());
        let (ended, stopped_by) = match report {
            Ok(report) => {
                let usage = report.usage;
                // Prompt plus completion: every row its contexts held, computed or reused.
                let tokens = usage.tokens_decoded + usage.tokens_reused;
                tenant.charge_tokens(tokens);
                let tenant_labels = TenantLabels { tenant: tenant.label.to_string() };
                metrics.tenant_tokens.get_or_create(&tenant_labels).inc_by(tokens);
                let stopped_by = state.stopped_by(&report.outcome, usage.cancels);
                metrics.tokens_generated.get_or_create(&labels).inc_by(usage.tokens_generated);
                metrics.tokens_decoded.get_or_create(&labels).inc_by(usage.tokens_decoded);
                metrics.tokens_reused.get_or_create(&labels).inc_by(usage.tokens_reused);
                if usage.tokens_generated > 0 {
                    let rate = usage.tokens_generated as f64 / elapsed.as_secs_f64().max(1e-6);
                    metrics.generated_tokens_per_second.get_or_create(&labels).observe(rate);
                }
                match (stopped_by, &report.outcome) {
                    (Some(cause), _) => metrics.cancel(cause, 1),
                    (None, RunOutcome::DeadlineExceeded) => metrics.cancel(Cause::Deadline, 1),
                    (None, _) if usage.cancels > 0 => metrics.cancel(Cause::Plugin, usage.cancels),
                    (None, _) => {}
                }
                tracing::info!(
                    outcome = ?report.outcome,
                    ms = elapsed.as_millis() as u64,
                    decoded = usage.tokens_decoded,
                    reused = usage.tokens_reused,
                    generated = usage.tokens_generated,
                    cancels = usage.cancels,
                    "run ended"
                );
                (RunEnd::Outcome(report.outcome), stopped_by)
            }
            Err(e) => {
                let stopped_by = state.cause.get().copied();
                if let Some(cause) = stopped_by {
                    metrics.cancel(cause, 1);
                }
                tracing::warn!(
                    ms = elapsed.as_millis() as u64,
                    "run failed: {:#}",
                    anyhow::Error::from(e)
                );
                (RunEnd::Failed, stopped_by)
            }
        };
        match (stopped_by, state.hung_up_at.get()) {
            (Some(Cause::Disconnect), Some(at)) => {
                let stopped_in = at.elapsed();
                metrics.disconnect_stop_seconds.observe(stopped_in.as_secs_f64());
                tracing::info!(
                    stop_ms = stopped_in.as_secs_f64() * 1e3,
                    "client hung up; its native work stopped"
                );
            }
            (None, Some(_)) => tracing::debug!(
                "client left once the plugin's work was done: nothing was cut short"
            ),
            _ => {}
        }
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        ended
    }
}

/// The connection a request came on: its client's address, and a way to close it.
#[derive(Clone)]
struct Peer {
    ip: IpAddr,
    /// Closes the connection (its task drops it): for a client that stopped reading.
    close: Arc<tokio::sync::Notify>,
    kind: Listener,
}

/// Which address a connection came to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Listener {
    /// `listen`: the plugins, the health checks, and `/metrics` unless it has its own.
    Main,
    /// `metrics_listen`: `/metrics` and the health checks only.
    Admin,
}

/// Bind `addr` with a small send buffer ([`SEND_BUFFER`]), which accepted connections
/// inherit.
fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As TcpListener::bind does: a restarted server rebinds at once.
    socket.set_reuseaddr(true)?;
    socket.set_send_buffer_size(SEND_BUFFER)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// `response` with `connection: close`: the rest of its request's body was not read,
/// so the connection cannot carry another request.
fn closing(mut response: Response<Body>) -> Response<Body> {
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Whether `route` serves `path`: the same, or a prefix ending at a `/`.
fn route_matches(route: &str, path: &str) -> bool {
    route == "/"
        || path == route
        || path.strip_prefix(route).is_some_and(|rest| rest.starts_with('/'))
}

fn full(text: impl Into<Bytes>) -> Body {
    Full::new(text.into()).map_err(|never| match never {}).boxed_unsync()
}

fn text(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut response = Response::new(full(text));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

/// A JSON body's top-level `cache_salt` (vLLM's field), as a digest: requests with
/// different salts never reuse each other's prompts, even within a tenant. Read here,
/// not by the plugin, because the group is fixed before the plugin runs; the digest
/// keeps the client's text out of groups and logs.
fn cache_salt(headers: &http::HeaderMap, body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Salted {
        cache_salt: Option<String>,
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    if !json {
        return None;
    }
    let salt = serde_json::from_slice::<Salted>(body).ok()?.cache_salt?;
    let digest = sha2::Sha256::digest(salt.as_bytes());
    Some(digest[..8].iter().map(|b| format!("{b:02x}")).collect())
}

/// Which API's error body a path gets: Anthropic's for its Messages API, OpenAI's
/// everywhere else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    OpenAi,
    Anthropic,
}

impl Shape {
    fn of(path: &str) -> Self {
        if path.contains("/v1/messages") {
            Shape::Anthropic
        } else {
            Shape::OpenAi
        }
    }
}

/// The server's own errors, in the API's own shape: OpenAI's `{"error": {"message",
/// "type", "param", "code"}}` or Anthropic's `{"type": "error", "error": {"type",
/// "message"}}`, each API's type names for the status.
fn error(
    shape: Shape,
    status: StatusCode,
    message: &str,
    retry_after: Option<u64>,
) -> Response<Body> {
    let openai_type =
        if status.is_server_error() { "server_error" } else { "invalid_request_error" };
    typed_error(shape, status, openai_type, message, retry_after)
}

/// A 429 from a quota: OpenAI types it by what ran out (`requests` or `tokens`).
fn rate_limited(
    shape: Shape,
    message: &str,
    kind: &'static str,
    retry_after: u64,
) -> Response<Body> {
    typed_error(shape, StatusCode::TOO_MANY_REQUESTS, kind, message, Some(retry_after))
}

fn typed_error(
    shape: Shape,
    status: StatusCode,
    openai_type: &str,
    message: &str,
    retry_after: Option<u64>,
) -> Response<Body> {
    let body = match shape {
        Shape::OpenAi => {
            let code = match status {
                StatusCode::UNAUTHORIZED => Some("invalid_api_key"),
                StatusCode::FORBIDDEN => Some("permission_denied"),
                StatusCode::TOO_MANY_REQUESTS => Some("rate_limit_exceeded"),
                _ => None,
            };
            serde_json::json!({"error": {"message": message, "type": openai_type, "param": null, "code": code}})
        }
        Shape::Anthropic => {
            let kind = match status {
                StatusCode::UNAUTHORIZED => "authentication_error",
                StatusCode::FORBIDDEN => "permission_error",
                StatusCode::NOT_FOUND => "not_found_error",
                StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
                StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
                StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
                s if s.is_server_error() => "api_error",
                _ => "invalid_request_error",
            };
            serde_json::json!({"type": "error", "error": {"type": kind, "message": message}})
        }
    };
    let body = format!("{body}\n");
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(seconds) = retry_after {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// A line on stdout for whoever started the server (and the tests, which wait for
/// `ready`).
/// `sha256:HEX` of a plugin file, for `/metrics` and the logs.
async fn file_digest(path: &std::path::Path) -> anyhow::Result<String> {
    let bytes =
        tokio::fs::read(path).await.with_context(|| format!("reading {}", path.display()))?;
    let hash = sha2::Sha256::digest(&bytes);
    Ok(format!("sha256:{}", hash.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

fn status_line(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The header in which a plugin says why it answered with an error (its field's path
/// and message); see guest/openai's `http::send_error`.
const REASON_HEADER: &str = "llamabox-reason";
/// The most of a plugin's reason that is logged.
const MAX_REASON_CHARS: usize = 300;

/// Log a plugin's reason for an error answer in the request's span, beside its status,
/// and keep it from the client: it is for the operator. Written with `Debug` escapes
/// and cut short, so that a plugin cannot forge or flood log lines through it.
fn log_reason(parts: &mut http::response::Parts) {
    let Some(reason) = parts.headers.remove(REASON_HEADER) else { return };
    if parts.status.is_client_error() || parts.status.is_server_error() {
        let reason: String =
            String::from_utf8_lossy(reason.as_bytes()).chars().take(MAX_REASON_CHARS).collect();
        tracing::info!(status = parts.status.as_u16(), reason = ?reason, "refused by the plugin");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_match_at_segment_boundaries() {
        assert!(route_matches("/", "/v1/models"));
        assert!(route_matches("/a", "/a"));
        assert!(route_matches("/a", "/a/v1"));
        assert!(!route_matches("/a", "/ab"));
        assert!(!route_matches("/a/b", "/a"));
    }

    #[tokio::test]
    async fn accepted_connections_inherit_the_small_send_buffer() {
        let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let (_client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let socket =
            tokio::net::TcpSocket::from_std_stream(accepted.unwrap().0.into_std().unwrap());
        // Linux doubles what was set (for its bookkeeping) and locks it: no autotuning.
        assert_eq!(socket.send_buffer_size().unwrap(), 2 * SEND_BUFFER);
    }

    #[test]
    fn progress_waits_only_while_a_piece_is_held_back() {
        let progress = Progress::new();
        assert!(progress.waiting().is_some(), "the head is handed over at the start");
        progress.taken();
        assert_eq!(progress.waiting(), None);
        progress.handed();
        std::thread::sleep(Duration::from_millis(5));
        assert!(progress.waiting().unwrap() >= Duration::from_millis(5));
    }

    async fn json_of(response: Response<Body>) -> serde_json::Value {
        let body = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&body).unwrap()
    }

    #[test]
    fn a_cache_salt_is_read_from_a_json_body_as_a_digest() {
        let json: http::HeaderMap =
            [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))]
                .into_iter()
                .collect();
        let salt = |body: &str| cache_salt(&json, body.as_bytes());
        let a = salt(r#"{"model":"m","cache_salt":"alice","messages":[]}"#).unwrap();
        assert_eq!(a.len(), 16);
        assert!(!a.contains("alice"));
        assert_ne!(Some(a.clone()), salt(r#"{"cache_salt":"bob"}"#));
        assert_eq!(Some(a), salt(r#"{"cache_salt":"alice"}"#));
        assert_eq!(salt(r#"{"model":"m"}"#), None);
        assert_eq!(salt("not json"), None);
        assert_eq!(cache_salt(&http::HeaderMap::new(), br#"{"cache_salt":"alice"}"#), None);
    }

    #[tokio::test]
    async fn errors_are_json_in_each_apis_shape() {
        let message = "a \"b\"\n\\";
        let openai = json_of(error(Shape::OpenAi, StatusCode::BAD_REQUEST, message, None)).await;
        assert_eq!(openai["error"]["message"], message);
        assert_eq!(openai["error"]["type"], "invalid_request_error");
        let limited = json_of(rate_limited(Shape::OpenAi, "m", "tokens", 3)).await;
        assert_eq!(
            (limited["error"]["type"].as_str(), limited["error"]["code"].as_str()),
            (Some("tokens"), Some("rate_limit_exceeded"))
        );
        assert_eq!(Shape::of("/v1/messages/count_tokens"), Shape::Anthropic);
        assert_eq!(Shape::of("/v1/chat/completions"), Shape::OpenAi);
        let anthropic =
            json_of(error(Shape::Anthropic, StatusCode::UNAUTHORIZED, message, None)).await;
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "authentication_error");
        assert_eq!(anthropic["error"]["message"], message);
    }
}
