//! Batched contexts: the one-sequence contexts of many runs (and tenants) as *seats*,
//! sequences of one shared native context whose thread merges every seat's pending
//! rows into one `llama_decode` per step: generation tokens first, then prompt chunks
//! up to the step's row budget, rotating between the seats with prompts (continuous
//! batching with chunked prefill).
//!
//! A seat looks to its plugin exactly like a context of its own: sequence 0, positions
//! from 0, `n-ctx` as granted, every call all or nothing. What differs:
//! - **Cancel.** A step asks after every graph node whether *any* member's token (or
//!   abandoned call) is set. When one is, the step stops within a node and is rolled back
//!   for every member (memory as before the step); the cancelled members end
//!   `cancelled` (their whole call undone) and the next step re-runs the others at once.
//!   A cancel between steps just drops the member. Nobody else's call fails.
//! - **Numerics.** llama.cpp's kernels depend on the batch's shape, so a seat's logits
//!   are not bitwise those of a context of its own (see docs/ARCHITECTURE.md).
//! - **Prefix reuse.** A seat is bound to a native sequence at its first decode, to a
//!   free one whose leftover tokens (what an earlier seat of the *same group* left)
//!   start the same way; else the lowest empty one. The sequences share one pool of
//!   KV cells, and a seat reserves the cells its context asked for (`reserve.rs`), so
//!   the seats are as many as fit.
//! - **Media** prompts (`media.eval-chunks`) run as a step of their own; embeddings
//!   need a context of their own (a seat refuses them).
//!
//! Everything native happens on the batch's thread, one op at a time per seat and in
//! the order the seat sent them; a seat's ops wait behind its own compute, never behind
//! another seat's.
//!
//! The rooms: `seat.rs` (the seat API and its ops), `thread.rs` (the batch thread's
//! loop and its steps), `calls.rs` (a seat's calls between steps, generation),
//! `rollback.rs` (undoing a call), `media.rs` (media prompts in parts),
//! `sequences.rs` (which sequence a seat gets, prefix reuse); the policy of what each
//! step takes is the engine's scheduler (`engine/schedule.rs`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use super::schedule::Claim;
use crate::engine::{Cores, Flow, FlowCores, Meter};
use crate::native::{CancelFlag, Context, ContextParams, Error, Model, SharedCores};
use crate::worker::Tracker;

mod calls;
mod media;
mod reserve;
mod rollback;
mod seat;
mod sequences;
#[cfg(test)]
mod tests;
mod thread;

use reserve::{Ask, Capacity, Reservations, Reserved};
use seat::Op;
pub use seat::Seat;
use thread::Steps;

/// Called after every step with what it did; runs on the batch's thread, so it must be quick.
pub type StepObserver = Arc<dyn Fn(&StepReport) + Send + Sync>;

/// What a seat is asked for: its size as its context was asked for (after the host's
/// caps), and whose it is.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeatRequest<'a> {
    /// Cells, padded as a context of its own would be.
    pub n_ctx: u32,
    /// Most rows one decode takes.
    pub n_batch: u32,
    /// Its run's group (tenant and plugin): leftovers, shares and rollbacks are per group.
    pub group: &'a str,
    /// Its run's claim on the cores.
    pub claim: Claim,
    /// Its run holds no native work yet, so it may wait for a seat without holding
    /// up another run that waits (`reserve.rs`).
    pub may_wait: bool,
}

