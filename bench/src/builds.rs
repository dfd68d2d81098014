//! The CPU builds side by side. One process links one ggml build, so the portable build
//! (baseline x86-64: SSE2), the AVX2 one and the one for this CPU's features (AVX-512
//! where present) are measured by separate runs (`make bench CPU=portable|avx2|native`). Each run
//! saves its headline figures as `build-<name>.json` beside its report, and every report
//! shows the builds saved so far in one table, the run's own included.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use crate::encode::EncodeResults;
use crate::report::{ModelResults, Way};
use crate::workload::Shape;

/// What one run of the suite says about its build, in the units the table prints.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Headline {
    /// `portable`, `avx2` or `avx512`: the linked ggml's `InstructionLevel`.
    pub build: String,
    /// The CPU model the run measured on: builds compare only on the same one.
    #[serde(default)]
    pub cpu: String,
    /// Those features, as ggml prints them.
    pub features: String,
    pub date: String,
    pub threads: u32,
    pub prompt_tokens: u32,
    pub gen_tokens: u32,
    pub models: Vec<ModelHeadline>,
    pub encode_ms: f64,
    pub encode_cancel_ms: f64,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ModelHeadline {
    pub label: String,
    /// Plain native prompt decode, tokens/s (median).
    pub prompt_tps: f64,
    pub llama_bench_prompt_tps: Option<f64>,
    /// Native greedy generation, tokens/s (median).
    pub gen_tps: f64,
    pub guest_gen_tps: f64,
    pub llama_bench_gen_tps: Option<f64>,
    /// Paired-median time ratios minus one (`+0.01` = 1% slower).
    pub cancellable_vs_plain: f64,
    pub guest_vs_native: f64,
    pub cancel_median_ms: f64,
    /// The cancel latency's median in mean graph nodes.
    pub cancel_median_nodes: f64,
}

impl Headline {
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        build: &str,
        cpu: &str,
        features: &[String],
        date: &str,
        shape: Shape,
        models: &[ModelResults],
        encode: &EncodeResults,
    ) -> Self {
        let (p, g) = (shape.prompt_tokens as f64, shape.gen_tokens as f64);
        let models = models
            .iter()
            .map(|r| {
                let plain = &r.runs(Way::Plain).times;
                let cancellable = &r.runs(Way::Cancellable).times;
                let latency = r.latencies();
                ModelHeadline {
                    label: r.model.label.clone(),
                    prompt_tps: p / plain.median(),
                    llama_bench_prompt_tps: r.llama_bench.as_ref().map(|lb| p / lb.prompt.median()),
                    gen_tps: g / r.gen_native.times.median(),
                    guest_gen_tps: g / r.gen_guest.times.median(),
                    llama_bench_gen_tps: r
                        .llama_bench
                        .as_ref()
                        .map(|lb| g / lb.generation.median()),
                    cancellable_vs_plain: cancellable.ratios_to(plain).median() - 1.0,
                    guest_vs_native: r
                        .runs(Way::GuestBlocking)
                        .times
                        .ratios_to(cancellable)
                        .median()
                        - 1.0,
                    cancel_median_ms: latency.median() * 1e3,
                    cancel_median_nodes: latency.median() / r.mean_node_secs(),
                }
            })
            .collect();
        Self {
            build: build.into(),
            cpu: cpu.into(),
            features: features.join(" "),
            date: date.into(),
            threads: shape.threads,
            prompt_tokens: shape.prompt_tokens,
            gen_tokens: shape.gen_tokens,
            models,
            encode_ms: encode.plain.median() * 1e3,
            encode_cancel_ms: encode.latency.median() * 1e3,
        }
    }
}

/// Where a build's headline at a thread count is kept: beside the report.
fn path(report: &Path, build: &str, threads: u32) -> PathBuf {
    report.with_file_name(format!("build-{build}-t{threads}.json"))
}

/// Save `this` and return every build's headline found beside `report`, `this` in place
/// of the file it replaced, portable first. A build saved with another shape (threads,
/// token counts) or on another CPU model is left out: its figures would not compare.
pub fn save_and_collect(report: &Path, this: &Headline) -> anyhow::Result<Vec<Headline>> {
    let own = path(report, &this.build, this.threads);
    std::fs::write(&own, serde_json::to_string_pretty(this)? + "\n")
        .with_context(|| format!("writing {}", own.display()))?;
    let mut all = Vec::new();
    for build in ["portable", "avx2", "avx512"] {
        if build == this.build {
            all.push(this.clone());
            continue;
        }
        let file = path(report, build, this.threads);
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let other: Headline =
            serde_json::from_str(&text).with_context(|| format!("reading {}", file.display()))?;
        if (other.threads, other.prompt_tokens, other.gen_tokens, other.cpu.as_str())
            == (this.threads, this.prompt_tokens, this.gen_tokens, this.cpu.as_str())
        {
            all.push(other);
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headline(build: &str, threads: u32) -> Headline {
        Headline {
            build: build.into(),
            cpu: "AMD EPYC".into(),
            features: String::new(),
            date: "today".into(),
            threads,
            prompt_tokens: 512,
            gen_tokens: 128,
            models: Vec::new(),
            encode_ms: 1.0,
            encode_cancel_ms: 0.1,
        }
    }

    #[test]
    fn collects_saved_builds_of_the_same_shape_portable_first() {
        let dir =
            std::env::temp_dir().join(format!("llamabox-bench-builds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let report = dir.join("RESULTS.md");
        let native = save_and_collect(&report, &headline("avx2", 1)).unwrap();
        assert_eq!(native.iter().map(|h| h.build.as_str()).collect::<Vec<_>>(), ["avx2"]);
        let both = save_and_collect(&report, &headline("portable", 1)).unwrap();
        assert_eq!(both.iter().map(|h| h.build.as_str()).collect::<Vec<_>>(), ["portable", "avx2"]);
        // Another CPU model does not compare either.
        let elsewhere = save_and_collect(
            &report,
            &Headline { cpu: "Intel Xeon".into(), ..headline("avx2", 1) },
        )
        .unwrap();
        assert_eq!(elsewhere.iter().map(|h| h.build.as_str()).collect::<Vec<_>>(), ["avx2"]);
        // Another thread count does not compare with the saved native figures.
        let alone = save_and_collect(&report, &headline("portable", 2)).unwrap();
        assert_eq!(alone.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
