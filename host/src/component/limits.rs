//! Host policy for one plugin: caps on what a guest may ask for, each with its reason,
//! grouped by the interface they govern (as wasmtime-wasi keeps each interface's limits
//! in its own context).
//!
//! Each group is declared once by `limit_group!` (a `knob_group!` of crate::knobs): a
//! knob's doc, type and default make the group's struct (what the host enforces), its
//! overrides (`llamabox run`'s flag, serve.toml's key, the doc as the flag's help) and
//! nothing else to keep in step.

use serde::de::{Deserializer, MapAccess, Visitor};

/// [`knob_group!`] for one group of plugin limits, its overrides read from `[limits.KEY]`
/// and `[plugins.limits.KEY]`.
macro_rules! limit_group {
    (
        $(#[doc = $doc:literal])*
        $group:ident, $overrides:ident, $key:literal, $heading:literal { $($knobs:tt)* }
    ) => {
        knob_group! {
            $(#[doc = $doc])*
            $group, $overrides, $key, $heading,
            concat!(
                "`llamabox run`'s flags and serve.toml's `[limits.", $key,
                "]` (or `[plugins.limits.", $key, "]`)"
            ), { $($knobs)* }
        }
    };
}

fn all_cores() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as u32
}

limit_group! {
    /// The `llm` interface: models' contexts and text.
    ContextLimits, ContextOverrides, "context", "Context limits (llm)" {
        /// Largest n-ctx of one context: KV memory grows linearly with it.
        max_n_ctx: u32 = 8192,
        /// Largest n-batch: the compute buffer grows with it.
        max_n_batch: u32 = 2048,
        /// Largest n-seq-max.
        max_n_seq: u32 = 16,
        /// Most threads one context may use (at least 1; a context's default follows it
        /// down): ggml's threads spin, so more threads than the plugin's share of cores
        /// slows everyone.
        max_threads: u32 = all_cores(); "all cores",
        /// Threads of a context that does not ask.
        default_threads: u32 = all_cores().min(4); "all cores, at most 4",
        /// Contexts alive at once: each owns a thread and its KV memory.
        max_contexts: u32 = 4,
        /// KV cells (n-ctx x the model's layers) over all its contexts: what KV memory
        /// grows with.
        max_kv_cells: u64 = 8192 * 32; "262144",
        /// Pending decodes and encodes alive at once: each holds a queued native call.
        max_pending_calls: u32 = 16,
        /// Longest text tokenize takes, in bytes: it allocates a token per byte and
        /// cannot be stopped midway (1 MiB took ~680 ms with SmolLM2's BPE; the default
        /// is more text than the default max-n-ctx holds).
        max_text_bytes: usize = 128 << 10; "131072 (128 KiB)",
        /// Longest text tokenize takes with parse-special, and longest media prompt
        /// (mtmd always parses special tokens): llama.cpp's special-token partition is
        /// quadratic in the special tokens of the text and cannot be stopped midway.
        max_special_text_bytes: usize = 16 << 10; "16384 (16 KiB)",
        /// Most tokens detokenize takes.
        max_detokenize_tokens: usize = 1 << 18; "262144",
    }
}

limit_group! {
    /// The `generate` interface's samplers, grammars included.
    SamplerLimits, SamplerOverrides, "sampler", "Sampler limits (generate)" {
        /// Samplers alive at once: each holds n-vocab candidates (12 bytes per token)
        /// and possibly a parsed grammar.
        max_samplers: u32 = 16,
        /// Longest GBNF grammar in bytes: llama.cpp's grammar parser and matcher recurse
        /// over the grammar's structure, so its size bounds their stack depth and time.
        max_grammar_bytes: usize = 16 << 10; "16384 (16 KiB)",
        /// Deepest nesting of groups in a grammar (each level is parser recursion).
        max_grammar_nesting: usize = 64,
        /// Logit-bias entries per sampler.
        max_logit_bias: usize = 1024,
        /// Largest penalties.last-n: the sampler keeps a ring of that many tokens.
        max_penalty_last_n: u32 = 4096,
    }
}

limit_group! {
    /// The `generate` interface's generations.
    GenerateLimits, GenerateOverrides, "generate", "Generation limits (generate)" {
        /// Tokens one generation may produce: bounds how long one call holds its context
        /// (a cancel stops it sooner).
        max_generate_tokens: u32 = 4096,
        /// Stop strings per generation: each is searched in the held-back text per token.
        max_stop_strings: usize = 8,
        /// Longest stop string in bytes: text up to this long is held back per token.
        max_stop_bytes: usize = 256,
    }
}

limit_group! {
    /// The `embeddings` interface, counted over a store's life.
    EmbeddingLimits, EmbeddingOverrides, "embeddings", "Embedding limits (embeddings)" {
        /// Inputs embedded over a run (embed and embed-rows together), refused before
        /// anything is computed: each costs a call whatever its length (~15 ms for a
        /// one-token input with SmolLM2 on 2 cores).
        max_embed_inputs: u32 = 256,
        /// Tokens embedded over a run, all inputs together: what embedding costs grows
        /// with. The default, one full max-n-ctx, costs about what one full prompt does.
        max_embed_tokens: u64 = 8192,
    }
}

limit_group! {
    /// The `media` interface: projectors, their chunks and encodes.
    MediaLimits, MediaOverrides, "media", "Media limits (media)" {
        /// Media contexts alive at once: each owns a thread and a projector's weights.
        max_media_contexts: u32 = 2,
        /// Native bytes held by its media chunks (estimated per chunk): a tiny image
        /// still holds its preprocessed pixels and the embeddings it encodes to.
        max_chunk_bytes: u64 = 256 << 20; "268435456 (256 MiB)",
        /// Largest image side in pixels: preprocessing allocates per pixel and cannot be
        /// stopped midway (a 4096-pixel square takes ~260 ms on 2 cores).
        max_image_side: u32 = 2048,
        /// Longest audio input in samples (one 30 s whisper window at 16 kHz; 60 s took
        /// ~270 ms to preprocess, unstoppable).
        max_audio_samples: usize = 30 * 16_000; "480000",
        /// Milliseconds a cancelled media encode may run on, about: each media context
        /// paces its stop points to it from its own measured speed (shorter stops sooner
        /// and synchronises more often; never below one op of the encoder).
        encode_cancel_latency_ms: u64 = 10,
        /// Fixed work units between encode stop points instead of the pacing (0: paced):
        /// stop points then fall on the same graph nodes whatever the machine's speed,
        /// as reproducible cancels need.
        encode_fixed_chunk_work: u64 = 0,
    }
}

limit_group! {
    /// The `cancel` interface's tokens and the capabilities shared from them.
    CancelLimits, CancelOverrides, "cancel", "Cancel-token limits (cancel)" {
        /// Cancel tokens alive at once (the resource table has no cap of its own).
        max_tokens: u32 = 1024,
        /// Capabilities its cancel tokens may be shared under at once, each an entry in
        /// the host-wide registry; 0 withholds sharing tokens with other instances
        /// (share answers limit-exceeded naming max-shares).
        max_shares: u32 = 256,
    }
}

limit_group! {
    /// The plugin's wasm instance, for `Store::limiter`.
    WasmLimits, WasmOverrides, "wasm", "Wasm limits" {
        /// Linear memory of one plugin instance, in MiB: a guest that grows past it gets
        /// a failed memory.grow (and usually a trap), never the host's memory.
        max_memory_mib: usize = 256,
        /// Core instances per store (a Rust component needs about 4).
        max_instances: usize = 16,
        /// Elements per wasm table.
        max_table_elements: usize = 100_000; "100000",
    }
}

/// Limits a plugin runs under, one group per interface. `Default` gives values safe for
/// an untrusted plugin on a small machine.
///
/// `#[non_exhaustive]`, as is each group: start from [`Limits::default`] and set fields
/// (`limits.context.max_n_ctx = 4096`), so that a limit added later does not break an
/// embedder's code.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Limits {
    /// Contexts and text (`llm`).
    pub context: ContextLimits,
    /// Samplers and grammars (`generate`).
    pub sampler: SamplerLimits,
    /// Generations (`generate`).
    pub generate: GenerateLimits,
    /// Embeddings (`embeddings`).
    pub embeddings: EmbeddingLimits,
    /// Media contexts, chunks and encodes (`media`).
    pub media: MediaLimits,
    /// Cancel tokens and their shares (`cancel`).
    pub cancel: CancelLimits,
    /// The wasm instance.
    pub wasm: WasmLimits,
}

