//! The engine: what executes native work for every run of a host. It owns the model
//! registry (models loaded once and shared), the contexts runs left idle, and the
//! batches that run many runs' one-sequence contexts as sequences of one shared native
//! context; and it decides which of these backs a plugin's context (`Lease`).
//! `component` holds leases and maps WIT onto them; the engine knows nothing of wasm
//! and hands native objects only to their own threads (`worker`).

pub mod batch;
mod cores;
mod idle;
mod lease;
mod media;
mod meter;
mod registry;
pub mod schedule;

pub use batch::{BatchPolicy, StepObserver, StepReport};
pub(crate) use cores::{Booking, Cores, Flow, FlowCores, Pacer};
pub(crate) use lease::{Lease, LeaseRequest};
pub(crate) use media::{EncodePace, MediaLease, MediaRequest};
pub(crate) use meter::Meter;
pub use registry::{ModelRegistry, OpenError, Opened};
pub use schedule::Claim;
