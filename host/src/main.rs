//! `llamabox`: run a plugin component against llama.cpp models registered by name.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand, ValueEnum};
use llamabox::native::{self, ProjectorSpec, TextModelSpec};
use llamabox::{HostOptions, Limits, ModelRegistry, PluginHost, RunOptions, RunOutcome};
use wasmtime_wasi::WasiCtxBuilder;

#[derive(Parser)]
#[command(version, about = "llama.cpp inference for sandboxed WebAssembly plugins, with in-flight cancel")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a plugin (a WASI 0.2 command component).
    Run {
        /// The plugin component (.wasm).
        plugin: PathBuf,
        /// Register a model the plugin may open by NAME (repeatable).
        #[arg(long = "model", value_name = "NAME=PATH", value_parser = parse_named)]
        models: Vec<(String, PathBuf)>,
        /// Register a projector (mmproj) the plugin may open by NAME (repeatable).
        #[arg(long = "projector", value_name = "NAME=PATH", value_parser = parse_named)]
        projectors: Vec<(String, PathBuf)>,
        #[command(flatten)]
        limits: LimitFlags,
        /// Stop the plugin, native work included, after this many milliseconds.
        #[arg(long, value_name = "MS")]
        deadline_ms: Option<u64>,
        #[command(flatten)]
        cache: CacheFlags,
        /// How long idle llama.cpp threads spin for the next graph before sleeping
        /// (0-100, llama.cpp's tools use 50). 0 (the default) frees the cores between
        /// calls; more saves a wake-up per token when one context owns the cores.
        #[arg(long, value_name = "LEVEL", default_value_t = native::DEFAULT_IDLE_POLL, value_parser = clap::value_parser!(u32).range(0..=100))]
        idle_poll: u32,
        /// Arguments passed to the plugin, after `--`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Print what llama.cpp was built for: the CPU features of the linked ggml.
    Info,
    /// Write a seeded synthetic llama model (random weights) for tests and offline demos.
    SynthModel {
        out: PathBuf,
        #[arg(long, value_enum, default_value = "tiny")]
        size: Size,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Write a seeded synthetic projector (mmproj) for a text model of width N-EMBD-TEXT.
    SynthProjector {
        out: PathBuf,
        /// The text model's embedding width (576 for SmolLM2-135M).
        #[arg(long)]
        n_embd_text: u32,
        #[arg(long, value_enum, default_value = "tiny-vision")]
        kind: ProjectorSize,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ProjectorSize {
    TinyVision,
    /// An image encode takes a few hundred milliseconds on one core.
    SlowVision,
    TinyAudio,
}

/// Limits for the plugin (defaults: `llamabox::Limits::default()`, see SECURITY.md).
#[derive(clap::Args)]
struct LimitFlags {
    /// Most threads a plugin's context may use (default: all cores).
    #[arg(long)]
    max_threads: Option<u32>,
    /// Linear memory of the plugin, in MiB (default 256).
    #[arg(long, value_name = "MIB")]
    max_memory_mib: Option<usize>,
    /// Contexts alive at once (default 4).
    #[arg(long)]
    max_contexts: Option<u32>,
    /// Largest n-ctx of one context (default 8192).
    #[arg(long)]
    max_n_ctx: Option<u32>,
    /// KV cells (n-ctx x layers) over all contexts (default 262144).
    #[arg(long)]
    max_kv_cells: Option<u64>,
}

impl LimitFlags {
    fn apply(&self, limits: &mut Limits) {
        if let Some(n) = self.max_threads {
            limits.max_threads = n.max(1);
            limits.default_threads = limits.default_threads.min(limits.max_threads);
        }
        if let Some(mib) = self.max_memory_mib {
            limits.max_wasm_memory = mib << 20;
        }
        if let Some(n) = self.max_contexts {
            limits.max_contexts = n;
        }
        if let Some(n) = self.max_n_ctx {
            limits.max_n_ctx = n;
        }
        if let Some(n) = self.max_kv_cells {
            limits.max_kv_cells = n;
        }
    }
}

/// Where compiled plugins are kept between runs (a plugin is compiled once per change of
/// its bytes, the host's wasmtime or its engine settings).
#[derive(clap::Args)]
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
        HostOptions { compile_cache }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Size {
    /// Decodes in microseconds.
    Tiny,
    /// A 512-token decode takes a good fraction of a second on one core.
    Slow,
}

fn parse_named(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok((name.to_string(), PathBuf::from(path))),
        _ => Err(format!("expected NAME=PATH, got {s:?}")),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,llama_cpp=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("llamabox: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Info => {
            let features = native::cpu_features();
            let level = native::InstructionLevel::of(&features);
            println!("ggml CPU features: {}\nbuild: {level}", features.join(" "));
            Ok(ExitCode::SUCCESS)
        }
        Command::SynthModel { out, size, seed } => {
            let spec = match size {
                Size::Tiny => TextModelSpec::tiny(),
                Size::Slow => TextModelSpec::slow(),
            };
            TextModelSpec { seed, ..spec }.write(&out)?;
            println!("wrote {}", out.display());
            Ok(ExitCode::SUCCESS)
        }
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
        Command::Run { plugin, models, projectors, limits: limit_flags, deadline_ms, cache, idle_poll, args } => {
            native::set_idle_poll(idle_poll);
            let registry = ModelRegistry::new();
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
            let mut limits = Limits::default();
            limit_flags.apply(&mut limits);
            let host = PluginHost::with_options(registry, limits, cache.options())?;
            let argv0 = plugin.file_name().map_or("plugin".into(), |n| n.to_string_lossy().into_owned());
            let plugin = host.load(&plugin)?;
            let mut wasi = WasiCtxBuilder::new();
            wasi.inherit_stdout().inherit_stderr();
            wasi.args(&std::iter::once(argv0).chain(args).collect::<Vec<_>>());
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let options = RunOptions { deadline: deadline_ms.map(Duration::from_millis), ..RunOptions::default() };
            match runtime.block_on(plugin.run_with(&options, wasi))? {
                RunOutcome::Success => Ok(ExitCode::SUCCESS),
                RunOutcome::Failed(code) => Ok(ExitCode::from(code.clamp(1, 255) as u8)),
                RunOutcome::DeadlineExceeded => {
                    eprintln!("llamabox: the plugin's deadline of {} ms passed; it was stopped", deadline_ms.unwrap_or(0));
                    Ok(ExitCode::from(124))
                }
                // The CLI passes no stop handle.
                RunOutcome::Stopped => Ok(ExitCode::from(130)),
            }
        }
    }
}
