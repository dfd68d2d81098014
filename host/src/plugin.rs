//! Running plugin components: an engine, a linker with WASI 0.2 and llamabox, and one
//! fresh store per run.

use std::path::Path;
use std::sync::Arc;

use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::error::Context as _;
use wasmtime::{Engine, Store};
use wasmtime_wasi::p2::bindings::CommandPre;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::component::{self, LlamaCtx, LlamaCtxView, LlamaView, Limits, ModelRegistry};

/// Store data of one plugin run.
pub struct PluginState {
    wasi: WasiCtx,
    llama: LlamaCtx,
    table: ResourceTable,
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl LlamaView for PluginState {
    fn llama(&mut self) -> LlamaCtxView<'_> {
        LlamaCtxView { ctx: &mut self.llama, table: &mut self.table }
    }
}

/// Hosts plugins: compiles components and runs them against a model registry.
pub struct PluginHost {
    engine: Engine,
    linker: Linker<PluginState>,
    registry: Arc<ModelRegistry>,
    limits: Limits,
}

/// How a plugin's `wasi:cli/run` ended (a trap is an `Err` of [`Plugin::run`] instead).
#[derive(Debug, PartialEq, Eq)]
pub enum RunOutcome {
    Success,
    /// The plugin exited with this non-zero status (1 when `run` returned an error).
    Failed(i32),
}

impl PluginHost {
    pub fn new(registry: ModelRegistry, limits: Limits) -> anyhow::Result<Self> {
        let engine = Engine::new(&wasmtime::Config::new())?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        component::add_to_linker(&mut linker)?;
        Ok(Self { engine, linker, registry: Arc::new(registry), limits })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Compile a plugin and check it can link against this host.
    pub fn load(&self, path: &Path) -> anyhow::Result<Plugin> {
        if !path.is_file() {
            anyhow::bail!("plugin {} not found", path.display());
        }
        let component = Component::from_file(&self.engine, path)
            .with_context(|| format!("{} is not a valid WebAssembly component", path.display()))?;
        self.prepare(component)
    }

    pub fn load_bytes(&self, bytes: &[u8]) -> anyhow::Result<Plugin> {
        self.prepare(Component::new(&self.engine, bytes).context("not a valid WebAssembly component")?)
    }

    fn prepare(&self, component: Component) -> anyhow::Result<Plugin> {
        let pre = self
            .linker
            .instantiate_pre(&component)
            .context("the plugin imports something this host does not provide")?;
        let pre = CommandPre::new(pre).context("the plugin is not a WASI command (it does not export wasi:cli/run)")?;
        Ok(Plugin { pre, registry: self.registry.clone(), limits: self.limits.clone() })
    }
}

/// A compiled plugin, ready to run any number of times.
pub struct Plugin {
    pre: CommandPre<PluginState>,
    registry: Arc<ModelRegistry>,
    limits: Limits,
}

impl Plugin {
    /// Run the plugin's `wasi:cli/run` in a fresh store. `wasi` sets its arguments and
    /// stdio (it gets no filesystem, network or environment unless given here).
    pub async fn run(&self, mut wasi: WasiCtxBuilder) -> anyhow::Result<RunOutcome> {
        let state = PluginState {
            wasi: wasi.build(),
            llama: LlamaCtx::new(self.registry.clone(), self.limits.clone()),
            table: ResourceTable::new(),
        };
        let mut store = Store::new(self.pre.engine(), state);
        let command = self.pre.instantiate_async(&mut store).await?;
        match command.wasi_cli_run().call_run(&mut store).await {
            Ok(Ok(())) => Ok(RunOutcome::Success),
            Ok(Err(())) => Ok(RunOutcome::Failed(1)),
            Err(e) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
                Some(wasmtime_wasi::I32Exit(0)) => Ok(RunOutcome::Success),
                Some(wasmtime_wasi::I32Exit(code)) => Ok(RunOutcome::Failed(*code)),
                None => Err(e.into()),
            },
        }
    }
}
