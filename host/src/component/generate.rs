//! `llamabox:inference/generate`: samplers, streamed generation and chat templates.
//! The token loop itself runs where the engine runs the context (`engine::Lease`: its
//! own worker thread, or its batch's); this module checks host policy, builds the
//! sampler (so a bad grammar fails `start` itself) and carries pieces to the guest.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::mpsc;
use wasmtime::component::Resource;
use wasmtime_wasi::p2::{DynPollable, Pollable};

use super::bindings::llamabox::inference::generate::{
    ChatMessage, FinishReason, GenerateParams, Host, HostGeneration, HostSampler, Logprobs, Piece,
    SamplerParams, TokenLogprob, Usage,
};
use super::llm::{ContextHandle, ModelHandle};
use super::pending::{finished, subscribe_shared};
use super::{within, CancelToken, Charge, Error, LlamaCtxView, LlamaResult, PendingSlot};
use crate::native::{self, CancelFlag, Model, Sampler, Token};
use crate::worker::Call;

pub struct SamplerHandle {
    sampler: Arc<Mutex<Sampler>>,
}

/// A generation started with `generate.start`.
pub struct GenerationHandle {
    slot: Slot,
    /// Its place under max-pending-calls, given back when the generation is dropped.
    _pending: PendingSlot,
}

/// Where a generation's stream is: here, or lent to an async `generation-next` that
/// is waiting on it (the store is not held across that wait). The flag says whether
/// the borrower was dropped without returning it, which cancelled the generation.
/// The stream is shared (not a table child) so that its pollables may outlive it.
enum Slot {
    Here(SharedStream),
    Lent(Arc<AtomicBool>),
}

/// Owned by the generation (or its borrower); pollables hold it weakly.
type SharedStream = Arc<tokio::sync::Mutex<Stream>>;

struct Stream {
    pieces: mpsc::Receiver<native::Piece>,
    /// The next piece, received by `ready` but not yet taken by `next`.
    peeked: Option<native::Piece>,
    state: StreamState,
}

enum StreamState {
    Running(Call<native::Result<native::Outcome>>),
    Ended(Result<native::Outcome, Error>),
}

impl Stream {
    /// Wait until a piece is peeked or the generation has ended. Cancel-safe: both
    /// awaits (`Receiver::recv`, `&mut Call`) can be dropped and resumed.
    async fn ready(&mut self) {
        if self.peeked.is_some() {
            return;
        }
        if let StreamState::Running(call) = &mut self.state {
            if let Some(piece) = self.pieces.recv().await {
                self.peeked = Some(piece);
                return;
            }
            // The worker dropped its sender: the loop has returned.
            let outcome = call.await;
            self.state = StreamState::Ended(finished(outcome));
        }
    }

    async fn next(&mut self) -> Result<Option<Piece>, Error> {
        self.ready().await;
        if let Some(piece) = self.peeked.take() {
            let logprobs = piece.logprobs.into_iter().map(wit_logprobs).collect();
            return Ok(Some(Piece { text: piece.text, tokens: piece.tokens, logprobs }));
        }
        match &self.state {
            StreamState::Ended(Ok(_)) => Ok(None),
            StreamState::Ended(Err(e)) => Err(e.clone()),
            StreamState::Running(_) => {
                unreachable!("ready() returns with a piece or an ended stream")
            }
        }
    }

