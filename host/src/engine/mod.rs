//! The engine: what executes native work for every run of a host. It owns the model
//! registry (models loaded once and shared), the contexts runs left idle, and the
//! batches that run many runs' one-sequence contexts as sequences of one shared native
//! context. `component` holds handles into it and maps WIT onto it; the engine knows
//! nothing of wasm and hands native objects only to their own threads (`worker`).

pub mod batch;
mod idle;
mod registry;

pub use batch::{BatchPolicy, Seat, StepObserver, StepReport};
pub(crate) use batch::SeatSize;
pub(crate) use idle::IdleContexts;
pub use registry::{ModelRegistry, OpenError, Opened};
