//! The report: Markdown tables (printed, and written to bench/RESULTS.md) and a verdict
//! for each performance target of docs/ARCHITECTURE.md / DESIGN.md.
//!
//! Comparisons use run-by-run ratios (run i of both sides came from the same round,
//! moments apart) and also the fastest runs' ratio: on a shared machine interference
//! only ever adds time, so the fastest run is the least disturbed one.

use std::fmt::Write as _;

use crate::builds::Headline;
use crate::guest::Boundary;
use crate::machine::{Machine, ThreadSched};
use crate::native::CancelLatency;
use crate::reference::Provenance;
use crate::stats::{num, Runs, Samples};
use crate::workload::{BenchModel, Shape};

/// The ways a prompt decode is run: the rows of the decode table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    Plain,
    Cancellable,
    GuestBlocking,
    GuestPending,
}

impl Way {
    pub const ALL: [Way; 4] = [Way::Plain, Way::Cancellable, Way::GuestBlocking, Way::GuestPending];

    fn label(self) -> &'static str {
        match self {
            Way::Plain => "native `decode(batch, None)`",
            Way::Cancellable => "native `decode(batch, Some(Stop::on(&flag)))`, flag clear",
            Way::GuestBlocking => "guest `decode`",
            Way::GuestPending => "guest `start-decode` + `finish`",
        }
    }
}

/// llama-bench's times on one model, from the same rounds as ours.
pub struct Reference {
    pub prompt: Samples,
    pub generation: Samples,
}

/// Everything measured on one model.
pub struct ModelResults {
    pub model: BenchModel,
    /// Prompt decodes, indexed like [`Way::ALL`].
    pub decode: [Runs; 4],
    /// Computing graph nodes of one prompt decode.
    pub nodes: u64,
    pub gen_native: Runs,
    /// The guest's own loop, each token from the logits it reads (argmax in wasm).
    pub gen_guest: Runs,
    /// The guest's own loop, each token from the host's sampler (`sampler.sample`).
    pub gen_guest_sampler: Runs,
    /// The host's generation loop driven from the guest (`generate.start` + `next`).
    pub gen_host: Runs,
    /// Bytes into the guest per generated token on that path (text and token ids).
    pub host_bytes_per_token: f64,
    /// Per token, the scheduler's counts for the thread that ran the guest, for the guest
    /// loop (wasm argmax), the guest loop on the host sampler and the host loop.
    pub executor_per_token: [Option<ThreadSched>; 3],
    pub n_vocab: u32,
    /// llama-bench as llama.cpp's users build it (GGML_NATIVE=ON).
    pub llama_bench: Option<Reference>,
    /// llama-bench built with the compile flags of our llama.cpp.
    pub llama_bench_same_flags: Option<Reference>,
    pub cancel: CancelLatency,
    /// Share of a core the process got while measuring this model, and the load
    /// averages before and after.
    pub cpu_share: Option<f64>,
    pub load: (String, String),
}

impl ModelResults {
    /// The llama-benches measured, each with how it was built.
    pub fn references(&self) -> impl Iterator<Item = (&'static str, &Reference)> {
        let users = self.llama_bench.as_ref().map(|r| ("as users build it", r));
        users.into_iter().chain(self.llama_bench_same_flags.as_ref().map(|r| ("same flags", r)))
    }

    /// The generation ways, native first.
    pub fn generation_ways(&self) -> [GenerationWay<'_>; 4] {
        let [wasm, sampler, host] = self.executor_per_token;
        let way = |label, runs, bytes_per_token, executor| GenerationWay {
            label,
            runs,
            bytes_per_token,
            executor,
        };
        [
            way("native", &self.gen_native, None, None),
            way("guest loop (wasm argmax)", &self.gen_guest, Some(self.n_vocab as f64 * 4.0), wasm),
            way("guest loop (host sampler)", &self.gen_guest_sampler, Some(4.0), sampler),
            way("host loop, from the guest", &self.gen_host, Some(self.host_bytes_per_token), host),
        ]
    }