/// How a host batches one-sequence contexts (`ModelRegistry::batch`).
///
/// Each step decodes one row for every generating seat, then prompt rows (a decode's
/// batch, a generation's prompt), shortest first:
/// - prompts add at most about `step_target` to a step, so a generating client waits at
///   most that long for its next token because of other clients' prompts;
/// - a *long* prompt (more than `long_prompt_rows` rows left) yields to everything else,
///   taking at most `long_prompt_share` of the time while anyone else has work;
/// - a step of long prompts alone runs up to `step_rows` rows, and yields in flight when
///   another seat's call arrives: it is rolled back, and the next step takes the
///   newcomer first; what a yield threw away is made good before the next may yield;
/// - a step with prompt rows yields in flight to the call of a group that would go
///   first in fair share (a newcomer), whose first step is then its own rows.
///
/// `#[non_exhaustive]`: start from [`BatchPolicy::new`] and set fields.
#[derive(Clone)]
#[non_exhaustive]
pub struct BatchPolicy {
    /// Seats (native sequences) per shared context: how many runs' contexts it holds
    /// at once.
    pub seats: u32,
    /// Most cells one seat may ask for: contexts asking for more get contexts of their
    /// own.
    pub seat_n_ctx: u32,
    /// KV cells the seats share (llama.cpp's unified KV), allocated with the shared
    /// context: each seat reserves the cells its context asked for, so the seats held at
    /// once are as many as fit. A run that holds nothing yet waits for cells (fairly,
    /// by group); one that holds a context already gets a context of its own.
    pub cells: u32,
    /// The most of the seats and of the cells one group (tenant and plugin) may hold,
    /// 0 to 1: the rest stays for others, whatever one tenant sends.
    pub group_share: f64,
    /// Threads of the shared context's decodes: the share of the machine for this model.
    pub threads: u32,
    /// Most rows one step decodes (the shared context's n-batch and n-ubatch).
    pub step_rows: u32,
    /// How long prompt rows may make a step with other work in it: the rows it takes
    /// come from the measured speed of earlier steps.
    pub step_target: Duration,
    /// Prompts with more rows than this left are long (a document, not a chat turn).
    pub long_prompt_rows: u32,
    /// The most of the time long prompts take while other seats generate or prefill.
    pub long_prompt_share: f64,
    /// Called after every step (metrics).
    pub observer: Option<StepObserver>,
    /// Whose turn it is on the cores: shared by every batch made by this policy (and
    /// its clones), so that batches of different models take turns instead of
    /// oversubscribing the cores.
    pub(crate) cores: Arc<Cores>,
}

impl std::fmt::Debug for BatchPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchPolicy")
            .field("seats", &self.seats)
            .field("seat_n_ctx", &self.seat_n_ctx)
            .field("cells", &self.cells)
            .field("group_share", &self.group_share)
            .field("threads", &self.threads)
            .field("step_rows", &self.step_rows)
            .field("step_target", &self.step_target)
            .field("long_prompt_rows", &self.long_prompt_rows)
            .field("long_prompt_share", &self.long_prompt_share)
            .finish_non_exhaustive()
    }
}

impl BatchPolicy {
    /// Whether `other` is this policy: the same settings, observer and cores.
    fn same_as(&self, other: &BatchPolicy) -> bool {
        let same_observer = match (&self.observer, &other.observer) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        (
            self.seats,
            self.seat_n_ctx,
            self.cells,
            self.threads,
            self.step_rows,
            self.step_target,
            self.long_prompt_rows,
        ) == (
            other.seats,
            other.seat_n_ctx,
            other.cells,
            other.threads,
            other.step_rows,
            other.step_target,
            other.long_prompt_rows,
        ) && self.long_prompt_share.to_bits() == other.long_prompt_share.to_bits()
            && self.group_share.to_bits() == other.group_share.to_bits()
            && same_observer
            && Arc::ptr_eq(&self.cores, &other.cores)
    }

    /// `seats` seats of at most `seat_n_ctx` cells each, sharing `seats × seat_n_ctx`
    /// cells (so every seat fits at its largest), on `threads` threads; no share cap per
    /// group; 512-row steps, prompts adding at most 250 ms to a step, prompts of more
    /// than 512 rows long, taking at most a quarter of the time while others have work.
    pub fn new(seats: u32, seat_n_ctx: u32, threads: u32) -> Self {
        Self {
            seats,
            seat_n_ctx,
            cells: seat_n_ctx.saturating_mul(seats),
            group_share: 1.0,
            threads,
            step_rows: 512,
            step_target: Duration::from_millis(250),
            long_prompt_rows: 512,
            long_prompt_share: 0.25,
            observer: None,
            cores: Arc::default(),
        }
    }

