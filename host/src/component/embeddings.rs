//! `llamabox:inference/embeddings`: per-input and per-row embeddings from a text
//! context, computed on its worker thread and cancellable like a decode.

use wasmtime::component::Resource;

use super::bindings::llamabox::inference::embeddings::{Host, Pooling};
use super::llm::ContextHandle;
use super::pending::finished;
use super::{Answer, CancelToken, LlamaCtxView};
use crate::native::{self, Stop, Token};

impl Host for LlamaCtxView<'_> {
    async fn embed(
        &mut self,
        ctx: Resource<ContextHandle>,
        inputs: Vec<Vec<Token>>,
        pooling: Pooling,
        normalize: bool,
        cancel: Resource<CancelToken>,
    ) -> Answer<Vec<Vec<f32>>> {
        let token = self.table.get(&cancel)?.flag.clone();
        let pooling = match pooling {
            Pooling::Mean => native::Pooling::Mean,
            Pooling::Cls => native::Pooling::Cls,
            Pooling::Last => native::Pooling::Last,
        };
        let call = self.table.get(&ctx)?.worker.call(move |c, abandoned| {
            c.embed(&inputs, pooling, normalize, Some(Stop::on_either(&token, abandoned)))
        });
        Ok(finished(call.await))
    }

    async fn embed_rows(
        &mut self,
        ctx: Resource<ContextHandle>,
        tokens: Vec<Token>,
        normalize: bool,
        cancel: Resource<CancelToken>,
    ) -> Answer<Vec<Vec<f32>>> {
        let token = self.table.get(&cancel)?.flag.clone();
        let call = self
            .table
            .get(&ctx)?
            .worker
            .call(move |c, abandoned| c.embed_rows(&tokens, normalize, Some(Stop::on_either(&token, abandoned))));
        Ok(finished(call.await))
    }
}
