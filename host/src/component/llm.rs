//! `llamabox:inference/llm`: models, contexts and decodes. Every argument is checked
//! here against host policy and by `crate::native` against llama.cpp's preconditions;
//! the native work itself runs on the context's worker thread.

use std::sync::Arc;

use wasmtime::component::Resource;
use wasmtime_wasi::p2::DynPollable;

use super::bindings::llamabox::inference::llm::{Batch, ContextParams, Host, HostContext, HostModel, HostPendingDecode};
use super::pending::{finished, Pending};
use super::{LlamaResult, CancelToken, Error, Charge, LlamaCtxView};
use crate::engine::{IdleContexts, Opened, Seat, SeatSize};
use crate::native::{self, CancelFlag, Context, Model, Stop, Token};
use crate::worker::{Call, Worker};

pub struct ModelHandle {
    pub(super) model: Arc<Model>,
    /// The engine's idle contexts and batches on this model.
    pub(super) opened: Opened,
}

/// What runs a plugin's context: a native context of its own on its own thread, or a
/// seat (one sequence) of a batch the engine shares between runs.
pub(super) enum Backing {
    Own(Worker<Context>),
    Seat(Seat),
}

impl Backing {
    /// Run `f` on the context's own thread; on a seat, `seat_op` instead.
    pub(super) fn call<T: Send + 'static>(
        &self,
        own: impl FnOnce(&mut Context, &CancelFlag) -> native::Result<T> + Send + 'static,
        seat_op: impl FnOnce(&Seat) -> Call<native::Result<T>>,
    ) -> Call<native::Result<T>> {
        match self {
            Backing::Own(worker) => worker.call(own),
            Backing::Seat(seat) => seat_op(seat),
        }
    }

    /// The native context of its own, for what a seat cannot do.
    pub(super) fn own(&self, what: &str) -> Result<&Worker<Context>, Error> {
        match self {
            Backing::Own(worker) => Ok(worker),
            Backing::Seat(_) => Err(Error::InvalidArgument(format!(
                "this context is a sequence of a batched context, which cannot {what}: create the context with n-ubatch set to get a context of its own"
            ))),
        }
    }
}

pub struct ContextHandle {
    pub(super) backing: Backing,
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

