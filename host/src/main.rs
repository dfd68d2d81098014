//! `llamabox`: run a plugin component against llama.cpp models registered by name.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand, ValueEnum};
use llamabox::serve::{ServeConfig, Server};
use llamabox::source::GrantChoice;
use llamabox::{
    HostOptions, LimitOverrides, Limits, ModelRegistry, PluginHost, RunOptions, RunOutcome,
};
use llamabox_native as native;
#[cfg(feature = "synthetic")]
use llamabox_native::{ProjectorSpec, TextModelSpec};
use wasmtime_wasi::WasiCtxBuilder;

#[derive(Parser)]
#[command(
    version,
    about = "llama.cpp inference for sandboxed WebAssembly plugins, with in-flight cancel"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once per process: boxing `serve`'s flags buys nothing"
)]
enum Command {
    /// Run a plugin (a WASI 0.2 command component).
    Run {
        /// The plugin component: a .wasm file, or oci://REGISTRY/REPO@sha256:DIGEST (or
        /// :TAG) pulled from a registry, verified by digest and cached.
        plugin: PathBuf,
        /// Register a model the plugin may open by NAME (repeatable).
        #[arg(long = "model", value_name = "NAME=PATH", value_parser = parse_named)]
        models: Vec<(String, PathBuf)>,
        /// Register a projector (mmproj) the plugin may open by NAME (repeatable).
        #[arg(long = "projector", value_name = "NAME=PATH", value_parser = parse_named)]
        projectors: Vec<(String, PathBuf)>,
        #[command(flatten)]
        source: SourceFlags,
        #[command(flatten)]
        offload: OffloadFlags,
        /// Stop the plugin, native work included, after this many milliseconds.
        #[arg(long, value_name = "MS")]
        deadline_ms: Option<u64>,
        #[command(flatten)]
        cache: CacheFlags,
        /// How long idle llama.cpp threads spin for the next graph before sleeping
        /// (0-100, each unit a few ms; llama.cpp's tools use 50). 1 (the default) keeps
        /// a generation's threads awake between tokens and frees the cores within ms;
        /// 0 frees them at once and pays a wake-up per token.
        #[arg(long, value_name = "LEVEL", default_value_t = native::DEFAULT_IDLE_POLL, value_parser = clap::value_parser!(u32).range(0..=100))]
        idle_poll: u32,
        /// Arguments passed to the plugin, after `--`.
        #[arg(last = true)]
        args: Vec<String>,
        /// Last: each group's flags come under a heading of their own, after the rest.
        #[command(flatten)]
        limits: LimitOverrides,
    },
    /// Serve plugins that are wasi:http handlers (the http-plugin world) over HTTP: one
    /// fresh instance per request; a client that hangs up stops its request's native
    /// work. Either a config file, or one plugin and its models from flags.
    Serve(ServeArgs),
    /// Print what llama.cpp was built for (the CPU features of the linked ggml, the GPU
    /// backends built in) and the devices it finds.
    Info,
    /// Print what a plugin is before running it: where it came from, its SHA-256 digest
    /// and size, its signer, the interfaces it imports (what it may ask the host for)
    /// and exports, and whether the grant allows what it imports.
    Inspect {
        /// The plugin component: a .wasm file, or oci://REGISTRY/REPO@sha256:DIGEST (or
        /// :TAG), pulled and verified as `run` does.
        plugin: PathBuf,
        #[command(flatten)]
        source: SourceFlags,
        #[command(flatten)]
        cache: CacheFlags,
    },
    /// Write a seeded synthetic llama model (random weights) for tests and offline demos.
    #[cfg(feature = "synthetic")]
    SynthModel {
        out: PathBuf,
        #[arg(long, value_enum, default_value = "tiny")]
        size: Size,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Write a seeded synthetic projector (mmproj) for a text model of width N-EMBD-TEXT.
    #[cfg(feature = "synthetic")]
    SynthProjector {
        out: PathBuf,
        /// The text model's embedding width (576 for SmolLM2-135M).
        #[arg(long)]
        n_embd_text: u32,
        #[arg(long, value_enum, default_value = "tiny-vision")]
        kind: ProjectorSize,
    },
}

#[cfg(feature = "synthetic")]
#[derive(Clone, Copy, ValueEnum)]
enum ProjectorSize {
    TinyVision,
    /// An image encode takes a few hundred milliseconds on one core.
    SlowVision,
    TinyAudio,
}

/// `llamabox serve`'s flags: a config file with flags over it, or a whole config from
/// flags alone. Kept whole so that a reload (SIGHUP, `POST /admin/reload`) builds the
/// config again the same way: the file read afresh, the same flags over it.
#[derive(clap::Args, Clone)]
struct ServeArgs {
    /// A TOML config (many plugins, their models, limits and tenants); see
    /// docs/ARCHITECTURE.md. Flags below are then not allowed.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["listen", "plugins", "models", "projectors"])]
    config: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free port; the bound one is printed).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// Serve a plugin as NAME (repeatable; the only one is mounted at `/`, several
    /// at `/NAME`): a .wasm file or oci://REGISTRY/REPO@sha256:DIGEST (or :TAG).
    #[arg(long = "plugin", value_name = "NAME=PLUGIN.wasm", value_parser = parse_named)]
    plugins: Vec<(String, PathBuf)>,
    /// Load a model once, at start, as NAME (repeatable).
    #[arg(long = "model", value_name = "NAME=PATH", value_parser = parse_named)]
    models: Vec<(String, PathBuf)>,
    /// Register a projector (mmproj) as NAME (repeatable).
    #[arg(long = "projector", value_name = "NAME=PATH", value_parser = parse_named)]
    projectors: Vec<(String, PathBuf)>,
    /// Environment for the plugins (repeatable), e.g. the openai plugin's
    /// `LLAMABOX_VISION=MODEL=PROJECTOR`.
    #[arg(long = "plugin-env", value_name = "KEY=VALUE", value_parser = parse_pair)]
    plugin_env: Vec<(String, String)>,
    /// llama.cpp threads of all requests together (default: every core, or the
    /// config's `threads`).
    #[arg(long)]
    threads: Option<u32>,
    /// llama.cpp threads of each request (default 1): requests run at once up to
    /// threads / this.
    #[arg(long)]
    request_threads: Option<u32>,
    /// Stop each request after this many milliseconds (504).
    #[arg(long, value_name = "MS")]
    deadline_ms: Option<u64>,
    /// Require this API key (`authorization: Bearer KEY` or `x-api-key: KEY`): one
    /// tenant, named `default`. For several, use `[[tenants]]` in a config file.
    #[arg(long, value_name = "KEY", env = "LLAMABOX_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The same, read from a file (e.g. a mounted Kubernetes Secret).
    #[arg(long, value_name = "FILE", conflicts_with = "api_key")]
    api_key_file: Option<PathBuf>,
    /// The key for `POST /admin/reload` (`authorization: Bearer KEY`), over the config's
    /// `admin_key`. Without one, only SIGHUP reloads.
    #[arg(long, value_name = "KEY", env = "LLAMABOX_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// A proxy (address or network) whose Forwarded / X-Forwarded-For headers name
    /// the client (repeatable).
    #[arg(long = "trusted-proxy", value_name = "ADDR[/BITS]")]
    trusted_proxies: Vec<String>,
    /// Serve /metrics on this address instead of the main one.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Contexts each model keeps idle for later requests of the same group, which
    /// then skip creating one and reuse the start of the prompt they share with the
    /// last (default: --threads; 0: none).
    #[arg(long, value_name = "N")]
    idle_contexts: Option<u32>,
    #[command(flatten)]
    batch: llamabox::serve::BatchConfig,
    #[command(flatten)]
    source: SourceFlags,
    #[command(flatten)]
    offload: OffloadFlags,
    #[command(flatten)]
    cache: CacheFlags,
    /// Last: each group's flags come under a heading of their own, after the rest.
    #[command(flatten)]
    requests: llamabox::serve::RequestOverrides,
    #[command(flatten)]
    limits: LimitOverrides,
}

