//! The wasmtime side: WIT bindings, one host module per interface, the model registry
//! and the limits a plugin runs under. Never calls llama.cpp directly: native work goes
//! through `crate::native` types owned by `crate::worker` threads.

mod async_calls;
mod cancel;
mod embeddings;
mod generate;
mod limits;
mod llm;
mod media;
mod pending;
mod tokens;
mod version;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use wasmtime::component::{HasData, Linker, ResourceTable};

use crate::engine::Claim;
use crate::worker::Tracker;

pub use crate::engine::{ModelRegistry, OpenError};
pub use cancel::CancelToken;
pub use generate::{GenerationHandle, SamplerHandle};
pub use limits::{
    CancelLimits, CancelOverrides, ContextLimits, ContextOverrides, EmbeddingLimits,
    EmbeddingOverrides, GenerateLimits, GenerateOverrides, LimitOverrides, Limits, MediaLimits,
    MediaOverrides, SamplerLimits, SamplerOverrides, WasmLimits, WasmOverrides,
};
pub use llm::{ContextHandle, ModelHandle, PendingDecode};
pub use media::{ChunkHandle, MediaContextHandle, PendingEncode};
pub use tokens::{ShareError, TokenRegistry};
pub(crate) use version::first_unsupported as first_unsupported_wit;
pub(crate) use version::PACKAGE;
pub use version::{OLDEST_WIT_VERSION, WIT_VERSION};

/// Bindings generated from `wit/`. Every import is async (decode waits on a worker
/// thread without blocking the executor) and trappable (a bad resource handle traps the
/// guest instead of panicking the host).
pub mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "plugin",
        imports: { default: async | trappable },
        trappable_error_type: {
            "llamabox:inference/types.error" => super::LlamaError,
        },
        with: {
            "wasi:io/poll": wasmtime_wasi::p2::bindings::io::poll,
            "wasi:clocks": wasmtime_wasi::p2::bindings::clocks,
            "llamabox:inference/cancel.cancel-token": super::CancelToken,
            "llamabox:inference/llm.model": super::ModelHandle,
            "llamabox:inference/llm.context": super::ContextHandle,
            "llamabox:inference/llm.pending-decode": super::PendingDecode,
            "llamabox:inference/media.chunk": super::ChunkHandle,
            "llamabox:inference/media.media-context": super::MediaContextHandle,
            "llamabox:inference/media.pending-encode": super::PendingEncode,
            "llamabox:inference/generate.sampler": super::SamplerHandle,
            "llamabox:inference/generate.generation": super::GenerationHandle,
        },
    });
}

/// Bindings of the `async func` imports (WASI 0.3 guests), reusing the types above.
pub mod async_bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "async-host",
        imports: { default: trappable },
        trappable_error_type: {
            "llamabox:inference/types.error" => super::LlamaError,
        },
        with: {
            "llamabox:inference/types": super::bindings::llamabox::inference::types,
            "llamabox:inference/cancel": super::bindings::llamabox::inference::cancel,
            "llamabox:inference/llm": super::bindings::llamabox::inference::llm,
            "llamabox:inference/media": super::bindings::llamabox::inference::media,
            "llamabox:inference/generate": super::bindings::llamabox::inference::generate,
        },
    });
}

pub use bindings::llamabox::inference::types::Error;

/// `limit-exceeded` for `n` of `what` above the host limit `limit` (`max`), else `Ok`:
/// every size a call is checked for is refused in one wording, the limit's name first
/// (as native limits are: `{limit}: {requested} is above {max}`).
fn within(limit: &str, max: usize, n: usize, what: &str) -> Result<(), Error> {
    if n > max {
        return Err(Error::LimitExceeded(format!("{limit}: {n} {what} is above {max}")));
    }
    Ok(())
}

/// Why a host function failed: the WIT `error` the guest gets back, or a trap (a bad
/// resource handle, a host invariant broken) that ends the guest. Both convert with
/// `?`, as wasi-nn's and wasi's trappable errors do; `convert_error` below sorts them.
#[derive(Debug)]
pub struct LlamaError(Failure);

#[derive(Debug)]
enum Failure {
    Guest(Error),
    Trap(wasmtime::Error),
}

impl LlamaError {
    /// A failure that ends the guest rather than returning to it.
    pub fn trap(e: impl Into<wasmtime::Error>) -> Self {
        Self(Failure::Trap(e.into()))
    }
}

impl From<Error> for LlamaError {
    fn from(e: Error) -> Self {
        Self(Failure::Guest(e))
    }
}

