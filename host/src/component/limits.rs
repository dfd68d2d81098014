//! Host policy for one plugin: caps on what a guest may ask for, each with its reason.

/// Limits a plugin runs under. `Default` gives values safe for an untrusted plugin on a
/// small machine.
///
/// `#[non_exhaustive]`: start from [`Limits::default`] and set fields, so that a limit
/// added later does not break an embedder's code.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Limits {
    /// Largest `n-ctx` per context: KV memory grows linearly with it.
    pub max_n_ctx: u32,
    /// Largest `n-batch`: the compute buffer grows with it.
    pub max_n_batch: u32,
    /// Largest `n-seq-max`.
    pub max_n_seq: u32,
    /// Most threads one context may use: ggml's threads spin, so more threads than the
    /// plugin's share of cores slows everyone.
    pub max_threads: u32,
    /// Threads used when the plugin does not ask.
    pub default_threads: u32,
    /// Contexts alive at once per store: each owns a thread and its KV memory.
    pub max_contexts: u32,
    /// KV cells (n-ctx × the model's layers) over all of a store's contexts: what KV
    /// memory grows with.
    pub max_kv_cells: u64,
    /// `pending-decode` / `pending-encode` alive at once per store: each holds a queued
    /// native call.
    pub max_pending_calls: u32,
    /// Cancel tokens alive at once per store (the resource table has no cap of its own).
    pub max_tokens: u32,
    /// Capabilities shared from a store's tokens and not yet dropped with them: each is
    /// an entry in the host-wide registry (which also caps each group).
    pub max_shares: u32,
    /// Media contexts alive at once per store: each owns a thread and a projector's weights.
    pub max_media_contexts: u32,
    /// Native bytes held by a store's media chunks (estimated per chunk: see
    /// `native::Chunk::native_bytes`): a tiny image still holds its preprocessed
    /// pixels and the embeddings it encodes to, so chunk counts alone bound nothing.
    pub max_chunk_bytes: u64,
    /// Largest image side in pixels: preprocessing allocates per pixel, and cannot be
    /// stopped midway (a 4096² image takes ~260 ms on this project's CI machine).
    pub max_image_side: u32,
    /// Longest audio input in samples (30 s at 16 kHz by default, one whisper window;
    /// 60 s took ~270 ms to preprocess, unstoppable).
    pub max_audio_samples: usize,
    /// Linear memory of one plugin instance, in bytes: a guest that grows past it gets a
    /// failed `memory.grow` (and usually a trap), never the host's memory.
    pub max_wasm_memory: usize,
    /// Core instances per store (a Rust component needs about 4).
    pub max_wasm_instances: usize,
    /// Elements per wasm table.
    pub max_wasm_table_elements: usize,
    /// Longest text `tokenize` takes, in bytes: it allocates a token per byte and cannot
    /// be stopped midway (1 MiB took ~680 ms with SmolLM2's BPE; the default 128 KiB
    /// is more text than the default max-n-ctx holds).
    pub max_text_bytes: usize,
    /// Longest text `tokenize` takes with parse-special, and longest media prompt (mtmd
    /// always parses special tokens): llama.cpp's special-token partition is quadratic
    /// in the number of special tokens in the text and cannot be stopped midway, so
    /// this bounds how long a deadline or cancel can wait for it.
    pub max_special_text_bytes: usize,
    /// Most tokens `detokenize` takes.
    pub max_detokenize_tokens: usize,
    /// How long a cancelled media encode may run on (store → return), about: each media
    /// context paces its stop points to this from its own measured speed. Shorter stops
    /// sooner and synchronises more often (each stop point costs tens of µs); it cannot
    /// go below one matmul or attention op of the encoder.
    pub encode_cancel_latency: std::time::Duration,
    /// Fixed work units between encode stop points instead of pacing them to
    /// `encode_cancel_latency`: stop points then fall on the same graph nodes in every
    /// run, whatever the machine's speed (reproducible cancels, as tests need).
    pub encode_fixed_chunk_work: Option<u64>,
    /// Most tokens one generation may produce: bounds how long one call holds its
    /// context (a cancel stops it sooner).
    pub max_generate_tokens: u32,
    /// Stop strings per generation: each is searched in the held-back text per token.
    pub max_stop_strings: usize,
    /// Longest stop string in bytes: text up to this long is held back per token.
    pub max_stop_bytes: usize,
    /// Longest GBNF grammar in bytes: llama.cpp's grammar parser and matcher recurse
    /// over the grammar's structure, so its size bounds their stack depth and time.
    pub max_grammar_bytes: usize,
    /// Deepest nesting of groups in a grammar (each level is parser recursion).
    pub max_grammar_nesting: usize,
    /// Logit-bias entries per sampler.
    pub max_logit_bias: usize,
    /// Largest `penalties.last-n`: the sampler keeps a ring of that many tokens.
    pub max_penalty_last_n: u32,
    /// Samplers alive at once per store: each holds n-vocab candidates (12 bytes per
    /// token) and possibly a parsed grammar.
    pub max_samplers: u32,
    /// Inputs one store may embed over its life (`embed` and `embed-rows` together):
    /// each costs a call on the context's worker whatever its length (~15 ms for a
    /// one-token input with SmolLM2 on this project's 2-core VM: 256 took 3.85 s; the
    /// 60 000 of issue 23, a 300 KB request, were ~13 minutes of work). A call that
    /// would go over is refused before it computes anything.
    pub max_embed_inputs: u32,
    /// Tokens one store may embed over its life: what embedding costs grows with. The
    /// default, one full `max_n_ctx`, costs about what one full prompt does (~44 s on
    /// one core at SmolLM2's 187 tokens/s), within the server's default deadline.
    pub max_embed_tokens: u64,
}

