//! `llamabox serve`'s settings: a TOML file (many plugins, each with its models, limits
//! and tenant), or the same built from command-line flags.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::tenants::TenantConfig;
use crate::{LimitOverrides, Limits};

/// The whole server. Field names are the TOML keys.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Where to listen, e.g. `127.0.0.1:8080` (port 0 picks a free one).
    pub listen: SocketAddr,
    /// llama.cpp threads all running requests may use together (default: every core).
    /// Each request holds its plugin's `threads` of it while it runs, so concurrent
    /// contexts never oversubscribe the cores (ggml's threads wait on each other at
    /// every graph barrier, and a descheduled one stalls the whole team).
    #[serde(default = "all_cores")]
    pub threads: u32,
    /// How requests are taken in and bounded: how many run and wait, how long and how
    /// large they may be (`[requests]`, the `--max-concurrent`... flags).
    #[serde(default)]
    pub requests: RequestOverrides,
    /// Tenants, each named by an API key. With none, the server is open: each client
    /// address is a tenant of its own (and the server says so at start when it listens
    /// beyond loopback).
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// Proxies (addresses or networks, `10.0.0.0/8`) whose `Forwarded` /
    /// `X-Forwarded-For` headers name the client; from anyone else they are ignored.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// The key `/metrics` asks for (`authorization: Bearer`). Without it (and without
    /// `metrics_listen`), `/metrics` is open on an open server and refused on a server
    /// with tenants.
    pub metrics_key: Option<String>,
    /// The key `POST /admin/reload` asks for (`authorization: Bearer`). Without it, the
    /// config is reloaded only on SIGHUP.
    pub admin_key: Option<String>,
    /// Serve `/metrics` (and the health checks) on this address instead, e.g. a
    /// cluster-internal port; the main address then answers 404 for it.
    pub metrics_listen: Option<SocketAddr>,
    /// Compiled plugins are kept here between starts (see `HostOptions::compile_cache`).
    pub compile_cache: Option<PathBuf>,
    /// How `oci://` plugins are pulled: size limit, plain-HTTP registries, their cache
    /// (`[registry]`, see `llamabox::source`).
    #[serde(default)]
    pub registry: crate::source::RegistryOptions,
    /// Contexts each model keeps idle between requests, for later requests of the same
    /// group asking for the same context size: they skip creating one and recompute
    /// only the part of their prompt that differs from the last one's (see
    /// `ModelRegistry::keep_idle_contexts`). Each holds its KV cache and compute
    /// buffers. Default: `threads`, at most as many as could be busy at once; 0 frees
    /// every context after its request.
    pub idle_contexts: Option<u32>,
    /// Limits of every plugin over the host's defaults, by group (`[limits.context]`,
    /// `[limits.media]`, ...: see `llamabox::LimitOverrides`); a plugin's
    /// `[plugins.limits.*]` override them knob by knob.
    #[serde(default)]
    pub limits: LimitOverrides,
    /// How running requests are batched (`[batch]`).
    #[serde(default)]
    pub batch: BatchConfig,
    /// Model layers on the GPU (default: all when there is one; 0: the CPU alone).
    pub gpu_layers: Option<u32>,
    /// The GPU by ggml's device name (`llamabox info`; default: the first GPU).
    pub device: Option<String>,
    /// Models by name, loaded once at start.
    #[serde(default)]
    pub models: BTreeMap<String, PathBuf>,
    /// Projectors (mmproj) by name.
    #[serde(default)]
    pub projectors: BTreeMap<String, PathBuf>,
    /// The plugins served, each on its route (`[[plugins]]`).
    pub plugins: Vec<PluginConfig>,
}

