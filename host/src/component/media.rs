//! `llamabox:inference/media`: projectors, chunks, cancellable encodes, and evaluating
//! a chunk list into a text context.

use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::Resource;
use wasmtime_wasi::p2::DynPollable;

use super::bindings::llamabox::inference::media::{
    ChunkKind, Host, HostChunk, HostMediaContext, HostPendingEncode, Input,
};
use super::llm::{ContextHandle, ModelHandle};
use super::pending::{finished, Pending};
use super::{within, CancelToken, Charge, Error, LlamaCtxView, LlamaResult};
use crate::engine::{EncodePace, MediaLease, MediaRequest};
use crate::native::{self, Chunk, MediaContext, MediaInput, Model, Token};
use crate::worker::Call;

pub struct ChunkHandle {
    chunk: Arc<Chunk>,
}

impl ChunkHandle {
    /// What it counts against `max-chunk-bytes`.
    fn held(&self) -> Charge {
        Charge::Chunks { bytes: self.chunk.native_bytes() as u64 }
    }
}

pub struct MediaContextHandle {
    lease: MediaLease,
    model: Arc<Model>,
}

/// An encode started with `start-encode-chunk`.
pub type PendingEncode = Pending<Vec<f32>>;

impl LlamaCtxView<'_> {
    fn media(&self, media: &Resource<MediaContextHandle>) -> wasmtime::Result<&MediaContextHandle> {
        Ok(self.table.get(media)?)
    }

    /// Queue an encode of `chunk`, which must come from `media` (else `invalid-argument`).
    pub(super) fn queue_encode(
        &mut self,
        media: &Resource<MediaContextHandle>,
        chunk: &Resource<ChunkHandle>,
        token: &Resource<CancelToken>,
    ) -> LlamaResult<Call<native::Result<Vec<f32>>>> {
        let token = self.table.get(token)?.flag.clone();
        let chunk = self.table.get(chunk)?.chunk.clone();
        Ok(self.media(media)?.lease.encode(chunk, token)?)
    }
}

impl Host for LlamaCtxView<'_> {}

impl HostChunk for LlamaCtxView<'_> {
    async fn kind(&mut self, chunk: Resource<ChunkHandle>) -> wasmtime::Result<ChunkKind> {
        Ok(match self.table.get(&chunk)?.chunk.kind() {
            native::ChunkKind::Text => ChunkKind::Text,
            native::ChunkKind::Image => ChunkKind::Image,
            native::ChunkKind::Audio => ChunkKind::Audio,
        })
    }

    async fn n_tokens(&mut self, chunk: Resource<ChunkHandle>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&chunk)?.chunk.n_tokens() as u32)
    }

    async fn n_pos(&mut self, chunk: Resource<ChunkHandle>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&chunk)?.chunk.n_pos().max(0) as u32)
    }

    async fn text_tokens(&mut self, chunk: Resource<ChunkHandle>) -> wasmtime::Result<Vec<Token>> {
        Ok(self.table.get(&chunk)?.chunk.text_tokens().to_vec())
    }

    async fn drop(&mut self, chunk: Resource<ChunkHandle>) -> wasmtime::Result<()> {
        // A running encode holds its own reference: the chunk outlives it.
        let handle = self.table.delete(chunk)?;
        self.ctx.release(handle.held());
        Ok(())
    }
}

