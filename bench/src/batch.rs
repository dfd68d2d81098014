//! Many generations at once (issue 24's native row, `make bench-batch`): N plugin runs,
//! started together, each generate `tokens` tokens greedily on the host
//! (`generate.start`) after an 8-token prompt:
//! - **seats**: the engine batches them as N seats of one shared context, one
//!   `llama_decode` per step on every thread;
//! - **contexts**: each on a native context of its own, as the unbatched host runs them
//!   at its best split: `min(N, threads)` at a time with `threads / that` threads each,
//!   the rest waiting their turn;
//! - **llama-batched-bench**: llama.cpp's own tool for the same shape (N sequences of
//!   one context, `-npp 8 -ntg T -npl N`), its prompt and generation time together.
//!
//! Tokens/s is N × T over the wall time from the first run's start to the last one's
//! end (for llamabox: plugin start and context creation included, a few ms).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use llamabox::{BatchPolicy, Limits, ModelRegistry, PluginHost, RunOutcome};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

use crate::stats::{in_rounds, Runs, Samples};
use crate::workload::{BenchModel, GEN_PROMPT_TOKENS};

#[derive(Clone, Copy, PartialEq)]
enum Way {
    Seats,
    Contexts,
    BatchedBench,
}

/// llama.cpp's `llama-batched-bench` (built by bench/llama-bench.sh beside llama-bench).
pub struct BatchedBench {
    pub bin: PathBuf,
    pub model: PathBuf,
}

impl BatchedBench {
    /// One run of `n` sequences: `GEN_PROMPT_TOKENS` prompt tokens each decoded in one
    /// batch, then `tokens` steps of `n` rows; its total time (its `T s` column).
    fn run(&self, n: u32, tokens: u32, threads: u32) -> anyhow::Result<Duration> {
        let n_ctx = n * (GEN_PROMPT_TOKENS + tokens + 1);
        let stdout = crate::reference::tool_output(
            "llama-batched-bench",
            &self.bin,
            &self.model,
            &[
                "-c",
                &n_ctx.to_string(),
                "-b",
                "2048",
                "-ub",
                "512",
                "-t",
                &threads.to_string(),
                "-npp",
                &GEN_PROMPT_TOKENS.to_string(),
                "-ntg",
                &tokens.to_string(),
                "-npl",
                &n.to_string(),
            ],
        )?;
        // |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
        let stdout = String::from_utf8_lossy(&stdout);
        let row = stdout
            .lines()
            .map(|l| l.split('|').map(str::trim).filter(|c| !c.is_empty()).collect::<Vec<_>>())
            .find(|cells| {
                cells.len() == 10 && cells[2] == n.to_string() && cells[1] == tokens.to_string()
            })
            .with_context(|| format!("llama-batched-bench printed no row for B={n}:\n{stdout}"))?;
        let secs: f64 = row[8].parse().with_context(|| format!("its T s column: {:?}", row[8]))?;
        Ok(Duration::from_secs_f64(secs))
    }
}

/// One configuration of llamabox: a host whose registry batches (or not), its plugin.
struct Host {
    plugin: llamabox::Plugin,
    runtime: tokio::runtime::Runtime,
}

impl Host {
    fn new(
        wasm: &Path,
        model: &BenchModel,
        policy: Option<BatchPolicy>,
        threads: u32,
    ) -> anyhow::Result<Self> {
        let registry = ModelRegistry::new();
        registry.register(model.name, &model.path);
        registry.batch(policy);
        let mut limits = Limits::default();
        limits.context.max_threads = threads;
        let host = PluginHost::new(registry, limits)?;
        let plugin = host
            .load(wasm)
            .with_context(|| format!("loading the bench plugin {}", wasm.display()))?;
        // The guests only wait for pieces: one executor thread leaves the cores to llama.cpp.
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok(Self { plugin, runtime })
    }