    fn outcome(&self) -> Option<&native::Outcome> {
        match &self.state {
            StreamState::Ended(Ok(outcome)) => Some(outcome),
            _ => None,
        }
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for Stream {
    async fn ready(&mut self) {
        Stream::ready(self).await
    }
}

impl GenerationHandle {
    pub(super) async fn next(&mut self) -> Result<Option<Piece>, Error> {
        match &mut self.slot {
            Slot::Here(stream) => stream.lock().await.next().await,
            Slot::Lent(lost) => Err(Self::lent_error(lost)),
        }
    }

    /// Lend the stream to an async call, unless it is already lent (or was lost).
    pub(super) fn lend(&mut self) -> Result<LentStream, Error> {
        if let Slot::Lent(lost) = &self.slot {
            return Err(Self::lent_error(lost));
        }
        let lost = Arc::new(AtomicBool::new(false));
        match std::mem::replace(&mut self.slot, Slot::Lent(lost.clone())) {
            Slot::Here(stream) => Ok(LentStream { stream: Some(stream), lost }),
            Slot::Lent(_) => unreachable!("checked above"),
        }
    }

    fn lent_error(lost: &AtomicBool) -> Error {
        if lost.load(Relaxed) {
            Error::Cancelled
        } else {
            Error::InvalidArgument(
                "an async generation-next is already waiting on this generation".into(),
            )
        }
    }

    pub(super) fn give_back(&mut self, mut lent: LentStream) {
        if let Some(stream) = lent.stream.take() {
            self.slot = Slot::Here(stream);
        }
    }

    /// `read` of the outcome once ended; `Err` if cancelled by losing the stream.
    async fn outcome<R>(&self, read: impl FnOnce(&native::Outcome) -> R) -> Option<Result<R, ()>> {
        match &self.slot {
            Slot::Here(stream) => stream.lock().await.outcome().map(|o| Ok(read(o))),
            Slot::Lent(lost) if lost.load(Relaxed) => Some(Err(())),
            Slot::Lent(_) => None,
        }
    }

    /// A pollable that is not this generation's child; ready at once while the
    /// stream is lent to an async call, and once the generation is dropped.
    fn watch(&self) -> Weak<tokio::sync::Mutex<Stream>> {
        match &self.slot {
            Slot::Here(stream) => Arc::downgrade(stream),
            Slot::Lent(_) => Weak::new(),
        }
    }
}

/// A generation's stream while an async `generation-next` waits on it. Dropped
/// without being given back (the guest dropped that call's future), it drops the
/// stream, which cancels the generation, and marks the generation cancelled.
pub(super) struct LentStream {
    stream: Option<SharedStream>,
    lost: Arc<AtomicBool>,
}

impl LentStream {
    pub(super) async fn next(&mut self) -> Result<Option<Piece>, Error> {
        match &mut self.stream {
            Some(stream) => stream.lock().await.next().await,
            None => Err(Error::Cancelled),
        }
    }
}

impl Drop for LentStream {
    fn drop(&mut self) {
        if self.stream.is_some() {
            self.lost.store(true, Relaxed);
        }
    }
}

impl LlamaCtxView<'_> {
    /// Host policy and the sampler's own checks; the sampler is built here, so that a
    /// bad parameter or grammar fails the call that passed it. Compiling a grammar
    /// (and a model's first grammar, its token trie) is bounded work, done off the
    /// executor.
    async fn sampler_for(
        &mut self,
        model: &Arc<Model>,
        params: SamplerParams,
    ) -> LlamaResult<Sampler> {
        let (model, caps) = (model.clone(), self.ctx.limits.sampler_caps());
        let params = native_sampler_params(params);
        self.off_executor(move || Sampler::new(model, &params, &caps)).await
    }

    fn check_generate(&self, params: &GenerateParams) -> Result<(), Error> {
        let l = &self.ctx.limits.generate;
        let (max, asked) = (l.max_generate_tokens as usize, params.max_tokens as usize);
        within("max-generate-tokens", max, asked, "max-tokens")?;
        within("max-stop-strings", l.max_stop_strings, params.stop.len(), "stop strings")?;
        let longest_stop = params.stop.iter().map(String::len).max().unwrap_or(0);
        within("max-stop-bytes", l.max_stop_bytes, longest_stop, "bytes of a stop string")?;
        if let Some(n) = params.logprobs.filter(|&n| n > native::MAX_TOP_LOGPROBS) {
            return Err(Error::InvalidArgument(format!(
                "logprobs {n} is outside [0, {}]",
                native::MAX_TOP_LOGPROBS
            )));
        }
        Ok(())
    }
}

fn wit_logprobs(p: native::TokenLogprob) -> Logprobs {
    let entry = |(token, logprob)| TokenLogprob { token, logprob };
    Logprobs { chosen: entry((p.token, p.logprob)), top: p.top.into_iter().map(entry).collect() }
}

fn native_sampler_params(p: SamplerParams) -> native::SamplerParams {
    native::SamplerParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        typical_p: p.typical_p,
        penalties: p.penalties.map(|p| native::Penalties {
            last_n: p.last_n,
            repeat: p.repeat,
            frequency: p.frequency,
            presence: p.presence,
        }),
        seed: p.seed,
        logit_bias: p.logit_bias.into_iter().map(|b| (b.token, b.bias)).collect(),
        grammar: p.grammar.map(|g| native::Grammar { text: g.text, root: g.root }),
        json_schema: p.json_schema,
    }
}