    pub fn runs(&self, way: Way) -> &Runs {
        &self.decode[way as usize]
    }

    fn plain(&self) -> &Samples {
        &self.runs(Way::Plain).times
    }

    /// Every run of `way` gave bitwise the logits of the first plain run.
    fn identical(&self, way: Way) -> bool {
        let reference = self.runs(Way::Plain).digests.first().copied();
        reference.is_some_and(|d| self.runs(way).all_equal(d))
    }

    pub fn latencies(&self) -> Samples {
        let mut lat = Samples::default();
        self.cancel.samples.iter().for_each(|c| lat.push(c.latency));
        lat
    }

    /// The plain decode's median divided by its computing nodes.
    pub fn mean_node_secs(&self) -> f64 {
        self.plain().median() / self.nodes.max(1) as f64
    }
}

/// One row of the generation table.
pub struct GenerationWay<'a> {
    pub label: &'static str,
    pub runs: &'a Runs,
    /// Bytes into the guest per token; none for native.
    pub bytes_per_token: Option<f64>,
    /// Per token, the guest's thread: none for native.
    pub executor: Option<ThreadSched>,
}

/// Times of one side against another's.
struct Comparison {
    /// Median of the run-by-run time ratios.
    ratio: f64,
    /// Fastest run against fastest run.
    fastest: f64,
    /// How far the base's runs spread, relative to their median.
    noise: f64,
}

impl Comparison {
    fn of(times: &Samples, base: &Samples) -> Self {
        Self {
            ratio: times.ratios_to(base).median(),
            fastest: times.min() / base.min(),
            noise: base.relative_spread(),
        }
    }

    /// The difference in time, `+x%` = slower.
    fn time_cell(&self) -> String {
        format!("{} (fastest {})", pct(self.ratio - 1.0), pct(self.fastest - 1.0))
    }

    /// The difference in speed (tokens/s), `-x%` = slower.
    fn speed_cell(&self) -> String {
        format!("{} (fastest {})", pct(1.0 / self.ratio - 1.0), pct(1.0 / self.fastest - 1.0))
    }

    /// Verdict on "at most `limit` slower", the slowdown measured by `slowdown`: met or
    /// missed when the paired median and the fastest runs agree, inconclusive when they
    /// do not (the difference is then below what this machine's noise lets us see).
    fn verdict(&self, limit: f64, slowdown: fn(f64) -> f64) -> String {
        let (median, fastest) = (slowdown(self.ratio), slowdown(self.fastest));
        match (median <= limit, fastest <= limit) {
            (true, true) => "met".into(),
            (false, false) => format!(
                "**missed** by {:.1} points (by {:.1} on the fastest runs)",
                (median - limit) * 100.0,
                (fastest - limit) * 100.0
            ),
            _ => format!(
                "inconclusive: {} by the paired median, {} by the fastest runs; runs spread over {:.0}%",
                pct(median),
                pct(fastest),
                self.noise * 100.0
            ),
        }
    }
}

/// Slowdown as extra time: time ratio − 1.
fn time_slowdown(ratio: f64) -> f64 {
    ratio - 1.0
}

/// Slowdown as lost speed: 1 − speed ratio.
fn speed_slowdown(ratio: f64) -> f64 {
    1.0 - 1.0 / ratio
}

fn pct(fraction: f64) -> String {
    format!("{:+.1}%", fraction * 100.0)
}

/// What the report says about the run as a whole.
pub struct RunInfo<'a> {
    pub machine: &'a Machine,
    pub shape: Shape,
    pub runs: usize,
    /// Rounds of the generation rows.
    pub gen_runs: usize,
    pub load_start: String,
    pub load_end: String,
    pub date: String,
    pub linked: &'a Provenance,
    pub reference: Option<&'a Provenance>,
    pub reference_same_flags: Option<&'a Provenance>,
    pub boundary: &'a Boundary,
    pub instantiation: &'a Samples,
    pub startup: &'a [crate::startup::Startup],
    /// The host's greedy generation loop against llama-simple, on the real model.
    pub agreement: Option<&'a crate::reference::Agreement>,
    /// The figure, as the report links to it.
    pub png: String,
    /// Headline figures of every CPU build measured so far, this run's included.
    pub builds: &'a [Headline],
}