    /// The cores as `group`'s computations beside the batches take them (its contexts
    /// of their own and media encodes): one flow per tenant, so that its turns come
    /// once a round between the batches' steps however many it runs at once.
    pub(crate) fn cores_for(&self, group: &str) -> Arc<dyn SharedCores> {
        FlowCores::shared(self.cores.clone(), Flow::Tenant(group.into()))
    }
}

/// What one step did, for metrics.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct StepReport {
    /// Seats with rows in the step.
    pub seats: usize,
    /// Rows (tokens) the step decoded.
    pub rows: usize,
    /// Rows of long prompts among them.
    pub long_rows: usize,
    /// Seats holding a lease on the shared context now.
    pub active_seats: usize,
    /// How long the step's decode took.
    pub elapsed: Duration,
    /// The step was stopped by a member's cancel and rolled back for all of them.
    pub rolled_back: bool,
    /// The step (long prompts alone) yielded in flight to a newcomer's call and was
    /// rolled back; its rows run again after the newcomer's.
    pub yielded: bool,
}

/// Most rows with logits one decode on a seat may ask for: each is copied out of the
/// step (n-vocab floats, 192 KiB for a 49k vocabulary) and kept until the seat's next
/// decode, so without a bound a plugin could hold n-batch of them per seat.
pub const MAX_SEAT_LOGIT_ROWS: usize = 64;

/// The shared contexts of one loaded model (one per seat size in use).
#[derive(Default)]
pub struct BatchPool {
    batchers: tokio::sync::Mutex<Vec<Arc<Batcher>>>,
}

impl BatchPool {
    /// A seat for a one-sequence context of `n_ctx` cells (allocated as a context of its
    /// own would be), or `None` when this policy does not batch it, or the batch is
    /// short of seats or cells and the run may not wait for them (it holds native work
    /// already). A run that may wait does so here until its reservation is granted.
    pub(crate) async fn lease(
        &self,
        policy: &BatchPolicy,
        model: &Arc<Model>,
        SeatRequest { n_ctx, n_batch, group, claim, may_wait }: SeatRequest<'_>,
        meter: Arc<Meter>,
        tracker: &Tracker,
    ) -> Option<Result<Seat, Error>> {
        if n_ctx > policy.seat_n_ctx || n_ctx > policy.cells || policy.seats == 0 {
            return None;
        }
        let mut batchers = self.batchers.lock().await;
        // A batch made under another policy (the embedder changed it) takes no new seats:
        // the pool forgets it, and its thread ends once its last seat has left.
        batchers.retain(|b| b.policy.same_as(policy));
        let batcher = match batchers.first() {
            Some(b) => b.clone(),
            None => match Batcher::start(model.clone(), policy.clone()).await {
                Ok(b) => {
                    batchers.push(b.clone());
                    b
                }
                Err(e) => return Some(Err(e)),
            },
        };
        drop(batchers);
        let ask = Ask { group: group.to_string(), weight: claim.weight, cells: n_ctx as u64 };
        match batcher.reservations.reserve(ask.clone(), may_wait) {
            Reserved::Now => {}
            Reserved::Later(ticket, granted) => {
                tracing::trace!(group, cells = n_ctx, "seat lease waits for its cells");
                if !batcher.reservations.wait(ticket, granted).await {
                    return None;
                }
                tracing::trace!(group, cells = n_ctx, "seat lease granted");
            }
            Reserved::No => return None,
        }
        let id = batcher.next_id.fetch_add(1, SeqCst);
        let join = Op::Join {
            id,
            group: group.to_string(),
            claim,
            meter,
            alive: tracker.count(),
            n_ctx,
            n_batch,
        };
        if batcher.ops.send(join).is_err() {
            // Its thread ended (it never does unless it panicked): forget it, so the
            // next lease starts a new batch instead of meeting a dead one for good.
            self.batchers.lock().await.retain(|b| !Arc::ptr_eq(b, &batcher));
            batcher.reservations.release(&ask);
            return Some(Err(Error::Backend("the batch's thread is gone".into())));
        }
        Some(Ok(Seat { id, ask, batcher }))
    }

