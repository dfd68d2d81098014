//! `llamabox:inference/llm`: models, contexts and decodes. Every argument is checked
//! here against host policy and by `crate::native` against llama.cpp's preconditions;
//! the engine decides what backs a context (`engine::Lease`) and runs its native work.

use std::sync::Arc;

use wasmtime::component::Resource;
use wasmtime_wasi::p2::DynPollable;

use super::bindings::llamabox::inference::llm::{
    Batch, ContextParams, Host, HostContext, HostModel, HostPendingDecode,
};
use super::pending::{finished, Pending};
use super::{within, CancelToken, Charge, Error, LlamaCtxView, LlamaResult};
use crate::engine::{Lease, LeaseRequest, Opened};
use crate::native::{self, CancelFlag, Model, Token};
use crate::worker::Call;

/// Longest key `model.meta` looks up: GGUF keys are short dotted names.
const MAX_META_KEY_BYTES: usize = 256;

pub struct ModelHandle {
    pub(super) model: Arc<Model>,
    /// The engine's idle contexts and batches on this model.
    pub(super) opened: Opened,
}

pub struct ContextHandle {
    /// What the engine runs it on.
    pub(super) lease: Lease,
    params: native::ContextParams,
    pub(super) model: Arc<Model>,
    /// What it counts against the store's limits.
    held: Charge,
    /// The settings it was asked with (what an idle context is matched on), and the
    /// engine state it came from (where it may be parked when dropped).
    requested: native::ContextParams,
    opened: Opened,
}

impl ContextHandle {
    /// Cells the context has in all (its sequences share or split them).
    pub(super) fn n_ctx(&self) -> u32 {
        self.params.n_ctx
    }
}

/// A decode started with `start-decode`.
pub type PendingDecode = Pending<()>;

impl LlamaCtxView<'_> {
    fn context(&self, ctx: &Resource<ContextHandle>) -> wasmtime::Result<&ContextHandle> {
        Ok(self.table.get(ctx)?)
    }

    /// Wait for a call on the context's lease.
    async fn on_lease<T: Send + 'static>(
        &mut self,
        ctx: &Resource<ContextHandle>,
        call: impl FnOnce(&Lease) -> Call<native::Result<T>>,
    ) -> LlamaResult<T> {
        let call = call(&self.context(ctx)?.lease);
        Ok(finished(call.await)?)
    }

    /// Run `f` (native work that cannot stop midway, bounded by the limits on its
    /// input) on a blocking thread counted in the store's tracker: the executor stays
    /// free, and a run that ends (at its deadline, say) still waits for it.
    pub(super) async fn off_executor<T: Send + 'static>(
        &mut self,
        f: impl FnOnce() -> native::Result<T> + Send + 'static,
    ) -> LlamaResult<T> {
        match self.ctx.workers.blocking(f).await {
            Some(result) => Ok(result?),
            None => Err(Error::Backend("the native call panicked".into()).into()),
        }
    }

    /// Queue a decode; the returned call stops in flight when `token` is cancelled or
    /// the call is dropped.
    pub(super) fn queue_decode(
        &mut self,
        ctx: &Resource<ContextHandle>,
        batch: Batch,
        token: &Resource<CancelToken>,
    ) -> wasmtime::Result<Call<native::Result<()>>> {
        let token: CancelFlag = self.table.get(token)?.flag.clone();
        let batch = native::Batch {
            tokens: batch.tokens,
            positions: batch.positions,
            seq_ids: batch.seq_ids,
            logits: batch.logits,
        };
        Ok(self.context(ctx)?.lease.decode(batch, token))
    }

    /// Resolve `params` against the host's defaults and caps. Only host limits are
    /// checked here (`limit-exceeded`); whether the params make sense together is
    /// `native`'s to say (`invalid-argument`).
    fn resolve(
        &self,
        params: ContextParams,
        model: &Model,
    ) -> Result<native::ContextParams, Error> {
        let (p, c) = (params, &self.ctx.limits.context);
        // `asked`, or `default` when the plugin left it out, unless it is above `max`.
        let cap = |name: &str, asked: Option<u32>, default: u32, limit: &str, max: u32| {
            let value = asked.unwrap_or(default);
            if value > max {
                Err(Error::LimitExceeded(format!(
                    "{name} {value} is above this host's limit {max} ({limit})"
                )))
            } else {
                Ok(value)
            }
        };
        let n_ctx_default = model.n_ctx_train().clamp(1, 4096).min(c.max_n_ctx);
        let n_ctx = cap("n-ctx", p.n_ctx, n_ctx_default, "max-n-ctx", c.max_n_ctx)?;
        let n_batch = cap("n-batch", p.n_batch, n_ctx.min(512), "max-n-batch", c.max_n_batch)?;
        let n_ubatch = cap("n-ubatch", p.n_ubatch, n_batch.min(512), "max-n-batch", c.max_n_batch)?;
        let n_seq_max = cap("n-seq-max", p.n_seq_max, 1, "max-n-seq", c.max_n_seq)?;
        let n_threads =
            cap("n-threads", p.n_threads, c.default_threads, "max-threads", c.max_threads)?;
        Ok(native::ContextParams { n_ctx, n_batch, n_ubatch, n_seq_max, n_threads })
    }
}