    /// Run `own` on the context's worker thread, or `seat_op` on its seat, and wait.
    async fn on_backing<T: Send + 'static>(
        &mut self,
        ctx: &Resource<ContextHandle>,
        own: impl FnOnce(&mut Context) -> native::Result<T> + Send + 'static,
        seat_op: impl FnOnce(&Seat) -> Call<native::Result<T>>,
    ) -> LlamaResult<T> {
        let call = self.context(ctx)?.backing.call(move |c, _| own(c), seat_op);
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
        Ok(match &self.context(ctx)?.backing {
            Backing::Own(worker) => worker.call(move |c, abandoned| c.decode(&batch, Some(Stop::on_either(&token, abandoned)))),
            Backing::Seat(seat) => seat.decode(batch, token),
        })
    }

    /// A seat for a context asked for with `params` (resolved as `requested`), when
    /// the host batches it: one sequence, n-ubatch left to the host, n-ctx within a
    /// seat. `None`: it gets a context of its own.
    async fn lease_seat(&mut self, opened: &Opened, params: &ContextParams, requested: &native::ContextParams, n_ctx: u32) -> Option<Result<(Seat, native::ContextParams), Error>> {
        let policy = opened.policy.as_ref()?;
        if requested.n_seq_max != 1 || params.n_ubatch.is_some() {
            return None;
        }
        let seat = opened
            .batch
            .lease(policy, &opened.model, SeatSize { n_ctx, n_batch: requested.n_batch }, &self.ctx.group, self.ctx.meter.clone(), &self.ctx.workers)
            .await?;
        Some(seat.map_err(Error::from).map(|seat| {
            let granted = native::ContextParams { n_ctx, n_ubatch: seat.n_ubatch().min(requested.n_batch), n_threads: policy.threads, ..*requested };
            (seat, granted)
        }))
    }

    /// A new context on its own worker thread, and the settings llama.cpp gave it.
    async fn start_context(&mut self, opened: &Opened, params: native::ContextParams) -> Result<(Worker<Context>, native::ContextParams), Error> {
        let (model, cores) = (opened.model.clone(), opened.policy.as_ref().map(|p| p.cores.clone()));
        let meter = self.ctx.meter.clone();
        let init = move || {
            let mut context = Context::new(model, params)?;
            context.set_meter(meter);
            // Beside batches, it decodes in turns with them (their steps use every core).
            context.share_cores(cores);
            Ok::<_, native::Error>(context)
        };
        let worker = Worker::start("llamabox-context", &self.ctx.workers, init).await?;
        match worker.call(|c, _| c.params()).await {
            Some(params) => Ok((worker, params)),
            None => Err(Error::Backend("context worker stopped".into())),
        }
    }

    /// An idle context of this store's group made with `params`, now counted in this
    /// store and metering its run; `None` if there is none (or its thread is gone).
    async fn reuse_idle(&mut self, idle: &IdleContexts, params: &native::ContextParams) -> Option<(Worker<Context>, native::ContextParams)> {
        let worker = idle.take(&self.ctx.group, params)?;
        worker.retrack(&self.ctx.workers);
        let meter = self.ctx.meter.clone();
        let params = worker
            .call(move |c, _| {
                c.set_meter(meter);
                c.params()
            })
            .await?;
        Some((worker, params))
    }

    /// Resolve `params` against the host's defaults and caps. Only host limits are
    /// checked here (`limit-exceeded`); whether the params make sense together is
    /// `native`'s to say (`invalid-argument`).
    fn resolve(&self, params: ContextParams, model: &Model) -> Result<native::ContextParams, Error> {
        let limits = &self.ctx.limits;
        let cap = |name: &str, value: u32, limit: &str, max: u32| {
            if value > max {
                Err(Error::LimitExceeded(format!("{name} {value} is above this host's limit {max} ({limit})")))
            } else {
                Ok(value)
            }
        };
        let n_ctx_default = model.n_ctx_train().clamp(1, 4096).min(limits.max_n_ctx);
        let n_ctx = cap("n-ctx", params.n_ctx.unwrap_or(n_ctx_default), "max-n-ctx", limits.max_n_ctx)?;
        let n_batch = cap("n-batch", params.n_batch.unwrap_or(n_ctx.min(512)), "max-n-batch", limits.max_n_batch)?;
        let n_ubatch = cap("n-ubatch", params.n_ubatch.unwrap_or(n_batch.min(512)), "max-n-batch", limits.max_n_batch)?;
        let n_seq_max = cap("n-seq-max", params.n_seq_max.unwrap_or(1), "max-n-seq", limits.max_n_seq)?;
        let n_threads = cap("n-threads", params.n_threads.unwrap_or(limits.default_threads), "max-threads", limits.max_threads)?;
        Ok(native::ContextParams { n_ctx, n_batch, n_ubatch, n_seq_max, n_threads })
    }
}

impl Host for LlamaCtxView<'_> {}

impl HostModel for LlamaCtxView<'_> {
    async fn open(&mut self, name: String) -> LlamaResult<Resource<ModelHandle>> {
        use crate::engine::OpenError;
        match self.ctx.registry.open_entry(&name).await {
            Ok(opened) => Ok(self.table.push(ModelHandle { model: opened.model.clone(), opened })?),
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
            (limits.max_special_text_bytes, "max-special-text-bytes")
        } else {
            (limits.max_text_bytes, "max-text-bytes")
        };
        if text.len() > max {
            return Err(Error::LimitExceeded(format!("text of {} bytes is above {limit} {max}", text.len())).into());
        }
        let model = self.table.get(&model)?.model.clone();
        self.off_executor(move || model.tokenize(&text, add_special, parse_special)).await
    }

    async fn token_to_piece(&mut self, model: Resource<ModelHandle>, token: Token, special: bool) -> LlamaResult<Vec<u8>> {
        Ok(self.table.get(&model)?.model.token_to_piece(token, special)?)
    }

    async fn detokenize(
        &mut self,
        model: Resource<ModelHandle>,
        tokens: Vec<Token>,
        remove_special: bool,
        unparse_special: bool,
    ) -> LlamaResult<String> {
        let max = self.ctx.limits.max_detokenize_tokens;
        if tokens.len() > max {
            return Err(Error::LimitExceeded(format!("{} tokens is above max-detokenize-tokens {max}", tokens.len())).into());
        }
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

    async fn is_eog(&mut self, model: Resource<ModelHandle>, token: Token) -> wasmtime::Result<bool> {
        Ok(self.table.get(&model)?.model.is_eog(token))
    }

    async fn drop(&mut self, model: Resource<ModelHandle>) -> wasmtime::Result<()> {
        self.table.delete(model)?;
        Ok(())
    }
}

