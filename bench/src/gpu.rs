//! The GPU rows (`make GPU=vulkan bench-gpu`, scripts/device-check.sh): on the device the
//! model's layers went to, side by side with llama.cpp's own llama-bench built for
//! Vulkan from the same tree with the same flags.
//! - pp and tg: plain (no callback) vs cancellable (the eval callback's boundaries paced
//!   to the default 10 ms target) vs densely chunked (a boundary after every allowed op),
//!   and llama-bench (`-ngl 99`, its default);
//! - store → return of cancelled prompt decodes and generations (a cancelled decode must
//!   also leave the next decode's logits as before);
//! - the same for an image encode (the encode rows, on the device).

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context as _};
use llamabox_native::{chunker::DEFAULT_LATENCY_TARGET, Model};

use crate::encode;
use crate::native::Native;
use crate::reference::LlamaBench;
use crate::stats::{in_rounds, Runs, Samples};
use crate::workload::{BenchModel, Shape};

#[derive(Clone, Copy, PartialEq)]
enum Way {
    Plain,
    Paced,
    Dense,
    LlamaBench,
}

const WAYS: [(Way, &str); 4] = [
    (Way::Plain, "plain (no callback)"),
    (Way::Paced, "cancellable, 10 ms target"),
    (Way::Dense, "boundary after every allowed op"),
    (Way::LlamaBench, "llama-bench (Vulkan, -ngl 99)"),
];

