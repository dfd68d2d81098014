//! `llamabox:inference/embeddings`: per-input and per-row embeddings from a text
//! context, computed on its worker thread and cancellable like a decode.

use wasmtime::component::Resource;

use super::bindings::llamabox::inference::embeddings::{Host, Pooling};
use super::llm::ContextHandle;
use super::pending::finished;
use super::{CancelToken, Error, LlamaCtxView, LlamaResult};
use crate::native::{self, Token};

impl LlamaCtxView<'_> {
    /// Charge `inputs` more inputs of `tokens` tokens in all to this store's embedding
    /// budget, before any of it is computed; or name the limit it would go over.
    fn charge_embeddings(&mut self, inputs: usize, tokens: usize) -> Result<(), Error> {
        let (usage, limits) = (&mut self.ctx.usage, &self.ctx.limits);
        let inputs = u32::try_from(inputs).unwrap_or(u32::MAX);
        let tokens = u64::try_from(tokens).unwrap_or(u64::MAX);
        let over = |name: &str, done: u64, more: u64, max: u64| {
            Err(Error::LimitExceeded(format!(
                "{name}: this plugin embedded {done} of {max} already, and asked for {more} more"
            )))
        };
        if usage.embedded_inputs.saturating_add(inputs) > limits.embeddings.max_embed_inputs {
            return over(
                "max-embed-inputs",
                usage.embedded_inputs.into(),
                inputs.into(),
                limits.embeddings.max_embed_inputs.into(),
            );
        }
        if usage.embedded_tokens.saturating_add(tokens) > limits.embeddings.max_embed_tokens {
            return over(
                "max-embed-tokens",
                usage.embedded_tokens,
                tokens,
                limits.embeddings.max_embed_tokens,
            );
        }
        usage.embedded_inputs += inputs;
        usage.embedded_tokens += tokens;
        Ok(())
    }
}

impl Host for LlamaCtxView<'_> {
    async fn embed(
        &mut self,
        ctx: Resource<ContextHandle>,
        inputs: Vec<Vec<Token>>,
        pooling: Pooling,
        normalize: bool,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<Vec<Vec<f32>>> {
        self.charge_embeddings(inputs.len(), inputs.iter().map(Vec::len).sum())?;
        let token = self.table.get(&cancel)?.flag.clone();
        let pooling = match pooling {
            Pooling::Mean => native::Pooling::Mean,
            Pooling::Cls => native::Pooling::Cls,
            Pooling::Last => native::Pooling::Last,
        };
        let call = self.table.get(&ctx)?.lease.embed(inputs, pooling, normalize, token)?;
        Ok(finished(call.await)?)
    }

    async fn embed_rows(
        &mut self,
        ctx: Resource<ContextHandle>,
        tokens: Vec<Token>,
        normalize: bool,
        cancel: Resource<CancelToken>,
    ) -> LlamaResult<Vec<Vec<f32>>> {
        self.charge_embeddings(1, tokens.len())?;
        let token = self.table.get(&cancel)?.flag.clone();
        let call = self.table.get(&ctx)?.lease.embed_rows(tokens, normalize, token)?;
        Ok(finished(call.await)?)
    }
}
