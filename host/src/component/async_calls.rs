//! `llamabox:inference/async-calls`: decode and encode as `async func`s (WASI 0.3).
//! The store is touched only inside `accessor.with`, never across an await; the call
//! itself is the same worker call as the blocking form, so dropping the host future
//! (wasmtime does when the guest drops the subtask) stops the native work. Each call
//! holds one of the store's max-pending-calls places while it runs.

use wasmtime::component::{Accessor, Resource};

use super::async_bindings::llamabox::inference::async_calls::{Host, HostWithStore};
use super::bindings::llamabox::inference::generate::Piece;
use super::bindings::llamabox::inference::llm::Batch;
use super::pending::finished;
use super::{
    CancelToken, ChunkHandle, ContextHandle, GenerationHandle, HasLlama, LlamaCtxView, LlamaResult,
    MediaContextHandle,
};

impl Host for LlamaCtxView<'_> {}

impl<T> HostWithStore<T> for HasLlama {
    async fn decode(
        accessor: &Accessor<T, Self>,
        ctx: Resource<ContextHandle>,
        batch: Batch,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<()> {
        let (_slot, call) = accessor.with(|mut access| -> LlamaResult<_> {
            let mut view = access.get();
            let slot = view.ctx.pending_slot()?;
            Ok((slot, view.queue_decode(&ctx, batch, &cancel)?))
        })?;
        // The slot is held until the call ends or its future is dropped.
        Ok(finished(call.await)?)
    }

    async fn encode_chunk(
        accessor: &Accessor<T, Self>,
        media: Resource<MediaContextHandle>,
        chunk: Resource<ChunkHandle>,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<Vec<f32>> {
        let (_slot, call) = accessor.with(|mut access| -> LlamaResult<_> {
            let mut view = access.get();
            let slot = view.ctx.pending_slot()?;
            Ok((slot, view.queue_encode(&media, &chunk, &cancel)?))
        })?;
        Ok(finished(call.await)?)
    }

    async fn generation_next(
        accessor: &Accessor<T, Self>,
        generation: Resource<GenerationHandle>,
    ) -> LlamaResult<Option<Piece>> {
        // The stream is lent out of the table while this call waits (the store is
        // never held across an await). If the guest drops this call's future, the
        // stream drops with it, and with the stream the generation: it is cancelled.
        let mut lent = accessor.with(|mut access| {
            access.get().table.get_mut(&generation).map(GenerationHandle::lend)
        })??;
        let piece = lent.next().await;
        accessor.with(|mut access| {
            access.get().table.get_mut(&generation).map(|g| g.give_back(lent))
        })?;
        Ok(piece?)
    }
}