/// A Markdown table.
struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(head: &[&str]) -> Self {
        Self { head: head.iter().map(|s| s.to_string()).collect(), rows: Vec::new() }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self, out: &mut String) {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        out.push_str(&line(&self.head));
        out.push_str(&line(&vec!["---".to_string(); self.head.len()]));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out.push('\n');
    }
}

fn yes_no(b: bool) -> String {
    if b { "yes" } else { "**no**" }.into()
}

pub fn render(
    cx: &RunInfo,
    models: &[ModelResults],
    encode: &crate::encode::EncodeResults,
) -> String {
    let mut out = String::new();
    let s = &cx.shape;
    let m = cx.machine;
    let _ = writeln!(out, "# llamabox benchmarks\n");
    let _ = writeln!(
        out,
        "Written by `make bench` (bench/src) on {}. {} rounds ({} for generation): each round runs every way \
         once, in rotating order, so run i of every way comes from round i. Times: median (min–max). Comparisons: median of the \
         round-by-round ratios, and the fastest run against the fastest run. Every run decodes the same tokens \
         on a cleared context.\n",
        cx.date, cx.runs, cx.gen_runs
    );
    let _ = writeln!(
        out,
        "- CPU: {}, {} cores (a shared VM: figures move by several % between runs)",
        m.cpu, m.cores
    );
    let _ = writeln!(
        out,
        "- ggml CPU features: {} (build: {})",
        m.ggml_features.join(" "),
        m.build_config
    );
    let _ = writeln!(
        out,
        "- threads: {} for every llama.cpp call, idle poll {} (llama-bench: 50); load average at start {}, at end {}",
        s.threads,
        llamabox_native::idle_poll(),
        cx.load_start,
        cx.load_end
    );
    let _ = writeln!(
        out,
        "- llamabox's llama.cpp: ggml {}, {}",
        cx.linked.ggml_version, cx.linked.detail
    );
    if let Some(r) = cx.reference {
        let _ = writeln!(out, "- llama-bench's llama.cpp: ggml {}, {}", r.ggml_version, r.detail);
    }
    if let Some(r) = cx.reference_same_flags {
        let _ = writeln!(
            out,
            "- llama-bench with llamabox's flags (the \"same flags\" rows): ggml {}, {}",
            r.ggml_version, r.detail
        );
    }
    for r in models {
        let share = r.cpu_share.map_or("unknown".into(), |c| format!("{c:.2}"));
        let _ = writeln!(
            out,
            "- while measuring {}: this process got {share} of a core (about 1.0 when nothing else ran); load average {} → {}",
            r.model.label, r.load.0, r.load.1
        );
    }
    out.push('\n');

    decode_table(&mut out, s, models);
    llama_bench_table(&mut out, s, models);
    generation_table(&mut out, s, models);
    if let Some(a) = cx.agreement {
        let _ = writeln!(
            out,
            "**Greedy text against llama.cpp's own loop.** The host's generation loop (`native::generate`, greedy: \
             what `generate.start` runs) and llama-simple (llama-bench's tree and build), {} tokens of SmolLM2 \
             after the prompt `{}`: {}.\n",
            a.tokens,
            crate::reference::AGREEMENT_PROMPT.escape_debug(),
            if a.same() { "the same text".to_string() } else { format!("**different**: ours {:?}, llama-simple {:?}", a.ours, a.llama_simple) }
        );
    }
    cancel_table(&mut out, s, models, &cx.png);
    boundary_table(&mut out, s, cx.boundary, cx.instantiation);
    crate::startup::table(&mut out, cx.startup, cx.instantiation);
    crate::encode::table(&mut out, encode);
    builds_table(&mut out, cx.builds);
    targets(&mut out, s, models, encode);
    out
}