impl Host for LlamaCtxView<'_> {}

impl HostModel for LlamaCtxView<'_> {
    async fn open(&mut self, name: String) -> LlamaResult<Resource<ModelHandle>> {
        use crate::engine::OpenError;
        match self.ctx.registry.open_entry(&name).await {
            Ok(opened) => {
                Ok(self.table.push(ModelHandle { model: opened.model.clone(), opened })?)
            }
            Err(OpenError::NotFound(name)) => Err(Error::ModelNotFound(name).into()),
            Err(e @ OpenError::LoadFailed(_)) => Err(Error::Backend(e.to_string()).into()),
        }
    }

    async fn tokenize(
        &mut self,
        model: Resource<ModelHandle>,
        text: String,
        add_special: bool,
        parse_special: bool,
    ) -> LlamaResult<Vec<Token>> {
        let limits = &self.ctx.limits;
        let (max, limit) = if parse_special {
            (limits.context.max_special_text_bytes, "max-special-text-bytes")
        } else {
            (limits.context.max_text_bytes, "max-text-bytes")
        };
        within(limit, max, text.len(), "bytes of text")?;
        let model = self.table.get(&model)?.model.clone();
        self.off_executor(move || model.tokenize(&text, add_special, parse_special)).await
    }

    async fn token_to_piece(
        &mut self,
        model: Resource<ModelHandle>,
        token: Token,
        special: bool,
    ) -> LlamaResult<Vec<u8>> {
        Ok(self.table.get(&model)?.model.token_to_piece(token, special)?)
    }

    async fn detokenize(
        &mut self,
        model: Resource<ModelHandle>,
        tokens: Vec<Token>,
        remove_special: bool,
        unparse_special: bool,
    ) -> LlamaResult<String> {
        let max = self.ctx.limits.context.max_detokenize_tokens;
        within("max-detokenize-tokens", max, tokens.len(), "tokens")?;
        let model = self.table.get(&model)?.model.clone();
        self.off_executor(move || model.detokenize(&tokens, remove_special, unparse_special)).await
    }

    async fn n_vocab(&mut self, model: Resource<ModelHandle>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&model)?.model.n_vocab())
    }

    async fn n_embd(&mut self, model: Resource<ModelHandle>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&model)?.model.n_embd())
    }

    async fn n_ctx_train(&mut self, model: Resource<ModelHandle>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&model)?.model.n_ctx_train())
    }

    async fn bos(&mut self, model: Resource<ModelHandle>) -> wasmtime::Result<Option<Token>> {
        Ok(self.table.get(&model)?.model.bos())
    }

    async fn eos(&mut self, model: Resource<ModelHandle>) -> wasmtime::Result<Option<Token>> {
        Ok(self.table.get(&model)?.model.eos())
    }

    async fn is_eog(
        &mut self,
        model: Resource<ModelHandle>,
        token: Token,
    ) -> wasmtime::Result<bool> {
        Ok(self.table.get(&model)?.model.is_eog(token))
    }

    async fn meta(
        &mut self,
        model: Resource<ModelHandle>,
        key: String,
    ) -> LlamaResult<Option<String>> {
        if key.len() > MAX_META_KEY_BYTES {
            return Err(Error::LimitExceeded(format!(
                "a metadata key of {} bytes is above {MAX_META_KEY_BYTES}",
                key.len()
            ))
            .into());
        }
        let max = self.ctx.limits.context.max_text_bytes;
        let model = &self.table.get(&model)?.model;
        model.meta_within(&key, max).map_err(|len| {
            Error::LimitExceeded(format!(
                "metadata {key:?} of {len} bytes is above max-text-bytes {max}"
            ))
            .into()
        })
    }

    async fn drop(&mut self, model: Resource<ModelHandle>) -> wasmtime::Result<()> {
        self.table.delete(model)?;
        Ok(())
    }
}

