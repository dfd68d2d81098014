//! Safe Rust over llama.cpp (`llama-cpp-sys-2`), the bottom layer of llamabox.
//!
//! Knows nothing of wasm, plugins or tenants: every function here is safe to call with
//! any arguments, checking them before llama.cpp can assert, and every long call stops
//! at the next graph node once its [`CancelFlag`] is raised. Policy (who shares the
//! cores, whose work counts where, which prefix is kept) belongs to the engine above,
//! which is why this is a crate of its own: nothing here can reach up.
//!
//! An embedder uses the `llamabox` crate. This one serves llamabox's engine, tests and
//! benchmarks; it is versioned with the workspace, by semver like any crate.

// Every `unsafe` block and impl says why it is sound, every `unsafe fn` what its caller
// must uphold.
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]
#![warn(missing_docs)]

mod backend;
pub mod cancel;
pub mod chat;
pub mod chunker;
pub mod context;
pub mod devices;
mod eval_scope;
pub mod generate;
mod grammar;
mod logprobs;
pub mod media;
pub mod model;
pub mod sampler;
mod share;
#[cfg(feature = "synthetic")]
pub mod synthetic;
mod threads;

pub use backend::{build_c_flags, cpu_features, InstructionLevel};
pub use cancel::{CancelFlag, Stop, WeakCancelFlag};
pub use chat::{ChatMessage, ChatTemplate};
pub use context::{warm_up, Batch, Context, ContextParams, Pooling, PromptPiece};
pub use devices::{devices, gpu_backends, Device, DeviceKind, Offload};
pub use generate::{
    check_request, generate, nothing_to_continue, FinishReason, GenerateRequest, GenerationUsage,
    Outcome, Pick, Piece, TokenLoop,
};
pub use grammar::GrammarSyntax;
pub use logprobs::{token_logprob, TokenLogprob, MAX_TOP_LOGPROBS};
pub use media::{
    check_owner, Chunk, ChunkKind, MediaCaps, MediaContext, MediaContextId, MediaInput,
};
pub use model::Model;
pub use sampler::{Grammar, Penalties, Sampler, SamplerCaps, SamplerParams, MIN_TEMPERATURE};
pub use share::{CoreTurn, Pieces, SharedCores, Tally};
#[cfg(feature = "synthetic")]
pub use synthetic::{ProjectorKind, ProjectorSpec, TextModelSpec};
pub use threads::{idle_poll, set_idle_poll, DEFAULT_IDLE_POLL};

/// Why a native call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The call was cancelled; it changed nothing.
    #[error("cancelled")]
    Cancelled,
    /// An argument llama.cpp would refuse or assert on (the message says which); the
    /// call changed nothing.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A grammar or JSON Schema that does not compile, or whose matcher gave up (its
    /// per-token limits); the call changed nothing.
    #[error("{syntax}: {reason}")]
    Grammar {
        /// What the grammar was written in.
        syntax: GrammarSyntax,
        /// Why, in the grammar engine's words.
        reason: String,
    },
    /// No room in the context's memory for the batch.
    #[error("context is full")]
    ContextFull,
    /// A budget would be exceeded; nothing is kept.
    #[error("limit exceeded: {limit}: {requested} is above {max}")]
    LimitExceeded {
        /// The limit's name, as the config and the WIT docs spell it (`max-chunk-bytes`).
        limit: &'static str,
        /// What the call would have come to.
        requested: u64,
        /// What the limit allows (what is left of it, for a budget being spent).
        max: u64,
    },
    /// llama.cpp failed for a reason of its own (its message, or what was being done).
    #[error("{0}")]
    Backend(String),
}

impl Error {
    /// `limit` (the config's and the WIT docs' name) would be exceeded: `requested` is
    /// above `max`.
    pub(crate) fn limit(
        limit: &'static str,
        requested: impl TryInto<u64>,
        max: impl TryInto<u64>,
    ) -> Self {
        let (requested, max) =
            (requested.try_into().unwrap_or(u64::MAX), max.try_into().unwrap_or(u64::MAX));
        Error::LimitExceeded { limit, requested, max }
    }
}

/// A token id in a model's vocabulary, as llama.cpp numbers it (`llama_token`).
pub type Token = i32;

/// `Result` with the native [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