impl Default for Limits {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        Self {
            max_n_ctx: 8192,
            max_n_batch: 2048,
            max_n_seq: 16,
            max_threads: cores,
            default_threads: cores.min(4),
            max_wasm_memory: 256 << 20,
            max_wasm_instances: 16,
            max_wasm_table_elements: 100_000,
            max_contexts: 4,
            max_kv_cells: 8192 * 32,
            max_pending_calls: 16,
            max_tokens: 1024,
            max_shares: 256,
            max_media_contexts: 2,
            max_chunk_bytes: 256 << 20,
            max_image_side: 2048,
            max_audio_samples: 30 * 16_000,
            max_text_bytes: 128 << 10,
            max_special_text_bytes: 16 << 10,
            max_detokenize_tokens: 1 << 18,
            encode_cancel_latency: crate::native::chunker::DEFAULT_LATENCY_TARGET,
            encode_fixed_chunk_work: None,
            max_generate_tokens: 4096,
            max_stop_strings: 8,
            max_stop_bytes: 256,
            max_grammar_bytes: 16 << 10,
            max_grammar_nesting: 64,
            max_logit_bias: 1024,
            max_penalty_last_n: 4096,
            max_samplers: 16,
            max_embed_inputs: 256,
            max_embed_tokens: 8192,
        }
    }
}

impl Limits {
    /// The wasm side of these limits, for `Store::limiter`.
    pub fn store_limits(&self) -> wasmtime::StoreLimits {
        wasmtime::StoreLimitsBuilder::new()
            .memory_size(self.max_wasm_memory)
            .instances(self.max_wasm_instances)
            .table_elements(self.max_wasm_table_elements)
            .build()
    }

    pub(crate) fn sampler_caps(&self) -> crate::native::SamplerCaps {
        crate::native::SamplerCaps {
            max_grammar_bytes: self.max_grammar_bytes,
            max_grammar_nesting: self.max_grammar_nesting,
            max_logit_bias: self.max_logit_bias,
            max_penalty_last_n: self.max_penalty_last_n,
        }
    }

    pub(crate) fn media_caps(&self) -> crate::native::MediaCaps {
        crate::native::MediaCaps {
            max_image_side: self.max_image_side,
            max_audio_samples: self.max_audio_samples,
        }
    }
}