/// Where models put their layers: host policy (a plugin never chooses a device).
#[derive(clap::Args, Clone)]
struct OffloadFlags {
    /// Model layers on the GPU (default: all of them when there is a GPU; 0: the CPU alone).
    #[arg(long, value_name = "N")]
    gpu_layers: Option<u32>,
    /// The GPU, by the name `llamabox info` lists (default: the first GPU).
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
}

impl OffloadFlags {
    fn offload(&self) -> native::Offload {
        native::Offload { gpu_layers: self.gpu_layers, device: self.device.clone() }
    }
}

/// Where a plugin comes from and what it is granted: the same flags for `run`, `inspect`
/// and `serve`.
#[derive(clap::Args, Clone)]
struct SourceFlags {
    #[command(flatten)]
    registry: RegistryFlags,
    /// The llamabox interfaces a plugin may import: NAME,NAME (llm, generate,
    /// embeddings, media, cancel, async-calls), all or none, or requested: what a
    /// pulled plugin's artifact asks for. Default: all for a file, none for an oci://
    /// plugin; `serve` applies it to every plugin, over their `grant` in the config file;
    /// `inspect` checks the plugin's imports against it.
    #[arg(long, value_name = "INTERFACES")]
    grant: Option<GrantChoice>,
}

/// Plugins pulled from OCI registries (`oci://...`; see `llamabox::source`).
#[derive(clap::Args, Clone)]
struct RegistryFlags {
    /// Largest plugin pulled from a registry, in MiB (default 64).
    #[arg(long, value_name = "MIB")]
    max_plugin_mib: Option<u64>,
    /// Pull from this registry (HOST or HOST:PORT) over plain HTTP (repeatable). Loopback
    /// registries always are; others only over HTTPS.
    #[arg(long = "insecure-registry", value_name = "HOST")]
    insecure_registries: Vec<String>,
    /// Where pulled plugins are kept by digest (default: oci-plugins beside the compile
    /// cache). Must be writable by this user only.
    #[arg(long, value_name = "DIR")]
    plugin_cache: Option<PathBuf>,
    /// A cosign public key (PEM, `cosign.pub`) trusted to sign pulled plugins
    /// (repeatable). A pulled plugin runs only if one of them signed its digest.
    #[arg(long = "trust-key", value_name = "PEM")]
    trust_keys: Vec<PathBuf>,
    /// Run pulled plugins that no trusted key signed (logged at start).
    #[arg(long)]
    allow_unsigned: bool,
}