impl Limits {
    /// The wasm side of these limits, for `Store::limiter`.
    pub fn store_limits(&self) -> wasmtime::StoreLimits {
        wasmtime::StoreLimitsBuilder::new()
            .memory_size(self.wasm.max_memory_mib << 20)
            .instances(self.wasm.max_instances)
            .table_elements(self.wasm.max_table_elements)
            .build()
    }

    pub(crate) fn sampler_caps(&self) -> crate::native::SamplerCaps {
        crate::native::SamplerCaps {
            max_grammar_bytes: self.sampler.max_grammar_bytes,
            max_grammar_nesting: self.sampler.max_grammar_nesting,
            max_logit_bias: self.sampler.max_logit_bias,
            max_penalty_last_n: self.sampler.max_penalty_last_n,
        }
    }

    pub(crate) fn media_caps(&self) -> crate::native::MediaCaps {
        crate::native::MediaCaps {
            max_image_side: self.media.max_image_side,
            max_audio_samples: self.media.max_audio_samples,
        }
    }
}

/// Host policy that differs from a base [`Limits`], group by group: `llamabox run`'s
/// flags, and serve.toml's `[limits.GROUP]` tables (every plugin) and
/// `[plugins.limits.GROUP]` (one plugin). One definition for both: each knob's doc is
/// its flag's help.
///
/// The flat `[plugins.limits] max_n_ctx = …` of earlier releases is still read, each
/// such key kept so that serve can warn.
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[non_exhaustive]
pub struct LimitOverrides {
    /// `[limits.context]`.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub context: ContextOverrides,
    /// `[limits.sampler]`.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub sampler: SamplerOverrides,
    /// `[limits.generate]`.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub generate: GenerateOverrides,
    /// `[limits.embeddings]`.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub embeddings: EmbeddingOverrides,
    /// `[limits.media]`.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub media: MediaOverrides,
    /// `[limits.cancel]`.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub cancel: CancelOverrides,
    /// `[limits.wasm]`.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub wasm: WasmOverrides,
    /// Flat keys of earlier releases read here: `(group, key)`.
    #[cfg_attr(feature = "cli", arg(skip))]
    moved: Vec<(&'static str, String)>,
}

impl LimitOverrides {
    /// `base` with these overrides. Fewer `max_threads` pull the default threads down
    /// with them; at least one thread is left.
    pub fn apply(&self, base: &Limits) -> Limits {
        let mut limits = base.clone();
        self.context.apply_to(&mut limits.context);
        self.sampler.apply_to(&mut limits.sampler);
        self.generate.apply_to(&mut limits.generate);
        self.embeddings.apply_to(&mut limits.embeddings);
        self.media.apply_to(&mut limits.media);
        self.cancel.apply_to(&mut limits.cancel);
        self.wasm.apply_to(&mut limits.wasm);
        let context = &mut limits.context;
        if self.context.max_threads.is_some() {
            context.max_threads = context.max_threads.max(1);
            context.default_threads = context.default_threads.min(context.max_threads);
        }
        limits
    }

