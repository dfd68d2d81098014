//! `llamabox-bench` (`make bench`): what in-flight cancel and the component boundary cost,
//! measured side by side in one run against plain llama.cpp calls and llama.cpp's own
//! llama-bench. Prints a Markdown report and writes it to bench/RESULTS.md, with the
//! cancel-latency figure beside it.
//!
//! Everything compared is measured in rounds (one run of each way per round, the order
//! rotating, llama-bench included) so that load changing on a shared machine falls on
//! every way alike.

mod batch;
mod builds;
mod encode;
mod gpu;
mod grammar;
mod guest;
mod machine;
mod native;
mod plot;
mod reference;
mod report;
mod startup;
mod stats;
mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context as _};
use clap::Parser;
use llamabox_native::Model;

use guest::{Guest, GuestGeneration};
use machine::ThreadSched;
use native::Native;
use reference::LlamaBench;
use report::{ModelResults, Reference, Way};
use stats::Runs;
use workload::{BenchModel, Shape};

#[derive(Parser)]
#[command(about = "llamabox benchmarks: decode, generation, cancel latency, boundary cost")]
struct Cli {
    /// The real model (SmolLM2-135M-Instruct Q4_1; `scripts/fetch-model.sh` prints its
    /// path). Without it only the generated model is measured.
    #[arg(long)]
    real_model: Option<PathBuf>,
    /// The bench plugin component (guest/bench-plugin).
    #[arg(long, default_value = "target/guest/wasm32-wasip2/release/llamabox-bench-plugin.wasm")]
    plugin: PathBuf,
    /// llama.cpp's llama-bench (bench/llama-bench.sh builds it). Without it that
    /// comparison is left out.
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// A second llama-bench, built with the compile flags of the llama.cpp linked here
    /// (`LLAMA_BENCH_SAME_FLAGS=1 bench/llama-bench.sh`): against it, a difference is
    /// our code's; against `--llama-bench` (GGML_NATIVE=ON), the flags' share is in it.
    #[arg(long, requires = "llama_bench")]
    llama_bench_same_flags: Option<PathBuf>,
    /// Threads of every llama.cpp context (ggml's threads spin: keep to free cores).
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// How long idle llama.cpp threads spin before sleeping (`native::set_idle_poll`;
    /// llamabox's default 1, llama-bench's default 50, which it keeps here).
    #[arg(long, default_value_t = llamabox_native::DEFAULT_IDLE_POLL)]
    idle_poll: u32,
    /// More plugins to time start-up of (compiling, cached, a run to its argument check):
    /// large ones, CPython or a JS engine inside. Repeatable.
    #[arg(long)]
    startup_plugin: Vec<std::path::PathBuf>,
    /// Timed runs per column (after a warm-up).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Rounds of the generation rows. A token is 3–16 ms, so a run is short and its time
    /// moves with the machine's load of the moment: the median of many rounds is what
    /// separates a few-percent gap from noise here.
    #[arg(long, default_value_t = 15)]
    gen_runs: usize,
    /// Decodes cancelled at random points, per model.
    #[arg(long, default_value_t = 20)]
    cancels: usize,
    #[arg(long, default_value_t = 512)]
    prompt_tokens: u32,
    #[arg(long, default_value_t = 128)]
    gen_tokens: u32,
    /// Calls per loop of the cheap boundary measurements.
    #[arg(long, default_value_t = 10_000)]
    boundary_iters: u32,
    /// Where the generated model is written (once).
    #[arg(long, default_value = "target/bench-models")]
    model_dir: PathBuf,
    /// The report. Anything below its notes marker is kept from the previous report.
    #[arg(long, default_value = "bench/RESULTS.md")]
    out: PathBuf,
    /// The cancel-latency figure.
    #[arg(long, default_value = "bench/cancel-latency.png")]
    png: PathBuf,
    /// Only compare grammar-constrained sampling (llguidance vs llama.cpp's matcher) on
    /// `--real-model` and write that report here (`make bench-grammar`).
    #[arg(long, requires = "real_model")]
    grammar_report: Option<PathBuf>,
    /// Only the GPU rows, on the device the model's layers go to (a `--features vulkan`
    /// build), against `--llama-bench` built for Vulkan; written here (`make GPU=vulkan
    /// bench-gpu`, scripts/device-check.sh). On `--real-model` if given, else the
    /// generated model.
    #[arg(long)]
    gpu_report: Option<PathBuf>,
    /// Only the many-generations rows (`make bench-batch`): N plugin runs batched as
    /// seats of one context against N contexts of their own and llama.cpp's
    /// llama-batched-bench, at 1 thread and at every core, N = `--batch-levels`;
    /// written here. On `--real-model` if given, else the generated model.
    #[arg(long)]
    batch_report: Option<PathBuf>,
    #[arg(long, default_value = "1,4,8,16", value_delimiter = ',')]
    batch_levels: Vec<u32>,
    /// llama.cpp's llama-batched-bench (bench/llama-bench.sh builds it beside
    /// llama-bench), for the batch rows.
    #[arg(long)]
    llama_batched_bench: Option<PathBuf>,
}