fn decode_table(out: &mut String, s: &Shape, models: &[ModelResults]) {
    let _ = writeln!(out, "## Prompt decode: {} tokens in one batch, ms\n", s.prompt_tokens);
    let mut t = Table::new(&["model", "way", "ms", "time vs plain", "logits identical to plain"]);
    for r in models {
        for way in Way::ALL {
            let vs = match way {
                Way::Plain => "—".into(),
                _ => Comparison::of(&r.runs(way).times, r.plain()).time_cell(),
            };
            t.row(vec![
                r.model.label.clone(),
                way.label().into(),
                r.runs(way).times.ms().to_string(),
                vs,
                yes_no(r.identical(way)),
            ]);
        }
    }
    t.render(out);
    let _ = writeln!(
        out,
        "Guest times are taken inside the plugin with `wasi:clocks/monotonic-clock` around the call only; \
         `start-decode` + `finish` also waits on the pending decode's pollable, as an event loop does. \
         Each guest run is a fresh plugin run whose first decode (a warm-up) is not counted.\n"
    );
}

fn llama_bench_table(out: &mut String, s: &Shape, models: &[ModelResults]) {
    let (pp, tg) = (format!("pp{}", s.prompt_tokens), format!("tg{}", s.gen_tokens));
    let _ = writeln!(out, "## Against llama.cpp's llama-bench, tokens/s\n");
    let mut t = Table::new(&[
        "model",
        "llama-bench built",
        &format!("llamabox {pp}"),
        &format!("llama-bench {pp}"),
        "llamabox speed vs llama-bench",
        &format!("llamabox {tg}"),
        &format!("llama-bench {tg}"),
        "llamabox speed vs llama-bench",
    ]);
    for r in models {
        for (built, lb) in r.references() {
            let (p, g) = (s.prompt_tokens as f64, s.gen_tokens as f64);
            t.row(vec![
                r.model.label.clone(),
                built.into(),
                r.plain().rate(p).to_string(),
                lb.prompt.rate(p).to_string(),
                Comparison::of(r.plain(), &lb.prompt).speed_cell(),
                r.gen_native.times.rate(g).to_string(),
                lb.generation.rate(g).to_string(),
                Comparison::of(&r.gen_native.times, &lb.generation).speed_cell(),
            ]);
        }
    }
    if t.rows.is_empty() {
        let _ = writeln!(out, "Not measured: no llama-bench (bench/llama-bench.sh builds it).\n");
        return;
    }
    t.render(out);
    let _ = writeln!(
        out,
        "llamabox {pp} is the plain native decode above; llamabox {tg} is the native generation below (it also \
         reads the logits and takes the argmax for each token, which llama-bench does not). llama-bench ran \
         `-p {p} -n 0` and `-p 0 -n {g}` with `-t {t} -r 1` once per round, in turn with our ways, with its \
         defaults otherwise (flash attention auto, n-ubatch 512: as llamabox's contexts). \"as users build it\": \
         GGML_NATIVE=ON (-march=native); \"same flags\": llamabox's own compile flags, so that a difference there \
         is the code's and the rest of the first row's difference is the compile flags'.\n",
        p = s.prompt_tokens,
        g = s.gen_tokens,
        t = s.threads
    );
}