fn finish_reason(f: native::FinishReason) -> FinishReason {
    match f {
        native::FinishReason::Stop { index } => FinishReason::Stop(index),
        native::FinishReason::EndOfGeneration => FinishReason::EndOfGeneration,
        native::FinishReason::MaxTokens => FinishReason::MaxTokens,
        native::FinishReason::Cancelled => FinishReason::Cancelled,
    }
}

fn usage(u: &native::GenerationUsage) -> Usage {
    Usage {
        prompt_tokens: u.prompt_tokens,
        cached_tokens: u.cached_tokens,
        generated_tokens: u.generated_tokens,
        prefill_ns: u.prefill.as_nanos().min(u64::MAX as u128) as u64,
        generation_ns: u.generation.as_nanos().min(u64::MAX as u128) as u64,
    }
}

impl Host for LlamaCtxView<'_> {
    async fn greedy_sampler(&mut self) -> wasmtime::Result<SamplerParams> {
        Ok(SamplerParams {
            temperature: None,
            top_k: None,
            top_p: None,
            min_p: None,
            typical_p: None,
            penalties: None,
            seed: None,
            logit_bias: Vec::new(),
            grammar: None,
            json_schema: None,
        })
    }

    async fn start(
        &mut self,
        ctx: Resource<ContextHandle>,
        params: GenerateParams,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<Resource<GenerationHandle>> {
        let token: CancelFlag = self.table.get(&cancel)?.flag.clone();
        let model = self.table.get(&ctx)?.model.clone();
        self.check_generate(&params)?;
        let sampler = self.sampler_for(&model, params.sampler).await?;
        let pending = self.ctx.pending_slot()?;
        let request = native::GenerateRequest {
            prompt: params.prompt,
            seq: params.seq,
            max_tokens: params.max_tokens,
            stop: params.stop,
            logprobs: params.logprobs,
        };
        let (call, rx) = self.table.get(&ctx)?.lease.generate(sampler, request, token);
        let stream = Stream { pieces: rx, peeked: None, state: StreamState::Running(call) };
        let stream = Arc::new(tokio::sync::Mutex::new(stream));
        Ok(self.table.push(GenerationHandle { slot: Slot::Here(stream), _pending: pending })?)
    }

    async fn apply_chat_template(
        &mut self,
        model: Resource<ModelHandle>,
        messages: Vec<ChatMessage>,
        add_assistant_prompt: bool,
        template: Option<String>,
    ) -> LlamaResult<String> {
        let max = self.ctx.limits.context.max_text_bytes;
        let messages: Vec<native::ChatMessage> = messages
            .into_iter()
            .map(|m| native::ChatMessage { role: m.role, content: m.content })
            .collect();
        let cost = native::chat::messages_cost(&messages);
        if cost > max {
            return Err(Error::LimitExceeded(format!(
                "{} messages cost {cost} bytes ({} each for the template's markers), above max-text-bytes {max}",
                messages.len(),
                native::chat::MESSAGE_OVERHEAD
            )).into());
        }
        let model = self.table.get(&model)?.model.clone();
        let template = template.map_or(native::ChatTemplate::Model, native::ChatTemplate::Named);
        self.off_executor(move || {
            model.apply_chat_template(&template, &messages, add_assistant_prompt)
        })
        .await
    }

    async fn builtin_chat_templates(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(native::chat::builtin_templates())
    }

    async fn model_chat_template(
        &mut self,
        model: Resource<ModelHandle>,
    ) -> wasmtime::Result<Option<String>> {
        Ok(self.table.get(&model)?.model.chat_template())
    }
}