impl From<crate::native::Error> for LlamaError {
    fn from(e: crate::native::Error) -> Self {
        Self(Failure::Guest(e.into()))
    }
}

impl From<wasmtime::component::ResourceTableError> for LlamaError {
    fn from(e: wasmtime::component::ResourceTableError) -> Self {
        Self::trap(e)
    }
}

impl From<wasmtime::Error> for LlamaError {
    fn from(e: wasmtime::Error) -> Self {
        Self::trap(e)
    }
}

impl std::fmt::Display for LlamaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Failure::Guest(e) => write!(f, "{e:?}"),
            Failure::Trap(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for LlamaError {}

/// What a host function returns that can fail as the WIT says.
type LlamaResult<T> = Result<T, LlamaError>;

/// Per-store llamabox state: which models this plugin may open, the tokens it may
/// share and open (within its group), and its limits.
pub struct LlamaCtx {
    registry: Arc<ModelRegistry>,
    tokens: Arc<TokenRegistry>,
    group: String,
    /// The run's claim on the cores (weight, class, deadline) for batches' schedulers.
    claim: Claim,
    limits: Limits,
    usage: Usage,
    /// Calls in flight that the guest does not wait on in the same host call
    /// (`start-*`, WASI 0.3 `async func`s): counted by slots that free themselves
    /// when dropped, since an async call's future can be dropped outside any host call.
    pending_calls: Arc<AtomicU32>,
    /// The store's worker threads and blocking calls.
    workers: Tracker,
    /// Usage of this store's native work (its run's report).
    meter: Arc<crate::engine::Meter>,
}

/// One of a store's `max-pending-calls` places, held by a pending call (a `pending-*`
/// resource or a WASI 0.3 call's future) and given back when that is dropped.
pub(crate) struct PendingSlot(Arc<AtomicU32>);

impl Drop for PendingSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a store holds now, counted against its `Limits`.
#[derive(Default, Debug)]
struct Usage {
    contexts: u32,
    media_contexts: u32,
    tokens: u32,
    shares: u32,
    kv_cells: u64,
    chunk_bytes: u64,
    samplers: u32,
    /// Inputs and tokens embedded so far (never given back: see `max_embed_inputs`).
    embedded_inputs: u32,
    embedded_tokens: u64,
}

/// Something a plugin holds that counts against a limit.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Charge {
    /// A context with n-ctx × n-layer KV cells.
    Context {
        kv_cells: u64,
    },
    MediaContext,
    Token,
    /// A capability shared from one of this store's tokens.
    Share,
    /// Media chunks holding this many native bytes.
    Chunks {
        bytes: u64,
    },
    /// A `generate.sampler` (n-vocab candidates, maybe a grammar).
    Sampler,
}

impl LlamaCtx {
    /// `group` scopes shared tokens: a plugin opens only capabilities shared in its group.
    pub fn new(
        registry: Arc<ModelRegistry>,
        tokens: Arc<TokenRegistry>,
        group: impl Into<String>,
        limits: Limits,
    ) -> Self {
        let workers = Tracker::new();
        let (usage, pending_calls, meter) = (Usage::default(), Arc::default(), Arc::default());
        let (group, claim) = (group.into(), Claim::default());
        Self { registry, tokens, group, claim, limits, usage, pending_calls, workers, meter }
    }

    /// Schedule this store's batched work by `claim` instead of weight 1, class 0 and
    /// no deadline.
    pub fn claiming(mut self, claim: Claim) -> Self {
        self.claim = claim;
        self
    }

    /// Count this store's native work in `meter` (its run's) instead of a meter of its own.
    pub fn metered_by(mut self, meter: Arc<crate::engine::Meter>) -> Self {
        self.meter = meter;
        self
    }

    /// Where this store's decodes, generated tokens, cancels and KV cells are counted.
    pub fn meter(&self) -> &Arc<crate::engine::Meter> {
        &self.meter
    }

    /// Count this store's threads in `workers` (a child of the host's tracker, say)
    /// instead of a tracker of its own.
    pub fn tracked_by(mut self, workers: Tracker) -> Self {
        self.workers = workers;
        self
    }

    /// The group (tenant) this store's shared tokens are scoped to.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The store's native threads: await `all_stopped` after dropping the store to know
    /// that no native work it started is still running.
    pub fn workers(&self) -> &Tracker {
        &self.workers
    }