fn generation_table(out: &mut String, s: &Shape, models: &[ModelResults]) {
    let _ = writeln!(out, "## Greedy generation: {} tokens, tokens/s\n", s.gen_tokens);
    let mut t = Table::new(&[
        "model",
        "way",
        "tokens/s",
        "vs native",
        "vs llama-bench (as users build it)",
        "vs llama-bench (same flags)",
        "bytes into the guest per token",
        "guest's thread per token: on a CPU, waiting for one, wake-ups",
        "same tokens as native",
    ]);
    let g = s.gen_tokens as f64;
    for r in models {
        let d = r.gen_native.digests.first().copied();
        let native_token_ns = r.gen_native.times.median() / g * 1e9;
        let versus = |runs: &Runs, lb: Option<&Reference>| {
            lb.map_or("—".into(), |lb| Comparison::of(&runs.times, &lb.generation).speed_cell())
        };
        for way in r.generation_ways() {
            let runs = way.runs;
            t.row(vec![
                r.model.label.clone(),
                way.label.into(),
                runs.times.rate(g).to_string(),
                if std::ptr::eq(runs, &r.gen_native) {
                    "—".into()
                } else {
                    Comparison::of(&runs.times, &r.gen_native.times).speed_cell()
                },
                versus(runs, r.llama_bench.as_ref()),
                versus(runs, r.llama_bench_same_flags.as_ref()),
                way.bytes_per_token.map_or("—".into(), |b| format!("{b:.1}")),
                way.executor.map_or("—".into(), |e| {
                    format!(
                        "{} µs ({:.1}% of a native token), {} µs, {:.1}",
                        num(e.on_cpu_ns / 1e3),
                        e.on_cpu_ns / native_token_ns * 100.0,
                        num(e.waiting_ns / 1e3),
                        e.switches_in
                    )
                }),
                yes_no(d.is_some_and(|d| runs.all_equal(d))),
            ]);
        }
    }
    t.render(out);
    let _ = writeln!(
        out,
        "After an 8-token prompt, per token: native, a one-token `decode`, then `logits-ith` and argmax, called \
         directly; guest loop (wasm argmax), the same calls from the plugin, the logits (n_vocab floats) lowered \
         into it and the argmax in wasm; guest loop (host sampler), a one-token `decode` and `sampler.sample` \
         (greedy), so only the token id crosses; host loop, `generate.start` with a greedy sampler, then `next` \
         until done: decode, sample and accept run on the context's thread, the guest receives each piece (its \
         time is the host's generation time, from the end of the prefill).\n\n\
         The guest's thread (the executor: lifting, lowering, the plugin's own code; ggml runs on the context's \
         threads) is counted by the kernel (/proc/thread-self/schedstat): per token, the median of the timed runs \
         less that of one-token runs. In the guest's own loops that time is on the token's critical path (the \
         next decode waits for it); in the host loop it is not, but at threads = cores it is taken from a core \
         that ggml's threads would use. \"Waiting\" is time runnable without a core.\n"
    );
}

fn cancel_table(out: &mut String, s: &Shape, models: &[ModelResults], png: &str) {
    let _ = writeln!(
        out,
        "## Cancel latency: {}-token decodes cancelled at random points\n",
        s.prompt_tokens
    );
    let mut t = Table::new(&[
        "model",
        "cancels",
        "store → return, median ms",
        "p90 ms",
        "max ms",
        "median / decode",
        "max / decode",
        "mean node ms (decode / nodes)",
        "median / mean node",
        "next decode identical",
    ]);
    for r in models {
        let lat = r.latencies();
        let decode = r.plain().median();
        let node = r.mean_node_secs();
        let mut cancels = r.cancel.samples.len().to_string();
        if r.cancel.finished_first > 0 {
            cancels += &format!(" (+{} finished first)", r.cancel.finished_first);
        }
        t.row(vec![
            r.model.label.clone(),
            cancels,
            num(lat.median() * 1e3),
            num(lat.quantile(0.9) * 1e3),
            num(lat.max() * 1e3),
            format!("{:.2}%", lat.median() / decode * 100.0),
            format!("{:.2}%", lat.max() / decode * 100.0),
            format!("{} ({} nodes)", num(node * 1e3), r.nodes),
            format!("{:.1}", lat.median() / node),
            yes_no(r.cancel.identical_after),
        ]);
    }
    t.render(out);
    let _ = writeln!(
        out,
        "A second thread waits a random [0, 0.9) × the decode's median, then stores the flag; latency runs from \
         just before the store to `decode` returning `Cancelled`. After the last cancel the same context decodes \
         again without `clear`, and its logits are compared with the plain decode's.\n\n![cancel latency]({png})\n"
    );
}