/// One served plugin.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginConfig {
    /// Its name: in logs and metrics, its default route and cache group.
    pub name: String,
    /// The component (`http-plugin` world): a file, or `oci://REGISTRY/REPO@sha256:DIGEST`
    /// (or `:TAG`), pulled and verified before it is compiled (`llamabox::source`).
    pub path: PathBuf,
    /// The path prefix it serves, stripped before the plugin sees the request (default:
    /// `/` for the only plugin, else `/NAME`).
    pub route: Option<String>,
    /// llama.cpp threads of each of its contexts, held from the server's `threads`
    /// while a request runs.
    #[serde(default = "one")]
    pub threads: u32,
    /// Its requests running at once (default: the server's `max_concurrent`).
    pub max_concurrent: Option<u32>,
    /// Each request is stopped after this long (answered 504 if no response was
    /// started).
    #[serde(default = "default_deadline_ms")]
    pub deadline_ms: u64,
    /// The cache group of its runs, within each tenant: runs of plugins with the same
    /// group (and the same tenant) may reuse each other's prompts and open each other's
    /// shared cancel tokens. Default: the plugin's name, so nothing crosses plugins
    /// unless their config says so.
    pub group: Option<String>,
    /// Models (and projectors) it may open (default: all).
    pub models: Option<Vec<String>>,
    /// More environment for the plugin (it always gets `LLAMABOX_MODELS` and
    /// `LLAMABOX_MODELS_LOADED_AT`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Its limits over the server's `[limits]`, by group (`[plugins.limits.context]`, ...).
    #[serde(default)]
    pub limits: LimitOverrides,
    /// The llamabox interfaces it may import (`["llm", "generate"]`, `"all"` or
    /// `"none"`), or `"requested"`: what a pulled plugin's artifact asks for. Default:
    /// all for a file, none for an `oci://` plugin. A plugin that imports one it is not
    /// granted is refused at start, naming the import.
    pub grant: Option<crate::source::GrantChoice>,
    /// Its signature policy, over `[registry] signatures` (`oci://` plugins only).
    pub signatures: Option<crate::source::SignaturePolicy>,
}

impl PluginConfig {
    /// Its grant, now that it is found as `resolved` (see [`crate::source::grant_for`]).
    pub fn grant(&self, resolved: &crate::source::Resolved) -> anyhow::Result<crate::Grant> {
        crate::source::grant_for(self.grant, &self.path, resolved)
            .map_err(|e| anyhow::anyhow!("plugin {:?}: {e}", self.name))
    }
}

fn all_cores() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
}
/// 120 s: the most work the default limits allow one request, with SmolLM2-135M on one
/// core of this project's 2-core VM (bench/RESULTS.md): a full 8192-token context with
/// 4096 of it generated (`max_generate_tokens`) is ~22 s of prompt at 187 tokens/s and
/// ~51 s of generation at 81 tokens/s; 120 s leaves room for the slower steps of a
/// long context. Every second more is a second a runaway request holds its slot (300 s
/// did). Raise it for larger models.
fn default_deadline_ms() -> u64 {
    120_000
}
fn one() -> u32 {
    1
}
knob_group! {
    /// How the server takes requests in and bounds them (`[requests]`): how many run
    /// and wait, how long they may wait, and how large and how slow a client may be.
    RequestLimits, RequestOverrides, "requests", "Request limits",
        "`llamabox serve`'s flags over serve.toml's `[requests]`", {
        /// Requests running at once, all plugins together (with batching, at most one
        /// per seat).
        max_concurrent: u32 = 64,
        /// Requests that may wait for a slot; one more is answered 503 at once.
        max_queue: u32 = 64,
        /// Milliseconds a request waits for a slot before it is answered 503: a waiting
        /// client is better off with a 503 and Retry-After soon (its balancer can try
        /// another replica) than after half a minute.
        queue_timeout_ms: u64 = 5_000; "5000",
        /// Largest request body in bytes; a larger one is answered 413.
        max_body_bytes: u64 = 1 << 20; "1048576 (1 MiB)",
        /// Milliseconds a client may take to send its whole request body (from the end
        /// of its head), else 408. The body is read before the request takes a slot, so
        /// a client that stalls mid-body holds only its connection and this much time
        /// (a 1 MiB body arrives in well under a second on any link used for inference).
        body_timeout_ms: u64 = 10_000; "10000",
        /// Milliseconds a response may wait for its client to take the next piece of
        /// its body; then the client is taken for gone: its request is stopped as if it
        /// had hung up (`cause="write_stall"`) and its connection closed. Half nginx's
        /// `send_timeout`: a client that reads at all takes the next piece within round
        /// trips.
        write_stall_timeout_ms: u64 = 30_000; "30000",
        /// Requests one client address (an IPv4 address, an IPv6 /64; the forwarded one
        /// behind a trusted proxy) may have in progress at once, from its request head
        /// to the end of its run; one more is answered 429 at once. A flood guard, not
        /// an identity: contention between clients is settled by fair share (tenants).
        /// 0: no cap.
        max_client_requests: Option<u32> as u32 = None; "max_concurrent",
        /// Milliseconds in-flight requests may take to finish on SIGTERM before they are
        /// stopped (native work included).
        shutdown_grace_ms: u64 = 10_000; "10000",
    }
}

