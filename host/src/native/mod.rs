//! Safe Rust over llama.cpp (`llama-cpp-sys-2`). Knows nothing of wasm: every function
//! here is safe to call with any arguments, checking them before llama.cpp can assert.

mod backend;
pub mod cancel;
pub mod chunker;
pub mod context;
pub mod media;
pub mod model;
#[cfg(feature = "synthetic")]
pub mod synthetic;

pub use backend::cpu_features;
pub use cancel::{CancelFlag, Stop, WeakCancelFlag};
pub use context::{Batch, Context, ContextParams, Piece};
pub use media::{check_owner, Chunk, ChunkKind, MediaCaps, MediaContext, MediaContextId, MediaInput};
pub use model::{Model, Token};
#[cfg(feature = "synthetic")]
pub use synthetic::{ProjectorKind, ProjectorSpec, TextModelSpec};

/// Why a native call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The call was cancelled; it changed nothing.
    #[error("cancelled")]
    Cancelled,
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No room in the context's memory for the batch.
    #[error("context is full")]
    ContextFull,
    #[error("{0}")]
    Backend(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
