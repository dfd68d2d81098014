//! Safe Rust over llama.cpp (`llama-cpp-sys-2`). Knows nothing of wasm: every function
//! here is safe to call with any arguments, checking them before llama.cpp can assert.

mod backend;
pub mod cancel;
pub mod chat;
pub mod chunker;
pub mod context;
mod cores;
pub mod devices;
mod eval_scope;
pub mod generate;
mod grammar;
mod logprobs;
pub mod media;
mod meter;
pub mod model;
pub mod sampler;
#[cfg(feature = "synthetic")]
pub mod synthetic;
mod threads;

pub use backend::{build_c_flags, cpu_features, InstructionLevel};
pub use cancel::{CancelFlag, Stop, WeakCancelFlag};
pub use chat::{ChatMessage, ChatTemplate};
pub use context::{warm_up, Batch, Context, ContextParams, Pooling, PromptPiece};
pub use cores::{Cores, Turn};
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
pub use meter::Meter;
pub use model::Model;
pub use sampler::{Grammar, Penalties, Sampler, SamplerCaps, SamplerParams, MIN_TEMPERATURE};
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

/// A token id in a model's vocabulary, as llama.cpp numbers it (`llama_token`).
pub type Token = i32;

/// `Result` with the native [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