fn boundary_table(out: &mut String, s: &Shape, b: &Boundary, instantiation: &Samples) {
    let _ = writeln!(out, "## Boundary cost, µs per call (measured inside the guest)\n");
    let mut t = Table::new(&["call", "median µs", "fastest µs"]);
    let us = |name: &str| {
        let (median, min) = b.cost(name);
        (median / 1e3, min / 1e3)
    };
    let diff = |a: (f64, f64), b: (f64, f64)| (a.0 - b.0, a.1 - b.1);
    let n = s.prompt_tokens;
    let (one, many, trip, logits) = (
        us("decode-cancelled-1"),
        us(&format!("decode-cancelled-{n}")),
        us("worker-round-trip"),
        us("logits-ith"),
    );
    let rows = [
        ("empty import (`cancel-token.is-cancelled`)".to_string(), us("empty-import")),
        ("worker round trip (`seq-pos-max`: host call, job to the context's thread, answer back)".into(), trip),
        ("`decode` of 1 token, token already cancelled (lift + worker round trip)".into(), one),
        (format!("`decode` of {n} tokens, token already cancelled"), many),
        (format!("→ lifting {} more tokens (difference)", n - 1), diff(many, one)),
        (format!("`logits-ith`: {} f32 out", b.n_vocab), logits),
        (format!("→ lowering {} f32 (difference from `seq-pos-max`)", b.n_vocab), diff(logits, trip)),
        (format!("not a call: argmax over {} f32 in wasm (what a generating plugin adds)", b.n_vocab), us("argmax-in-wasm")),
    ];
    for (name, (median, min)) in rows {
        t.row(vec![name, num(median), num(min)]);
    }
    let inst = instantiation.ms();
    t.row(vec![
        "instantiation: `Plugin::run` of a plugin that returns at once (new store, instantiate from the \
         `InstancePre`, WASI setup), host wall time"
            .into(),
        num(inst.median * 1e3),
        num(inst.min * 1e3),
    ]);
    t.render(out);
    let _ = writeln!(
        out,
        "Batches of calls are timed with the guest's clock; median and fastest batch. A call that hands work to \
         the context's thread costs what waking that thread costs, which on this VM depends on whether the other \
         vCPU is idle: it moves by an order of magnitude between runs. Differences are of the figures above them.\n"
    );
}

/// How a headline figure prints, and which way is better.
#[derive(Clone, Copy)]
enum Unit {
    /// Tokens/s: higher is better.
    Rate,
    /// Milliseconds: lower is better.
    Millis,
    /// A slowdown against another way: compared within each build, not across.
    Slowdown,
    /// A plain number, compared within each build.
    Count,
}