impl HostContext for LlamaCtxView<'_> {
    async fn create(
        &mut self,
        model: Resource<ModelHandle>,
        params: ContextParams,
    ) -> LlamaResult<Resource<ContextHandle>> {
        let handle = self.table.get(&model)?;
        let (model, opened) = (handle.model.clone(), handle.opened.clone());
        let requested = self.resolve(params, &model)?;
        // Charged as llama.cpp allocates: n-ctx after its padding, every layer.
        let allocated = requested.allocated_n_ctx()?;
        let held = Charge::Context { kv_cells: allocated as u64 * model.n_layer() as u64 };
        self.ctx.admit(held)?;
        let want = LeaseRequest {
            params: requested,
            ubatch_chosen: params.n_ubatch.is_some(),
            allocated_n_ctx: allocated,
            group: &self.ctx.group,
            claim: self.ctx.claim,
            meter: self.ctx.meter.clone(),
            tracker: &self.ctx.workers,
        };
        match opened.lease(want).await {
            Ok((lease, params)) => Ok(self.table.push(ContextHandle {
                lease,
                params,
                model,
                held,
                requested,
                opened,
            })?),
            Err(e) => {
                self.ctx.release(held);
                Err(Error::from(e).into())
            }
        }
    }

    async fn decode(
        &mut self,
        ctx: Resource<ContextHandle>,
        batch: Batch,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<()> {
        let call = self.queue_decode(&ctx, batch, &cancel)?;
        Ok(finished(call.await)?)
    }

    async fn start_decode(
        &mut self,
        ctx: Resource<ContextHandle>,
        batch: Batch,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<Resource<PendingDecode>> {
        let slot = self.ctx.pending_slot()?;
        let call = self.queue_decode(&ctx, batch, &cancel)?;
        Ok(self.table.push(Pending::new(call, slot))?)
    }

    async fn logits_ith(
        &mut self,
        ctx: Resource<ContextHandle>,
        row: u32,
    ) -> LlamaResult<Vec<f32>> {
        self.on_lease(&ctx, |l| l.logits(Some(row))).await
    }

    async fn last_logits(&mut self, ctx: Resource<ContextHandle>) -> LlamaResult<Vec<f32>> {
        self.on_lease(&ctx, |l| l.logits(None)).await
    }

    async fn seq_rm(
        &mut self,
        ctx: Resource<ContextHandle>,
        seq: i32,
        p0: i32,
        p1: i32,
    ) -> LlamaResult<()> {
        self.on_lease(&ctx, |l| l.seq_rm(seq, p0, p1)).await
    }

    async fn seq_pos_max(&mut self, ctx: Resource<ContextHandle>, seq: i32) -> LlamaResult<i32> {
        self.on_lease(&ctx, |l| l.seq_pos_max(seq)).await
    }

    async fn clear(&mut self, ctx: Resource<ContextHandle>) -> LlamaResult<()> {
        self.on_lease(&ctx, Lease::clear).await
    }

    async fn n_ctx(&mut self, ctx: Resource<ContextHandle>) -> wasmtime::Result<u32> {
        Ok(self.context(&ctx)?.params.n_ctx)
    }

    async fn n_batch(&mut self, ctx: Resource<ContextHandle>) -> wasmtime::Result<u32> {
        Ok(self.context(&ctx)?.params.n_batch)
    }

    async fn n_ubatch(&mut self, ctx: Resource<ContextHandle>) -> wasmtime::Result<u32> {
        Ok(self.context(&ctx)?.params.n_ubatch)
    }

    async fn n_seq_max(&mut self, ctx: Resource<ContextHandle>) -> wasmtime::Result<u32> {
        Ok(self.context(&ctx)?.params.n_seq_max)
    }

    async fn drop(&mut self, ctx: Resource<ContextHandle>) -> wasmtime::Result<()> {
        let ContextHandle { lease, requested, opened, held, .. } = self.table.delete(ctx)?;
        // A seat's call is stopped and undone and its sequence freed before the run's
        // tracker says so; a context of its own is parked or freed (`give_back`).
        opened.give_back(lease, self.ctx.group.clone(), requested).await;
        self.ctx.release(held);
        Ok(())
    }
}

impl HostPendingDecode for LlamaCtxView<'_> {
    async fn subscribe(
        &mut self,
        pending: Resource<PendingDecode>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        Pending::subscribe(self.table, &pending)
    }

    async fn finish(&mut self, pending: Resource<PendingDecode>) -> LlamaResult<()> {
        Ok(self.table.get_mut(&pending)?.finish().await?)
    }

    async fn drop(&mut self, pending: Resource<PendingDecode>) -> wasmtime::Result<()> {
        // Dropping an unfinished call sets its stop flag: the decode stops in flight.
        self.table.delete(pending)?;
        Ok(())
    }
}
