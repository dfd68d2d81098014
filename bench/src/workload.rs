//! What is benchmarked, defined once for the native side and (as arguments) for the
//! guest: the models, the context shape, the token stream and the output digests.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use llamabox_native::{Batch, ContextParams, TextModelSpec, Token};

/// A model under benchmark: the name plugins open it by, and its file.
#[derive(Clone, Debug)]
pub struct BenchModel {
    pub name: &'static str,
    /// What the report calls it.
    pub label: String,
    pub path: PathBuf,
}

/// The generated model: [`TextModelSpec::slow`] (E512, 8 layers, f32 weights), whose
/// 512-token decode takes a few hundred ms on one core: long enough to cancel at random
/// points, short enough for many runs. Written once (the spec is seeded) into `dir`.
pub fn synthetic_model(dir: &Path) -> anyhow::Result<BenchModel> {
    let spec = TextModelSpec::slow();
    let TextModelSpec { n_embd, n_layer, n_ff, seed, .. } = spec;
    let path = dir.join(format!("llama-e{n_embd}-l{n_layer}-ff{n_ff}-seed{seed}.gguf"));
    if !path.is_file() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        spec.write(&path)
            .with_context(|| format!("writing the generated model {}", path.display()))?;
    }
    Ok(BenchModel {
        name: "synthetic",
        label: format!("generated llama E{n_embd} L{n_layer} FF{n_ff} (f32)"),
        path,
    })
}

pub fn real_model(path: PathBuf) -> anyhow::Result<BenchModel> {
    anyhow::ensure!(
        path.is_file(),
        "the real model {} does not exist (scripts/fetch-model.sh fetches it)",
        path.display()
    );
    Ok(BenchModel { name: "smollm2", label: "SmolLM2-135M-Instruct Q4_1".into(), path })
}

/// Context shape and threads, the same natively and in the guest.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Tokens of the timed prompt decode (one batch, one ubatch).
    pub prompt_tokens: u32,
    /// Tokens of greedy generation.
    pub gen_tokens: u32,
    pub threads: u32,
}

/// Tokens of the generation prompt (also in guest/bench-plugin).
pub const GEN_PROMPT_TOKENS: u32 = 8;

impl Shape {
    /// Room for the prompt decode and for the generation, rounded up as llama.cpp pads.
    pub fn n_ctx(&self) -> u32 {
        (self.prompt_tokens.max(GEN_PROMPT_TOKENS + self.gen_tokens) + 1)
            .next_power_of_two()
            .max(256)
    }

    /// The whole prompt in one ubatch, as llama-bench's pp test (n_ubatch 512) runs it.
    pub fn n_batch(&self) -> u32 {
        self.prompt_tokens.max(GEN_PROMPT_TOKENS)
    }

    pub fn params(&self) -> ContextParams {
        ContextParams {
            n_ctx: self.n_ctx(),
            n_batch: self.n_batch(),
            n_ubatch: self.n_batch(),
            n_seq_max: 1,
            n_threads: self.threads,
        }
    }

    /// The same context as guest arguments.
    pub fn guest_args(&self) -> Vec<String> {
        let flags =
            [("--threads", self.threads), ("--ctx", self.n_ctx()), ("--batch", self.n_batch())];
        flags.iter().flat_map(|(k, v)| [k.to_string(), v.to_string()]).collect()
    }
}

/// The benchmark's token stream: a fixed multiplicative hash of the index, the same
/// formula as in guest/bench-plugin, so both sides decode the same tokens without
/// passing them around. Which tokens they are does not change a decode's cost.
pub fn bench_tokens(n: u32, n_vocab: u32) -> Vec<Token> {
    (0..n as u64).map(|i| ((i * 2_654_435_761 + 12_345) % n_vocab as u64) as Token).collect()
}

/// The prompt batch of the decode benchmark: logits for its last row only.
pub fn prompt_batch(shape: &Shape, n_vocab: u32) -> Batch {
    Batch::sequence(&bench_tokens(shape.prompt_tokens, n_vocab), 0, 0)
}

/// The first index of the largest logit, as the guest computes it.
pub fn argmax(logits: &[f32]) -> Token {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > best.1 {
            best = (i, l);
        }
    }
    best.0 as Token
}

/// FNV-1a over the values' bits (as the guest prints it): equal digests, equal output.
pub fn fnv1a64_logits(values: &[f32]) -> u64 {
    fnv1a64(values.iter().flat_map(|v| v.to_bits().to_le_bytes()))
}

pub fn fnv1a64_tokens(tokens: &[Token]) -> u64 {
    fnv1a64(tokens.iter().flat_map(|t| t.to_le_bytes()))
}

fn fnv1a64(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}
