//! `llamabox:inference/cancel`: the cancel-token resource over a native `CancelFlag`.

use std::sync::Arc;

use wasmtime::component::Resource;

use super::bindings::llamabox::inference::cancel::{Host, HostCancelToken};
use super::tokens::ShareError;
use super::{Charge, Error, LlamaCtxView, LlamaError, LlamaResult, TokenRegistry};
use crate::native::CancelFlag;

/// A guest's cancel token: a `CancelFlag`, and the capabilities shared from it. An
/// embedder cancels a plugin's calls from outside through a shared capability
/// (`TokenRegistry::share`), never by holding this.
pub struct CancelToken {
    pub(crate) flag: CancelFlag,
    /// Capabilities made from this handle: unshared when it is dropped (by the guest or
    /// with its store), so the registry never keeps what no plugin holds.
    shares: Vec<(Arc<TokenRegistry>, String)>,
}

impl CancelToken {
    pub fn from_flag(flag: CancelFlag) -> Self {
        Self { flag, shares: Vec::new() }
    }
}

impl Host for LlamaCtxView<'_> {}

impl Drop for CancelToken {
    fn drop(&mut self) {
        for (registry, capability) in &self.shares {
            registry.unshare(capability);
        }
    }
}

impl HostCancelToken for LlamaCtxView<'_> {
    async fn new(&mut self) -> wasmtime::Result<Resource<CancelToken>> {
        // A constructor cannot return an error: too many tokens traps the guest
        // (`create` returns `limit-exceeded` instead).
        self.ctx.admit(Charge::Token)?;
        Ok(self.table.push(CancelToken::from_flag(CancelFlag::new()))?)
    }

    async fn create(&mut self) -> LlamaResult<Resource<CancelToken>> {
        self.ctx.admit(Charge::Token)?;
        Ok(self.table.push(CancelToken::from_flag(CancelFlag::new()))?)
    }

    async fn cancel(&mut self, token: Resource<CancelToken>) -> wasmtime::Result<()> {
        self.table.get(&token)?.flag.cancel();
        Ok(())
    }

    async fn is_cancelled(&mut self, token: Resource<CancelToken>) -> wasmtime::Result<bool> {
        Ok(self.table.get(&token)?.flag.is_cancelled())
    }

    async fn share(&mut self, token: Resource<CancelToken>) -> LlamaResult<String> {
        self.ctx.admit(Charge::Share)?;
        let registry = self.ctx.tokens.clone();
        let handle = self.table.get_mut(&token)?;
        match registry.share(&self.ctx.group, &handle.flag) {
            Ok(capability) => {
                handle.shares.push((registry, capability.clone()));
                Ok(capability)
            }
            Err(e) => {
                self.ctx.release(Charge::Share);
                match e {
                    ShareError::GroupFull(_) => Err(Error::LimitExceeded(e.to_string()).into()),
                    // No random capability without the OS random source: trap rather than panic.
                    ShareError::Random(_) => {
                        Err(LlamaError::trap(wasmtime::Error::msg(e.to_string())))
                    }
                }
            }
        }
    }

    async fn open_shared(&mut self, capability: String) -> LlamaResult<Resource<CancelToken>> {
        match self.ctx.tokens.open(&self.ctx.group, &capability) {
            Some(flag) => match self.ctx.admit(Charge::Token) {
                Ok(()) => Ok(self.table.push(CancelToken::from_flag(flag))?),
                Err(e) => Err(e.into()),
            },
            None => Err(Error::InvalidArgument(
                "no token is shared under this capability in this group".into(),
            )
            .into()),
        }
    }

    async fn drop(&mut self, token: Resource<CancelToken>) -> wasmtime::Result<()> {
        let handle = self.table.delete(token)?;
        self.ctx.release(Charge::Token);
        for _ in &handle.shares {
            self.ctx.release(Charge::Share);
        }
        Ok(())
    }
}