impl RequestLimits {
    /// Requests one client address may have in progress: the setting, or
    /// `max_concurrent`; `None` for no cap (a setting of 0).
    pub fn per_client(&self) -> Option<u32> {
        match self.max_client_requests {
            Some(0) => None,
            Some(n) => Some(n),
            None => Some(self.max_concurrent),
        }
    }

    /// `queue_timeout_ms` as a duration.
    pub fn queue_timeout(&self) -> Duration {
        Duration::from_millis(self.queue_timeout_ms)
    }

    /// `body_timeout_ms` as a duration.
    pub fn body_timeout(&self) -> Duration {
        Duration::from_millis(self.body_timeout_ms)
    }

    /// `write_stall_timeout_ms` as a duration.
    pub fn write_stall_timeout(&self) -> Duration {
        Duration::from_millis(self.write_stall_timeout_ms)
    }

    /// `shutdown_grace_ms` as a duration.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }
}

/// Top-level keys of earlier releases, each with the table and key it moved to. Still
/// read (a warning names the new place) where the table does not set the knob itself.
const MOVED_KEYS: &[(&str, &str, &str)] = &[
    ("batch_seats", "batch", "seats"),
    ("batch_n_ctx", "batch", "n_ctx"),
    ("batch_step_ms", "batch", "step_ms"),
    ("batch_long_prompt_rows", "batch", "long_prompt_rows"),
    ("batch_long_prompt_share", "batch", "long_prompt_share"),
    ("max_concurrent", "requests", "max_concurrent"),
    ("max_queue", "requests", "max_queue"),
    ("queue_timeout_ms", "requests", "queue_timeout_ms"),
    ("max_body_bytes", "requests", "max_body_bytes"),
    ("body_timeout_ms", "requests", "body_timeout_ms"),
    ("write_stall_timeout_ms", "requests", "write_stall_timeout_ms"),
    ("max_client_requests", "requests", "max_client_requests"),
    ("shutdown_grace_ms", "requests", "shutdown_grace_ms"),
];

/// Moves `file`'s keys of earlier releases into their tables (`batch = false` becomes
/// `[batch] enabled = false`) and says where each went, for a warning. A knob its table
/// also sets is dropped: the table wins.
fn adopt_moved_keys(file: &mut toml::Table) -> Vec<String> {
    let mut moved = Vec::new();
    if let Some(&toml::Value::Boolean(on)) = file.get("batch") {
        let table = toml::Table::from_iter([("enabled".to_string(), toml::Value::Boolean(on))]);
        file.insert("batch".into(), table.into());
        moved.push("top-level batch = BOOL is now [batch] enabled = BOOL".to_string());
    }
    for &(old, table, key) in MOVED_KEYS {
        let Some(value) = file.remove(old) else { continue };
        moved.push(format!("top-level {old} is now [{table}] {key}"));
        let entry = file.entry(table).or_insert_with(|| toml::Table::new().into());
        if let toml::Value::Table(table) = entry {
            table.entry(key).or_insert(value);
        }
    }
    moved
}