impl HostSampler for LlamaCtxView<'_> {
    async fn create(
        &mut self,
        model: Resource<ModelHandle>,
        params: SamplerParams,
    ) -> LlamaResult<Resource<SamplerHandle>> {
        let model = self.table.get(&model)?.model.clone();
        let sampler = self.sampler_for(&model, params).await?;
        self.ctx.admit(Charge::Sampler)?;
        Ok(self.table.push(SamplerHandle { sampler: Arc::new(Mutex::new(sampler)) })?)
    }

    async fn sample(
        &mut self,
        sampler: Resource<SamplerHandle>,
        ctx: Resource<ContextHandle>,
        row: u32,
    ) -> LlamaResult<Token> {
        let sampler = self.table.get(&sampler)?.sampler.clone();
        let context = self.table.get(&ctx)?;
        if !Arc::ptr_eq(lock(&sampler).model(), &context.model) {
            return Err(
                Error::InvalidArgument("the sampler was made for another model".into()).into()
            );
        }
        // Where the logits are (the context's thread or its batch's): they never leave it.
        let call = context.lease.sample(sampler, row);
        Ok(finished(call.await)?)
    }

    /// Off the executor: a grammar's step is bounded by its limits, but milliseconds.
    async fn accept(&mut self, sampler: Resource<SamplerHandle>, token: Token) -> LlamaResult<()> {
        let sampler = self.table.get(&sampler)?.sampler.clone();
        self.off_executor(move || lock(&sampler).accept(token)).await
    }

    async fn reset(&mut self, sampler: Resource<SamplerHandle>) -> wasmtime::Result<()> {
        // Resetting fails only for a grammar already failed for good (over its limits),
        // which the next `sample` or `accept` reports.
        let _ = lock(&self.table.get(&sampler)?.sampler).reset();
        Ok(())
    }

    async fn drop(&mut self, sampler: Resource<SamplerHandle>) -> wasmtime::Result<()> {
        self.table.delete(sampler)?;
        self.ctx.release(Charge::Sampler);
        Ok(())
    }
}

fn lock(sampler: &Mutex<Sampler>) -> std::sync::MutexGuard<'_, Sampler> {
    sampler.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl HostGeneration for LlamaCtxView<'_> {
    async fn next(&mut self, generation: Resource<GenerationHandle>) -> LlamaResult<Option<Piece>> {
        Ok(self.table.get_mut(&generation)?.next().await?)
    }

    async fn subscribe(
        &mut self,
        generation: Resource<GenerationHandle>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        let stream = self.table.get(&generation)?.watch();
        subscribe_shared(self.table, stream)
    }

    async fn finish_reason(
        &mut self,
        generation: Resource<GenerationHandle>,
    ) -> wasmtime::Result<Option<FinishReason>> {
        Ok(
            match self
                .table
                .get(&generation)?
                .outcome(|outcome| finish_reason(outcome.finish))
                .await
            {
                Some(Ok(reason)) => Some(reason),
                Some(Err(())) => Some(FinishReason::Cancelled),
                None => None,
            },
        )
    }

    async fn usage(
        &mut self,
        generation: Resource<GenerationHandle>,
    ) -> wasmtime::Result<Option<Usage>> {
        Ok(match self.table.get(&generation)?.outcome(|outcome| usage(&outcome.usage)).await {
            Some(Ok(usage)) => Some(usage),
            _ => None,
        })
    }

    async fn drop(&mut self, generation: Resource<GenerationHandle>) -> wasmtime::Result<()> {
        // Dropping the receiver and the call stops the loop at its next token or node.
        self.table.delete(generation)?;
        Ok(())
    }
}