impl HostContext for LlamaCtxView<'_> {
    async fn create(&mut self, model: Resource<ModelHandle>, params: ContextParams) -> LlamaResult<Resource<ContextHandle>> {
        let handle = self.table.get(&model)?;
        let (model, opened) = (handle.model.clone(), handle.opened.clone());
        let requested = self.resolve(params, &model)?;
        // Charged as llama.cpp allocates: n-ctx after its padding, every layer.
        let allocated = requested.allocated_n_ctx()?;
        let held = Charge::Context { kv_cells: allocated as u64 * model.n_layer() as u64 };
        self.ctx.admit(held)?;
        let started = match self.lease_seat(&opened, &params, &requested, allocated).await {
            Some(seat) => seat.map(|(seat, granted)| (Backing::Seat(seat), granted)),
            None => match self.reuse_idle(&opened.idle, &requested).await {
                Some((worker, params)) => Ok((Backing::Own(worker), params)),
                None => self.start_context(&opened, requested).await.map(|(worker, params)| (Backing::Own(worker), params)),
            },
        };
        match started {
            Ok((backing, params)) => {
                Ok(self.table.push(ContextHandle { backing, params, model, held, requested, opened })?)
            }
            Err(e) => {
                self.ctx.release(held);
                Err(e.into())
            }
        }
    }

    async fn decode(&mut self, ctx: Resource<ContextHandle>, batch: Batch, cancel: Resource<CancelToken>) -> LlamaResult<()> {
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

    async fn logits_ith(&mut self, ctx: Resource<ContextHandle>, row: u32) -> LlamaResult<Vec<f32>> {
        self.on_backing(&ctx, move |c| c.logits_ith(row).map(<[f32]>::to_vec), |s| s.logits(Some(row))).await
    }

    async fn last_logits(&mut self, ctx: Resource<ContextHandle>) -> LlamaResult<Vec<f32>> {
        self.on_backing(&ctx, |c| c.last_logits().map(<[f32]>::to_vec), |s| s.logits(None)).await
    }

    async fn seq_rm(&mut self, ctx: Resource<ContextHandle>, seq: i32, p0: i32, p1: i32) -> LlamaResult<()> {
        self.on_backing(&ctx, move |c| c.seq_rm(seq, p0, p1), |s| s.seq_rm(seq, p0, p1)).await
    }

    async fn seq_pos_max(&mut self, ctx: Resource<ContextHandle>, seq: i32) -> LlamaResult<i32> {
        self.on_backing(&ctx, move |c| c.seq_pos_max(seq), |s| s.seq_pos_max(seq)).await
    }

    async fn clear(&mut self, ctx: Resource<ContextHandle>) -> LlamaResult<()> {
        let own = |c: &mut Context| {
            c.clear();
            Ok(())
        };
        self.on_backing(&ctx, own, Seat::clear).await
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
        let ContextHandle { backing, requested, opened, held, .. } = self.table.delete(ctx)?;
        let worker = match backing {
            Backing::Own(worker) => worker,
            // The batch stops the seat's call, undoes it and frees its sequence (keeping
            // its tokens as a leftover for this group) before the run's tracker says so.
            Backing::Seat(seat) => {
                drop(seat);
                self.ctx.release(held);
                return Ok(());
            }
        };
        let idle = &opened.idle;
        // With nothing queued on it (no pending decode or generation), a context can be
        // parked for a later run of this group: on its own thread, so that when the
        // call returns it reads as new and no call of this run is left on it.
        if idle.keeps_any() && worker.is_idle() && worker.call(|c, _| c.park()).await.is_some() {
            idle.put(self.ctx.group.clone(), requested, worker);
        } else {
            // Stopping the worker stops its running call; its thread frees the native
            // context after the call has returned, and this waits (off the executor's
            // threads) until it has, so its memory is back before the budget is.
            worker.stop().await;
        }
        self.ctx.release(held);
        Ok(())
    }
}

impl HostPendingDecode for LlamaCtxView<'_> {
    async fn subscribe(&mut self, pending: Resource<PendingDecode>) -> wasmtime::Result<Resource<DynPollable>> {
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