/// `[batch]` in serve.toml and the `--batch*` flags: one definition per knob, its doc
/// the flag's help and the key's docs, its default in its accessor. The flags given
/// override the file's knobs one by one ([`BatchConfig::overridden_by`]).
///
/// Batching: the one-sequence contexts of all running requests on a model are sequences
/// (seats) of one shared native context, decoded together one step at a time on all
/// `threads`, and a hang-up still stops only its own request's work in flight (see
/// docs/ARCHITECTURE.md). Requests then run `seats` at a time and hold no thread share
/// of their own.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// Batch running requests into one decode per step on all threads (default true);
    /// false gives every request a context of its own with its plugin's `threads`
    /// (answers bit for bit those of one request alone).
    #[cfg_attr(feature = "cli", arg(long = "batch", value_name = "BOOL"))]
    pub enabled: Option<bool>,
    /// Most requests each model's batch decodes together (default 64), as many as
    /// their contexts fit in `cells`.
    #[cfg_attr(feature = "cli", arg(long = "batch-seats", value_name = "N"))]
    pub seats: Option<u32>,
    /// Most tokens one seat may hold (default 4096, the openai plugin's cap); larger
    /// contexts get their own.
    #[cfg_attr(feature = "cli", arg(long = "batch-n-ctx", value_name = "N"))]
    pub n_ctx: Option<u32>,
    /// KV cells the seats share (default 16384: four seats at the largest n_ctx, 64
    /// chats of up to 256 tokens). Each request's context reserves what it asks for
    /// (the openai plugin: prompt plus max_tokens); requests that do not fit wait for
    /// cells in fair order. Allocated when a model's first request comes
    /// (docs/DEPLOY.md has the sizes).
    #[cfg_attr(feature = "cli", arg(long = "batch-cells", value_name = "N"))]
    pub cells: Option<u32>,
    /// The most of the seats and of the cells one tenant's requests hold, 0 to 1
    /// (default 0.75): the rest stays for others, whatever one tenant sends.
    #[cfg_attr(feature = "cli", arg(long = "batch-tenant-share", value_name = "SHARE"))]
    pub tenant_share: Option<f64>,
    /// Milliseconds other requests' prompts may add to a batch step, the most a
    /// streaming client waits for its next token because of them (default 250).
    #[cfg_attr(feature = "cli", arg(long = "batch-step-ms", value_name = "MS"))]
    pub step_ms: Option<u64>,
    /// Prompts with more tokens than this left are long: they yield to streams and
    /// shorter prompts (default 512).
    #[cfg_attr(feature = "cli", arg(long = "batch-long-prompt-rows", value_name = "N"))]
    pub long_prompt_rows: Option<u32>,
    /// The most of the time long prompts take while others have work, 0 to 1 (default
    /// 0.25): 0 makes them wait until nothing else runs, 1 treats them as any other.
    #[cfg_attr(feature = "cli", arg(long = "batch-long-prompt-share", value_name = "SHARE"))]
    pub long_prompt_share: Option<f64>,
}

impl BatchConfig {
    /// Whether requests are batched (default: yes).
    pub fn enabled(&self) -> bool {
        self.enabled.unwrap_or(true)
    }

    /// Seats of each model's batch (default 64).
    pub fn seats(&self) -> u32 {
        self.seats.unwrap_or(64)
    }

    /// Cells the seats share (default 16384).
    pub fn cells(&self) -> u32 {
        self.cells.unwrap_or(16_384)
    }

    /// Cells of each seat (default 4096).
    pub fn n_ctx(&self) -> u32 {
        self.n_ctx.unwrap_or(4096)
    }

    /// `self` with every knob that `over` sets taken from it (flags over the file).
    pub fn overridden_by(&self, over: &BatchConfig) -> BatchConfig {
        BatchConfig {
            enabled: over.enabled.or(self.enabled),
            seats: over.seats.or(self.seats),
            n_ctx: over.n_ctx.or(self.n_ctx),
            cells: over.cells.or(self.cells),
            tenant_share: over.tenant_share.or(self.tenant_share),
            step_ms: over.step_ms.or(self.step_ms),
            long_prompt_rows: over.long_prompt_rows.or(self.long_prompt_rows),
            long_prompt_share: over.long_prompt_share.or(self.long_prompt_share),
        }
    }

    /// The engine's policy for `threads`: the knobs set, [`crate::BatchPolicy::new`]'s
    /// defaults for the rest.
    pub fn policy(&self, threads: u32) -> crate::BatchPolicy {
        let mut policy = crate::BatchPolicy::new(self.seats(), self.n_ctx(), threads);
        policy.cells = self.cells();
        policy.group_share = self.tenant_share.unwrap_or(0.75);
        if let Some(ms) = self.step_ms {
            policy.step_target = Duration::from_millis(ms);
        }
        policy.long_prompt_rows = self.long_prompt_rows.unwrap_or(policy.long_prompt_rows);
        policy.long_prompt_share = self.long_prompt_share.unwrap_or(policy.long_prompt_share);
        policy
    }

    fn check(&self) -> anyhow::Result<()> {
        if !(1..=crate::native::context::MAX_SEQ).contains(&self.seats()) {
            anyhow::bail!(
                "[batch] seats must be 1..={} (llama.cpp's most sequences per context)",
                crate::native::context::MAX_SEQ
            );
        }
        if self.n_ctx() < 16 {
            anyhow::bail!("[batch] n_ctx must be at least 16");
        }
        if self.cells() < self.n_ctx() {
            anyhow::bail!(
                "[batch] cells ({}) must hold at least one seat of n_ctx ({})",
                self.cells(),
                self.n_ctx()
            );
        }
        if !self.tenant_share.is_none_or(|s| s > 0.0 && s <= 1.0) {
            anyhow::bail!("[batch] tenant_share must be above 0 and at most 1");
        }
        if self.step_ms == Some(0)
            || self.long_prompt_share.is_some_and(|s| !(0.0..=1.0).contains(&s))
        {
            anyhow::bail!("[batch] step_ms must be at least 1 and long_prompt_share in 0..=1");
        }
        Ok(())
    }
}