    /// `n` runs started together, at most `at_once` of them running; the wall time of
    /// all and a digest of their tokens (equal runs give equal digests).
    fn generate(
        &self,
        model: &BenchModel,
        n: u32,
        tokens: u32,
        threads_each: u32,
        at_once: usize,
    ) -> anyhow::Result<(Duration, u64)> {
        let args: Vec<String> = [
            "host-generate",
            "--model",
            model.name,
            "--tokens",
            &tokens.to_string(),
            "--runs",
            "1",
            "--threads",
            &threads_each.to_string(),
            "--ctx",
            &seat_n_ctx(tokens).to_string(),
            "--batch",
            "512",
            "--ubatch",
            "host",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let gate = Arc::new(tokio::sync::Semaphore::new(at_once));
        let one = |_: u32| {
            let (gate, args) = (gate.clone(), args.clone());
            async move {
                let _turn = gate.acquire().await.expect("never closed");
                let stdout = MemoryOutputPipe::new(1 << 16);
                let mut wasi = WasiCtxBuilder::new();
                wasi.stdout(stdout.clone()).args(
                    &std::iter::once("bench-plugin".to_string()).chain(args).collect::<Vec<_>>(),
                );
                let outcome = self.plugin.run(wasi).await?;
                ensure!(
                    matches!(outcome, RunOutcome::Success),
                    "a bench plugin run ended with {outcome:?}"
                );
                let out = String::from_utf8_lossy(&stdout.contents()).into_owned();
                let line = out
                    .lines()
                    .find(|l| l.starts_with("run:"))
                    .with_context(|| format!("no run line in {out:?}"))?;
                let digest = line
                    .split_whitespace()
                    .find_map(|kv| kv.strip_prefix("tokens="))
                    .context("no tokens= in the run line")?;
                Ok::<_, anyhow::Error>(u64::from_str_radix(digest, 16)?)
            }
        };
        let started = Instant::now();
        let digests =
            self.runtime.block_on(async { futures::future::join_all((0..n).map(one)).await });
        let elapsed = started.elapsed();
        let digests = digests.into_iter().collect::<anyhow::Result<Vec<u64>>>()?;
        // All runs generate from the same prompt: one digest, or the runs disagree.
        let first = digests[0];
        Ok((elapsed, if digests.iter().all(|&d| d == first) { first } else { 0 }))
    }
}

/// Cells each run's context asks for: the prompt, the tokens, rounded as llama.cpp pads.
fn seat_n_ctx(tokens: u32) -> u32 {
    (GEN_PROMPT_TOKENS + tokens + 1).next_multiple_of(256)
}

/// The report: for each thread count, N = `levels`, the three ways in `rounds` rounds.
pub fn report(
    wasm: &Path,
    model: &BenchModel,
    peer: Option<&BatchedBench>,
    threads_list: &[u32],
    levels: &[u32],
    tokens: u32,
    rounds: usize,
) -> anyhow::Result<String> {
    let machine = crate::machine::Machine::read();
    let mut out = String::new();
    let _ = writeln!(out, "# Many generations at once: seats of one batch, contexts of their own, llama-batched-bench\n");
    let _ = writeln!(
        out,
        "Written by `make bench-batch` (`llamabox-bench --batch-report`) on {}. CPU: {}; llama.cpp built with {}. Model: {}. \
         N plugin runs started together, each generating {tokens} tokens greedily on the host after an {GEN_PROMPT_TOKENS}-token prompt; \
         tokens/s = N × {tokens} / wall time from the first start to the last end. Medians of {rounds} rounds (min–max), the ways' order rotating.\n",
        crate::today(),
        machine.cpu,
        machine.build_config,
        model.label,
    );
    let _ = writeln!(out, "- **seats**: `ModelRegistry::batch` with N seats, the shared context on every thread, one `llama_decode` per step.");
    let _ = writeln!(out, "- **contexts**: no batching; `min(N, threads)` runs at a time with `threads / that` threads each (the unbatched host's best split), the rest waiting.");
    let _ = writeln!(out, "- **llama-batched-bench**: `-npp {GEN_PROMPT_TOKENS} -ntg {tokens} -npl N -b 2048 -ub 512`, its `T s` (prompt and generation).\n");
    for &threads in threads_list {
        let _ = writeln!(out, "## {threads} thread{}\n", if threads == 1 { "" } else { "s" });
        let _ = writeln!(out, "| N | seats tokens/s | contexts tokens/s | llama-batched-bench tokens/s | seats / contexts | seats / llama-batched-bench | same tokens |");
        let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- | --- |");
        for &n in levels {
            crate::progress(format_args!("batched generation, {threads} thread(s), N = {n}"));
            let policy = BatchPolicy::new(n, seat_n_ctx(tokens), threads);
            let seats = Host::new(wasm, model, Some(policy), threads)?;
            let contexts = Host::new(wasm, model, None, threads)?;
            let at_once = (n as usize).min(threads as usize);
            let threads_each = threads / at_once as u32;
            // Warm-ups: the batch's context, page faults, the plugin's first instance.
            seats.generate(model, n, 4, threads_each, n as usize)?;
            contexts.generate(model, at_once as u32, 4, threads_each, at_once)?;
            let ways: Vec<Way> = [Way::Seats, Way::Contexts, Way::BatchedBench]
                .into_iter()
                .filter(|w| *w != Way::BatchedBench || peer.is_some())
                .collect();
            let runs: Vec<Runs> = in_rounds(rounds, &ways, |way, _| match way {
                Way::Seats => seats.generate(model, n, tokens, threads_each, n as usize),
                Way::Contexts => contexts.generate(model, n, tokens, threads_each, at_once),
                Way::BatchedBench => {
                    peer.expect("listed only with it").run(n, tokens, threads).map(|t| (t, 0))
                }
            })?;
            let per = (n * tokens) as f64;
            let rate = |w: Way| ways.iter().position(|&x| x == w).map(|i| &runs[i].times);
            let (seat_t, ctx_t) =
                (rate(Way::Seats).expect("measured"), rate(Way::Contexts).expect("measured"));
            let peer_cell =
                rate(Way::BatchedBench).map_or("—".to_string(), |t| t.rate(per).to_string());
            // A rate ratio is the inverse of the time ratio, round by round.
            let ratio = |a: &Samples, b: &Samples| b.ratios_to(a).median();
            let peer_ratio = rate(Way::BatchedBench)
                .map_or("—".to_string(), |t| format!("{:.2}×", ratio(seat_t, t)));
            let same = {
                let (s, c) = (&runs[0].digests, &runs[1].digests);
                let all = s.iter().chain(c).copied().collect::<Vec<_>>();
                if all.iter().all(|&d| d != 0 && d == all[0]) {
                    "yes"
                } else {
                    "no (batched numerics: see ARCHITECTURE, Batching)"
                }
            };
            let _ = writeln!(
                out,
                "| {n} | {} | {} | {peer_cell} | {:.2}× | {peer_ratio} | {same} |",
                seat_t.rate(per),
                ctx_t.rate(per),
                ratio(seat_t, ctx_t),
            );
        }
        let _ = writeln!(out);
    }
    Ok(out)
}