    /// These overrides, and `under`'s where these leave a knob unset (a plugin's table
    /// over the server's).
    pub fn or(&self, under: &Self) -> Self {
        Self {
            context: self.context.or(&under.context),
            sampler: self.sampler.or(&under.sampler),
            generate: self.generate.or(&under.generate),
            embeddings: self.embeddings.or(&under.embeddings),
            media: self.media.or(&under.media),
            cancel: self.cancel.or(&under.cancel),
            wasm: self.wasm.or(&under.wasm),
            moved: self.moved.iter().chain(&under.moved).cloned().collect(),
        }
    }

    /// Keys of earlier releases' flat table that were read, each as `(its group, key)`
    /// (`[plugins.limits] max_n_ctx` is now `[plugins.limits.context] max_n_ctx`), once:
    /// for a warning.
    #[cfg_attr(not(feature = "serve"), allow(dead_code, reason = "serve warns with it"))]
    pub(crate) fn take_moved_keys(&mut self) -> Vec<(&'static str, String)> {
        std::mem::take(&mut self.moved)
    }
}

/// A table of group tables; a flat knob of earlier releases goes to its group (a group's
/// own table wins over it), anything else is refused by name.
impl<'de> serde::Deserialize<'de> for LimitOverrides {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Tables;
        impl<'de> Visitor<'de> for Tables {
            type Value = LimitOverrides;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a table of limit groups (context, sampler, generate, embeddings, media, cancel, wasm)")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LimitOverrides, A::Error> {
                let (mut tables, mut flat) = (LimitOverrides::default(), LimitOverrides::default());
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        ContextOverrides::KEY => tables.context = map.next_value()?,
                        SamplerOverrides::KEY => tables.sampler = map.next_value()?,
                        GenerateOverrides::KEY => tables.generate = map.next_value()?,
                        EmbeddingOverrides::KEY => tables.embeddings = map.next_value()?,
                        MediaOverrides::KEY => tables.media = map.next_value()?,
                        CancelOverrides::KEY => tables.cancel = map.next_value()?,
                        WasmOverrides::KEY => tables.wasm = map.next_value()?,
                        _ => {
                            let group = flat.read_flat_knob(&key, &mut map)?.ok_or_else(|| {
                                serde::de::Error::custom(format!(
                                    "unknown limit {key:?}: limits are set by group, as \
                                     [limits.context] max_n_ctx = 4096 (groups: context, \
                                     sampler, generate, embeddings, media, cancel, wasm)"
                                ))
                            })?;
                            flat.moved.push((group, key));
                        }
                    }
                }
                Ok(tables.or(&flat))
            }
        }
        d.deserialize_map(Tables)
    }
}