    /// Seats leased now over this model's shared contexts.
    pub fn seats_taken(&self) -> u32 {
        self.batchers.try_lock().map_or(0, |b| b.iter().map(|b| b.reservations.seats_taken()).sum())
    }
}

/// Where seats signal their calls that compute, for the step in flight to yield to
/// (`schedule::YieldTo`). The thread puts a fresh flag here, counting everyone's calls,
/// before it takes what was sent, and says whose count once the step is planned.
#[derive(Default)]
pub(super) struct Arrivals {
    /// Set by a call that counts.
    pub flag: CancelFlag,
    /// The groups whose calls do not count (`None`: everyone's counts).
    pub except: Option<HashSet<String>>,
}

impl Arrivals {
    /// A call of `group`'s seat that computes was sent.
    fn arrive(&self, group: &str) {
        if !self.except.as_ref().is_some_and(|except| except.contains(group)) {
            self.flag.cancel();
        }
    }
}

/// One shared native context and its thread. The thread ends when the pool and every
/// seat have let go of it (the op channel closes).
struct Batcher {
    ops: mpsc::Sender<Op>,
    /// The policy it was made under.
    policy: BatchPolicy,
    /// Where a seat's call that computes is signalled, for a step that yields to it.
    arrived: Arc<Mutex<Arrivals>>,
    step_rows: u32,
    /// Seats and cells leased and not yet dropped, and who waits for them.
    reservations: Reservations,
    next_id: AtomicU64,
}

impl Batcher {
    async fn start(model: Arc<Model>, asked: BatchPolicy) -> Result<Arc<Self>, Error> {
        let mut policy = asked.clone();
        // Every seat may add a generation row to a step (and llama.cpp wants an output
        // row per sequence within n-batch).
        policy.step_rows = policy.step_rows.max(policy.seats);
        // A long computation beside the batch (a context of its own, a media encode) keeps
        // the cores at most a step target while the batch waits.
        policy.cores.set_turn(policy.step_target);
        let (ops, ops_rx) = mpsc::channel();
        let arrived: Arc<Mutex<Arrivals>> = Arc::default();
        let thread_arrived = arrived.clone();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let capacity = Capacity::new(
            policy.seats,
            policy.cells as u64,
            policy.seat_n_ctx as u64,
            policy.group_share,
        );
        let step_rows = policy.step_rows;
        let span = tracing::Span::current();
        std::thread::Builder::new()
            .name("llamabox-batch".into())
            .spawn(move || {
                let params = ContextParams {
                    n_ctx: policy.cells,
                    n_batch: policy.step_rows,
                    n_ubatch: policy.step_rows,
                    n_seq_max: policy.seats,
                    n_threads: policy.threads,
                };
                // Only its creation is the creating run's: what later steps log carries
                // their own members (`Steps::step`), not the first request's id.
                // Its steps take turns on the cores with contexts beside it: its
                // threads keep one a CPU, as theirs do (`Context::pin_threads`).
                let created = span.in_scope(|| {
                    let mut ctx = Context::new_unified(model, params)?;
                    ctx.pin_threads()?;
                    Ok::<_, Error>(ctx)
                });
                match created {
                    Ok(ctx) => {
                        let _ = ready_tx.send(Ok(()));
                        Steps::new(ctx, policy, thread_arrived).run(ops_rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| Error::Backend(format!("could not start a batch thread: {e}")))?;
        match ready_rx.await {
            Ok(Ok(())) => Ok(Arc::new(Self {
                ops,
                policy: asked,
                arrived,
                step_rows,
                reservations: Reservations::new(capacity),
                next_id: AtomicU64::new(0),
            })),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                Err(Error::Backend("the batch thread panicked while creating its context".into()))
            }
        }
    }
}
