//! llamabox: llama.cpp inference for sandboxed WebAssembly components, where a plugin
//! can cancel any call from another task and the cancel stops native work in flight.
//!
//! Layers, top to bottom (nothing reaches back up):
//! - `serve` (feature `serve`, on by default): `llamabox serve`, HTTP in front of
//!   plugins that are `wasi:http` handlers.
//! - `plugin`: the embedder-facing host that runs plugin components ([`PluginHost`]).
//! - `component`: the WIT interfaces over wasmtime (bindings, validation, limits).
//! - `engine`: the model registry, idle contexts and batches (many runs' contexts as
//!   sequences of one shared native context, one decode per step).
//! - `worker`: one thread per native context, stop-and-join on drop.
//! - `native`: safe Rust over llama.cpp, no wasm types; the `llamabox-native` crate
//!   (`native/`), so that nothing in it can reach up.

// Every `unsafe` block and impl says why it is sound, every `unsafe fn` what its caller
// must uphold (docs/ARCHITECTURE.md, native/).
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]
#![warn(missing_docs)]

#[macro_use]
mod knobs;
mod component;
mod engine;
pub mod error;
mod grant;
// The native layer is its own crate; inside this one it keeps its layer's name.
use llamabox_native as native;
mod plugin;
#[cfg(feature = "serve")]
pub mod serve;
pub mod source;
mod worker;

// What an embedder uses, deliberately: the host and its runs, the registries and
// limits, errors, and for an embedder that owns its store, the linker entry point and
// the view it needs. Everything else is the crate's own.
pub use component::{
    add_to_linker, LimitOverrides, Limits, LlamaCtx, LlamaCtxView, LlamaView, ModelRegistry,
    OpenError, ShareError, TokenRegistry, OLDEST_WIT_VERSION, WIT_VERSION,
};
/// The groups of [`Limits`] and of [`LimitOverrides`], one per interface.
pub mod limits {
    pub use crate::component::{
        CancelLimits, CancelOverrides, ContextLimits, ContextOverrides, EmbeddingLimits,
        EmbeddingOverrides, GenerateLimits, GenerateOverrides, MediaLimits, MediaOverrides,
        SamplerLimits, SamplerOverrides, WasmLimits, WasmOverrides,
    };
}
pub use engine::{BatchPolicy, Claim, StepObserver, StepReport};
pub use error::{Error, Result};
pub use grant::{Grant, Interface};
pub use native::CancelFlag;
pub use plugin::{
    CompileCacheStats, HostOptions, HttpResponse, Plugin, PluginHost, PluginState, ResponseSender,
    RunOptions, RunOutcome, RunReport, RunStop, RunUsage,
};

/// The wasmtime and wasmtime-wasi this API is built on (`WasiCtxBuilder`, traps, the
/// engine): use these rather than pinning the same versions by hand.
pub use wasmtime;
pub use wasmtime_wasi;