/// Everything below this line in RESULTS.md is written by hand and kept across runs.
const NOTES_MARKER: &str = "<!-- Notes below are written by hand; `make bench` keeps them. -->";

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("llamabox-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    ensure!(
        cli.runs >= 1 && cli.gen_runs >= 1 && cli.threads >= 1,
        "--runs, --gen-runs and --threads must be at least 1"
    );
    if let (Some(out), Some(model)) = (&cli.grammar_report, &cli.real_model) {
        let report = grammar::report(model, 64, cli.runs.max(3), Duration::from_secs(5))?;
        std::fs::write(out, &report).with_context(|| format!("writing {}", out.display()))?;
        println!("{report}");
        return Ok(());
    }
    llamabox_native::set_idle_poll(cli.idle_poll);
    ensure!((2..=2048).contains(&cli.prompt_tokens), "--prompt-tokens must be in [2, 2048]");
    if let Some(out) = &cli.gpu_report {
        let shape = Shape {
            prompt_tokens: cli.prompt_tokens,
            gen_tokens: cli.gen_tokens,
            threads: cli.threads,
        };
        let model = match &cli.real_model {
            Some(path) => workload::real_model(path.clone())?,
            None => workload::synthetic_model(&cli.model_dir)?,
        };
        let report = gpu::report(
            &model,
            cli.llama_bench.as_deref(),
            shape,
            cli.runs,
            cli.cancels,
            &cli.model_dir,
        )?;
        std::fs::write(out, &report).with_context(|| format!("writing {}", out.display()))?;
        println!("{report}");
        return Ok(());
    }
    if let Some(out) = &cli.batch_report {
        let model = match &cli.real_model {
            Some(path) => workload::real_model(path.clone())?,
            None => workload::synthetic_model(&cli.model_dir)?,
        };
        let peer = cli
            .llama_batched_bench
            .as_ref()
            .map(|bin| batch::BatchedBench { bin: bin.clone(), model: model.path.clone() });
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        let mut threads = vec![1, cores];
        threads.dedup();
        let report = batch::report(
            &cli.plugin,
            &model,
            peer.as_ref(),
            &threads,
            &cli.batch_levels,
            cli.gen_tokens,
            cli.runs,
        )?;
        write_report(out, &report)?;
        println!("{report}");
        return Ok(());
    }
    let load_start = machine::load_average();
    let machine = machine::Machine::read();
    let shape = Shape {
        prompt_tokens: cli.prompt_tokens,
        gen_tokens: cli.gen_tokens,
        threads: cli.threads,
    };
    let linked = reference::linked_llama_cpp();
    let reference = cli.llama_bench.as_deref().map(reference::llama_bench_tree).transpose()?;
    let reference_same_flags =
        cli.llama_bench_same_flags.as_deref().map(reference::llama_bench_tree).transpose()?;

    let mut models = vec![workload::synthetic_model(&cli.model_dir)?];
    if let Some(path) = &cli.real_model {
        models.push(workload::real_model(path.clone())?);
    }
    let guest = Guest::new(&cli.plugin, &models.iter().collect::<Vec<_>>(), shape)?;

    let mut results = Vec::new();
    for model in &models {
        results.push(measure_model(&cli, shape, &guest, model)?);
    }
    // Boundary figures depend on n_vocab (logits out): take the real model's if any.
    let boundary_model = models.last().context("no model")?;
    progress(format_args!("boundary cost on {}", boundary_model.label));
    let boundary = guest.boundary(boundary_model, cli.boundary_iters)?;
    let instantiation = guest.instantiation(30)?;
    progress(format_args!("plugin start-up, compiled and cached"));
    let mut startup = vec![startup::measure(
        &cli.plugin,
        "guest/bench-plugin (Rust)",
        &cli.model_dir,
        cli.runs,
        false,
    )?];
    for plugin in &cli.startup_plugin {
        let label = plugin
            .file_name()
            .map_or_else(|| plugin.display().to_string(), |n| n.to_string_lossy().into_owned());
        startup.push(startup::measure(plugin, &label, &cli.model_dir, cli.runs, true)?);
    }
    progress(format_args!("media encode on a generated projector"));
    // llama-simple always runs llama.cpp's default 4 threads (it has no option): once per
    // `make bench`, in the 1-thread run; on a 2-core machine it takes minutes.
    let agreement = match (&cli.llama_bench, &cli.real_model) {
        (Some(lb), Some(real)) if cli.threads == 1 => {
            progress(format_args!("greedy text against llama-simple"));
            Some(reference::greedy_agreement(lb, real, 48)?)
        }
        _ => None,
    };
    let targets = [5, 10, 25].map(Duration::from_millis);
    let encode =
        encode::measure(&models[0].path, &cli.model_dir, cli.threads, cli.runs, 20, &targets)?;

    let series: Vec<plot::Series> = results
        .iter()
        .map(|r| plot::Series {
            title: r.model.label.clone(),
            samples: &r.cancel.samples,
            decode_secs: r.runs(Way::Plain).times.median(),
        })
        .collect();
    let with_text =
        plot::cancel_latency_png(&cli.png, &series).context("drawing the cancel-latency figure")?;
    if !with_text {
        eprintln!("no DejaVu Sans font found: {} has no text", cli.png.display());
    }

    let date = today();
    // CPU=native and CPU=native-march link the same instructions, compiled without and
    // with -march=native: two builds.
    let level = llamabox_native::InstructionLevel::of(&machine.ggml_features);
    let build = if machine.build_config.starts_with("-march=native") {
        format!("{}-march-native", level.name())
    } else {
        level.name().to_string()
    };
    let headline = builds::Headline::of(
        &build,
        &machine.cpu,
        &machine.ggml_features,
        &date,
        shape,
        &results,
        &encode,
    );
    let builds = builds::save_and_collect(&cli.out, &headline)?;
    let cx = report::RunInfo {
        machine: &machine,
        shape,
        runs: cli.runs,
        gen_runs: cli.gen_runs,
        load_start,
        load_end: machine::load_average(),
        date,
        linked: &linked,
        reference: reference.as_ref(),
        reference_same_flags: reference_same_flags.as_ref(),
        boundary: &boundary,
        instantiation: &instantiation,
        startup: &startup,
        agreement: agreement.as_ref(),
        png: relative_to(&cli.png, &cli.out),
        builds: &builds,
    };
    let report = report::render(&cx, &results, &encode);
    print!("{report}");
    write_report(&cli.out, &report)?;
    eprintln!("wrote {} and {}", cli.out.display(), cli.png.display());
    Ok(())
}

