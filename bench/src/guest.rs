//! The component side: guest/bench-plugin run under `llamabox::PluginHost`, which
//! times its own calls and prints one line per measurement.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _};
use llamabox::{Limits, ModelRegistry, PluginHost, RunOutcome};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

use crate::machine::ThreadSched;
use crate::stats::{timed, Samples};
use crate::workload::{BenchModel, Shape};

pub struct Guest {
    plugin: llamabox::Plugin,
    runtime: tokio::runtime::Runtime,
    shape: Shape,
}

/// How a plugin generates: its own token loop (picking each token in wasm from the
/// logits it reads, or with the host's sampler), or the host's loop driven from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestGeneration {
    WasmArgmax,
    HostSampler,
    HostLoop,
}

/// One plugin generation run.
pub struct GenerationRun {
    /// The guest's time for its token loop (the host loop: the host's generation time).
    pub time: Duration,
    pub digest: u64,
    /// The scheduler's counts for the guest's thread over the plugin run.
    pub executor: Option<ThreadSched>,
    /// The host loop's bytes into the guest per token (text and token ids).
    pub bytes_per_token: Option<f64>,
}

/// Per-call costs measured inside the guest.
pub struct Boundary {
    /// In the order the guest printed them.
    pub calls: Vec<CallCost>,
    pub n_vocab: u32,
}

/// One call's cost in nanoseconds: the median batch and the fastest one.
#[derive(Clone, Debug)]
pub struct CallCost {
    pub name: String,
    pub median: f64,
    pub min: f64,
}

impl Boundary {
    /// The cost of `name`, NaN if the guest printed none (a NaN cell, rather than no
    /// report after minutes of measuring).
    pub fn cost(&self, name: &str) -> (f64, f64) {
        self.calls
            .iter()
            .find(|c| c.name == name)
            .map_or((f64::NAN, f64::NAN), |c| (c.median, c.min))
    }
}