impl RegistryFlags {
    fn apply(&self, options: &mut llamabox::source::RegistryOptions) {
        options.max_plugin_mib = self.max_plugin_mib.unwrap_or(options.max_plugin_mib);
        options.insecure.extend(self.insecure_registries.iter().cloned());
        if self.plugin_cache.is_some() {
            options.cache = self.plugin_cache.clone();
        }
        options.keys.extend(self.trust_keys.iter().cloned());
        if self.allow_unsigned {
            options.signatures = llamabox::source::SignaturePolicy::AllowUnsigned;
        }
    }

    /// Where `plugin` is on disk: the file itself, or an oci:// plugin pulled (or found
    /// in the cache) and verified before the host compiles anything.
    fn resolve(
        &self,
        runtime: &tokio::runtime::Runtime,
        plugin: &std::path::Path,
        compile_cache: Option<&std::path::Path>,
    ) -> anyhow::Result<llamabox::source::Resolved> {
        let mut sources = llamabox::source::RegistryOptions::default();
        self.apply(&mut sources);
        Ok(runtime.block_on(llamabox::source::resolve(plugin, &sources, compile_cache))?)
    }
}

/// Where compiled plugins are kept between runs (a plugin is compiled once per change of
/// its bytes, the host's wasmtime or its engine settings).
#[derive(clap::Args, Clone)]
struct CacheFlags {
    /// The compile cache folder (default: $XDG_CACHE_HOME or ~/.cache, then
    /// llamabox/compiled). Must be writable by this user only: its entries are loaded as
    /// native code.
    #[arg(long, value_name = "DIR", conflicts_with = "no_compile_cache")]
    compile_cache: Option<PathBuf>,
    /// Compile the plugin on every run.
    #[arg(long)]
    no_compile_cache: bool,
}

impl CacheFlags {
    fn options(&self) -> HostOptions {
        let compile_cache = match (&self.compile_cache, self.no_compile_cache) {
            (_, true) => None,
            (Some(dir), false) => Some(dir.clone()),
            (None, false) => HostOptions::default_compile_cache(),
        };
        let mut options = HostOptions::default();
        options.compile_cache = compile_cache;
        options
    }
}

#[cfg(feature = "synthetic")]
#[derive(Clone, Copy, ValueEnum)]
enum Size {
    /// Decodes in microseconds.
    Tiny,
    /// A 512-token decode takes a good fraction of a second on one core.
    Slow,
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

fn parse_named(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), PathBuf::from(path)))
        }
        _ => Err(format!("expected NAME=PATH, got {s:?}")),
    }
}

/// SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            tracing::warn!("no signal handlers: stop the server with SIGKILL");
            std::future::pending::<()>().await
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A server logs each request (with its id) by default; other commands only warnings.
    let default_filter = match cli.command {
        Command::Serve { .. } => "warn,llama_cpp=off,llamabox=info",
        _ => "warn,llama_cpp=off",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("llamabox: {e:#}");
            ExitCode::FAILURE
        }
    }
}