impl LimitOverrides {
    /// Reads a flat knob of earlier releases into its group; its group's name, or
    /// `None` if no group has it.
    fn read_flat_knob<'de, A: MapAccess<'de>>(
        &mut self,
        key: &str,
        map: &mut A,
    ) -> Result<Option<&'static str>, A::Error> {
        Ok(if self.context.read_knob(key, map)? {
            Some(ContextOverrides::KEY)
        } else if self.sampler.read_knob(key, map)? {
            Some(SamplerOverrides::KEY)
        } else if self.generate.read_knob(key, map)? {
            Some(GenerateOverrides::KEY)
        } else if self.embeddings.read_knob(key, map)? {
            Some(EmbeddingOverrides::KEY)
        } else if self.media.read_knob(key, map)? {
            Some(MediaOverrides::KEY)
        } else if self.cancel.read_knob(key, map)? {
            Some(CancelOverrides::KEY)
        } else if self.wasm.read_knob(key, map)? {
            Some(WasmOverrides::KEY)
        } else {
            None
        })
    }
}

#[cfg(test)]
mod overrides_tests {
    use super::*;

    #[test]
    fn overrides_change_only_what_they_name_and_threads_pull_the_default_down() {
        let mut base = Limits::default();
        (base.context.max_threads, base.context.default_threads) = (8, 4);
        assert_eq!(LimitOverrides::default().apply(&base), base);
        let mut over = LimitOverrides::default();
        over.context.max_threads = Some(2);
        over.wasm.max_memory_mib = Some(64);
        over.context.max_contexts = Some(1);
        let l = over.apply(&base);
        assert_eq!(
            (
                l.context.max_threads,
                l.context.default_threads,
                l.wasm.max_memory_mib,
                l.context.max_contexts
            ),
            (2, 2, 64, 1)
        );
        assert_eq!(
            (l.context.max_n_ctx, l.context.max_kv_cells),
            (base.context.max_n_ctx, base.context.max_kv_cells)
        );
        over.context.max_threads = Some(0);
        let zero = over.apply(&base);
        assert_eq!(
            (zero.context.max_threads, zero.context.default_threads),
            (1, 1),
            "at least one thread"
        );
        // Sharing tokens is withheld by a limit of 0, not clamped up.
        let mut no_shares = LimitOverrides::default();
        no_shares.cancel.max_shares = Some(0);
        let l = no_shares.apply(&base);
        assert_eq!((l.cancel.max_shares, l.context.max_contexts), (0, base.context.max_contexts));
    }

    #[test]
    fn tables_by_group_and_flat_keys_of_earlier_releases_both_read() {
        let over: LimitOverrides = serde_json::from_str(
            r#"{"max_n_ctx": 1024, "max_shares": 0,
                "context": {"max_n_ctx": 2048}, "media": {"max_image_side": 64}}"#,
        )
        .unwrap();
        assert_eq!(over.context.max_n_ctx, Some(2048), "the group's table wins over the flat key");
        assert_eq!((over.cancel.max_shares, over.media.max_image_side), (Some(0), Some(64)));
        assert_eq!(
            over.clone().take_moved_keys(),
            [("context", "max_n_ctx".to_string()), ("cancel", "max_shares".to_string())]
        );
        let server: LimitOverrides = serde_json::from_str(
            r#"{"generate": {"max_stop_strings": 2}, "media": {"max_image_side": 32}}"#,
        )
        .unwrap();
        let both = over.or(&server);
        assert_eq!(
            (both.generate.max_stop_strings, both.media.max_image_side),
            (Some(2), Some(64))
        );
    }

    #[test]
    fn an_unknown_limit_or_group_is_refused_by_name() {
        let flat = serde_json::from_str::<LimitOverrides>(r#"{"max_n_ctxx": 1}"#).unwrap_err();
        let flat = flat.to_string();
        assert!(
            flat.contains("unknown limit \"max_n_ctxx\"") && flat.contains("[limits.context]"),
            "{flat}"
        );
        let grouped = serde_json::from_str::<LimitOverrides>(r#"{"media": {"max_n_ctx": 1}}"#);
        let grouped = grouped.unwrap_err().to_string();
        assert!(grouped.contains("unknown field `max_n_ctx`"), "{grouped}");
    }
}