impl ServeConfig {
    /// Read and check a TOML file.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        Self::from_toml(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// Parse and check a config's TOML text.
    /// Keys of earlier releases are still read, each named in a warning with its new
    /// place.
    pub fn from_toml(text: &str) -> anyhow::Result<Self> {
        let mut file: toml::Table = toml::from_str(text)?;
        let moved = adopt_moved_keys(&mut file);
        let mut config: ServeConfig = if moved.is_empty() {
            // From the text, so that an error points at its line.
            toml::from_str(text)?
        } else {
            file.try_into()?
        };
        for warning in moved {
            tracing::warn!("{warning}; the old key is read for now");
        }
        config.check()?;
        Ok(config)
    }

    /// A server with one plugin per `(name, path)`, every model and projector, and the
    /// defaults otherwise (what the command-line flags build).
    pub fn with_plugins(listen: SocketAddr, plugins: Vec<(String, PathBuf)>) -> Self {
        ServeConfig {
            listen,
            threads: all_cores(),
            requests: RequestOverrides::default(),
            tenants: Vec::new(),
            trusted_proxies: Vec::new(),
            metrics_key: None,
            admin_key: None,
            metrics_listen: None,
            compile_cache: None,
            registry: Default::default(),
            idle_contexts: None,
            limits: LimitOverrides::default(),
            batch: BatchConfig::default(),
            gpu_layers: None,
            device: None,
            models: BTreeMap::new(),
            projectors: BTreeMap::new(),
            plugins: plugins
                .into_iter()
                .map(|(name, path)| PluginConfig {
                    name,
                    path,
                    route: None,
                    threads: one(),
                    max_concurrent: None,
                    deadline_ms: default_deadline_ms(),
                    group: None,
                    models: None,
                    env: BTreeMap::new(),
                    limits: LimitOverrides::default(),
                    grant: None,
                    signatures: None,
                })
                .collect(),
        }
    }

