//! llamabox: llama.cpp inference for sandboxed WebAssembly components, where a plugin
//! can cancel any call from another task and the cancel stops native work in flight.
//!
//! Layers, top to bottom (nothing reaches back up):
//! - [`serve`]: `llamabox serve`, HTTP in front of plugins that are `wasi:http` handlers.
//! - [`plugin`]: an embedder-facing host that runs plugin components.
//! - [`component`]: the WIT interfaces over wasmtime (bindings, validation, limits).
//! - `engine`: the model registry, idle contexts and batches (many runs' contexts as
//!   sequences of one shared native context, one decode per step).
//! - [`worker`]: one thread per native context, stop-and-join on drop.
//! - [`native`]: safe Rust over llama.cpp; no wasm types.

// Every `unsafe` block and impl says why it is sound, every `unsafe fn` what its caller
// must uphold (docs/ARCHITECTURE.md, native/).
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

pub mod component;
mod engine;
pub mod error;
pub mod native;
pub mod plugin;
pub mod serve;
pub mod worker;

pub use component::{Limits, ModelRegistry, OpenError, ShareError, TokenRegistry};
pub use engine::{BatchPolicy, StepObserver, StepReport};
pub use error::{Error, Result};
pub use native::CancelFlag;
pub use plugin::{
    CompileCacheStats, HostOptions, HttpResponse, Plugin, PluginHost, PluginState, RunOptions, RunOutcome, RunReport, RunStop, RunUsage,
};

/// The wasmtime and wasmtime-wasi this API is built on (`WasiCtxBuilder`, traps, the
/// engine): use these rather than pinning the same versions by hand.
pub use wasmtime;
pub use wasmtime_wasi;