    /// A place for one more pending call, or `limit-exceeded` naming max-pending-calls.
    pub(crate) fn pending_slot(&self) -> Result<PendingSlot, Error> {
        let max = self.limits.context.max_pending_calls;
        self.pending_calls
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < max).then_some(n + 1))
            .map(|_| PendingSlot(self.pending_calls.clone()))
            .map_err(|_| {
                Error::LimitExceeded(format!("max-pending-calls: this plugin already holds {max}"))
            })
    }

    /// Count `held` against this store's limits, or name the limit it would exceed.
    pub(crate) fn admit(&mut self, held: Charge) -> Result<(), Error> {
        let (u, l) = (&self.usage, &self.limits);
        let over = |name: &str, max: String| {
            Err(Error::LimitExceeded(format!("{name}: this plugin already holds {max}")))
        };
        // Resources counted one by one: (limit, held now, most).
        let counted = match held {
            Charge::Context { .. } => Some(("max-contexts", u.contexts, l.context.max_contexts)),
            Charge::MediaContext => {
                Some(("max-media-contexts", u.media_contexts, l.media.max_media_contexts))
            }
            Charge::Token => Some(("max-tokens", u.tokens, l.cancel.max_tokens)),
            Charge::Share => Some(("max-shares", u.shares, l.cancel.max_shares)),
            Charge::Sampler => Some(("max-samplers", u.samplers, l.sampler.max_samplers)),
            Charge::Chunks { .. } => None,
        };
        if let Some((name, _, max)) = counted.filter(|&(_, now, max)| now >= max) {
            return over(name, max.to_string());
        }
        // Resources counted by size.
        match held {
            Charge::Context { kv_cells } if u.kv_cells + kv_cells > l.context.max_kv_cells => {
                let (now, max) = (u.kv_cells, l.context.max_kv_cells);
                return over("max-kv-cells", format!("{now} of {max} KV cells (n-ctx x layers)"));
            }
            Charge::Chunks { bytes }
                if u.chunk_bytes.saturating_add(bytes) > l.media.max_chunk_bytes =>
            {
                let (now, max) = (u.chunk_bytes, l.media.max_chunk_bytes);
                let what =
                    format!("{now} of {max} bytes in media chunks (this needs {bytes} more)");
                return over("max-chunk-bytes", what);
            }
            _ => {}
        }
        self.count(held, true);
        Ok(())
    }

    /// Native bytes this store's media chunks may still hold under max-chunk-bytes.
    pub(crate) fn chunk_bytes_left(&self) -> usize {
        usize::try_from(self.limits.media.max_chunk_bytes.saturating_sub(self.usage.chunk_bytes))
            .unwrap_or(usize::MAX)
    }

    /// Stop counting `held` (its resource was dropped).
    pub(crate) fn release(&mut self, held: Charge) {
        self.count(held, false);
    }

    fn count(&mut self, held: Charge, add: bool) {
        let u = &mut self.usage;
        let step = |n: &mut u32| *n = if add { *n + 1 } else { n.saturating_sub(1) };
        match held {
            Charge::Context { kv_cells } => {
                step(&mut u.contexts);
                u.kv_cells =
                    if add { u.kv_cells + kv_cells } else { u.kv_cells.saturating_sub(kv_cells) };
                self.meter.note_kv_cells(u.kv_cells);
            }
            Charge::MediaContext => step(&mut u.media_contexts),
            Charge::Token => step(&mut u.tokens),
            Charge::Share => step(&mut u.shares),
            Charge::Chunks { bytes } => {
                u.chunk_bytes =
                    if add { u.chunk_bytes + bytes } else { u.chunk_bytes.saturating_sub(bytes) };
            }
            Charge::Sampler => step(&mut u.samplers),
        }
    }
}

/// What the host functions work on: the store's llamabox state and its resource table.
pub struct LlamaCtxView<'a> {
    /// The store's llamabox state.
    pub ctx: &'a mut LlamaCtx,
    /// The store's resource table, which the guest's resource handles index.
    pub table: &'a mut ResourceTable,
}

/// Implemented by a store's data type to give llamabox its state (like `WasiView`).
pub trait LlamaView: Send {
    /// The llamabox state and resource table of this store.
    fn llama(&mut self) -> LlamaCtxView<'_>;
}

pub(crate) struct HasLlama;

impl HasData for HasLlama {
    type Data<'a> = LlamaCtxView<'a>;
}