/// Every saved build's headline figures in one table, with the second build's speed
/// against the first's when there are two.
fn builds_table(out: &mut String, builds: &[Headline]) {
    let Some(first) = builds.first() else { return };
    let _ = writeln!(out, "## CPU builds side by side\n");
    let mut head = vec!["figure".to_string(), "model".to_string()];
    head.extend(builds.iter().map(|b| format!("{} build ({}), {}", b.build, b.features, b.date)));
    // Each later build against the first (portable, then avx2, then avx512).
    for later in &builds[1..] {
        head.push(format!("{} vs {}", later.build, first.build));
    }
    let mut t = Table { head, rows: Vec::new() };
    let mut row =
        |figure: &str, model: &str, unit: Unit, value: &dyn Fn(&Headline) -> Option<f64>| {
            let values: Vec<Option<f64>> = builds.iter().map(value).collect();
            if values.iter().all(Option::is_none) {
                return;
            }
            let mut cells = vec![figure.to_string(), model.to_string()];
            cells.extend(values.iter().map(|v| match (v, unit) {
                (None, _) => "—".into(),
                (Some(x), Unit::Slowdown) => pct(*x),
                (Some(x), Unit::Count) => format!("{x:.1}"),
                (Some(x), _) => num(*x),
            }));
            for &later in &values[1..] {
                cells.push(match (values[0], later, unit) {
                    (Some(a), Some(b), Unit::Rate) => format!("{:.1}× faster", b / a),
                    (Some(a), Some(b), Unit::Millis) => format!("{:.1}× shorter", a / b),
                    _ => "—".into(),
                });
            }
            t.row(cells);
        };
    let (p, g) = (first.prompt_tokens, first.gen_tokens);
    for (i, m) in first.models.iter().enumerate() {
        // The same model in another build's figures (models are measured in one order).
        let model = |b: &Headline| b.models.get(i).filter(|other| other.label == m.label).cloned();
        let label = &m.label;
        row(&format!("llamabox pp{p}, t/s"), label, Unit::Rate, &|b| {
            model(b).map(|m| m.prompt_tps)
        });
        row(&format!("llama-bench pp{p}, t/s"), label, Unit::Rate, &|b| {
            model(b)?.llama_bench_prompt_tps
        });
        row(&format!("llamabox tg{g}, t/s"), label, Unit::Rate, &|b| model(b).map(|m| m.gen_tps));
        row(&format!("guest tg{g}, t/s"), label, Unit::Rate, &|b| {
            model(b).map(|m| m.guest_gen_tps)
        });
        row(&format!("llama-bench tg{g}, t/s"), label, Unit::Rate, &|b| {
            model(b)?.llama_bench_gen_tps
        });
        row("cancellable vs plain, time", label, Unit::Slowdown, &|b| {
            model(b).map(|m| m.cancellable_vs_plain)
        });
        row("guest `decode` vs native, time", label, Unit::Slowdown, &|b| {
            model(b).map(|m| m.guest_vs_native)
        });
        row("decode cancel store → return, median ms", label, Unit::Millis, &|b| {
            model(b).map(|m| m.cancel_median_ms)
        });
        row("decode cancel, median in mean graph nodes", label, Unit::Count, &|b| {
            model(b).map(|m| m.cancel_median_nodes)
        });
    }
    let projector = "generated vision projector";
    row("image encode, ms", projector, Unit::Millis, &|b| Some(b.encode_ms));
    row("encode cancel store → return, median ms", projector, Unit::Millis, &|b| {
        Some(b.encode_cancel_ms)
    });
    t.render(out);
    let _ = writeln!(
        out,
        "One process links one ggml build, so each build is measured by its own run (`make bench CPU=portable`, \
         `CPU=avx2`, `CPU=native`) at the date in its column; each run saves its figures as \
         bench/build-<name>-t<threads>.json and this table shows every build saved on the same CPU model with the \
         same threads and token counts. Across builds, compare \
         speeds (the last column, from medians of runs minutes or hours apart on a shared machine); the \
         slowdown rows compare ways within one build.\n"
    );
    if builds.len() == 1 {
        let _ = writeln!(out, "Only the {} build has been measured so far.\n", first.build);
    }
}