/// Host policy that differs from a base [`Limits`]: `llamabox run`'s flags and a
/// serve.toml `[plugins.limits]` table, one definition for both (each field's doc is the
/// flag's help).
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct LimitOverrides {
    /// Most threads a plugin's context may use (default: all cores; at least 1); a
    /// context's default follows it down.
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub max_threads: Option<u32>,
    /// Largest n-ctx of one context (default 8192).
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub max_n_ctx: Option<u32>,
    /// KV cells (n-ctx x layers) over all its contexts (default 262144).
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub max_kv_cells: Option<u64>,
    /// The plugin's linear memory, in MiB (default 256).
    #[cfg_attr(feature = "cli", arg(long, value_name = "MIB"))]
    pub max_memory_mib: Option<usize>,
    /// Contexts alive at once (default 4).
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub max_contexts: Option<u32>,
    /// Tokens one generation may produce (default 4096).
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub max_generate_tokens: Option<u32>,
    /// Inputs of one embeddings call (default 256).
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub max_embed_inputs: Option<u32>,
    /// Tokens of one embeddings call, all inputs together (default 8192).
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub max_embed_tokens: Option<u64>,
    /// Capabilities its cancel tokens may be shared under at once (default 256); 0
    /// withholds sharing tokens with other instances (`share` answers `limit-exceeded`
    /// naming `max-shares`).
    #[cfg_attr(feature = "cli", arg(long, value_name = "N"))]
    pub max_shares: Option<u32>,
}

impl LimitOverrides {
    /// `base` with these overrides.
    pub fn apply(&self, base: &Limits) -> Limits {
        let mut limits = base.clone();
        if let Some(n) = self.max_threads {
            limits.max_threads = n.max(1);
            limits.default_threads = limits.default_threads.min(limits.max_threads);
        }
        limits.max_n_ctx = self.max_n_ctx.unwrap_or(limits.max_n_ctx);
        limits.max_kv_cells = self.max_kv_cells.unwrap_or(limits.max_kv_cells);
        limits.max_wasm_memory =
            self.max_memory_mib.map_or(limits.max_wasm_memory, |mib| mib << 20);
        limits.max_contexts = self.max_contexts.unwrap_or(limits.max_contexts);
        limits.max_generate_tokens = self.max_generate_tokens.unwrap_or(limits.max_generate_tokens);
        limits.max_embed_inputs = self.max_embed_inputs.unwrap_or(limits.max_embed_inputs);
        limits.max_embed_tokens = self.max_embed_tokens.unwrap_or(limits.max_embed_tokens);
        limits.max_shares = self.max_shares.unwrap_or(limits.max_shares);
        limits
    }
}

#[cfg(test)]
mod overrides_tests {
    use super::*;

    #[test]
    fn overrides_change_only_what_they_name_and_threads_pull_the_default_down() {
        let base = Limits { max_threads: 8, default_threads: 4, ..Limits::default() };
        assert_eq!(format!("{:?}", LimitOverrides::default().apply(&base)), format!("{base:?}"));
        let l = LimitOverrides {
            max_threads: Some(2),
            max_memory_mib: Some(64),
            max_contexts: Some(1),
            ..LimitOverrides::default()
        }
        .apply(&base);
        assert_eq!(
            (l.max_threads, l.default_threads, l.max_wasm_memory, l.max_contexts),
            (2, 2, 64 << 20, 1)
        );
        assert_eq!((l.max_n_ctx, l.max_kv_cells), (base.max_n_ctx, base.max_kv_cells));
        let zero =
            LimitOverrides { max_threads: Some(0), ..LimitOverrides::default() }.apply(&base);
        assert_eq!((zero.max_threads, zero.default_threads), (1, 1), "at least one thread");
        // Sharing tokens is withheld by a limit of 0, not clamped up.
        let no_shares =
            LimitOverrides { max_shares: Some(0), ..LimitOverrides::default() }.apply(&base);
        assert_eq!((no_shares.max_shares, no_shares.max_contexts), (0, base.max_contexts));
    }
}