/// One step of a prompt-decode round: one of our ways, or a llama-bench's pp test (its
/// index in `measure_model`'s list).
#[derive(Clone, Copy)]
enum DecodeStep {
    Ours(Way),
    LlamaBench(usize),
}

/// One step of a generation round.
#[derive(Clone, Copy)]
enum GenStep {
    Native,
    Guest(GuestGeneration),
    LlamaBench(usize),
}

const GUEST_GENERATIONS: [GuestGeneration; 3] =
    [GuestGeneration::WasmArgmax, GuestGeneration::HostSampler, GuestGeneration::HostLoop];

/// Every measurement on one model.
fn measure_model(
    cli: &Cli,
    shape: Shape,
    guest: &Guest,
    model: &BenchModel,
) -> anyhow::Result<ModelResults> {
    let (cpu, load_before) = (machine::CpuShare::start(), machine::load_average());
    let loaded =
        Model::load(&model.path).with_context(|| format!("loading {}", model.path.display()))?;
    let mut native = Native::new(Arc::new(loaded), shape)?;
    // As users build llama.cpp, then (if given) with our flags: both take turns with ours.
    let llama_benches: Vec<LlamaBench> = [&cli.llama_bench, &cli.llama_bench_same_flags]
        .into_iter()
        .flatten()
        .map(|bin| LlamaBench {
            bin: bin.clone(),
            model: model.path.clone(),
            threads: shape.threads,
        })
        .collect();
    let no_digest = |time| (time, 0);

    let mut steps: Vec<DecodeStep> = Way::ALL.map(DecodeStep::Ours).into();
    steps.extend((0..llama_benches.len()).map(DecodeStep::LlamaBench));
    native.prompt_decode(false)?; // warm-ups: the guest and llama-bench warm up per run
    native.prompt_decode(true)?;
    let mut decode = stats::in_rounds(cli.runs, &steps, |step, round| {
        if matches!(step, DecodeStep::Ours(Way::Plain)) {
            progress(format_args!(
                "{}: prompt decode, round {}/{}",
                model.label,
                round + 1,
                cli.runs
            ));
        }
        match step {
            DecodeStep::Ours(Way::Plain) => native.prompt_decode(false),
            DecodeStep::Ours(Way::Cancellable) => native.prompt_decode(true),
            DecodeStep::Ours(Way::GuestBlocking) => guest.prompt_decode(model, "blocking"),
            DecodeStep::Ours(Way::GuestPending) => guest.prompt_decode(model, "pending"),
            DecodeStep::LlamaBench(i) => {
                llama_benches[i].prompt(shape.prompt_tokens).map(no_digest)
            }
        }
    })?;
    let reference_prompts = decode.split_off(Way::ALL.len());
    let decode: [Runs; 4] =
        decode.try_into().map_err(|_| anyhow::anyhow!("one result per decode way"))?;
    let nodes = native.prompt_nodes()?;

    let mut steps = vec![GenStep::Native];
    steps.extend(GUEST_GENERATIONS.map(GenStep::Guest));
    steps.extend((0..llama_benches.len()).map(GenStep::LlamaBench));
    native.generate()?; // warm-up
    let mut bytes_per_token = Vec::new();
    let mut executor: [Vec<ThreadSched>; 3] = Default::default();
    let mut generation = stats::in_rounds(cli.gen_runs, &steps, |step, round| {
        if matches!(step, GenStep::Native) {
            progress(format_args!(
                "{}: generation, round {}/{}",
                model.label,
                round + 1,
                cli.gen_runs
            ));
        }
        match step {
            GenStep::Native => native.generate(),
            GenStep::Guest(way) => guest.generation(model, way, shape.gen_tokens).map(|run| {
                bytes_per_token.extend(run.bytes_per_token);
                executor[way as usize].extend(run.executor);
                (run.time, run.digest)
            }),
            GenStep::LlamaBench(i) => llama_benches[i].generation(shape.gen_tokens).map(no_digest),
        }
    })?
    .into_iter();
    let mut next = || generation.next().unwrap_or_default();
    let (gen_native, gen_guest, gen_guest_sampler, gen_host) = (next(), next(), next(), next());
    let mut references = reference_prompts
        .into_iter()
        .zip(generation)
        .map(|(prompt, gen)| Reference { prompt: prompt.times, generation: gen.times });
    let (llama_bench, llama_bench_same_flags) = (references.next(), references.next());
    let executor_per_token = executor_per_token(guest, model, shape, &executor)?;

    progress(format_args!("{}: {} cancels", model.label, cli.cancels));
    let plain = &decode[Way::Plain as usize];
    let expected = plain.digests.first().copied().context("no plain decode")?;
    let decode_time = Duration::from_secs_f64(plain.times.median());
    let cancel = native.cancel_latency(cli.cancels, decode_time, expected)?;

    Ok(ModelResults {
        model: model.clone(),
        decode,
        nodes,
        gen_native,
        gen_guest,
        gen_guest_sampler,
        gen_host,
        host_bytes_per_token: bytes_per_token.iter().copied().fold(0.0, f64::max),
        executor_per_token,
        n_vocab: native.model.n_vocab(),
        llama_bench,
        llama_bench_same_flags,
        cancel,
        cpu_share: cpu.share(),
        load: (load_before, machine::load_average()),
    })
}