impl HostMediaContext for LlamaCtxView<'_> {
    async fn open(
        &mut self,
        projector: String,
        model: Resource<ModelHandle>,
    ) -> LlamaResult<Resource<MediaContextHandle>> {
        let model = self.table.get(&model)?;
        let (opened, model) = (model.opened.clone(), model.model.clone());
        let Ok(projector_path) = self.ctx.registry.projector_path(&projector) else {
            return Err(Error::ModelNotFound(projector).into());
        };
        self.ctx.admit(Charge::MediaContext)?;
        let media = &self.ctx.limits.media;
        let pace = match media.encode_fixed_chunk_work {
            0 => EncodePace::Latency(Duration::from_millis(media.encode_cancel_latency_ms)),
            units => EncodePace::Work(units),
        };
        let want = MediaRequest {
            projector: projector_path,
            threads: self.ctx.limits.context.default_threads,
            pace,
            group: &self.ctx.group,
            meter: self.ctx.meter().clone(),
            tracker: &self.ctx.workers,
        };
        match opened.lease_media(want).await {
            Ok(lease) => Ok(self.table.push(MediaContextHandle { lease, model })?),
            Err(e) => {
                self.ctx.release(Charge::MediaContext);
                tracing::error!("opening projector {projector:?}: {e}");
                Err(Error::Backend(format!(
                    "projector {projector:?} could not be loaded for this model"
                ))
                .into())
            }
        }
    }

    async fn supports_vision(
        &mut self,
        media: Resource<MediaContextHandle>,
    ) -> wasmtime::Result<bool> {
        Ok(self.media(&media)?.lease.vision)
    }

    async fn supports_audio(
        &mut self,
        media: Resource<MediaContextHandle>,
    ) -> wasmtime::Result<bool> {
        Ok(self.media(&media)?.lease.audio)
    }

    async fn audio_sample_rate(
        &mut self,
        media: Resource<MediaContextHandle>,
    ) -> wasmtime::Result<Option<u32>> {
        Ok(self.media(&media)?.lease.sample_rate)
    }

    async fn marker(&mut self, _media: Resource<MediaContextHandle>) -> wasmtime::Result<String> {
        Ok(MediaContext::marker().to_string())
    }

    async fn tokenize(
        &mut self,
        media: Resource<MediaContextHandle>,
        prompt: String,
        inputs: Vec<Input>,
    ) -> LlamaResult<Vec<Resource<ChunkHandle>>> {
        // mtmd parses special tokens in every prompt.
        let max = self.ctx.limits.context.max_special_text_bytes;
        within("max-special-text-bytes", max, prompt.len(), "bytes of prompt")?;
        let caps = self.ctx.limits.media_caps();
        let inputs: Vec<MediaInput> = inputs
            .into_iter()
            .map(|input| match input {
                Input::Image(image) => {
                    MediaInput::Image { width: image.width, height: image.height, rgb: image.rgb }
                }
                Input::Audio(samples) => MediaInput::Audio { samples },
            })
            .collect();
        let budget = self.ctx.chunk_bytes_left();
        let call = self.media(&media)?.lease.tokenize(prompt, inputs, caps, budget);
        let chunks = finished(call.await)?;
        let bytes = chunks.iter().map(|c| c.native_bytes() as u64).sum();
        self.ctx.admit(Charge::Chunks { bytes })?;
        let handles = chunks
            .into_iter()
            .map(|chunk| self.table.push(ChunkHandle { chunk }))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(handles)
    }

    async fn encode_chunk(
        &mut self,
        media: Resource<MediaContextHandle>,
        chunk: Resource<ChunkHandle>,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<Vec<f32>> {
        let call = self.queue_encode(&media, &chunk, &cancel)?;
        Ok(finished(call.await)?)
    }

    async fn start_encode_chunk(
        &mut self,
        media: Resource<MediaContextHandle>,
        chunk: Resource<ChunkHandle>,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<Resource<PendingEncode>> {
        let call = self.queue_encode(&media, &chunk, &cancel)?;
        let slot = match self.ctx.pending_slot() {
            Ok(slot) => slot,
            Err(e) => return Err(e.into()), // dropping the call abandons it
        };
        Ok(self.table.push(Pending::new(call, slot))?)
    }

    async fn eval_chunks(
        &mut self,
        media: Resource<MediaContextHandle>,
        ctx: Resource<ContextHandle>,
        chunks: Vec<Resource<ChunkHandle>>,
        seq: i32,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<i32> {
        let token = self.table.get(&cancel)?.flag.clone();
        let chunks = chunks
            .iter()
            .map(|c| Ok(self.table.get(c)?.chunk.clone()))
            .collect::<wasmtime::Result<Vec<_>>>()?;
        let media = self.media(&media)?;
        let context = self.table.get(&ctx)?;
        if !Arc::ptr_eq(&media.model, &context.model) {
            return Err(Error::InvalidArgument(
                "the media context was opened for another model".into(),
            )
            .into());
        }
        media.lease.check_chunks(&chunks)?;
        // More tokens than the whole context holds can never fit: known before anything
        // is encoded, without waiting for the context's worker (native `eval` checks the
        // sequence's own room again before it computes).
        let n_tokens = chunks.iter().map(|c| c.n_tokens()).fold(0, usize::saturating_add);
        if n_tokens > context.n_ctx() as usize {
            return Err(Error::ContextFull.into());
        }
        Ok(media.lease.eval_into(&context.lease, chunks, seq, token).await?)
    }

    async fn drop(&mut self, media: Resource<MediaContextHandle>) -> wasmtime::Result<()> {
        // Stops its running encode, then waits for the projector to be freed.
        let handle = self.table.delete(media)?;
        handle.lease.give_back().await;
        self.ctx.release(Charge::MediaContext);
        Ok(())
    }
}

impl HostPendingEncode for LlamaCtxView<'_> {
    async fn subscribe(
        &mut self,
        pending: Resource<PendingEncode>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        Pending::subscribe(self.table, &pending)
    }

    async fn finish(&mut self, pending: Resource<PendingEncode>) -> LlamaResult<Vec<f32>> {
        Ok(self.table.get_mut(&pending)?.finish().await?)
    }

    async fn drop(&mut self, pending: Resource<PendingEncode>) -> wasmtime::Result<()> {
        // Dropping an unfinished encode sets its stop flag: it stops at the next boundary.
        self.table.delete(pending)?;
        Ok(())
    }
}
