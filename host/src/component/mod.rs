//! The wasmtime side: WIT bindings, one host module per interface, the model registry
//! and the limits a plugin runs under. Never calls llama.cpp directly: native work goes
//! through `crate::native` types owned by `crate::worker` threads.

mod async_calls;
mod cancel;
mod limits;
mod llm;
mod media;
mod pending;
mod registry;
mod tokens;

use std::sync::Arc;

use wasmtime::component::{HasData, Linker, ResourceTable};

pub use cancel::CancelToken;
pub use limits::Limits;
pub use llm::{ContextHandle, ModelHandle, PendingDecode};
pub use media::{ChunkHandle, MediaContextHandle, PendingEncode};
pub use registry::ModelRegistry;
pub use tokens::TokenRegistry;

/// Bindings generated from `wit/`. Every import is async (decode waits on a worker
/// thread without blocking the executor) and trappable (a bad resource handle traps the
/// guest instead of panicking the host).
pub mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "plugin",
        imports: { default: async | trappable },
        with: {
            "wasi:io/poll": wasmtime_wasi::p2::bindings::io::poll,
            "wasi:clocks": wasmtime_wasi::p2::bindings::clocks,
            "llamabox:inference/cancel.cancel-token": super::CancelToken,
            "llamabox:inference/llm.model": super::ModelHandle,
            "llamabox:inference/llm.context": super::ContextHandle,
            "llamabox:inference/llm.pending-decode": super::PendingDecode,
            "llamabox:inference/media.chunk": super::ChunkHandle,
            "llamabox:inference/media.media-context": super::MediaContextHandle,
            "llamabox:inference/media.pending-encode": super::PendingEncode,
        },
    });
}

/// Bindings of the `async func` imports (WASI 0.3 guests), reusing the types above.
pub mod async_bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "async-host",
        imports: { default: trappable },
        with: {
            "llamabox:inference/types": super::bindings::llamabox::inference::types,
            "llamabox:inference/cancel": super::bindings::llamabox::inference::cancel,
            "llamabox:inference/llm": super::bindings::llamabox::inference::llm,
            "llamabox:inference/media": super::bindings::llamabox::inference::media,
        },
    });
}

pub use bindings::llamabox::inference::types::Error;

/// Per-store llamabox state: which models this plugin may open, the tokens it may
/// share and open (within its group), and its limits.
pub struct LlamaCtx {
    registry: Arc<ModelRegistry>,
    tokens: Arc<TokenRegistry>,
    group: String,
    limits: Limits,
    /// Contexts this store has alive (checked against `limits.max_contexts`).
    live_contexts: u32,
    /// Media contexts alive (checked against `limits.max_media_contexts`).
    live_media_contexts: u32,
}

impl LlamaCtx {
    /// `group` scopes shared tokens: a plugin opens only capabilities shared in its group.
    pub fn new(registry: Arc<ModelRegistry>, tokens: Arc<TokenRegistry>, group: impl Into<String>, limits: Limits) -> Self {
        Self { registry, tokens, group: group.into(), limits, live_contexts: 0, live_media_contexts: 0 }
    }
}

/// What the host functions work on: the store's llamabox state and its resource table.
pub struct LlamaCtxView<'a> {
    pub ctx: &'a mut LlamaCtx,
    pub table: &'a mut ResourceTable,
}

/// Implemented by a store's data type to give llamabox its state (like `WasiView`).
pub trait LlamaView: Send {
    fn llama(&mut self) -> LlamaCtxView<'_>;
}

pub(crate) struct HasLlama;

impl HasData for HasLlama {
    type Data<'a> = LlamaCtxView<'a>;
}

/// Add the llamabox interfaces to a linker. WASI is added separately by the embedder
/// (`wasmtime_wasi::p2::add_to_linker_async`): the world imports `wasi:io` and
/// `wasi:clocks` too, so adding the whole world here would add them twice.
pub fn add_to_linker<T: LlamaView + 'static>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    use bindings::llamabox::inference as wit;
    wit::types::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    wit::cancel::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    wit::llm::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    wit::media::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    async_bindings::llamabox::inference::async_calls::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    Ok(())
}

impl bindings::llamabox::inference::types::Host for LlamaCtxView<'_> {}

impl From<crate::native::Error> for Error {
    fn from(e: crate::native::Error) -> Self {
        use crate::native::Error as N;
        match e {
            N::Cancelled => Error::Cancelled,
            N::InvalidArgument(m) => Error::InvalidArgument(m),
            N::ContextFull => Error::ContextFull,
            N::Backend(m) => Error::Backend(m),
        }
    }
}