/// Per generated token, what the scheduler counted for the guest's thread, for each
/// guest way: the median of its timed runs less the median of three one-token runs
/// (instantiation, the context, the prefill and the warm-up are in both).
fn executor_per_token(
    guest: &Guest,
    model: &BenchModel,
    shape: Shape,
    runs: &[Vec<ThreadSched>; 3],
) -> anyhow::Result<[Option<ThreadSched>; 3]> {
    let mut out = [None; 3];
    for way in GUEST_GENERATIONS {
        let mut base = Vec::new();
        for _ in 0..3 {
            base.extend(guest.generation(model, way, 1)?.executor);
        }
        let per_token =
            ThreadSched::median(&runs[way as usize]).zip(ThreadSched::median(&base)).map(
                |(full, base)| full.per(base, f64::from(shape.gen_tokens.saturating_sub(1).max(1))),
            );
        out[way as usize] = per_token;
    }
    Ok(out)
}

fn progress(what: std::fmt::Arguments) {
    eprintln!("[{}] {what}", machine::load_average());
}

/// Write `report` to `path`, keeping the hand-written notes of the previous report.
fn write_report(path: &Path, report: &str) -> anyhow::Result<()> {
    let previous = std::fs::read_to_string(path).unwrap_or_default();
    let notes = previous.split_once(NOTES_MARKER).map_or("\n", |(_, notes)| notes);
    let text = format!("{report}{NOTES_MARKER}{notes}");
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// `target` as the report at `report` links to it: its file name when they share a folder.
fn relative_to(target: &Path, report: &Path) -> String {
    match (target.parent(), report.parent(), target.file_name()) {
        (Some(a), Some(b), Some(name)) if a == b => name.to_string_lossy().into_owned(),
        _ => target.display().to_string(),
    }
}

/// Today's date and time in UTC, from `date` (the report's only use of a calendar).
fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "an unknown date".into())
}