/// The design's targets, each with met / missed / inconclusive and by how much. Why a
/// target was missed needs judgement: that goes in the notes kept below the report.
fn targets(
    out: &mut String,
    s: &Shape,
    models: &[ModelResults],
    encode: &crate::encode::EncodeResults,
) {
    let _ = writeln!(out, "## Targets\n");
    for r in models {
        let name = &r.model.label;
        let cancellable = Comparison::of(&r.runs(Way::Cancellable).times, r.plain());
        let identical = r.identical(Way::Cancellable);
        let _ = writeln!(
            out,
            "- {name}: cancellable ≤ 1% slower than plain, identical output: {}, identical {}: {}",
            cancellable.time_cell(),
            yes_no(identical),
            if identical {
                cancellable.verdict(0.01, time_slowdown)
            } else {
                "**missed**: output differs".into()
            },
        );
        for way in [Way::GuestBlocking, Way::GuestPending] {
            // "The same work called natively" is the cancellable call: the guest's
            // decode always installs the abort callback.
            let c = Comparison::of(&r.runs(way).times, &r.runs(Way::Cancellable).times);
            let _ = writeln!(
                out,
                "- {name}: {} ≤ 2% slower than the same call natively (cancellable): {}: {}",
                way.label(),
                c.time_cell(),
                c.verdict(0.02, time_slowdown)
            );
        }
        for (built, lb) in r.references() {
            let c = Comparison::of(r.plain(), &lb.prompt);
            let _ = writeln!(
                out,
                "- {name}: pp{} tokens/s within 3% of llama-bench ({built}): {}: {}",
                s.prompt_tokens,
                c.speed_cell(),
                c.verdict(0.03, speed_slowdown)
            );
            for way in r.generation_ways() {
                let c = Comparison::of(&way.runs.times, &lb.generation);
                let _ = writeln!(
                    out,
                    "- {name}: tg{} tokens/s within 3% of llama-bench ({built}; {}, {} threads): {}: {}",
                    s.gen_tokens,
                    way.label,
                    s.threads,
                    c.speed_cell(),
                    c.verdict(0.03, speed_slowdown)
                );
            }
        }
        let lat = r.latencies();
        let node = r.mean_node_secs();
        let nodes = lat.median() / node;
        let _ = writeln!(
            out,
            "- {name}: cancel latency about one graph node: median {} ms = {nodes:.1} mean nodes ({} ms each), max {} ms: {}",
            num(lat.median() * 1e3),
            num(node * 1e3),
            num(lat.max() * 1e3),
            if nodes <= 2.0 { "met (counted as met up to 2 mean nodes)".to_string() } else { format!("**missed**: {nodes:.1} mean nodes") },
        );
    }
    crate::encode::targets(out, encode);
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builds::ModelHeadline;

    fn headline(build: &str, prompt_tps: f64, encode_ms: f64) -> Headline {
        let model = ModelHeadline {
            label: "m".into(),
            prompt_tps,
            llama_bench_prompt_tps: None,
            gen_tps: 10.0,
            guest_gen_tps: 10.0,
            llama_bench_gen_tps: None,
            cancellable_vs_plain: 0.01,
            guest_vs_native: -0.02,
            cancel_median_ms: 5.0,
            cancel_median_nodes: 1.2,
        };
        Headline {
            build: build.into(),
            cpu: "AMD EPYC".into(),
            features: "F".into(),
            date: "d".into(),
            threads: 1,
            prompt_tokens: 512,
            gen_tokens: 128,
            models: vec![model],
            encode_ms,
            encode_cancel_ms: 1.0,
        }
    }

    #[test]
    fn builds_table_compares_speeds_across_builds_and_slowdowns_within() {
        let mut out = String::new();
        builds_table(
            &mut out,
            &[headline("portable", 50.0, 2000.0), headline("avx2", 900.0, 160.0)],
        );
        assert!(out.contains("| llamabox pp512, t/s | m | 50.0 | 900.0 | 18.0× faster |"), "{out}");
        assert!(out.contains("| image encode, ms | generated vision projector | 2000.0 | 160.0 | 12.5× shorter |"), "{out}");
        assert!(out.contains("| cancellable vs plain, time | m | +1.0% | +1.0% | — |"), "{out}");
        assert!(!out.contains("llama-bench"), "rows nobody measured are left out: {out}");
        assert!(!out.contains("so far"), "{out}");

        let mut alone = String::new();
        builds_table(&mut alone, &[headline("avx2", 900.0, 160.0)]);
        assert!(alone.contains("Only the avx2 build has been measured so far."), "{alone}");
        assert!(!alone.contains("faster"), "{alone}");
    }
}