    /// Fill in defaults that depend on other fields and refuse what cannot work.
    pub fn check(&mut self) -> anyhow::Result<()> {
        use anyhow::bail;
        if self.plugins.is_empty() {
            bail!("no plugins to serve");
        }
        let requests = self.requests();
        if self.threads == 0 || requests.max_concurrent == 0 {
            bail!("threads and max_concurrent must be at least 1");
        }
        if self.limits.context.max_threads.is_some() {
            bail!(
                "set the plugins' context threads with each plugin's `threads` \
                 (--request-threads), not [limits.context] max_threads (--max-threads)"
            );
        }
        if let Some(plugin) = self.plugins.iter().find(|p| p.limits.context.max_threads.is_some()) {
            bail!("plugin {:?}: set its contexts' threads with the plugin's `threads`, not [plugins.limits.context] max_threads", plugin.name);
        }
        self.warn_of_moved_limits();
        if requests.body_timeout_ms == 0 || requests.write_stall_timeout_ms == 0 {
            bail!("[requests] body_timeout_ms and write_stall_timeout_ms must be at least 1");
        }
        self.batch.check()?;
        for tenant in &self.tenants {
            for plugin in tenant.plugins.iter().flatten() {
                if !self.plugins.iter().any(|p| &p.name == plugin) {
                    bail!("tenant {:?}: plugin {plugin:?} is not in [[plugins]]", tenant.name);
                }
            }
            for model in tenant.models.iter().flatten() {
                if !self.models.contains_key(model) && !self.projectors.contains_key(model) {
                    bail!(
                        "tenant {:?}: model {model:?} is not in [models] or [projectors]",
                        tenant.name
                    );
                }
            }
        }
        if self.metrics_key.as_ref().is_some_and(|key| key.trim().len() < 16) {
            bail!("metrics_key must be at least 16 characters");
        }
        if self.admin_key.as_ref().is_some_and(|key| key.trim().len() < 16) {
            bail!("admin_key must be at least 16 characters");
        }
        if self.admin_key.is_some() && self.admin_key == self.metrics_key {
            bail!("admin_key must not be metrics_key: reading metrics is not reloading");
        }
        let only = self.plugins.len() == 1;
        let mut routes = std::collections::HashSet::new();
        for plugin in &mut self.plugins {
            let name = plugin.name.clone();
            if name.is_empty()
                || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                bail!("plugin name {name:?}: use letters, digits, '-' and '_'");
            }
            let route =
                plugin
                    .route
                    .get_or_insert_with(|| if only { "/".into() } else { format!("/{name}") });
            if !route.starts_with('/') || (route.len() > 1 && route.ends_with('/')) {
                bail!("plugin {name:?}: route {route:?} must start with '/' and not end with one");
            }
            if ["/healthz", "/readyz", "/metrics", "/admin"].iter().any(|ops| route == ops) {
                bail!("plugin {name:?}: route {route:?} is the server's own");
            }
            if !routes.insert(route.clone()) {
                bail!("plugin {name:?}: route {route:?} is served by another plugin");
            }
            if plugin.threads == 0 || plugin.threads > self.threads {
                bail!(
                    "plugin {name:?}: threads {} must be 1..={} (the server's threads)",
                    plugin.threads,
                    self.threads
                );
            }
            if plugin.max_concurrent == Some(0) {
                bail!("plugin {name:?}: max_concurrent must be at least 1");
            }
            for model in plugin.models.iter().flatten() {
                if !self.models.contains_key(model) && !self.projectors.contains_key(model) {
                    bail!("plugin {name:?}: model {model:?} is not in [models] or [projectors]");
                }
            }
        }
        Ok(())
    }

    /// Contexts each model keeps idle: the setting, or `threads` (as many as could be
    /// busy at once). Derived here, not filled in by `check`, so a `--threads` given
    /// after a config file moves the default with it.
    pub fn idle_contexts(&self) -> u32 {
        self.idle_contexts.unwrap_or(self.threads)
    }

    /// How requests are taken in: `[requests]` over the defaults. Derived, like
    /// `idle_contexts`, so that a flag given after a config file moves what follows it
    /// (`max_client_requests` follows `max_concurrent`).
    pub fn requests(&self) -> RequestLimits {
        self.requests.resolve()
    }

    /// How the server batches, if it does: `[batch]`'s policy, every step on all
    /// `threads`.
    pub fn batch_policy(&self) -> Option<crate::BatchPolicy> {
        self.batch.enabled().then(|| self.batch.policy(self.threads))
    }

    /// Flat limit keys of earlier releases, still read: each named with its new table.
    fn warn_of_moved_limits(&mut self) {
        for (group, key) in self.limits.take_moved_keys() {
            tracing::warn!(
                "[limits] {key} is now [limits.{group}] {key}; the old key is read for now"
            );
        }
        for plugin in &mut self.plugins {
            for (group, key) in plugin.limits.take_moved_keys() {
                tracing::warn!(
                    "plugin {:?}: [plugins.limits] {key} is now [plugins.limits.{group}] {key}; \
                     the old key is read for now",
                    plugin.name
                );
            }
        }
    }

    /// A plugin's per-run limits: the host's defaults under `[limits]`, under its own
    /// `[plugins.limits]`, contexts capped at its `threads`.
    pub fn plugin_limits(&self, plugin: &PluginConfig) -> Limits {
        // The plugin's `threads` are its contexts' threads, cap and default both.
        // (`check` refuses max_threads in [limits]: `threads` says it.)
        let mut limits = plugin.limits.or(&self.limits).apply(&Limits::default());
        limits.context.max_threads = plugin.threads;
        limits.context.default_threads = plugin.threads;
        limits
    }

    /// Where the models' layers go.
    pub fn offload(&self) -> crate::native::Offload {
        crate::native::Offload { gpu_layers: self.gpu_layers, device: self.device.clone() }
    }

    /// Requests that run at once: with batching, at most one per seat.
    pub fn max_running(&self) -> u32 {
        let max_concurrent = self.requests().max_concurrent;
        if self.batch.enabled() {
            max_concurrent.min(self.batch.seats())
        } else {
            max_concurrent
        }
    }
}

impl PluginConfig {
    /// Its runs' cache group within a tenant: `group`, or its name.
    pub fn group(&self) -> &str {
        self.group.as_deref().unwrap_or(&self.name)
    }