impl Guest {
    /// Compile `wasm` and register `models` under their names.
    pub fn new(wasm: &Path, models: &[&BenchModel], shape: Shape) -> anyhow::Result<Self> {
        let registry = ModelRegistry::new();
        for m in models {
            registry.register(m.name, &m.path);
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        let mut limits = Limits::default();
        limits.context.max_threads = shape.threads.max(cores);
        let host = PluginHost::new(registry, limits)?;
        let plugin = host.load(wasm).with_context(|| {
            format!("loading the bench plugin (built by `make bench` into {})", wasm.display())
        })?;
        // The guest's calls wait on the context's worker thread: one executor thread is
        // enough and leaves the cores to llama.cpp.
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok(Self { plugin, runtime, shape })
    }

    /// Run the plugin with `args`; its stdout, or an error with its stderr.
    fn run(&self, args: &[String]) -> anyhow::Result<String> {
        let (stdout, stderr) = (MemoryOutputPipe::new(1 << 20), MemoryOutputPipe::new(1 << 20));
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(stdout.clone()).stderr(stderr.clone());
        wasi.args(
            &std::iter::once("bench-plugin")
                .chain(args.iter().map(String::as_str))
                .collect::<Vec<_>>(),
        );
        let outcome =
            self.runtime.block_on(self.plugin.run(wasi)).context("the bench plugin trapped")?;
        let err = String::from_utf8_lossy(&stderr.contents()).into_owned();
        match outcome {
            RunOutcome::Success => Ok(String::from_utf8_lossy(&stdout.contents()).into_owned()),
            other => {
                bail!("the bench plugin ended with {other:?} (arguments {args:?}): {}", err.trim())
            }
        }
    }

    fn args(&self, mode: &str, model: &BenchModel, extra: &[(&str, String)]) -> Vec<String> {
        let mut args = vec![mode.to_string(), "--model".into(), model.name.into()];
        args.extend(self.shape.guest_args());
        args.extend(extra.iter().flat_map(|(k, v)| [k.to_string(), v.clone()]));
        args
    }

    /// One timed prompt decode, `mode` blocking|pending, after a warm-up decode in the
    /// same plugin run (a new context's first decode touches fresh memory).
    pub fn prompt_decode(&self, model: &BenchModel, mode: &str) -> anyhow::Result<(Duration, u64)> {
        let extra = [
            ("--tokens", self.shape.prompt_tokens.to_string()),
            ("--runs", "2".into()),
            ("--mode", mode.into()),
        ];
        self.last_run(&self.args("decode", model, &extra), "logits")
    }

    /// One timed greedy generation of `tokens` tokens the plugin's way `way` (the plugin
    /// warms up with a one-token one first), with what the scheduler counted for the
    /// thread that ran the guest (this one: the runtime is current-thread) over the whole
    /// plugin run.
    pub fn generation(
        &self,
        model: &BenchModel,
        way: GuestGeneration,
        tokens: u32,
    ) -> anyhow::Result<GenerationRun> {
        let mut extra = vec![("--tokens", tokens.to_string()), ("--runs", "1".into())];
        let (mode, sample) = match way {
            GuestGeneration::WasmArgmax => ("generate", Some("wasm")),
            GuestGeneration::HostSampler => ("generate", Some("host")),
            GuestGeneration::HostLoop => ("host-generate", None),
        };
        extra.extend(sample.map(|s| ("--sample", s.to_string())));
        let before = ThreadSched::now();
        let line = self.last_run_line(&self.args(mode, model, &extra))?;
        let executor = ThreadSched::now().zip(before).map(|(after, before)| after.since(before));
        let (time, digest) = run_fields(&line, "tokens")?;
        if !matches!(way, GuestGeneration::HostLoop) {
            return Ok(GenerationRun { time, digest, executor, bytes_per_token: None });
        }
        // The host loop may meet an end-of-generation token early: scale to `tokens`.
        let generated: f64 =
            field(&line, "generated")?.parse().with_context(|| format!("bad count in {line:?}"))?;
        let bytes: f64 = field(&line, "bytes-per-token")?
            .parse()
            .with_context(|| format!("bad bytes in {line:?}"))?;
        let full = time.mul_f64(tokens as f64 / generated.max(1.0));
        Ok(GenerationRun { time: full, digest, executor, bytes_per_token: Some(bytes) })
    }

    /// The last of the plugin's `run: ns=N <digest_key>=HEX` lines.
    fn last_run(&self, args: &[String], digest_key: &str) -> anyhow::Result<(Duration, u64)> {
        run_fields(&self.last_run_line(args)?, digest_key)
    }

    /// The plugin's last `run: ...` line (after the prefix).
    fn last_run_line(&self, args: &[String]) -> anyhow::Result<String> {
        let out = self.run(args)?;
        out.lines()
            .filter_map(|l| l.strip_prefix("run: "))
            .next_back()
            .map(str::to_string)
            .with_context(|| format!("the bench plugin printed no runs:\n{out}"))
    }

    /// The guest's per-call costs (`iters` calls of the cheap imports, a tenth as many
    /// of those that go to the context's thread).
    pub fn boundary(&self, model: &BenchModel, iters: u32) -> anyhow::Result<Boundary> {
        let extra =
            [("--tokens", self.shape.prompt_tokens.to_string()), ("--iters", iters.to_string())];
        let out = self.run(&self.args("boundary", model, &extra))?;
        let mut calls = Vec::new();
        for line in out.lines().filter_map(|l| l.strip_prefix("boundary: ")) {
            let (name, rest) =
                line.split_once(' ').with_context(|| format!("bad boundary line {line:?}"))?;
            let number = |key| -> anyhow::Result<f64> {
                field(rest, key)?.parse().with_context(|| format!("bad {key} in {line:?}"))
            };
            calls.push(CallCost {
                name: name.to_string(),
                median: number("median-ns")?,
                min: number("min-ns")?,
            });
        }
        let n_vocab = out
            .lines()
            .find_map(|l| l.strip_prefix("n-vocab: "))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("the bench plugin printed no n-vocab:\n{out}"))?;
        Ok(Boundary { calls, n_vocab })
    }

    /// Wall time of `Plugin::run` of a plugin that returns at once: a new store,
    /// instantiation from the `InstancePre`, WASI setup and an empty `main`.
    pub fn instantiation(&self, runs: usize) -> anyhow::Result<Samples> {
        let args = ["noop".to_string()];
        self.run(&args)?; // warm-up
        let mut times = Samples::default();
        for _ in 0..runs {
            let (t, out) = timed(|| self.run(&args));
            out?;
            times.push(t);
        }
        Ok(times)
    }
}

/// The time (`ns=N`) and the digest (`<digest_key>=HEX`) of a run line.
fn run_fields(line: &str, digest_key: &str) -> anyhow::Result<(Duration, u64)> {
    let ns: u64 = field(line, "ns")?.parse().with_context(|| format!("bad ns in {line:?}"))?;
    let digest = u64::from_str_radix(field(line, digest_key)?, 16)
        .with_context(|| format!("bad digest in {line:?}"))?;
    Ok((Duration::from_nanos(ns), digest))
}

/// The value of `key=value` among space-separated fields.
fn field<'a>(line: &'a str, key: &str) -> anyhow::Result<&'a str> {
    line.split(' ')
        .find_map(|kv| kv.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
        .with_context(|| format!("no {key}= in {line:?}"))
}
