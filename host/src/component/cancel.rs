//! `llamabox:inference/cancel`: the cancel-token resource over a native `CancelFlag`.

use wasmtime::component::Resource;
use wasmtime::error::Context as _;

use super::bindings::llamabox::inference::cancel::{Host, HostCancelToken};
use super::{Error, Held, LlamaCtxView};
use crate::native::CancelFlag;

/// A guest's cancel token. The embedder can make one from its own `CancelFlag` (to
/// cancel a plugin's calls from outside) with [`CancelToken::from_flag`].
pub struct CancelToken {
    pub(crate) flag: CancelFlag,
}

impl CancelToken {
    pub fn from_flag(flag: CancelFlag) -> Self {
        Self { flag }
    }

    pub fn flag(&self) -> &CancelFlag {
        &self.flag
    }
}

impl Host for LlamaCtxView<'_> {}

impl HostCancelToken for LlamaCtxView<'_> {
    async fn new(&mut self) -> wasmtime::Result<Resource<CancelToken>> {
        // A constructor cannot return an error: too many tokens traps the guest.
        self.ctx.admit(Held::Token)?;
        Ok(self.table.push(CancelToken { flag: CancelFlag::new() })?)
    }

    async fn cancel(&mut self, token: Resource<CancelToken>) -> wasmtime::Result<()> {
        self.table.get(&token)?.flag.cancel();
        Ok(())
    }

    async fn is_cancelled(&mut self, token: Resource<CancelToken>) -> wasmtime::Result<bool> {
        Ok(self.table.get(&token)?.flag.is_cancelled())
    }

    async fn share(&mut self, token: Resource<CancelToken>) -> wasmtime::Result<String> {
        let flag = &self.table.get(&token)?.flag;
        // No random capability without the OS random source: trap rather than panic.
        self.ctx.tokens.share(&self.ctx.group, flag).context("drawing a capability from the OS random source")
    }

    async fn open_shared(&mut self, capability: String) -> wasmtime::Result<Result<Resource<CancelToken>, Error>> {
        match self.ctx.tokens.open(&self.ctx.group, &capability) {
            Some(flag) => match self.ctx.admit(Held::Token) {
                Ok(()) => Ok(Ok(self.table.push(CancelToken { flag })?)),
                Err(e) => Ok(Err(e)),
            },
            None => Ok(Err(Error::InvalidArgument("no token is shared under this capability in this group".into()))),
        }
    }

    async fn drop(&mut self, token: Resource<CancelToken>) -> wasmtime::Result<()> {
        self.table.delete(token)?;
        self.ctx.release(Held::Token);
        Ok(())
    }
}