/// Everything the GPU report measures, as markdown.
pub fn report(
    model: &BenchModel,
    llama_bench: Option<&Path>,
    shape: Shape,
    rounds: usize,
    cancels: usize,
    dir: &Path,
) -> anyhow::Result<String> {
    let loaded = Arc::new(
        Model::load(&model.path).with_context(|| format!("loading {}", model.path.display()))?,
    );
    let device = loaded.device().context("the model's layers went to no GPU (is a Vulkan device visible? GGML_VK_VISIBLE_DEVICES)")?.to_string();
    let description = llamabox_native::devices()
        .into_iter()
        .find(|d| d.name == device)
        .map_or_else(String::new, |d| d.description);
    let mut native = Native::new(loaded.clone(), shape)?;
    let bench = llama_bench.map(|bin| LlamaBench {
        bin: bin.to_path_buf(),
        model: model.path.clone(),
        threads: shape.threads,
    });
    let ways: Vec<Way> =
        WAYS.iter().map(|w| w.0).filter(|w| *w != Way::LlamaBench || bench.is_some()).collect();

    let mut out = String::new();
    let cpu = crate::machine::Machine::read().cpu;
    let _ = writeln!(out, "# GPU rows\n");
    let _ = writeln!(
        out,
        "Device **{device}** ({description}); host CPU {cpu}, {} llama.cpp threads; model {} ({} of its layers on the device). \
         Medians of {rounds} rounds, the ways' order rotating from round to round.\n",
        shape.threads,
        model.label,
        loaded.gpu_layers(),
    );
    if description.contains("llvmpipe") {
        let _ = writeln!(out, "**Lavapipe (llvmpipe) is Mesa's Vulkan driver on the CPU: these figures check correctness and relative costs, they are not GPU figures.**\n");
    }

    // Warm-ups (pipelines compile on first use), and the paced context learns its speed.
    native.prompt_decode(false)?;
    native.prompt_decode(true)?;
    let pp = in_rounds(rounds, &ways, |way, _| match way {
        Way::Plain => native.prompt_decode(false),
        Way::Paced => native.prompt_decode(true),
        Way::Dense => {
            native.set_device_chunk_work(Some(1));
            let run = native.prompt_decode(true);
            native.set_device_chunk_work(None);
            run
        }
        Way::LlamaBench => bench
            .as_ref()
            .expect("listed only with llama-bench")
            .prompt(shape.prompt_tokens)
            .map(|t| (t, 0)),
    })?;
    let paced_boundaries = native.prompt_nodes()?;
    native.set_device_chunk_work(Some(1));
    let dense_boundaries = native.prompt_nodes()?;
    native.set_device_chunk_work(None);
    let identical = pp[0].all_equal(pp[0].digests[0])
        && pp[1].all_equal(pp[0].digests[0])
        && pp[2].all_equal(pp[0].digests[0]);

    native.generate()?;
    let gen_ways: Vec<Way> = ways.iter().copied().filter(|w| *w != Way::Dense).collect();
    let flag = llamabox_native::CancelFlag::new();
    let tg = in_rounds(rounds, &gen_ways, |way, _| match way {
        Way::Plain => native.generate(),
        Way::Paced => native.generate_until(Some(&flag)),
        Way::LlamaBench => bench
            .as_ref()
            .expect("listed only with llama-bench")
            .generation(shape.gen_tokens)
            .map(|t| (t, 0)),
        Way::Dense => unreachable!("not a generation way"),
    })?;

    let _ = writeln!(out, "## Throughput\n");
    let _ = writeln!(
        out,
        "| row | way | tokens/s, median (min–max) | vs plain | vs llama-bench | polls per call |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    let polls = |way| match way {
        Way::Paced => paced_boundaries.to_string(),
        Way::Dense => dense_boundaries.to_string(),
        _ => "–".into(),
    };
    let pp_name = format!("pp{}", shape.prompt_tokens);
    rows(&mut out, &pp_name, &ways, &pp, shape.prompt_tokens, polls);
    let tg_name = format!("tg{}", shape.gen_tokens);
    rows(&mut out, &tg_name, &gen_ways, &tg, shape.gen_tokens, |_| "–".into());
    let _ = writeln!(
        out,
        "\nPolls: boundaries plus the abort callback's polls of the graph's CPU nodes. Chunked logits {} unchunked ones (every round's digest).\n",
        if identical { "are bitwise equal to" } else { "DIFFER from" }
    );

    let _ = writeln!(out, "## Cancel: store → return\n");
    let decode_time = Duration::from_secs_f64(pp[0].times.median());
    let decodes = native.cancel_latency(cancels, decode_time, pp[0].digests[0])?;
    let mut latency = Samples::default();
    decodes.samples.iter().for_each(|s| latency.push(s.latency));
    let gen_time = Duration::from_secs_f64(tg[0].times.median());
    let generations = native.generation_cancel_latency(cancels, gen_time)?;
    let _ = writeln!(out, "| what | cancels | median ms (min–max) | p90 ms | target |");
    let _ = writeln!(out, "|---|---|---|---|---|");
    let target_ms = DEFAULT_LATENCY_TARGET.as_secs_f64() * 1e3;
    let rows = [
        (
            format!("{}-token decode", shape.prompt_tokens),
            &latency,
            format!("{target_ms:.0} ms + one chunk"),
        ),
        (
            format!("generation ({} tokens)", shape.gen_tokens),
            &generations,
            "one token's decode".into(),
        ),
    ];
    for (what, samples, target) in rows {
        let (n, p90) = (samples.len(), samples.quantile(0.9) * 1e3);
        let _ = writeln!(out, "| {what} | {n} | {} | {p90:.2} | {target} |", samples.ms());
    }
    let _ = writeln!(
        out,
        "\n{} decodes finished before their cancel came. After the cancels, the next decode's logits {} those of an uncancelled one.\n",
        decodes.finished_first,
        if decodes.identical_after { "equal" } else { "DIFFER from" }
    );
    ensure!(
        decodes.identical_after,
        "a cancelled decode on the device changed the next decode's logits"
    );

    let _ = writeln!(out, "## Image encode on the device\n");
    let encodes = encode::measure(
        &model.path,
        dir,
        shape.threads,
        rounds,
        cancels,
        &[DEFAULT_LATENCY_TARGET],
    )?;
    encode::table(&mut out, &encodes);
    Ok(out)
}

fn label(way: Way) -> &'static str {
    WAYS.iter().find(|w| w.0 == way).map_or("?", |w| w.1)
}

/// The rows of one measurement (`name`: pp512, tg128), one per way, each against the plain
/// way (the first) and llama-bench where it ran.
fn rows(
    out: &mut String,
    name: &str,
    ways: &[Way],
    runs: &[Runs],
    tokens: u32,
    polls: impl Fn(Way) -> String,
) {
    let plain = &runs[0].times;
    let llama_bench = ways.iter().position(|w| *w == Way::LlamaBench).map(|i| &runs[i].times);
    for (&way, run) in ways.iter().zip(runs) {
        let times = &run.times;
        let vs =
            |base: &Samples| format!("{:+.1}%", (base.median() / times.median() - 1.0) * 100.0);
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} |",
            label(way),
            times.rate(tokens as f64),
            vs(plain),
            llama_bench.map_or_else(|| "–".into(), vs),
            polls(way),
        );
    }
}
