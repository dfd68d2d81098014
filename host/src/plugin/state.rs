//! What a run's store holds: WASI, wasi-http (no outgoing requests), llamabox's
//! state, the embedder's per-run value, and the limiter on its wasm memory.

use super::*;

/// Store data of one plugin run. Host functions the embedder adds (see
/// [`PluginHost::with_linker`]) get it, with the run's [`RunOptions::embedder`] state.
pub struct PluginState {
    pub(super) wasi: WasiCtx,
    pub(super) http: WasiHttpCtx,
    pub(super) no_outgoing: NoOutgoingRequests,
    pub(super) llama: LlamaCtx,
    pub(super) table: ResourceTable,
    pub(super) limits: RunLimiter,
    pub(super) embedder: Option<Arc<dyn Any + Send + Sync>>,
}

impl PluginState {
    /// The embedder's state for this run ([`RunOptions::embedder`]), if it is a `T`.
    pub fn embedder<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.embedder.as_deref()?.downcast_ref()
    }

    /// The run's resource table, for the embedder's own resources.
    pub fn table(&mut self) -> &mut ResourceTable {
        &mut self.table
    }

    /// The run's tenant ([`RunOptions::group`]).
    pub fn group(&self) -> &str {
        self.llama.group()
    }
}

/// The run's wasm limits, remembering which one refused a growth: the guest sees a
/// failed `memory.grow` and usually traps, and the trap is then reported as that limit.
pub(super) struct RunLimiter {
    pub(super) limits: wasmtime::StoreLimits,
    pub(super) refused: Option<&'static str>,
}

impl wasmtime::ResourceLimiter for RunLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = self.limits.memory_growing(current, desired, maximum)?;
        if !allowed {
            self.refused.get_or_insert("max-memory-mib");
        }
        Ok(allowed)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = self.limits.table_growing(current, desired, maximum)?;
        if !allowed {
            self.refused.get_or_insert("max-table-elements");
        }
        Ok(allowed)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl WasiHttpView for PluginState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: &mut self.no_outgoing,
        }
    }
}

/// `wasi:http` hooks of a served plugin. `outgoing-handler` is never linked (a plugin
/// makes no requests), so `send_request` is unreachable; it refuses all the same.
pub(super) struct NoOutgoingRequests;

impl wasmtime_wasi_http::WasiHttpHooks for NoOutgoingRequests {
    fn send_request(
        &mut self,
        _request: http::Request<wasmtime_wasi_http::WasiBody>,
        _options: Option<wasmtime_wasi_http::RequestOptions>,
        _fut: Box<dyn std::future::Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
    ) -> Box<
        dyn std::future::Future<
                Output = Result<
                    (
                        http::Response<wasmtime_wasi_http::WasiBody>,
                        Box<
                            dyn std::future::Future<Output = Result<(), wasmtime_wasi_http::Error>>
                                + Send,
                        >,
                    ),
                    wasmtime_wasi_http::Error,
                >,
            > + Send,
    > {
        Box::new(std::future::ready(Err(wasmtime_wasi_http::Error::HttpRequestDenied)))
    }
}

impl LlamaView for PluginState {
    fn llama(&mut self) -> LlamaCtxView<'_> {
        LlamaCtxView { ctx: &mut self.llama, table: &mut self.table }
    }
}