/// Add the llamabox interfaces to a linker. WASI is added separately by the embedder
/// (`wasmtime_wasi::p2::add_to_linker_async`): the world imports `wasi:io` and
/// `wasi:clocks` too, so adding the whole world here would add them twice.
pub fn add_to_linker<T: LlamaView + 'static>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    use bindings::llamabox::inference as wit;
    wit::types::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    wit::cancel::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    wit::llm::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    wit::media::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    wit::generate::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    wit::embeddings::add_to_linker::<T, HasLlama>(linker, T::llama)?;
    async_bindings::llamabox::inference::async_calls::add_to_linker::<T, HasLlama>(
        linker,
        T::llama,
    )?;
    Ok(())
}

impl bindings::llamabox::inference::types::Host for LlamaCtxView<'_> {
    fn convert_error(&mut self, err: LlamaError) -> wasmtime::Result<Error> {
        match err.0 {
            Failure::Guest(e) => Ok(e),
            Failure::Trap(e) => Err(e),
        }
    }
}

impl From<crate::native::Error> for Error {
    fn from(e: crate::native::Error) -> Self {
        use crate::native::Error as N;
        match e {
            N::Cancelled => Error::Cancelled,
            N::InvalidArgument(m) => Error::InvalidArgument(m),
            e @ N::Grammar { .. } => Error::InvalidArgument(e.to_string()),
            N::ContextFull => Error::ContextFull,
            N::LimitExceeded { limit, requested, max } => {
                Error::LimitExceeded(format!("{limit}: {requested} is above {max}"))
            }
            N::Backend(m) => Error::Backend(m),
            // A kind the native crate adds later is a failure of the host's, until it is
            // given a WIT error of its own here.
            e => Error::Backend(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(limits: Limits) -> LlamaCtx {
        LlamaCtx::new(
            Arc::new(ModelRegistry::new()),
            Arc::new(TokenRegistry::new()),
            "test",
            limits,
        )
    }

    fn limit_named(result: Result<(), Error>) -> String {
        match result {
            Err(Error::LimitExceeded(m)) => m,
            other => panic!("expected limit-exceeded, got {other:?}"),
        }
    }

    #[test]
    fn each_held_thing_counts_against_its_own_limit_until_released() {
        let mut limits = Limits::default();
        (limits.context.max_contexts, limits.context.max_kv_cells) = (2, 1000);
        limits.context.max_pending_calls = 1;
        (limits.cancel.max_tokens, limits.media.max_media_contexts) = (1, 1);
        let mut c = ctx(limits);
        let small = Charge::Context { kv_cells: 400 };
        c.admit(small).unwrap();
        assert!(limit_named(c.admit(Charge::Context { kv_cells: 601 })).starts_with("max-kv-cells"));
        c.admit(small).unwrap();
        assert!(limit_named(c.admit(Charge::Context { kv_cells: 1 })).starts_with("max-contexts"));
        c.release(small);
        c.admit(Charge::Context { kv_cells: 200 }).unwrap();

        let mut limits = Limits::default();
        limits.sampler.max_samplers = 1;
        let mut c2 = ctx(limits);
        c2.admit(Charge::Sampler).unwrap();
        assert!(limit_named(c2.admit(Charge::Sampler)).starts_with("max-samplers"));

        let mut limits = Limits::default();
        limits.media.max_chunk_bytes = 100;
        let mut c = ctx(limits);
        c.admit(Charge::Chunks { bytes: 60 }).unwrap();
        assert!(limit_named(c.admit(Charge::Chunks { bytes: 41 })).starts_with("max-chunk-bytes"));
        c.release(Charge::Chunks { bytes: 60 });
        c.admit(Charge::Chunks { bytes: 100 }).unwrap();

        let mut limits = Limits::default();
        limits.context.max_pending_calls = 2;
        (limits.cancel.max_tokens, limits.cancel.max_shares) = (1, 1);
        limits.media.max_media_contexts = 1;
        let mut c = ctx(limits);
        for (held, name) in [
            (Charge::Token, "max-tokens"),
            (Charge::Share, "max-shares"),
            (Charge::MediaContext, "max-media-contexts"),
        ] {
            c.admit(held).unwrap();
            assert!(limit_named(c.admit(held)).starts_with(name));
            c.release(held);
            c.admit(held).unwrap();
        }

        let slots = (c.pending_slot().unwrap(), c.pending_slot().unwrap());
        assert!(
            matches!(c.pending_slot(), Err(Error::LimitExceeded(m)) if m.starts_with("max-pending-calls"))
        );
        drop(slots.0);
        c.pending_slot().expect("a dropped slot frees its place");
    }
}