impl ServeArgs {
    /// The server's config: the file's (or the flags' plugins and models), with the
    /// flags given over it.
    fn config(&self) -> anyhow::Result<ServeConfig> {
        let ServeArgs {
            config,
            listen,
            plugins,
            models,
            projectors,
            plugin_env,
            threads,
            request_threads,
            deadline_ms,
            api_key,
            api_key_file,
            admin_key,
            trusted_proxies,
            metrics_listen,
            idle_contexts,
            batch,
            source: SourceFlags { registry, grant },
            offload,
            cache,
            requests,
            limits,
        } = self.clone();
        let mut config = match config {
            Some(path) => ServeConfig::from_file(&path)?,
            None => {
                let mut config = ServeConfig::with_plugins(listen, plugins);
                config.models = models.into_iter().collect();
                config.projectors = projectors.into_iter().collect();
                config
            }
        };
        // What the command line gives wins over serve.toml.
        config.threads = threads.unwrap_or(config.threads);
        config.idle_contexts = idle_contexts.or(config.idle_contexts);
        config.requests = requests.or(&config.requests);
        config.batch = config.batch.overridden_by(&batch);
        config.limits = limits.or(&config.limits);
        if api_key.is_some() || api_key_file.is_some() {
            anyhow::ensure!(
                config.tenants.is_empty(),
                "--api-key and LLAMABOX_API_KEY name one tenant; the config file has [[tenants]]"
            );
            let mut tenant = llamabox::serve::TenantConfig::named("default");
            (tenant.key, tenant.key_file) = (api_key, api_key_file);
            config.tenants.push(tenant);
        }
        config.trusted_proxies.extend(trusted_proxies);
        if admin_key.is_some() {
            config.admin_key = admin_key;
        }
        if metrics_listen.is_some() {
            config.metrics_listen = metrics_listen;
        }
        for plugin in &mut config.plugins {
            plugin.threads = request_threads.unwrap_or(plugin.threads);
            plugin.deadline_ms = deadline_ms.unwrap_or(plugin.deadline_ms);
            plugin.env.extend(plugin_env.iter().cloned());
            plugin.grant = grant.or(plugin.grant);
        }
        config.gpu_layers = offload.gpu_layers.or(config.gpu_layers);
        config.device = offload.device.clone().or(config.device.take());
        if config.compile_cache.is_none() {
            config.compile_cache = cache.options().compile_cache;
        }
        registry.apply(&mut config.registry);
        config.check()?;
        Ok(config)
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(args) => {
            let config = args.config()?;
            let reload: llamabox::serve::ConfigSource = Arc::new(move || args.config());
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            runtime.block_on(Server::run_reloading(config, reload, shutdown_signal()))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Info => {
            let features = native::cpu_features();
            let level = native::InstructionLevel::of(&features);
            let flags = match native::build_c_flags() {
                "" => String::new(),
                flags => format!(", C flags {flags}"),
            };
            println!("ggml CPU features: {}\nbuild: {level}{flags}", features.join(" "));
            let gpu = native::gpu_backends();
            println!(
                "GPU backends: {}",
                if gpu.is_empty() {
                    "none (a CPU build; `make GPU=vulkan build` adds Vulkan)".to_string()
                } else {
                    gpu.join(", ")
                }
            );
            for d in native::devices() {
                let memory = if d.memory_total > 0 {
                    format!(", {} MiB of {} MiB free", d.memory_free >> 20, d.memory_total >> 20)
                } else {
                    String::new()
                };
                println!("device {}: {} ({:?}{memory})", d.name, d.description, d.kind);
            }
            Ok(ExitCode::SUCCESS)
        }
        #[cfg(feature = "synthetic")]
        Command::SynthModel { out, size, seed } => {
            let spec = match size {
                Size::Tiny => TextModelSpec::tiny(),
                Size::Slow => TextModelSpec::slow(),
            };
            TextModelSpec { seed, ..spec }.write(&out)?;
            println!("wrote {}", out.display());
            Ok(ExitCode::SUCCESS)
        }
        #[cfg(feature = "synthetic")]
        Command::SynthProjector { out, n_embd_text, kind } => {
            let spec = match kind {
                ProjectorSize::TinyVision => ProjectorSpec::tiny_vision(n_embd_text),
                ProjectorSize::SlowVision => ProjectorSpec::slow_vision(n_embd_text),
                ProjectorSize::TinyAudio => ProjectorSpec::tiny_audio(n_embd_text),
            };
            spec.write(&out)?;
            println!("wrote {}", out.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect {
            plugin,
            source: SourceFlags { registry: registry_flags, grant },
            cache,
        } => {
            use sha2::{Digest as _, Sha256};
            let options = cache.options();
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let shown = llamabox::source::display_name(&plugin);
            let resolved =
                registry_flags.resolve(&runtime, &plugin, options.compile_cache.as_deref())?;
            let grant = llamabox::source::grant_for(grant, &plugin, &resolved);
            let path = &resolved.path;
            let bytes =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            let digest: String =
                Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
            let host = PluginHost::with_options(ModelRegistry::new(), Limits::default(), options)?;
            let engine = host.engine();
            let component = llamabox::wasmtime::component::Component::from_binary(engine, &bytes)
                .map_err(|e| {
                anyhow::anyhow!("{shown} is not a WebAssembly component: {e:#}")
            })?;
            let kind = component.component_type();
            println!("plugin    {shown}");
            if let Some(pulled) = &resolved.pulled {
                println!("manifest  {}", pulled.digest);
                println!(
                    "signer    {}",
                    pulled.signer.as_deref().unwrap_or("none (allowed unsigned)")
                );
                if let Some(requested) = &pulled.requested {
                    println!("requests  {requested} (applied only with --grant requested)");
                }
            }
            println!("digest    sha256:{digest}");
            println!("size      {} bytes", bytes.len());
            let imports: Vec<String> =
                kind.imports(engine).map(|(name, _)| name.to_string()).collect();
            for name in &imports {
                println!("import    {name}");
            }
            for (name, _) in kind.exports(engine) {
                println!("export    {name}");
            }
            match grant {
                Err(e) => println!("grant     none: {e}"),
                Ok(grant) => {
                    println!("grant     {grant}");
                    match grant.first_withheld(imports.iter().map(String::as_str)) {
                        None => println!("verdict   its imports are granted"),
                        Some((import, _)) => println!(
                            "verdict   refused: it imports {import}, which the grant withholds"
                        ),
                    }
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Run {
            plugin,
            models,
            projectors,
            limits: limit_flags,
            source: SourceFlags { registry: registry_flags, grant },
            offload,
            deadline_ms,
            cache,
            idle_poll,
            args,
        } => {
            native::set_idle_poll(idle_poll);
            let registry = ModelRegistry::new();
            offload.offload().check()?;
            registry.offload(offload.offload());
            for (name, path) in models {
                if !path.is_file() {
                    bail!("model {name:?}: file {} not found", path.display());
                }
                registry.register(name, path);
            }
            for (name, path) in projectors {
                if !path.is_file() {
                    bail!("projector {name:?}: file {} not found", path.display());
                }
                registry.register_projector(name, path);
            }
            let limits = limit_flags.apply(&Limits::default());
            let options = cache.options();
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let argv0 = llamabox::source::display_name(&plugin);
            let resolved =
                registry_flags.resolve(&runtime, &plugin, options.compile_cache.as_deref())?;
            let grant = llamabox::source::grant_for(grant, &plugin, &resolved)
                .map_err(|e| anyhow::anyhow!("plugin {argv0}: {e}"))?;
            let host = PluginHost::with_options(registry, limits, options)?;
            let plugin = host
                .load_granted(&resolved.path, grant)
                .with_context(|| format!("plugin {argv0}"))?;
            let mut wasi = WasiCtxBuilder::new();
            wasi.inherit_stdout().inherit_stderr();
            wasi.args(&std::iter::once(argv0).chain(args).collect::<Vec<_>>());
            let mut options = RunOptions::default();
            options.deadline = deadline_ms.map(Duration::from_millis);
            match runtime.block_on(plugin.run_with(&options, wasi))? {
                RunOutcome::Success => Ok(ExitCode::SUCCESS),
                RunOutcome::Failed(code) => Ok(ExitCode::from(code.clamp(1, 255) as u8)),
                RunOutcome::DeadlineExceeded => {
                    eprintln!(
                        "llamabox: the plugin's deadline of {} ms passed; it was stopped",
                        deadline_ms.unwrap_or(0)
                    );
                    Ok(ExitCode::from(124))
                }
                // The CLI passes no stop handle.
                RunOutcome::Stopped => Ok(ExitCode::from(130)),
            }
        }
    }
}