    /// The route, once `ServeConfig::check` has filled it in.
    pub fn route(&self) -> &str {
        self.route.as_deref().unwrap_or("/")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
listen = "127.0.0.1:0"
threads = 2
[models]
m = "/models/m.gguf"
[[plugins]]
name = "openai"
path = "/plugins/openai.wasm"
models = ["m"]
[limits.media]
max_image_side = 512
[plugins.limits.context]
max_n_ctx = 4096
[[plugins]]
name = "other"
path = "/plugins/other.wasm"
threads = 2
"#;

    #[test]
    fn routes_default_by_name_when_several() {
        let config = ServeConfig::from_toml(FULL).unwrap();
        assert_eq!(config.plugins[0].route(), "/openai");
        assert_eq!(config.plugins[1].route(), "/other");
        let (first, second) =
            (config.plugin_limits(&config.plugins[0]), config.plugin_limits(&config.plugins[1]));
        assert_eq!((first.context.max_n_ctx, second.context.max_n_ctx), (4096, 8192));
        assert_eq!((first.media.max_image_side, second.media.max_image_side), (512, 512));
        assert_eq!(second.context.max_threads, 2);
        assert_eq!(config.idle_contexts(), 2, "as many idle contexts as could be busy");
        let mut more = config.clone();
        more.threads = 8;
        assert_eq!(more.idle_contexts(), 8, "follows threads set after the file (a flag)");
        let none = ServeConfig::from_toml(
            &FULL.replace("threads = 2\n[models]", "threads = 2\nidle_contexts = 0\n[models]"),
        )
        .unwrap();
        assert_eq!(none.idle_contexts(), 0);
    }

    #[test]
    fn one_address_may_have_as_many_requests_as_the_server_runs() {
        let mut config = ServeConfig::from_toml(FULL).unwrap();
        assert_eq!(config.requests().per_client(), Some(64), "max_concurrent");
        config.requests.max_concurrent = Some(3);
        assert_eq!(config.requests().per_client(), Some(3), "follows max_concurrent");
        config.requests.max_client_requests = Some(0);
        assert_eq!(config.requests().per_client(), None, "0 turns it off");
        config.requests.max_client_requests = Some(5);
        assert_eq!(config.requests().per_client(), Some(5));
    }

    #[test]
    fn request_knobs_live_in_their_table_and_old_keys_are_still_read() {
        let defaults = ServeConfig::from_toml(FULL).unwrap().requests();
        assert_eq!(defaults, RequestLimits::default());
        assert_eq!((defaults.max_concurrent, defaults.queue_timeout_ms), (64, 5000));
        let table = FULL.replace(
            "[models]",
            "[requests]\nmax_concurrent = 3\nqueue_timeout_ms = 700\n[models]",
        );
        let config = ServeConfig::from_toml(&table).unwrap();
        assert_eq!((config.requests().max_concurrent, config.max_running()), (3, 3));
        assert_eq!(config.requests().queue_timeout(), Duration::from_millis(700));
        // Earlier releases' top-level keys, where the table does not set the knob.
        let old = FULL.replace(
            "threads = 2\n[models]",
            "threads = 2\nmax_queue = 7\nmax_concurrent = 9\n[requests]\nmax_concurrent = 3\n[models]",
        );
        let requests = ServeConfig::from_toml(&old).unwrap().requests();
        assert_eq!((requests.max_queue, requests.max_concurrent), (7, 3), "the table wins");
        // Flags over the file, knob by knob.
        let flags = RequestOverrides { max_queue: Some(1), ..RequestOverrides::default() };
        let merged = flags.or(&config.requests).resolve();
        assert_eq!((merged.max_queue, merged.max_concurrent), (1, 3));
        for (broken, why) in [
            (
                FULL.replace("[models]", "[requests]\nmax_concurent = 2\n[models]"),
                "unknown field `max_concurent`",
            ),
            (
                FULL.replace("[models]", "[requests]\nmax_concurrent = 0\n[models]"),
                "max_concurrent must be at least 1",
            ),
            (
                FULL.replace("[models]", "[requests]\nbody_timeout_ms = 0\n[models]"),
                "body_timeout_ms and",
            ),
            (
                FULL.replace("threads = 2\n[models]", "threads = 2\nmax_concurent = 2\n[models]"),
                "unknown field `max_concurent`",
            ),
        ] {
            let error = ServeConfig::from_toml(&broken).unwrap_err().to_string();
            assert!(error.contains(why), "{why:?} not in {error:?}");
        }
    }

    #[test]
    fn refuses_what_cannot_work() {
        for (broken, why) in [
            (
                FULL.replace("threads = 2\n[models]", "threads = 1\n[models]"),
                "threads 2 must be 1..=1",
            ),
            (FULL.replace("models = [\"m\"]", "models = [\"x\"]"), "model \"x\" is not in"),
            (
                FULL.replace("name = \"other\"", "name = \"other\"\nroute = \"/openai\""),
                "served by another plugin",
            ),
            (
                FULL.replace("name = \"other\"", "name = \"other\"\nroute = \"/metrics\""),
                "the server's own",
            ),
            (FULL.replace("max_n_ctx", "max_n_cxt"), "unknown field"),
            (FULL.replace("max_n_ctx = 4096", "max_threads = 1"), "the plugin's `threads`"),
            (FULL.replace("name = \"openai\"", "name = \"a/b\""), "use letters"),
        ] {
            let error = ServeConfig::from_toml(&broken).unwrap_err().to_string();
            assert!(error.contains(why), "{why:?} not in {error:?}");
        }
    }

    #[test]
    fn limits_live_in_group_tables_and_old_flat_keys_are_still_read() {
        let old = FULL.replace("[plugins.limits.context]", "[plugins.limits]");
        let config = ServeConfig::from_toml(&old).unwrap();
        assert_eq!(config.plugin_limits(&config.plugins[0]).context.max_n_ctx, 4096);
        let typo = FULL.replace("max_n_ctx = 4096", "max_n_ctxx = 4096");
        let err = ServeConfig::from_toml(&typo).unwrap_err().to_string();
        assert!(err.contains("unknown field `max_n_ctxx`"), "{err}");
        let flat_typo = old.replace("max_n_ctx = 4096", "max_n_ctxx = 4096");
        let err = ServeConfig::from_toml(&flat_typo).unwrap_err().to_string();
        assert!(err.contains("unknown limit \"max_n_ctxx\""), "{err}");
        let threads =
            FULL.replace("[limits.media]", "[limits.context]\nmax_threads = 2\n[limits.media]");
        let err = ServeConfig::from_toml(&threads).unwrap_err().to_string();
        assert!(err.contains("each plugin's `threads`"), "{err}");
    }

    #[test]
    fn batch_knobs_live_in_their_table_and_old_keys_are_still_read() {
        let defaults = ServeConfig::from_toml(FULL).unwrap().batch_policy().unwrap();
        assert_eq!((defaults.seats, defaults.cells, defaults.group_share), (64, 16_384, 0.75));
        let table = FULL.replace(
            "[models]",
            "[batch]\nseats = 2\nstep_ms = 100\ncells = 8192\ntenant_share = 0.5\n[models]",
        );
        let config = ServeConfig::from_toml(&table).unwrap();
        let policy = config.batch_policy().unwrap();
        assert_eq!((policy.seats, policy.seat_n_ctx, policy.threads), (2, 4096, 2));
        assert_eq!((policy.cells, policy.group_share), (8192, 0.5));
        assert_eq!(policy.step_target, Duration::from_millis(100));
        assert_eq!(config.max_running(), 2);
        // Earlier releases' top-level keys, where the table does not set the knob.
        let old = FULL.replace(
            "threads = 2\n[models]",
            "threads = 2\nbatch_seats = 3\nbatch_n_ctx = 512\n[models]",
        );
        let policy = ServeConfig::from_toml(&old).unwrap().batch_policy().unwrap();
        assert_eq!((policy.seats, policy.seat_n_ctx), (3, 512));
        let off = FULL.replace("threads = 2\n[models]", "threads = 2\nbatch = false\n[models]");
        assert!(ServeConfig::from_toml(&off).unwrap().batch_policy().is_none());
        // Flags over the file, knob by knob.
        let flags = BatchConfig { n_ctx: Some(1024), ..BatchConfig::default() };
        let merged = ServeConfig::from_toml(&table).unwrap().batch.overridden_by(&flags);
        assert_eq!((merged.seats(), merged.n_ctx(), merged.step_ms), (2, 1024, Some(100)));
        for (broken, why) in [
            (
                FULL.replace("[models]", "[batch]\nseats = 0\n[models]"),
                "[batch] seats must be 1..=",
            ),
            (FULL.replace("[models]", "[batch]\nsets = 2\n[models]"), "unknown field `sets`"),
            (
                FULL.replace("[models]", "[batch]\ncells = 1024\n[models]"),
                "must hold at least one seat",
            ),
            (
                FULL.replace("[models]", "[batch]\ntenant_share = 0\n[models]"),
                "tenant_share must be above 0",
            ),
        ] {
            let error = ServeConfig::from_toml(&broken).unwrap_err().to_string();
            assert!(error.contains(why), "{why:?} not in {error:?}");
        }
    }
}
