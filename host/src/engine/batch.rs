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
//!   start the same way; else the lowest free one, which keeps the members' sequence
//!   ids consecutive (llama.cpp's per-sequence KV streams put only consecutive ids in
//!   one ubatch: a hole costs every step one more ubatch until a seat fills it).
//! - **Media** prompts (`media.eval-chunks`) run as a step of their own; embeddings
//!   need a context of their own (a seat refuses them).
//!
//! Everything native happens on the batch's thread, one op at a time per seat and in
//! the order the seat sent them; a seat's ops wait behind its own compute, never behind
//! another seat's.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as pieces;

use crate::native::context::Pacer;
use crate::native::{
    self, Batch, CancelFlag, Context, ContextParams, Cores, Error, FinishReason, GenerateRequest,
    Meter, Model, Outcome, Pick, Piece, PromptPiece, Sampler, Stop, Token, TokenLoop,
};
use crate::worker::{Alive, Call, Reply, Tracker};

/// Called after every step with what it did; runs on the batch's thread, so it must be quick.
pub type StepObserver = Arc<dyn Fn(&StepReport) + Send + Sync>;

/// A seat's size as its context was asked for (after the host's caps).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeatSize {
    /// Cells, padded as a context of its own would be.
    pub n_ctx: u32,
    /// Most rows one decode takes.
    pub n_batch: u32,
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
///   newcomer first; what a yield threw away is made good before the next may yield.
///
/// `#[non_exhaustive]`: start from [`BatchPolicy::new`] and set fields.
#[derive(Clone)]
#[non_exhaustive]
pub struct BatchPolicy {
    /// Seats (native sequences) per shared context: contexts beyond this get contexts
    /// of their own. Each seat's KV stream is allocated with the shared context.
    pub seats: u32,
    /// Cells per seat: contexts asking for more get contexts of their own.
    pub seat_n_ctx: u32,
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
            self.threads,
            self.step_rows,
            self.step_target,
            self.long_prompt_rows,
        ) == (
            other.seats,
            other.seat_n_ctx,
            other.threads,
            other.step_rows,
            other.step_target,
            other.long_prompt_rows,
        ) && self.long_prompt_share.to_bits() == other.long_prompt_share.to_bits()
            && same_observer
            && Arc::ptr_eq(&self.cores, &other.cores)
    }

    /// `seats` seats of `seat_n_ctx` cells on `threads` threads; 512-row steps, prompts
    /// adding at most 250 ms to a step, prompts of more than 512 rows long, taking at
    /// most a quarter of the time while others have work.
    pub fn new(seats: u32, seat_n_ctx: u32, threads: u32) -> Self {
        Self {
            seats,
            seat_n_ctx,
            threads,
            step_rows: 512,
            step_target: Duration::from_millis(250),
            long_prompt_rows: 512,
            long_prompt_share: 0.25,
            observer: None,
            cores: Arc::default(),
        }
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

/// How long the thread sleeps when every member waits for its reader.
const DELIVERY_POLL: Duration = Duration::from_millis(1);

/// The shared contexts of one loaded model (one per seat size in use).
#[derive(Default)]
pub struct BatchPool {
    batchers: tokio::sync::Mutex<Vec<Arc<Batcher>>>,
}

impl BatchPool {
    /// A seat for a one-sequence context of `n_ctx` cells (allocated as a context of its
    /// own would be), or `None` when this policy does not batch it or every seat is taken.
    pub(crate) async fn lease(
        &self,
        policy: &BatchPolicy,
        model: &Arc<Model>,
        SeatSize { n_ctx, n_batch }: SeatSize,
        group: &str,
        meter: Arc<Meter>,
        tracker: &Tracker,
    ) -> Option<Result<Seat, Error>> {
        if n_ctx > policy.seat_n_ctx || policy.seats == 0 {
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
        batcher
            .taken
            .fetch_update(SeqCst, SeqCst, |n| (n < batcher.seats).then_some(n + 1))
            .ok()?;
        let id = batcher.next_id.fetch_add(1, SeqCst);
        let join = Op::Join {
            id,
            group: group.to_string(),
            meter,
            alive: tracker.count(),
            n_ctx,
            n_batch,
        };
        if batcher.ops.send(join).is_err() {
            // Its thread ended (it never does unless it panicked): forget it, so the
            // next lease starts a new batch instead of meeting a dead one for good.
            self.batchers.lock().await.retain(|b| !Arc::ptr_eq(b, &batcher));
            batcher.taken.fetch_sub(1, SeqCst);
            return Some(Err(Error::Backend("the batch's thread is gone".into())));
        }
        Some(Ok(Seat { id, batcher }))
    }

    /// Seats leased now over this model's shared contexts.
    pub fn seats_taken(&self) -> u32 {
        self.batchers.try_lock().map_or(0, |b| b.iter().map(|b| b.taken.load(SeqCst)).sum())
    }
}

/// One shared native context and its thread. The thread ends when the pool and every
/// seat have let go of it (the op channel closes).
struct Batcher {
    ops: mpsc::Sender<Op>,
    /// The policy it was made under.
    policy: BatchPolicy,
    /// Set when a seat sends a call that computes: a step of long prompts alone then
    /// yields to it. The thread puts a fresh flag here before it takes what was sent.
    arrived: Arc<Mutex<CancelFlag>>,
    seats: u32,
    step_rows: u32,
    /// Seats leased and not yet dropped.
    taken: Arc<AtomicU32>,
    next_id: AtomicU64,
}

impl Batcher {
    async fn start(model: Arc<Model>, asked: BatchPolicy) -> Result<Arc<Self>, Error> {
        let mut policy = asked.clone();
        // Every seat may add a generation row to a step (and llama.cpp wants an output
        // row per sequence within n-batch).
        policy.step_rows = policy.step_rows.max(policy.seats);
        let (ops, ops_rx) = mpsc::channel();
        let arrived: Arc<Mutex<CancelFlag>> = Arc::default();
        let thread_arrived = arrived.clone();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let taken = Arc::new(AtomicU32::new(0));
        let (seats, step_rows) = (policy.seats, policy.step_rows);
        let span = tracing::Span::current();
        std::thread::Builder::new()
            .name("llamabox-batch".into())
            .spawn(move || {
                let params = ContextParams {
                    n_ctx: policy.seat_n_ctx.saturating_mul(policy.seats),
                    n_batch: policy.step_rows,
                    n_ubatch: policy.step_rows,
                    n_seq_max: policy.seats,
                    n_threads: policy.threads,
                };
                // Only its creation is the creating run's: what later steps log carries
                // their own members (`Steps::step`), not the first request's id.
                match span.in_scope(|| Context::new(model, params)) {
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
                seats,
                step_rows,
                taken,
                next_id: AtomicU64::new(0),
            })),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                Err(Error::Backend("the batch thread panicked while creating its context".into()))
            }
        }
    }
}

/// A plugin's context as a sequence of a shared context. Dropping it stops its call in
/// flight (if any), removes its rows, and frees the sequence for the next seat.
pub struct Seat {
    id: u64,
    batcher: Arc<Batcher>,
}

impl Seat {
    fn send<R: Send + 'static>(&self, make: impl FnOnce(Reply<R>) -> SeatOp) -> Call<R> {
        let (call, reply) = Call::channel();
        let op = make(reply);
        let computes = op.computes();
        // If the thread is gone, the op (and its reply) drops: the call resolves to `None`.
        let _ = self.batcher.ops.send(Op::Seat { id: self.id, op });
        if computes {
            // After the send: a flag put in place before it is set; one put after it
            // belongs to a loop that takes the op first.
            self.batcher.arrived.lock().unwrap_or_else(PoisonError::into_inner).cancel();
        }
        call
    }

    /// Decode `batch` (sequence 0 of this seat), stopping in flight when `token` is set.
    pub fn decode(&self, batch: Batch, token: CancelFlag) -> Call<native::Result<()>> {
        self.send(|reply| SeatOp::Decode { batch, caller: Caller { token, reply } })
    }

    /// Generate on this seat (native::generate's contract), pieces sent to `pieces`.
    pub fn generate(
        &self,
        sampler: Sampler,
        request: GenerateRequest,
        token: CancelFlag,
        pieces: pieces::Sender<Piece>,
    ) -> Call<native::Result<Outcome>> {
        self.send(|reply| SeatOp::Generate {
            sampler: Box::new(sampler),
            request,
            pieces,
            caller: Caller { token, reply },
        })
    }

    /// `Context::eval` of a media prompt, as a step of its own.
    pub fn eval(
        &self,
        pieces: Vec<PromptPiece>,
        seq: i32,
        token: CancelFlag,
    ) -> Call<native::Result<i32>> {
        self.send(|reply| SeatOp::Eval { pieces, seq, caller: Caller { token, reply } })
    }

    /// Logits of `row` of the last successful decode, or of its last row (`None`).
    pub fn logits(&self, row: Option<u32>) -> Call<native::Result<Vec<f32>>> {
        self.send(|reply| SeatOp::Logits { row, reply })
    }

    /// `sampler.sample` on row `row`'s logits, on the batch's thread.
    pub fn sample(&self, sampler: Arc<Mutex<Sampler>>, row: u32) -> Call<native::Result<Token>> {
        self.send(|reply| SeatOp::Sample { sampler, row, reply })
    }

    pub fn seq_rm(&self, seq: i32, p0: i32, p1: i32) -> Call<native::Result<()>> {
        self.send(|reply| SeatOp::SeqRm { seq, p0, p1, reply })
    }

    pub fn seq_pos_max(&self, seq: i32) -> Call<native::Result<i32>> {
        self.send(|reply| SeatOp::PosMax { seq, reply })
    }

    pub fn clear(&self) -> Call<native::Result<()>> {
        self.send(|reply| SeatOp::Clear { reply })
    }

    /// Rows one step computes per graph (the shared context's n-ubatch).
    pub fn n_ubatch(&self) -> u32 {
        self.batcher.step_rows
    }
}

impl Drop for Seat {
    /// The seat is free for the next lease at once: its `Leave` goes down the same
    /// channel before that lease's `Join`, so the thread frees the sequence first.
    fn drop(&mut self) {
        let _ = self.batcher.ops.send(Op::Leave { id: self.id });
        self.batcher.taken.fetch_sub(1, SeqCst);
    }
}

/// A call's caller: its token and where its result goes (whose flag says abandoned).
struct Caller<T> {
    token: CancelFlag,
    reply: Reply<native::Result<T>>,
}

impl<T> Caller<T> {
    fn stop(&self) -> Stop<'_> {
        Stop::on_either(&self.token, self.reply.abandoned())
    }
}

enum Op {
    /// Test hook: the thread waits for the gate before it takes the next op, so a test
    /// can queue several seats' calls for one step.
    #[cfg(test)]
    Pause(mpsc::Receiver<()>),
    /// Test hook: every step that may yield does so at this node.
    #[cfg(test)]
    YieldAt(u64),
    Join {
        id: u64,
        group: String,
        meter: Arc<Meter>,
        alive: Alive,
        n_ctx: u32,
        n_batch: u32,
    },
    Seat {
        id: u64,
        op: SeatOp,
    },
    Leave {
        id: u64,
    },
}

enum SeatOp {
    Decode {
        batch: Batch,
        caller: Caller<()>,
    },
    Generate {
        sampler: Box<Sampler>,
        request: GenerateRequest,
        pieces: pieces::Sender<Piece>,
        caller: Caller<Outcome>,
    },
    Eval {
        pieces: Vec<PromptPiece>,
        seq: i32,
        caller: Caller<i32>,
    },
    Logits {
        row: Option<u32>,
        reply: Reply<native::Result<Vec<f32>>>,
    },
    Sample {
        sampler: Arc<Mutex<Sampler>>,
        row: u32,
        reply: Reply<native::Result<Token>>,
    },
    SeqRm {
        seq: i32,
        p0: i32,
        p1: i32,
        reply: Reply<native::Result<()>>,
    },
    PosMax {
        seq: i32,
        reply: Reply<native::Result<i32>>,
    },
    Clear {
        reply: Reply<native::Result<()>>,
    },
}

impl SeatOp {
    /// Whether it becomes a running call with rows to decode (it may then end a step of
    /// long prompts alone).
    fn computes(&self) -> bool {
        matches!(self, SeatOp::Decode { .. } | SeatOp::Generate { .. } | SeatOp::Eval { .. })
    }
}

/// One native sequence of the shared context.
#[derive(Default)]
struct Slot {
    /// The seat bound to it.
    seat: Option<u64>,
    /// The group whose seat last held it (whose leftover it keeps).
    group: String,
    /// What it holds, token by token, while that is known (not after embeddings).
    tokens: Option<Vec<Token>>,
    /// When its last seat left (`Steps::releases` then): of two leftovers that serve a
    /// call as well, the older one goes, so the newest stays for its likely next turn.
    released: u64,
}

struct Member {
    group: String,
    meter: Arc<Meter>,
    /// Counts this seat in its run's tracker until the thread has let go of it.
    alive: Alive,
    /// The seat's granted n-ctx (its room) and n-batch (most rows per decode).
    n_ctx: u32,
    n_batch: u32,
    slot: Option<usize>,
    /// Rows of the last successful decode: their logits if they asked for them.
    logits: Vec<Option<Vec<f32>>>,
    /// Ops in the order the seat sent them; the first may be running.
    queue: VecDeque<SeatOp>,
    /// The compute op at the front, once started.
    running: Option<Running>,
    /// Steps in a row its prompt had rows left and got none.
    passed_over: u32,
    /// Steps in a row it had rows and was kept out because its group is quarantined.
    quarantine_wait: u32,
}

/// A decode or generation in progress across steps.
enum Running {
    Decode(DecodeWork),
    Generate(Box<GenerateWork>),
}

struct DecodeWork {
    caller: Caller<()>,
    batch: Batch,
    /// Rows done (reused ones included).
    done: usize,
    /// Where the sequence ended before the call (`seq_pos_max`).
    end_before: i32,
    /// The call bound the seat (so failing unbinds it), keeping this many leftover rows.
    bound_here: bool,
    kept: usize,
    logits: Vec<Option<Vec<f32>>>,
}

struct GenerateWork {
    caller: Caller<Outcome>,
    sampler: Box<Sampler>,
    request: GenerateRequest,
    pieces: pieces::Sender<Piece>,
    end_before: i32,
    bound_here: bool,
    kept: usize,
    started: Instant,
    /// Prompt rows done; the token loop starts once all are.
    prompt_done: usize,
    tokens: Option<TokenLoop>,
    /// The token to decode next.
    next: Option<Token>,
    /// Pieces waiting for room in the reader's buffer; the first may carry the one
    /// token decoded but not yet delivered.
    undelivered: VecDeque<Piece>,
    /// How it ends, once decided (after the undelivered pieces are out).
    finish: Option<native::Result<FinishReason>>,
}

/// Rows one member contributes to a step.
struct Share {
    id: u64,
    slot: usize,
    rows: Batch,
    /// Rows of a long prompt (see `BatchPolicy::long_prompt_rows`).
    long: bool,
}

/// What the next step decodes, and whether it may yield to a newcomer.
struct Plan {
    shares: Vec<Share>,
    /// Long prompts alone, up to `step_rows`: a newcomer's call ends it in flight.
    yields: bool,
}

/// The speed of earlier steps, in rows per second, for the next step's row budget.
/// Steps too small to time well are left out; each timed one moves the estimate
/// halfway, so one disturbed by a busy machine does not swing it.
#[derive(Default)]
struct StepPace {
    rows_per_sec: Option<f64>,
}

/// A short prompt passed over this many steps in a row (shorter ones kept taking the
/// budget) goes before every other short prompt: shortest-first cannot starve it.
const PASSED_OVER_STEPS: u32 = 8;

/// Whoever rolls back shared steps pays for it. A group's cancels that roll back a
/// step with another group's rows in it add 1 each to its score, which fades by this
/// factor every step (half of it gone after ~69 steps). Above 1 (a second such
/// rollback before the first has faded) the group is *quarantined*: its rows run only
/// in steps no other group has rows in, so its next hang-up rolls back its own work
/// alone. A single hang-up (a user closing a tab) costs its group nothing.
const ROLLBACK_FADE: f64 = 0.99;
/// A quarantined member waits at most this many steps for the others before it gets a
/// step of its own (one step target at most): quarantine slows it, never starves it.
const QUARANTINE_WAIT: u32 = 3;

/// Fewest prompt rows a step offers (when it has room): below this a step's fixed cost
/// (a graph, the weights read once more) outweighs its rows, and the estimate is noise.
const MIN_CHUNK_ROWS: usize = 16;

impl StepPace {
    fn observe(&mut self, rows: usize, elapsed: Duration) {
        if rows < MIN_CHUNK_ROWS || elapsed.is_zero() {
            return;
        }
        let rate = rows as f64 / elapsed.as_secs_f64();
        self.rows_per_sec = Some(self.rows_per_sec.map_or(rate, |old| (old + rate) / 2.0));
    }

    /// Rows a step of about `target` takes (before any step was timed: no bound but
    /// the step's own, so the first big step measures the speed).
    fn rows(&self, target: Duration) -> usize {
        match self.rows_per_sec {
            None => usize::MAX,
            Some(rate) => ((rate * target.as_secs_f64()) as usize).max(MIN_CHUNK_ROWS),
        }
    }
}

/// The batch's thread: the shared context and its members.
struct Steps {
    ctx: Context,
    policy: BatchPolicy,
    slots: Vec<Slot>,
    members: BTreeMap<u64, Member>,
    pace: StepPace,
    /// Seconds of step time long prompts have earned while they waited for others
    /// (at `long_prompt_share`), less what they spent; they get rows once it covers a
    /// step target. Back to 0 whenever no long prompt waits.
    long_credit: f64,
    /// Seconds of long prompts' work thrown away by yields and not yet made good: while
    /// above 0, their steps take one target's worth of rows and do not yield, so the
    /// time they compute for good is at least the time arrivals made them lose (a flood
    /// of calls, even ones that fail, costs a long prompt at most half its speed).
    yield_debt: f64,
    /// The last plan left a long prompt waiting beside other work (see `account_long`).
    long_waiting: bool,
    /// Seats that have left, counted (`Slot::released`).
    releases: u64,
    /// Each group's score of shared steps it rolled back (see [`ROLLBACK_FADE`]).
    rollbacks: HashMap<String, f64>,
    /// Where seats signal an arrival (`Batcher::arrived`), and the flag of this loop.
    arrived_slot: Arc<Mutex<CancelFlag>>,
    arrived: CancelFlag,
    /// Test hook: every step that may yield does so at this node (as if a call arrived
    /// then: a flood of arrivals).
    #[cfg(test)]
    yield_at: Option<u64>,
}

impl Steps {
    fn new(ctx: Context, policy: BatchPolicy, arrived_slot: Arc<Mutex<CancelFlag>>) -> Self {
        let slots = (0..policy.seats).map(|_| Slot::default()).collect();
        Self {
            ctx,
            policy,
            slots,
            members: BTreeMap::new(),
            pace: StepPace::default(),
            long_credit: 0.0,
            yield_debt: 0.0,
            long_waiting: false,
            releases: 0,
            rollbacks: HashMap::new(),
            arrived_slot,
            arrived: CancelFlag::new(),
            #[cfg(test)]
            yield_at: None,
        }
    }

    /// Take what the seats sent, settle it (`advance`: pieces out, ends answered), then
    /// step if anyone has rows; block only when nobody has. The pieces of the step just
    /// computed are handed over before that question is asked, so a generation goes
    /// from step to step without waiting (it used to sleep one `DELIVERY_POLL` a token).
    fn run(mut self, ops: mpsc::Receiver<Op>) {
        loop {
            // A fresh arrival flag before taking what was sent: a call sent from here on
            // sets it, and one sent before is taken below.
            self.arrived = CancelFlag::new();
            *self.arrived_slot.lock().unwrap_or_else(PoisonError::into_inner) =
                self.arrived.clone();
            let disconnected = loop {
                match ops.try_recv() {
                    Ok(op) => self.take(op),
                    Err(e) => break e == mpsc::TryRecvError::Disconnected,
                }
            };
            if disconnected {
                return self.close();
            }
            self.advance();
            if self.has_rows() {
                self.step();
                continue;
            }
            // Nothing to compute: wait for a seat's op, polling while a reader's full
            // buffer holds a generation back.
            let op = if self.members.values().any(|m| m.running.is_some()) {
                ops.recv_timeout(DELIVERY_POLL)
                    .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected)
            } else {
                ops.recv().map_err(|_| true)
            };
            match op {
                Ok(op) => self.take(op),
                Err(true) => return self.close(),
                Err(false) => {}
            }
        }
    }

    /// Nobody can send any more (every seat left first): the context is freed here, on
    /// its own thread, when `self` drops.
    fn close(mut self) {
        let ids: Vec<u64> = self.members.keys().copied().collect();
        ids.into_iter().for_each(|id| self.leave(id));
    }

    fn take(&mut self, op: Op) {
        match op {
            #[cfg(test)]
            Op::Pause(gate) => {
                let _ = gate.recv();
            }
            #[cfg(test)]
            Op::YieldAt(node) => self.yield_at = Some(node),
            Op::Join { id, group, meter, alive, n_ctx, n_batch } => {
                let member = Member {
                    group,
                    meter,
                    alive,
                    n_ctx,
                    n_batch,
                    slot: None,
                    logits: Vec::new(),
                    queue: VecDeque::new(),
                    running: None,
                    passed_over: 0,
                    quarantine_wait: 0,
                };
                self.members.insert(id, member);
            }
            // A seat that left has no calls (its ops would drop unanswered).
            Op::Seat { id, op } => {
                if let Some(m) = self.members.get_mut(&id) {
                    m.queue.push_back(op);
                }
            }
            Op::Leave { id } => self.leave(id),
        }
    }

    /// The seat is gone: stop its work, undo its running call, free its sequence.
    fn leave(&mut self, id: u64) {
        if let Some(running) = self.members.get_mut(&id).and_then(|m| m.running.take()) {
            self.member(id).meter.add_cancel();
            self.undo(id, running, Err(Error::Cancelled));
        }
        let Some(member) = self.members.remove(&id) else { return };
        if let Some(slot) = member.slot {
            self.releases += 1;
            let s = &mut self.slots[slot];
            (s.seat, s.group, s.released) = (None, member.group, self.releases);
        }
        // `member.alive` drops here: its run sees this seat's native work ended.
    }

    /// Whether some member has rows to decode now.
    fn has_rows(&self) -> bool {
        self.members.values().any(|m| match &m.running {
            Some(Running::Decode(_)) => true,
            Some(Running::Generate(g)) => g.undelivered.is_empty() && g.finish.is_none(),
            None => m.queue.front().is_some_and(SeatOp::computes),
        })
    }

    /// Between steps: answer the ops that compute nothing, start the compute ops at the
    /// front of each queue, deliver pieces, and end calls that were cancelled or are done.
    fn advance(&mut self) {
        let ids: Vec<u64> = self.members.keys().copied().collect();
        for id in ids {
            loop {
                let running = self.members.get_mut(&id).and_then(|m| m.running.take());
                match running {
                    Some(running) => {
                        if let Some(still) = self.check_running(id, running) {
                            self.members.get_mut(&id).expect("member").running = Some(still);
                            break;
                        }
                    }
                    None => {
                        let Some(op) = self.members.get_mut(&id).and_then(|m| m.queue.pop_front())
                        else {
                            break;
                        };
                        self.start(id, op);
                    }
                }
            }
        }
    }

    /// A running call between steps: ended (`None`) if cancelled, or once its pieces
    /// are out; else it runs on.
    fn check_running(&mut self, id: u64, running: Running) -> Option<Running> {
        let stopped = match &running {
            Running::Decode(d) => d.caller.stop().is_set(),
            Running::Generate(g) => g.caller.stop().is_set(),
        };
        if stopped {
            self.members.get(&id).expect("member").meter.add_cancel();
            self.undo(id, running, Err(Error::Cancelled));
            return None;
        }
        let Running::Generate(mut g) = running else { return Some(running) };
        while let Some(piece) = g.undelivered.pop_front() {
            let carries_token = !piece.tokens.is_empty();
            match g.pieces.try_send(piece) {
                Ok(()) => {
                    if carries_token {
                        g.tokens.as_mut().expect("a token loop").delivered();
                    }
                }
                Err(pieces::error::TrySendError::Full(piece)) => {
                    g.undelivered.push_front(piece);
                    return Some(Running::Generate(g));
                }
                Err(pieces::error::TrySendError::Closed(_)) => {
                    // The reader is gone: what was not delivered is not kept.
                    self.undo(id, Running::Generate(g), Ok(FinishReason::Cancelled));
                    return None;
                }
            }
        }
        match g.finish.take() {
            Some(finish) => {
                self.finish_generation(id, g, finish);
                None
            }
            None => Some(Running::Generate(g)),
        }
    }

    fn member(&mut self, id: u64) -> &mut Member {
        self.members.get_mut(&id).expect("a member of this batch")
    }

    /// Where the seat's sequence ends (-1: empty, or not bound yet).
    fn end_of(&self, id: u64) -> i32 {
        match self.members.get(&id).and_then(|m| m.slot) {
            Some(slot) => self.ctx.seq_pos_max(slot as i32).unwrap_or(-1),
            None => -1,
        }
    }

    /// Start `op`, the front of `id`'s queue: answer it now, or make it the running call.
    fn start(&mut self, id: u64, op: SeatOp) {
        match op {
            SeatOp::Logits { row, reply } => {
                let logits = &self.member(id).logits;
                let row = row.unwrap_or(logits.len().saturating_sub(1) as u32);
                let result = match logits.get(row as usize) {
                    Some(Some(l)) => Ok(l.clone()),
                    _ if logits.is_empty() => Err(Error::InvalidArgument(
                        "there is no successful decode to read logits from".into(),
                    )),
                    _ => Err(Error::InvalidArgument(format!(
                        "row {row} has no logits: the last successful decode did not ask for them"
                    ))),
                };
                reply.send(result);
            }
            SeatOp::Sample { sampler, row, reply } => {
                let result = match self.member(id).logits.get(row as usize) {
                    Some(Some(l)) => sampler.lock().unwrap_or_else(|p| p.into_inner()).sample(l),
                    _ => Err(Error::InvalidArgument(format!(
                        "row {row} has no logits: the last successful decode did not ask for them"
                    ))),
                };
                reply.send(result);
            }
            SeatOp::PosMax { seq, reply } => {
                let result = check_seq(seq).map(|()| self.end_of(id));
                reply.send(result);
            }
            SeatOp::SeqRm { seq, p0, p1, reply } => {
                let result = self.seq_rm(id, seq, p0, p1);
                reply.send(result);
            }
            SeatOp::Clear { reply } => {
                self.member(id).logits.clear();
                if let Some(slot) = self.member(id).slot {
                    let _ = self.ctx.seq_rm(slot as i32, 0, -1);
                    self.slots[slot].tokens = Some(Vec::new());
                }
                reply.send(Ok(()));
            }
            SeatOp::Eval { pieces, seq, caller } => {
                let result = self.eval(id, &pieces, seq, &caller);
                caller.reply.send(result);
            }
            SeatOp::Decode { batch, caller } => match self.check_decode(id, &batch) {
                Err(e) => {
                    caller.reply.send(Err(e));
                }
                Ok(()) if caller.stop().is_set() => {
                    self.member(id).meter.add_cancel();
                    caller.reply.send(Err(Error::Cancelled));
                }
                Ok(()) => {
                    let end_before = self.end_of(id);
                    self.member(id).logits.clear();
                    let first_out = batch.logits.iter().position(|&l| l).unwrap_or(batch.len());
                    let (bound_here, done) =
                        self.bind(id, &batch.tokens, first_out.min(batch.len() - 1));
                    let logits = vec![None; batch.len()];
                    let work = DecodeWork {
                        caller,
                        batch,
                        done,
                        end_before,
                        bound_here,
                        kept: done,
                        logits,
                    };
                    self.member(id).running = Some(Running::Decode(work));
                }
            },
            SeatOp::Generate { sampler, request, pieces, caller } => {
                let model = self.ctx.model().clone();
                let checked = native::check_request(&model, &sampler, &request).and_then(|()| {
                    check_seq(request.seq)?;
                    let m = self.members.get(&id).expect("member");
                    if request.prompt.is_empty() && m.logits.last().is_none_or(Option::is_none) {
                        return Err(native::nothing_to_continue());
                    }
                    self.check_room(id, request.prompt.len())
                });
                if let Err(e) = checked {
                    caller.reply.send(Err(e));
                    return;
                }
                if caller.stop().is_set() {
                    self.member(id).meter.add_cancel();
                    caller.reply.send(Ok(Outcome {
                        finish: FinishReason::Cancelled,
                        usage: native::GenerationUsage::default(),
                    }));
                    return;
                }
                let end_before = self.end_of(id);
                let (bound_here, prompt_done) = if request.prompt.is_empty() {
                    (false, 0)
                } else {
                    self.bind(id, &request.prompt, request.prompt.len() - 1)
                };
                let mut work = GenerateWork {
                    caller,
                    sampler,
                    request,
                    pieces,
                    end_before,
                    bound_here,
                    kept: prompt_done,
                    started: Instant::now(),
                    prompt_done,
                    tokens: None,
                    next: None,
                    undelivered: VecDeque::new(),
                    finish: None,
                };
                if work.request.prompt.is_empty() {
                    let logits =
                        self.member(id).logits.last().cloned().flatten().unwrap_or_default();
                    self.start_tokens(id, &mut work, &logits);
                }
                self.member(id).running = Some(Running::Generate(Box::new(work)));
            }
        }
    }

    /// A decode's batch as a context of the seat's own would check it.
    fn check_decode(&self, id: u64, batch: &Batch) -> native::Result<()> {
        batch.check_shape(self.members[&id].n_batch)?;
        let invalid = |what: String| Err(Error::InvalidArgument(what));
        let outputs = batch.logits.iter().filter(|&&l| l).count();
        if outputs > MAX_SEAT_LOGIT_ROWS {
            return Err(Error::LimitExceeded {
                limit: "max-batched-logit-rows",
                requested: outputs as u64,
                max: MAX_SEAT_LOGIT_ROWS as u64,
            });
        }
        self.ctx.model().check_tokens(&batch.tokens)?;
        let rows = batch.seq_ids.iter().zip(&batch.positions).enumerate();
        for (expected, (row, (&seq, &pos))) in (self.end_of(id) + 1..).zip(rows) {
            check_seq(seq)?;
            if pos != expected {
                return invalid(format!(
                    "row {row}: sequence {seq} must continue at position {expected}, got {pos}"
                ));
            }
        }
        self.check_room(id, batch.len())
    }

    /// `ContextFull` unless `rows` more fit in the seat's n-ctx.
    fn check_room(&self, id: u64, rows: usize) -> native::Result<()> {
        let held = (self.end_of(id) + 1) as usize;
        if held.saturating_add(rows) > self.members[&id].n_ctx as usize {
            return Err(Error::ContextFull);
        }
        Ok(())
    }

    /// Bind an unbound seat to a free sequence for a call whose rows start with `tokens`
    /// (from position 0), reusing at most `most` of a leftover; returns whether it bound
    /// the seat now and how many rows are already in memory.
    fn bind(&mut self, id: u64, tokens: &[Token], most: usize) -> (bool, usize) {
        if self.members[&id].slot.is_some() {
            return (false, 0);
        }
        let group = self.members[&id].group.clone();
        let common = |slot: &Slot| match &slot.tokens {
            Some(held) if slot.group == group => {
                held.iter().zip(tokens).take_while(|(a, b)| a == b).count().min(most)
            }
            _ => 0,
        };
        let free = || self.slots.iter().enumerate().filter(|(_, s)| s.seat.is_none());
        // The longest shared start; of equal ones, the least recently left.
        let best = free()
            .map(|(i, s)| (common(s), std::cmp::Reverse(s.released), std::cmp::Reverse(i)))
            .max();
        // Nothing to reuse: the lowest sequence that holds nothing, so that another
        // group's (another tenant's) leftover is not thrown away while an empty one is
        // free; else the leftover left longest ago.
        let empty = |s: &Slot| s.group.is_empty() || s.tokens.as_ref().is_some_and(Vec::is_empty);
        let fresh = free()
            .min_by_key(|(i, s)| (!empty(s), if empty(s) { 0 } else { s.released }, *i))
            .map(|(i, _)| i)
            .expect("a seat was leased, so a sequence is free");
        let (slot, kept) = match best {
            Some((kept, _, std::cmp::Reverse(i))) if kept > 0 => (i, kept),
            _ => (fresh, 0),
        };
        // The rest of what the sequence held goes (all of it from another group).
        let _ = self.ctx.seq_rm(slot as i32, kept as i32, -1);
        let s = &mut self.slots[slot];
        s.seat = Some(id);
        s.group = group;
        s.tokens = Some(s.tokens.take().unwrap_or_default().into_iter().take(kept).collect());
        let member = self.member(id);
        member.slot = Some(slot);
        member.meter.add_reused(kept as u64);
        (true, kept)
    }

    /// Undo a call that bound the seat, keeping `kept` leftover rows: the sequence
    /// holds what it held when it was bound and is free again (its leftover stays for
    /// a later seat of the group), and the seat reads as empty, as before the call.
    fn unbind(&mut self, id: u64, kept: usize) {
        self.truncate(id, kept as i32 - 1);
        if let Some(slot) = self.member(id).slot.take() {
            self.slots[slot].seat = None;
        }
    }

    /// Cut the seat's sequence back to end at `end` (everything past it removed).
    fn truncate(&mut self, id: u64, end: i32) {
        let Some(slot) = self.members[&id].slot else { return };
        let _ = self.ctx.seq_rm(slot as i32, end + 1, -1);
        if let Some(tokens) = &mut self.slots[slot].tokens {
            tokens.truncate((end + 1) as usize);
        }
    }

    fn seq_rm(&mut self, id: u64, seq: i32, p0: i32, p1: i32) -> native::Result<()> {
        check_seq(seq)?;
        if p0 < 0 {
            return Err(Error::InvalidArgument(format!("p0 {p0} is negative")));
        }
        let Some(slot) = self.members[&id].slot else { return Ok(()) };
        self.ctx.seq_rm(slot as i32, p0, p1)?;
        let tokens = &mut self.slots[slot].tokens;
        if let Some(held) = tokens {
            let len = held.len();
            if p1 < 0 || p1 as usize >= len {
                held.truncate(p0 as usize);
            } else if (p0 as usize) < len && p1 > p0 {
                *tokens = None; // a hole: no longer a prefix of anything
            }
        }
        Ok(())
    }

    /// `pieces` evaluated into `seq` part by part: while other members have calls
    /// running, a token piece in parts of about a step target ([`Pacer`]), a media piece
    /// whole, each alone on the cores; between parts, those calls go on one step (new
    /// calls wait for the prompt's end). With nobody else running, the rest at once. So
    /// a long media prompt (a document with an image) no longer holds every stream of
    /// the batch for its whole evaluation. The end position.
    fn eval_in_parts(
        &mut self,
        id: u64,
        pieces: &[PromptPiece],
        seq: i32,
        caller: &Caller<i32>,
    ) -> native::Result<i32> {
        if pieces.is_empty() {
            // Nothing to evaluate: the sequence's end, as `Context::eval` answers it.
            return self.ctx.eval(pieces, seq, Some(caller.stop()));
        }
        let mut pacer = Pacer::new(self.policy.step_rows as usize);
        let mut end = Ok(0);
        for (i, piece) in pieces.iter().enumerate() {
            let tokens = match piece {
                PromptPiece::Tokens(tokens) => Some(tokens.as_slice()),
                PromptPiece::Embeddings { .. } => None,
            };
            let mut from = 0;
            loop {
                // Paced only while others have calls running: alone, the rest at once.
                let others = self.members.iter().any(|(&m, x)| m != id && x.running.is_some());
                let part = match tokens {
                    Some(tokens) => {
                        let rows = if others { pacer.rows() } else { tokens.len() - from };
                        PromptPiece::Tokens(tokens[from..(from + rows).min(tokens.len())].to_vec())
                    }
                    None => piece.clone(),
                };
                let rows = match &part {
                    PromptPiece::Tokens(t) => t.len(),
                    PromptPiece::Embeddings { .. } => 0,
                };
                let (result, elapsed) = {
                    let _turn = self.policy.cores.turn();
                    let started = Instant::now();
                    let result =
                        self.ctx.eval(std::slice::from_ref(&part), seq, Some(caller.stop()));
                    (result, started.elapsed())
                };
                self.members[&id].alive.add_busy(elapsed);
                end = Ok(result?);
                if rows > 0 {
                    pacer.observe(rows, elapsed);
                }
                from += rows;
                let piece_done = tokens.is_none_or(|t| from >= t.len());
                let prompt_done = piece_done && i + 1 == pieces.len();
                if !prompt_done {
                    self.step_others(id);
                }
                if piece_done {
                    break;
                }
            }
        }
        end
    }

    /// One step for the members other than `busy` whose calls are running (their
    /// pieces delivered, their cancels seen first), without starting new calls.
    fn step_others(&mut self, busy: u64) {
        let ids: Vec<u64> = self.members.keys().copied().filter(|&m| m != busy).collect();
        for id in ids {
            let running = self.members.get_mut(&id).and_then(|m| m.running.take());
            if let Some(running) = running {
                let still = self.check_running(id, running);
                if let Some(member) = self.members.get_mut(&id) {
                    member.running = still;
                }
            }
        }
        if self.members.values().any(|m| m.running.is_some()) && self.has_rows() {
            self.step();
        }
    }

    /// A media prompt: `Context::eval` into the seat's sequence, in parts.
    fn eval(
        &mut self,
        id: u64,
        pieces: &[PromptPiece],
        seq: i32,
        caller: &Caller<i32>,
    ) -> native::Result<i32> {
        check_seq(seq)?;
        let rows: usize = pieces
            .iter()
            .map(|p| match p {
                PromptPiece::Tokens(t) => t.len(),
                PromptPiece::Embeddings { embd, .. } => {
                    embd.len() / (self.ctx.model().n_embd_inp() as usize).max(1)
                }
            })
            .fold(0, usize::saturating_add);
        self.check_room(id, rows)?;
        let (bound_here, _) = self.bind(id, &[], 0);
        let slot = self.members[&id].slot.expect("bound");
        self.member(id).logits.clear();
        let start = self.ctx.seq_pos_max(slot as i32).map_or(0, |end| end + 1);
        let result = self.eval_in_parts(id, pieces, slot as i32, caller);
        if result.is_err() {
            // The parts evaluated before the one that failed (that one rolled itself
            // back): the prompt is all or nothing.
            let _ = self.ctx.seq_rm(slot as i32, start, -1);
        }
        match result {
            Ok(end) => {
                self.slots[slot].tokens = None; // embeddings: not a token prefix
                let last = self.ctx.last_logits().map(<[f32]>::to_vec).ok();
                let m = self.member(id);
                m.logits = vec![last];
                m.meter.add_decoded(rows as u64);
                Ok(end)
            }
            Err(e) => {
                if e == Error::Cancelled {
                    self.member(id).meter.add_cancel();
                }
                if bound_here {
                    self.unbind(id, 0);
                }
                Err(e)
            }
        }
    }

    /// The token loop starts from `logits` (the prompt's last row).
    fn start_tokens(&mut self, id: u64, work: &mut GenerateWork, logits: &[f32]) {
        let model = self.ctx.model().clone();
        let pos = self.end_of(id) + 1;
        let prompt = work.request.prompt.len() as u32;
        let mut tokens = TokenLoop::new(
            model,
            &work.request,
            pos,
            prompt,
            work.kept as u32,
            work.started.elapsed(),
        );
        match tokens.pick(&mut work.sampler, logits) {
            Ok(Pick::Decode(token)) => work.next = Some(token),
            Ok(Pick::Finish(reason)) => work.finish = Some(Ok(reason)),
            Err(e) => work.finish = Some(Err(e)),
        }
        work.tokens = Some(tokens);
    }

    /// Undo `running` (cancelled, failed, or its seat gone) and answer its caller with
    /// `result` (a generation that ends `Ok(reason)` keeps its delivered tokens).
    fn undo(&mut self, id: u64, running: Running, result: native::Result<FinishReason>) {
        match running {
            Running::Decode(d) => {
                if d.bound_here {
                    self.unbind(id, d.kept);
                } else {
                    self.truncate(id, d.end_before);
                }
                d.caller.reply.send(result.map(|_| ()));
            }
            Running::Generate(mut g) => {
                // A cancelled generation is an outcome, not an error (as `generate`).
                let result = match result {
                    Err(Error::Cancelled) => Ok(FinishReason::Cancelled),
                    other => other,
                };
                match g.tokens.as_ref() {
                    // In the token loop: memory keeps the prompt and what was delivered.
                    Some(tokens) => {
                        let end = tokens.pos() - 1;
                        self.truncate(id, end);
                        g.undelivered.clear();
                        self.finish_generation(id, g, result);
                    }
                    // In the prefill: as before the call.
                    None => {
                        if g.bound_here {
                            self.unbind(id, g.kept);
                        } else {
                            self.truncate(id, g.end_before);
                        }
                        let cancelled = Outcome {
                            finish: FinishReason::Cancelled,
                            usage: native::GenerationUsage::default(),
                        };
                        g.caller.reply.send(result.map(|_| cancelled));
                    }
                }
            }
        }
    }

    fn finish_generation(
        &mut self,
        id: u64,
        mut g: Box<GenerateWork>,
        finish: native::Result<FinishReason>,
    ) {
        let tokens = g.tokens.as_mut().expect("a token loop");
        if let Some(rest) = tokens.flush() {
            let _ = g.pieces.try_send(rest); // as `generate`: the last text, if there is room
        }
        let outcome = finish.map(|reason| tokens.outcome(reason));
        if let Ok(o) = &outcome {
            self.member(id).meter.add_generated(o.usage.generated_tokens.into());
        }
        g.caller.reply.send(outcome);
    }

    /// Each member's rows for the next step (the policy is `BatchPolicy`'s doc): a row
    /// for every generating seat, then prompt rows, short prompts before long ones and
    /// each kind shortest first (ties: the seat that joined first), within the budget.
    fn plan(&mut self) -> Plan {
        let step_rows = self.policy.step_rows as usize;
        // Quarantined groups' rows stay out of steps others have rows in; one that has
        // waited long enough gets a step of its own.
        let quarantined: HashSet<u64> = (self.members.iter())
            .filter(|(_, m)| self.rollbacks.get(&m.group).is_some_and(|&score| score > 1.0))
            .filter(|(_, m)| Self::wants_rows(m))
            .map(|(&id, _)| id)
            .collect();
        let others =
            self.members.iter().any(|(id, m)| !quarantined.contains(id) && Self::wants_rows(m));
        let alone = (quarantined.iter())
            .filter(|id| self.members[id].quarantine_wait >= QUARANTINE_WAIT)
            .max_by_key(|id| self.members[id].quarantine_wait)
            .copied();
        let left_out = |id: &u64| match alone {
            Some(only) => *id != only,
            None => others && quarantined.contains(id),
        };
        for &id in &quarantined {
            let m = self.member(id);
            m.quarantine_wait = if left_out(&id) { m.quarantine_wait + 1 } else { 0 };
        }
        let mut shares = Vec::new();
        for (&id, m) in &self.members {
            if left_out(&id) {
                continue;
            }
            if let (Some(Running::Generate(g)), Some(slot)) = (&m.running, m.slot) {
                if let (Some(token), true) =
                    (g.next, g.undelivered.is_empty() && g.finish.is_none())
                {
                    let pos = g.tokens.as_ref().expect("a token loop").pos();
                    shares.push(Share {
                        id,
                        slot,
                        rows: Batch::sequence(&[token], pos, slot as i32),
                        long: false,
                    });
                }
            }
        }
        let generating = shares.len();
        let long_rows = self.policy.long_prompt_rows as usize;
        // (long, not passed over too often, rows left, seat): the order prompts get rows.
        let mut prompts: Vec<(bool, bool, usize, u64)> = self
            .members
            .iter()
            .filter(|(id, m)| m.slot.is_some() && !left_out(id))
            .filter_map(|(&id, m)| {
                let left = match &m.running {
                    Some(Running::Decode(d)) => d.batch.len() - d.done,
                    Some(Running::Generate(g)) if g.tokens.is_none() => {
                        g.request.prompt.len() - g.prompt_done
                    }
                    _ => return None,
                };
                Some((left > long_rows, m.passed_over < PASSED_OVER_STEPS, left, id))
            })
            .collect();
        prompts.sort_unstable();
        let others = generating > 0 || prompts.iter().any(|&(long, ..)| !long);
        // Long prompts alone run in big steps that a newcomer ends; anything else, and
        // long prompts making good what a yield threw away, get one target's worth.
        let yields = !others && self.yield_debt <= 0.0;
        let budget = if yields { step_rows } else { self.pace.rows(self.policy.step_target) };
        let mut budget = budget.min(step_rows.saturating_sub(generating));
        let long_may = !others
            || self.long_credit >= self.policy.step_target.as_secs_f64()
            || self.policy.long_prompt_share >= 1.0;
        for &(long, _, left, id) in &prompts {
            if budget == 0 || (long && !long_may) {
                self.member(id).passed_over += 1;
                continue;
            }
            let n = left.min(budget);
            budget -= n;
            self.member(id).passed_over = 0;
            let (rows, slot) = self.prompt_rows(id, n);
            shares.push(Share { id, slot, rows, long });
        }
        // Ascending sequence ids: llama.cpp's per-sequence KV streams put only
        // consecutive ids in one ubatch.
        shares.sort_by_key(|s| s.slot);
        let any_long = prompts.iter().any(|&(long, ..)| long);
        self.long_waiting = any_long && others;
        if !any_long {
            // What a yield cost a prompt that has ended (or got short) is not the next one's.
            self.yield_debt = 0.0;
        }
        Plan { yields: yields && !shares.is_empty(), shares }
    }

    /// Whether a member would have rows in the next step: a generation's next token
    /// (delivered, not finished) or a prompt with rows left.
    fn wants_rows(m: &Member) -> bool {
        m.slot.is_some()
            && match &m.running {
                Some(Running::Decode(d)) => d.done < d.batch.len(),
                Some(Running::Generate(g)) => match &g.tokens {
                    None => g.prompt_done < g.request.prompt.len(),
                    Some(_) => g.next.is_some() && g.undelivered.is_empty() && g.finish.is_none(),
                },
                None => false,
            }
    }

    /// The next `n` rows of `id`'s prompt (a decode's batch or a generation's prompt),
    /// and its sequence.
    fn prompt_rows(&self, id: u64, n: usize) -> (Batch, usize) {
        let m = &self.members[&id];
        let slot = m.slot.expect("a member with a prompt running is bound");
        let rows = match &m.running {
            Some(Running::Decode(d)) => {
                let range = d.done..d.done + n;
                Batch {
                    tokens: d.batch.tokens[range.clone()].to_vec(),
                    positions: d.batch.positions[range.clone()].to_vec(),
                    seq_ids: vec![slot as i32; n],
                    logits: d.batch.logits[range].to_vec(),
                }
            }
            Some(Running::Generate(g)) => {
                let prompt = &g.request.prompt;
                let mut rows = Batch::sequence(
                    &prompt[g.prompt_done..g.prompt_done + n],
                    g.end_before + 1 + g.prompt_done as i32,
                    slot as i32,
                );
                rows.logits = (0..n).map(|r| g.prompt_done + r + 1 == prompt.len()).collect();
                rows
            }
            None => unreachable!("planned members are running"),
        };
        (rows, slot)
    }

    /// One `llama_decode` of every member's rows.
    fn step(&mut self) {
        let Plan { shares, yields } = self.plan();
        if shares.is_empty() {
            return;
        }
        // llama.cpp's log lines from this step name the groups (tenant/plugin) whose
        // rows it computes.
        let members: Vec<&str> =
            shares.iter().map(|s| self.members[&s.id].group.as_str()).collect();
        let _in_span = tracing::info_span!("batch_step", members = %members.join(",")).entered();
        let mut batch = Batch::default();
        for share in &shares {
            batch.tokens.extend(&share.rows.tokens);
            batch.positions.extend(&share.rows.positions);
            batch.seq_ids.extend(&share.rows.seq_ids);
            batch.logits.extend(&share.rows.logits);
        }
        #[cfg(test)]
        if let (true, Some(node)) = (yields, self.yield_at) {
            self.arrived.trip_after(node);
        }
        let (result, elapsed, cancelled) = {
            let mut stops: Vec<Stop<'_>> = shares
                .iter()
                .map(|s| match &self.members[&s.id].running {
                    Some(Running::Decode(d)) => d.caller.stop(),
                    Some(Running::Generate(g)) => g.caller.stop(),
                    None => unreachable!("planned members are running"),
                })
                .collect();
            let members = stops.len();
            if yields {
                stops.push(Stop::on(&self.arrived));
            }
            let _turn = self.policy.cores.turn();
            let started = Instant::now();
            let result = self.ctx.decode(&batch, Some(Stop::Any(&stops)));
            (
                result,
                started.elapsed(),
                stops[..members].iter().map(Stop::is_set).collect::<Vec<_>>(),
            )
        };
        self.charge_rollbacks(&shares, &cancelled, result == Err(Error::Cancelled));
        let cancelled = cancelled.iter().any(|&c| c);
        for share in &shares {
            let m = &self.members[&share.id];
            m.alive.add_busy(elapsed.mul_f64(share.rows.len() as f64 / batch.len() as f64));
        }
        let long_rows = shares.iter().filter(|s| s.long).map(|s| s.rows.len()).sum();
        let stopped = result == Err(Error::Cancelled);
        let yielded = stopped && !cancelled;
        let report = StepReport {
            seats: shares.len(),
            rows: batch.len(),
            long_rows,
            active_seats: self.members.len(),
            elapsed,
            rolled_back: result.is_err() && !yielded,
            yielded,
        };
        if let Some(observe) = &self.policy.observer {
            observe(&report);
        }
        // Long prompts' part of the step: its time split by rows.
        let long_time = elapsed.as_secs_f64() * long_rows as f64 / batch.len() as f64;
        self.account_long(long_time, elapsed);
        if yielded {
            self.yield_debt += elapsed.as_secs_f64();
        } else if result.is_ok() {
            self.yield_debt = (self.yield_debt - long_time).max(0.0);
        }
        match result {
            Ok(()) => {
                self.pace.observe(batch.len(), elapsed);
                let mut row = 0;
                for share in shares {
                    let n = share.rows.len();
                    self.decoded(share, row);
                    row += n;
                }
            }
            // Rolled back for everyone; the cancelled end between steps (`advance`), the
            // others' rows run again in the next step (after the newcomer's, if it yielded).
            Err(Error::Cancelled) => {}
            Err(e) => {
                for share in shares {
                    if let Some(running) = self.member(share.id).running.take() {
                        self.undo(share.id, running, Err(e.clone()));
                    }
                }
            }
        }
    }

    /// Fade every group's rollback score by a step, and charge the groups whose cancel
    /// (`cancelled[i]`: share i's stop was set) rolled back a step that another group
    /// had rows in. (A yield is the newcomer's, and `yield_debt` settles it.)
    fn charge_rollbacks(&mut self, shares: &[Share], cancelled: &[bool], rolled_back: bool) {
        self.rollbacks.retain(|_, score| {
            *score *= ROLLBACK_FADE;
            *score > 0.05
        });
        if !rolled_back {
            return;
        }
        let group = |i: usize| self.members[&shares[i].id].group.clone();
        let culprits: Vec<String> =
            (0..shares.len()).filter(|&i| cancelled[i]).map(group).collect();
        let shared = (0..shares.len()).any(|i| !culprits.contains(&group(i)));
        if shared {
            for culprit in culprits {
                *self.rollbacks.entry(culprit).or_default() += 1.0;
            }
        }
    }

    /// Long prompts beside other work earn `long_prompt_share` of the time the others'
    /// rows took, and spend `long_time`, what theirs took; with nobody waiting beside
    /// them, the account is settled at 0. So they run beside others only on time earned
    /// first, one step target at a time.
    fn account_long(&mut self, long_time: f64, elapsed: Duration) {
        if !self.long_waiting {
            self.long_credit = 0.0;
            return;
        }
        let share = self.policy.long_prompt_share.clamp(0.0, 0.99);
        let other_time = elapsed.as_secs_f64() - long_time;
        let target = self.policy.step_target.as_secs_f64();
        self.long_credit =
            (self.long_credit + share / (1.0 - share) * other_time - long_time).min(target);
    }

    /// A share of a successful step, whose rows started at `first_row` of the step.
    fn decoded(&mut self, share: Share, first_row: usize) {
        let Share { id, slot, rows, .. } = share;
        let n = rows.len();
        if let Some(held) = &mut self.slots[slot].tokens {
            held.extend(&rows.tokens);
        }
        let logits_of = |ctx: &Context, r: usize| {
            ctx.logits_ith((first_row + r) as u32).map(<[f32]>::to_vec).ok()
        };
        self.members[&id].meter.add_decoded(n as u64);
        let mut running = self.member(id).running.take().expect("planned members are running");
        match &mut running {
            Running::Decode(d) => {
                for r in 0..n {
                    if rows.logits[r] {
                        d.logits[d.done + r] = logits_of(&self.ctx, r);
                    }
                }
                d.done += n;
                if d.done == d.batch.len() {
                    let Running::Decode(d) = running else { unreachable!() };
                    self.member(id).logits = d.logits;
                    d.caller.reply.send(Ok(()));
                    return;
                }
            }
            Running::Generate(g) => match g.tokens.as_mut() {
                None => {
                    g.prompt_done += n;
                    if g.prompt_done == g.request.prompt.len() {
                        let logits = logits_of(&self.ctx, n - 1).unwrap_or_default();
                        self.start_tokens(id, g, &logits);
                    }
                }
                Some(tokens) => {
                    let token = g.next.take().expect("a token was planned");
                    match tokens.decoded(token) {
                        Ok((piece, matched)) => {
                            g.undelivered.push_back(piece);
                            match matched {
                                Some(reason) => g.finish = Some(Ok(reason)),
                                None => {
                                    let picked = self
                                        .ctx
                                        .logits_ith(first_row as u32)
                                        .and_then(|l| tokens.pick(&mut g.sampler, l));
                                    match picked {
                                        Ok(Pick::Decode(next)) => g.next = Some(next),
                                        Ok(Pick::Finish(reason)) => g.finish = Some(Ok(reason)),
                                        Err(e) => g.finish = Some(Err(e)),
                                    }
                                }
                            }
                        }
                        Err(e) => g.finish = Some(Err(e)),
                    }
                }
            },
        }
        self.member(id).running = Some(running);
    }
}

/// A seat has one sequence, 0.
fn check_seq(seq: i32) -> native::Result<()> {
    if seq == 0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("sequence id {seq} is outside [0, 1)")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::synthetic::TextModelSpec;

    fn model() -> Arc<Model> {
        static MODEL: std::sync::OnceLock<Arc<Model>> = std::sync::OnceLock::new();
        MODEL
            .get_or_init(|| {
                let dir =
                    std::env::temp_dir().join(format!("llamabox-batch-{}", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                let path = dir.join("tiny.gguf");
                TextModelSpec::tiny().write(&path).unwrap();
                Arc::new(Model::load(&path).unwrap())
            })
            .clone()
    }

    /// A pool on the test model, and the steps it ran.
    struct Fixture {
        pool: BatchPool,
        policy: BatchPolicy,
        steps: Arc<Mutex<Vec<StepReport>>>,
        tracker: Tracker,
    }

    impl Fixture {
        fn new(step_rows: u32) -> Self {
            let steps: Arc<Mutex<Vec<StepReport>>> = Arc::default();
            let seen = steps.clone();
            let policy = BatchPolicy {
                step_rows,
                observer: Some(Arc::new(move |r: &StepReport| seen.lock().unwrap().push(*r))),
                ..BatchPolicy::new(4, 256, 1)
            };
            Self { pool: BatchPool::default(), policy, steps, tracker: Tracker::new() }
        }

        async fn seat_in(&self, group: &str, meter: Arc<Meter>) -> Seat {
            let model = model();
            self.pool
                .lease(
                    &self.policy,
                    &model,
                    SeatSize { n_ctx: 256, n_batch: 256 },
                    group,
                    meter,
                    &self.tracker,
                )
                .await
                .expect("batched")
                .expect("a seat")
        }

        async fn seat(&self) -> Seat {
            self.seat_in("g", Arc::default()).await
        }

        fn steps(&self) -> Vec<StepReport> {
            self.steps.lock().unwrap().clone()
        }
    }

    /// Hold the batch's thread until the returned gate is dropped: calls sent meanwhile
    /// all join the next step.
    fn pause(seat: &Seat) -> mpsc::Sender<()> {
        let (gate, wait) = mpsc::channel();
        seat.batcher.ops.send(Op::Pause(wait)).unwrap();
        gate
    }

    fn prompt(seed: i32, n: usize) -> Vec<Token> {
        let n_vocab = model().n_vocab() as i32;
        (0..n as i32).map(|i| (seed * 7919 + i * 104_729).rem_euclid(n_vocab)).collect()
    }

    /// The last row's logits of `tokens` decoded on a context of its own.
    fn solo_logits(tokens: &[Token]) -> Vec<f32> {
        let params =
            ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 };
        let mut ctx = Context::new(model(), params).unwrap();
        ctx.decode(&Batch::sequence(tokens, 0, 0), None).unwrap();
        ctx.last_logits().unwrap().to_vec()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[tokio::test]
    async fn three_seats_share_one_step_and_each_gets_its_own_logits() {
        let f = Fixture::new(512);
        let seats = [f.seat().await, f.seat().await, f.seat().await];
        let prompts: Vec<Vec<Token>> = (0..3).map(|i| prompt(i, 40)).collect();
        let gate = pause(&seats[0]);
        let calls: Vec<_> = seats
            .iter()
            .zip(&prompts)
            .map(|(s, p)| s.decode(Batch::sequence(p, 0, 0), CancelFlag::new()))
            .collect();
        drop(gate);
        for call in calls {
            call.await.unwrap().unwrap();
        }
        let steps = f.steps();
        assert_eq!(
            (steps.len(), steps[0].seats, steps[0].rows),
            (1, 3, 120),
            "one step for all three: {steps:?}"
        );
        for (seat, p) in seats.iter().zip(&prompts) {
            let batched = seat.logits(None).await.unwrap().unwrap();
            let solo = solo_logits(p);
            // Batched numerics are not bitwise solo ones (the module doc says why).
            assert!(
                max_diff(&batched, &solo) < 1e-3,
                "batched vs solo logits differ by {}",
                max_diff(&batched, &solo)
            );
            assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), 39);
        }
    }

    /// Wait (bounded) until `n` turns are asked for on `cores`.
    async fn turns_asked(cores: &Cores, n: u64) {
        for _ in 0..10_000 {
            if cores.waiting() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("{} turns asked for, not {n}", cores.waiting());
    }

    #[tokio::test]
    async fn batches_of_one_policy_and_contexts_beside_them_compute_in_turns() {
        let f = Fixture::new(512);
        // Two batches of one policy (two seat sizes) and a context of its own sharing its cores.
        let small = BatchPolicy { seat_n_ctx: 128, ..f.policy.clone() };
        let (model, meter) = (model(), Arc::new(Meter::new()));
        let a = f.seat().await;
        let b = f
            .pool
            .lease(&small, &model, SeatSize { n_ctx: 128, n_batch: 128 }, "g", meter, &f.tracker)
            .await
            .expect("batched")
            .expect("a seat");
        let mut solo = Context::new(
            model,
            ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 },
        )
        .unwrap();
        solo.share_cores(Some(f.policy.cores.clone()));
        let held = f.policy.cores.turn();
        let decode_a = a.decode(Batch::sequence(&prompt(1, 8), 0, 0), CancelFlag::new());
        let decode_b = b.decode(Batch::sequence(&prompt(2, 8), 0, 0), CancelFlag::new());
        let tokens = prompt(3, 8);
        let solo = std::thread::spawn(move || solo.decode(&Batch::sequence(&tokens, 0, 0), None));
        // Each asks for a turn and waits: none computes while the cores are held.
        turns_asked(&f.policy.cores, 4).await;
        assert!(
            f.steps().is_empty() && !solo.is_finished(),
            "computed out of turn: {:?}",
            f.steps()
        );
        drop(held);
        decode_a.await.unwrap().unwrap();
        decode_b.await.unwrap().unwrap();
        solo.join().unwrap().unwrap();
        assert_eq!((f.steps().len(), f.policy.cores.waiting()), (2, 0));
    }

    #[tokio::test]
    async fn a_cancel_at_node_n_of_a_three_member_step_stops_only_that_member() {
        let f = Fixture::new(512);
        let seats = [f.seat().await, f.seat().await, f.seat().await];
        let prompts: Vec<Vec<Token>> = (0..3).map(|i| prompt(i + 10, 40)).collect();
        let tokens = [CancelFlag::new(), CancelFlag::new(), CancelFlag::new()];
        const NODE: u64 = 5;
        tokens[1].trip_after(NODE);
        let gate = pause(&seats[0]);
        let calls: Vec<_> = (0..3)
            .map(|i| seats[i].decode(Batch::sequence(&prompts[i], 0, 0), tokens[i].clone()))
            .collect();
        drop(gate);
        let results = futures_join(calls).await;
        assert_eq!(results[1], Err(Error::Cancelled));
        assert_eq!(
            (results[0].clone(), results[2].clone()),
            (Ok(()), Ok(())),
            "the others' calls do not fail"
        );
        assert_eq!(tokens[1].polls(), NODE, "stopped at the node the wire tripped");
        let steps = f.steps();
        assert_eq!(steps.len(), 2, "{steps:?}");
        assert!(
            steps[0].rolled_back && steps[0].seats == 3,
            "the step with all three was rolled back"
        );
        assert!(
            !steps[1].rolled_back && steps[1].seats == 2,
            "and re-run at once without the cancelled one"
        );
        assert_eq!(
            seats[1].seq_pos_max(0).await.unwrap().unwrap(),
            -1,
            "the cancelled seat's memory is as before"
        );
        assert!(seats[1].logits(None).await.unwrap().is_err(), "and it has no logits");
        // Sequences 0 and 2 are not consecutive, so the re-run computed each alone:
        // exactly what a context of its own computes.
        for i in [0, 2] {
            assert_eq!(seats[i].seq_pos_max(0).await.unwrap().unwrap(), 39);
            assert_eq!(
                seats[i].logits(None).await.unwrap().unwrap(),
                solo_logits(&prompts[i]),
                "survivor {i}'s logits are an uncancelled run's"
            );
        }
        // The cancelled seat decodes again as if nothing had happened.
        seats[1]
            .decode(Batch::sequence(&prompts[1], 0, 0), CancelFlag::new())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(seats[1].logits(None).await.unwrap().unwrap(), solo_logits(&prompts[1]));
    }

    /// A group whose cancels roll back steps it shares is quarantined after the second:
    /// its rows then run only in steps of their own, so its next hang-up costs nobody
    /// else anything. One hang-up costs nothing (the first round's next call shares).
    #[tokio::test]
    async fn a_group_that_keeps_rolling_back_shared_steps_runs_in_steps_of_its_own() {
        let f = Fixture::new(512);
        let victim = f.seat_in("victim", Arc::default()).await;
        let attacker = f.seat_in("attacker", Arc::default()).await;
        let mut pos = 0;
        let round = |wire: CancelFlag, seed: i32, pos: i32| {
            let gate = pause(&victim);
            let v = victim.decode(Batch::sequence(&prompt(seed, 20), pos, 0), CancelFlag::new());
            let a = attacker.decode(Batch::sequence(&prompt(seed + 50, 20), 0, 0), wire);
            drop(gate);
            (v, a)
        };
        for seed in 0..2 {
            let wire = CancelFlag::new();
            wire.trip_after(3);
            let before = f.steps().len();
            let (v, a) = round(wire, seed, pos);
            assert_eq!(v.await.unwrap(), Ok(()));
            assert_eq!(a.await.unwrap(), Err(Error::Cancelled));
            let steps = f.steps();
            assert!(
                steps[before].seats == 2 && steps[before].rolled_back,
                "round {seed}: the hang-up shared a step and rolled it back: {steps:?}"
            );
            pos += 20;
        }
        // Quarantined: its next call never shares a step with the victim's, and still
        // runs (once the victim has nothing, here at once).
        let before = f.steps().len();
        let (v, a) = round(CancelFlag::new(), 9, pos);
        assert_eq!((v.await.unwrap(), a.await.unwrap()), (Ok(()), Ok(())));
        let steps = &f.steps()[before..];
        assert!(steps.len() >= 2 && steps.iter().all(|s| s.seats == 1), "{steps:?}");
    }

    async fn futures_join<T>(calls: Vec<Call<native::Result<T>>>) -> Vec<native::Result<T>> {
        let mut out = Vec::new();
        for call in calls {
            out.push(call.await.expect("answered"));
        }
        out
    }

    #[tokio::test]
    async fn a_cancel_before_the_step_computes_nothing_for_that_seat() {
        let f = Fixture::new(512);
        let seat = f.seat().await;
        let token = CancelFlag::new();
        token.cancel();
        assert_eq!(
            seat.decode(Batch::sequence(&prompt(1, 8), 0, 0), token).await.unwrap(),
            Err(Error::Cancelled)
        );
        assert!(f.steps().is_empty());
        assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), -1);
    }

    #[tokio::test]
    async fn a_seat_checks_its_calls_as_a_context_of_its_own_would() {
        let f = Fixture::new(512);
        let seat = f.seat().await;
        let mut bad = Batch::sequence(&prompt(1, 4), 0, 0);
        bad.seq_ids[1] = 1;
        assert!(
            matches!(seat.decode(bad, CancelFlag::new()).await.unwrap(), Err(Error::InvalidArgument(m)) if m.contains("outside [0, 1)"))
        );
        let gap = Batch::sequence(&prompt(1, 4), 3, 0);
        assert!(
            matches!(seat.decode(gap, CancelFlag::new()).await.unwrap(), Err(Error::InvalidArgument(m)) if m.contains("must continue at position 0"))
        );
        let mut many = Batch::sequence(&prompt(1, 100), 0, 0);
        many.logits = vec![true; 100];
        assert!(matches!(
            seat.decode(many, CancelFlag::new()).await.unwrap(),
            Err(Error::LimitExceeded { limit: "max-batched-logit-rows", requested: 100, max: 64 })
        ));
        let full = Batch::sequence(&prompt(1, 200), 0, 0);
        seat.decode(full.clone(), CancelFlag::new()).await.unwrap().unwrap();
        assert_eq!(
            seat.decode(Batch::sequence(&prompt(2, 100), 200, 0), CancelFlag::new()).await.unwrap(),
            Err(Error::ContextFull)
        );
        assert!(f.steps().iter().all(|s| !s.rolled_back));
    }

    fn greedy() -> native::SamplerParams {
        native::SamplerParams::default()
    }

    fn request(prompt: Vec<Token>, max_tokens: u32) -> GenerateRequest {
        GenerateRequest { prompt, seq: 0, max_tokens, stop: Vec::new(), logprobs: None }
    }

    /// Tokens a generation on a context of its own picks.
    fn solo_generation(prompt: &[Token], max_tokens: u32) -> Vec<Token> {
        let params =
            ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 };
        let mut ctx = Context::new(model(), params).unwrap();
        let mut sampler =
            Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        let mut tokens = Vec::new();
        let token = CancelFlag::new();
        let mut sink = |p: Piece| {
            tokens.extend(p.tokens);
            true
        };
        native::generate(
            &mut ctx,
            &mut sampler,
            &request(prompt.to_vec(), max_tokens),
            Stop::on(&token),
            &mut sink,
        )
        .unwrap();
        tokens
    }

    async fn read_all(mut rx: pieces::Receiver<Piece>) -> Vec<Token> {
        let mut tokens = Vec::new();
        while let Some(p) = rx.recv().await {
            tokens.extend(p.tokens);
        }
        tokens
    }

    #[tokio::test]
    async fn generations_on_seats_batch_their_tokens_and_pick_what_a_context_of_its_own_picks() {
        let f = Fixture::new(512);
        let seats = [f.seat().await, f.seat().await];
        let prompts = [prompt(3, 12), prompt(4, 20)];
        let gate = pause(&seats[0]);
        let mut runs = Vec::new();
        for (seat, p) in seats.iter().zip(&prompts) {
            let (tx, rx) = pieces::channel(64);
            let sampler =
                Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
            runs.push((seat.generate(sampler, request(p.clone(), 16), CancelFlag::new(), tx), rx));
        }
        drop(gate);
        for ((call, rx), p) in runs.into_iter().zip(&prompts) {
            let tokens = read_all(rx).await;
            let outcome = call.await.unwrap().unwrap();
            assert_eq!(outcome.finish, FinishReason::MaxTokens);
            assert_eq!(
                (outcome.usage.prompt_tokens, outcome.usage.generated_tokens),
                (p.len() as u32, 16)
            );
            assert_eq!(
                tokens,
                solo_generation(p, 16),
                "greedy tokens equal a context of its own's"
            );
        }
        let steps = f.steps();
        assert!(
            steps.iter().filter(|s| s.seats == 2).count() >= 15,
            "the two generations shared their steps: {steps:?}"
        );
        assert_eq!(
            seats[1].seq_pos_max(0).await.unwrap().unwrap(),
            20 + 16 - 1,
            "the prompt and every delivered token"
        );
    }

    #[tokio::test]
    async fn a_reader_that_stops_reading_holds_back_only_its_own_generation() {
        let f = Fixture::new(512);
        let (slow, fast) = (f.seat().await, f.seat().await);
        let sampler = || Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        let (slow_tx, slow_rx) = pieces::channel(1);
        let slow_call =
            slow.generate(sampler(), request(prompt(5, 8), 32), CancelFlag::new(), slow_tx);
        let (fast_tx, fast_rx) = pieces::channel(64);
        let fast_call =
            fast.generate(sampler(), request(prompt(6, 8), 24), CancelFlag::new(), fast_tx);
        assert_eq!(read_all(fast_rx).await.len(), 24);
        assert_eq!(
            fast_call.await.unwrap().unwrap().finish,
            FinishReason::MaxTokens,
            "finished while the other's reader sleeps"
        );
        // The slow reader took nothing: one piece sits in its buffer and one token is
        // decoded but undelivered. Hanging up ends it, and only delivered tokens stay.
        drop(slow_rx);
        let outcome = slow_call.await.unwrap().unwrap();
        assert_eq!((outcome.finish, outcome.usage.generated_tokens), (FinishReason::Cancelled, 1));
        assert_eq!(
            slow.seq_pos_max(0).await.unwrap().unwrap(),
            8,
            "the prompt and the one delivered token"
        );
    }

    /// A media prompt on a seat is evaluated in parts while another seat generates, and
    /// that generation steps between the parts: steps happen while the prompt's
    /// evaluation is still unfinished (its seat's meter counts its rows only at the end).
    /// Its result is the prompt's: the same end, logits near those of one evaluation.
    #[tokio::test]
    async fn a_media_prompt_on_a_seat_lets_the_others_step_between_its_parts() {
        let prompt_meter = Arc::new(Meter::new());
        let (steps_seen, evaluating) = (Arc::new(Mutex::new(0usize)), prompt_meter.clone());
        let (seen, while_evaluating) = (steps_seen.clone(), Arc::new(Mutex::new(Vec::new())));
        let during = while_evaluating.clone();
        let mut f = Fixture::new(16);
        f.policy.observer = Some(Arc::new(move |_: &StepReport| {
            *seen.lock().unwrap() += 1;
            during.lock().unwrap().push(evaluating.decoded() == 0);
        }));
        let generating = f.seat().await;
        let prompting = f.seat_in("g", prompt_meter.clone()).await;
        // Both calls reach the batch's thread together: the generation starts first (its
        // seat came first), then the prompt is evaluated.
        let gate = pause(&generating);
        let before = *steps_seen.lock().unwrap();
        let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        let (tx, rx) = pieces::channel(64);
        let generation =
            generating.generate(sampler, request(prompt(9, 4), 24), CancelFlag::new(), tx);
        let long = prompt(10, 120);
        let eval = prompting.eval(vec![PromptPiece::Tokens(long.clone())], 0, CancelFlag::new());
        drop(gate);
        assert_eq!(eval.await.unwrap(), Ok(120));
        assert_eq!(read_all(rx).await.len(), 24);
        generation.await.unwrap().unwrap();
        let interleaved = while_evaluating.lock().unwrap()[before..]
            .iter()
            .filter(|&&unfinished| unfinished)
            .count();
        assert!(
            interleaved >= 2,
            "{interleaved} steps of the generation ran between the prompt's parts"
        );
        assert_eq!(prompt_meter.decoded(), 120);
        let parts = prompting.logits(None).await.unwrap().unwrap();
        let whole = solo_logits(&long);
        let scale = whole.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(
            max_diff(&parts, &whole) < 1e-2 * scale,
            "{} (logits up to {scale})",
            max_diff(&parts, &whole)
        );
    }

    #[tokio::test]
    async fn a_prompt_chunked_over_steps_never_keeps_a_generation_waiting_more_than_one_step() {
        let f = Fixture::new(32);
        let (generating, prefilling) = (f.seat().await, f.seat().await);
        let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        let (tx, rx) = pieces::channel(64);
        let generation =
            generating.generate(sampler, request(prompt(7, 4), 12), CancelFlag::new(), tx);
        let long = prompt(8, 200);
        let gate = pause(&generating);
        let decode = prefilling.decode(Batch::sequence(&long, 0, 0), CancelFlag::new());
        drop(gate);
        decode.await.unwrap().unwrap();
        assert_eq!(read_all(rx).await.len(), 12);
        generation.await.unwrap().unwrap();
        let steps = f.steps();
        assert!(steps.iter().all(|s| s.rows <= 32), "every step within its row budget: {steps:?}");
        let prompt_steps = steps.iter().filter(|s| s.rows > 1).count();
        assert!(prompt_steps >= 200 / 32, "the prompt went in chunks: {steps:?}");
        let chunked = prefilling.logits(None).await.unwrap().unwrap();
        // A prompt in pieces is not bitwise a prompt whole on llama.cpp's CPU kernels
        // either: compare with the same prompt decoded in 32-row pieces on a context of
        // its own, and with the whole one to a tolerance.
        let params =
            ContextParams { n_ctx: 256, n_batch: 256, n_ubatch: 256, n_seq_max: 1, n_threads: 1 };
        let mut own = Context::new(model(), params).unwrap();
        for (i, piece) in long.chunks(32).enumerate() {
            own.decode(&Batch::sequence(piece, (i * 32) as i32, 0), None).unwrap();
        }
        let (pieces_own, whole) = (own.last_logits().unwrap().to_vec(), solo_logits(&long));
        let scale = whole.iter().fold(0f32, |m, x| m.max(x.abs()));
        let (d_batched, d_own) = (max_diff(&chunked, &whole), max_diff(&pieces_own, &whole));
        assert!(d_batched < 1e-2 * scale, "batched chunks vs whole: {d_batched} (logits up to {scale}); own chunks vs whole: {d_own}");
        let argmax =
            |l: &[f32]| l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
        assert_eq!(argmax(&chunked), argmax(&whole));
    }

    #[tokio::test]
    async fn a_changed_policy_makes_a_new_batch_and_the_old_one_serves_its_seats_out() {
        let mut f = Fixture::new(512);
        let old = f.seat().await;
        f.policy = BatchPolicy { step_rows: 64, ..f.policy.clone() };
        let new = f.seat().await;
        assert_eq!(
            (old.n_ubatch(), new.n_ubatch()),
            (512, 64),
            "the second seat is in a batch made under the new policy"
        );
        assert!(!Arc::ptr_eq(&old.batcher, &new.batcher));
        let tokens = prompt(11, 8);
        old.decode(Batch::sequence(&tokens, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
        new.decode(Batch::sequence(&tokens, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
        assert_eq!(f.pool.seats_taken(), 1, "the pool counts only the new batch's seat");
    }

    #[tokio::test]
    async fn of_two_leftovers_that_serve_a_prompt_alike_the_older_one_is_taken() {
        let f = Fixture::new(512);
        let system = prompt(40, 12);
        let with = |rest: &[Token]| [system.as_slice(), rest].concat();
        let (a, b) = (with(&prompt(41, 6)), with(&prompt(42, 6)));
        let (first, second) = (f.seat().await, f.seat().await);
        first.decode(Batch::sequence(&a, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
        second.decode(Batch::sequence(&b, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
        // `second`'s leftover (sequence 1) is the older one.
        drop(second);
        drop(first);
        let shares_system = f.seat().await;
        shares_system
            .decode(Batch::sequence(&with(&prompt(43, 6)), 0, 0), CancelFlag::new())
            .await
            .unwrap()
            .unwrap();
        // `first`'s leftover is still whole for the conversation it came from.
        let meter = Arc::new(Meter::new());
        let continues = f.seat_in("g", meter.clone()).await;
        let turn = [a.as_slice(), &prompt(44, 4)].concat();
        continues.decode(Batch::sequence(&turn, 0, 0), CancelFlag::new()).await.unwrap().unwrap();
        assert_eq!(
            meter.reused(),
            a.len() as u64,
            "the newest leftover was kept for its own continuation"
        );
    }

    #[tokio::test]
    async fn shorter_prompts_go_first_whoever_joined_first() {
        let f = Fixture::new(32);
        let (long, short) = (f.seat().await, f.seat().await);
        let gate = pause(&long);
        let long_call = long.decode(Batch::sequence(&prompt(3, 100), 0, 0), CancelFlag::new());
        let mut short_call = short.decode(Batch::sequence(&prompt(4, 10), 0, 0), CancelFlag::new());
        drop(gate);
        // The 10-row prompt fits the first 32-row step whole; the 100-row one needs four.
        tokio::select! {
            biased;
            done = &mut short_call => done.unwrap().unwrap(),
            _ = long_call => panic!("the longer prompt, which joined first, finished first"),
        }
        let steps = f.steps();
        assert_eq!(
            (steps[0].seats, steps[0].rows),
            (2, 32),
            "the short prompt whole, the rest of the step for the long one: {steps:?}"
        );
    }

    #[tokio::test]
    async fn a_prompt_passed_over_by_shorter_ones_for_eight_steps_goes_first() {
        let f = Fixture::new(8);
        let flood = [f.seat().await, f.seat().await, f.seat().await];
        let waiting = f.seat().await;
        let gate = pause(&waiting);
        // Each flooding seat queues 20 decodes of 8 rows: every one fills a step alone.
        let mut floods = Vec::new();
        for (i, seat) in flood.iter().enumerate() {
            for k in 0..20 {
                floods.push(seat.decode(
                    Batch::sequence(&prompt(20 + i as i32, 8), k * 8, 0),
                    CancelFlag::new(),
                ));
            }
        }
        let mut last = floods.pop().expect("queued");
        let mut waited = waiting.decode(Batch::sequence(&prompt(30, 30), 0, 0), CancelFlag::new());
        drop(gate);
        // 60 steps of floods; the 30-row prompt gets a step after every 8 it is passed
        // over, so it is done in about 36.
        tokio::select! {
            biased;
            done = &mut waited => done.unwrap().unwrap(),
            _ = &mut last => panic!("the 30-row prompt waited for every shorter one: {:?}", f.steps().len()),
        }
        last.await.unwrap().unwrap();
        for call in floods {
            call.await.unwrap().unwrap();
        }
    }

    /// A policy whose prompts of more than 32 rows are long.
    fn long_prompt_fixture(share: f64, target: Duration) -> Fixture {
        let mut f = Fixture::new(256);
        f.policy.long_prompt_rows = 32;
        f.policy.long_prompt_share = share;
        f.policy.step_target = target;
        f
    }

    #[tokio::test]
    async fn a_step_of_long_prompts_alone_yields_to_an_arrival_and_runs_again_after_it() {
        let f = long_prompt_fixture(0.25, Duration::from_millis(50));
        let seat = f.seat().await;
        let long = prompt(5, 200);
        let gate = pause(&seat);
        // As if another seat's call arrived after node 3 of the first step.
        seat.batcher.ops.send(Op::YieldAt(3)).unwrap();
        let call = seat.decode(Batch::sequence(&long, 0, 0), CancelFlag::new());
        drop(gate);
        call.await.unwrap().unwrap();
        let steps = f.steps();
        assert!(
            steps[0].yielded && !steps[0].rolled_back && steps[0].rows == 200,
            "the first step yielded: {steps:?}"
        );
        assert!(
            steps[1..].iter().all(|s| !s.yielded && !s.rolled_back),
            "the rows ran again, once: {steps:?}"
        );
        assert_eq!(
            steps[1..].iter().map(|s| s.rows).sum::<usize>(),
            200,
            "every row once after the yield: {steps:?}"
        );
        // Memory as if it never yielded: the whole prompt, and logits of what it holds.
        assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), 199);
        let (batched, whole) = (seat.logits(None).await.unwrap().unwrap(), solo_logits(&long));
        let scale = whole.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(
            max_diff(&batched, &whole) < 1e-2 * scale,
            "after a yield: {} (logits up to {scale})",
            max_diff(&batched, &whole)
        );
    }

    #[tokio::test]
    async fn a_flood_of_arrivals_costs_a_long_prompt_at_most_half_its_time() {
        // A 100 µs target: chunks of the 16-row minimum on any machine, so rows remain to
        // yield again once the first yield is made good.
        let f = long_prompt_fixture(0.25, Duration::from_micros(100));
        let seat = f.seat().await;
        // One timed step first: the batch then sizes chunks by speed.
        seat.decode(Batch::sequence(&prompt(5, 32), 0, 0), CancelFlag::new())
            .await
            .unwrap()
            .unwrap();
        seat.clear().await.unwrap().unwrap();
        f.steps.lock().unwrap().clear();
        let long = prompt(6, 240);
        let gate = pause(&seat);
        // Every step that may yield does, late in the step.
        seat.batcher.ops.send(Op::YieldAt(20)).unwrap();
        let call = seat.decode(Batch::sequence(&long, 0, 0), CancelFlag::new());
        drop(gate);
        // Without making good what it lost, it would yield at every step, for ever.
        let done = tokio::time::timeout(Duration::from_secs(30), call)
            .await
            .expect("the long prompt got through the flood");
        done.unwrap().unwrap();
        let steps = f.steps();
        let lost: Duration = steps.iter().filter(|s| s.yielded).map(|s| s.elapsed).sum();
        let kept: Duration = steps.iter().filter(|s| !s.yielded).map(|s| s.elapsed).sum();
        let last_yield =
            steps.iter().filter(|s| s.yielded).map(|s| s.elapsed).max().unwrap_or_default();
        assert!(
            steps.iter().filter(|s| s.yielded).count() >= 2,
            "the flood made it yield again once the first was made good: {steps:?}"
        );
        assert!(
            lost <= kept + last_yield,
            "lost {lost:?} to yields against {kept:?} kept: {steps:?}"
        );
        assert_eq!(
            steps.iter().filter(|s| !s.yielded).map(|s| s.rows).sum::<usize>(),
            240,
            "every row computed for good once"
        );
        assert_eq!(seat.seq_pos_max(0).await.unwrap().unwrap(), 239);
    }

    #[tokio::test]
    async fn a_step_with_a_generation_in_it_never_yields() {
        let f = long_prompt_fixture(1.0, Duration::from_millis(50));
        let (generating, prefilling) = (f.seat().await, f.seat().await);
        let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        let (tx, rx) = pieces::channel(64);
        let gate = pause(&generating);
        generating.batcher.ops.send(Op::YieldAt(1)).unwrap();
        let generation =
            generating.generate(sampler, request(prompt(7, 4), 8), CancelFlag::new(), tx);
        let decode = prefilling.decode(Batch::sequence(&prompt(8, 100), 0, 0), CancelFlag::new());
        drop(gate);
        decode.await.unwrap().unwrap();
        assert_eq!(read_all(rx).await.len(), 8);
        generation.await.unwrap().unwrap();
        assert!(f.steps().iter().all(|s| !s.yielded), "{:?}", f.steps());
    }

    #[tokio::test]
    async fn a_long_prompt_beside_a_generation_runs_only_on_time_it_earned() {
        let share = 0.25;
        // A tiny-model generation step is 25-100 µs: 120 of them earn several such targets.
        let target = Duration::from_micros(200);
        let f = long_prompt_fixture(share, target);
        let (generating, prefilling) = (f.seat().await, f.seat().await);
        let sampler = Sampler::new(model(), &greedy(), &native::SamplerCaps::default()).unwrap();
        let (tx, rx) = pieces::channel(256);
        let gate = pause(&generating);
        let generation =
            generating.generate(sampler, request(prompt(9, 4), 120), CancelFlag::new(), tx);
        let decode = prefilling.decode(Batch::sequence(&prompt(10, 250), 0, 0), CancelFlag::new());
        drop(gate);
        decode.await.unwrap().unwrap();
        read_all(rx).await;
        generation.await.unwrap().unwrap();
        let steps = f.steps();
        // Until the long prompt first ran beside the generation, the generation's steps
        // had to earn it a target's worth at a quarter of the time: three targets.
        let first = steps
            .iter()
            .position(|s| s.long_rows > 0 && s.long_rows < s.rows)
            .unwrap_or_else(|| panic!("the long prompt ran beside the generation: {steps:?}"));
        let earned: Duration =
            steps[..first].iter().filter(|s| s.long_rows == 0).map(|s| s.elapsed).sum();
        assert!(
            earned.as_secs_f64() >= target.as_secs_f64() * (1.0 - share) / share * 0.999,
            "it ran after {earned:?} of others' steps: {steps:?}"
        );
        // Over the steps they shared, the long prompt took about its share: at most what
        // the others' time earned, plus the one target it may run ahead.
        let end = steps.iter().rposition(|s| s.long_rows > 0).expect("the long prompt ran");
        let shared: Vec<&StepReport> =
            steps[..=end].iter().filter(|s| s.long_rows < s.rows).collect();
        let long: f64 = shared
            .iter()
            .map(|s| s.elapsed.as_secs_f64() * s.long_rows as f64 / s.rows as f64)
            .sum();
        let other: f64 = shared.iter().map(|s| s.elapsed.as_secs_f64()).sum::<f64>() - long;
        let last = shared.iter().map(|s| s.elapsed.as_secs_f64()).fold(0.0, f64::max);
        assert!(
            long <= share / (1.0 - share) * other + target.as_secs_f64() + last,
            "long {long} s beside others' {other} s: {steps:?}"
        );
    }

    /// Not a gate (timings): what a member's cancel costs the others, on the real model.
    /// `LLAMABOX_REAL_MODEL=PATH cargo test --release --lib survivors -- --ignored --nocapture`
    /// (the Makefile's environment). Three seats generate while a fourth's 500-token
    /// prompt is cancelled at a random node of a step they share; the others lose that
    /// step's work (its time) and get their token from the re-run.
    #[tokio::test]
    #[ignore]
    async fn survivors_cost_of_a_cancelled_step() {
        let path = std::env::var("LLAMABOX_REAL_MODEL").expect("LLAMABOX_REAL_MODEL");
        let model = Arc::new(Model::load(std::path::Path::new(&path)).unwrap());
        let threads: u32 =
            std::env::var("LLAMABOX_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
        let steps: Arc<Mutex<Vec<StepReport>>> = Arc::default();
        let seen = steps.clone();
        let policy = BatchPolicy {
            observer: Some(Arc::new(move |r: &StepReport| seen.lock().unwrap().push(*r))),
            ..BatchPolicy::new(4, 2048, threads)
        };
        let (pool, tracker) = (BatchPool::default(), Tracker::new());
        let seat = || {
            pool.lease(
                &policy,
                &model,
                SeatSize { n_ctx: 2048, n_batch: 512 },
                "g",
                Arc::default(),
                &tracker,
            )
        };
        let n_vocab = model.n_vocab() as i32;
        let (mut lost, mut gen_steps, mut shared_steps) = (Vec::new(), Vec::new(), Vec::new());
        let mut rng = crate::native::synthetic::SplitMix64(11);
        for trial in 0..24 {
            let generators = [
                seat().await.unwrap().unwrap(),
                seat().await.unwrap().unwrap(),
                seat().await.unwrap().unwrap(),
            ];
            let victim = seat().await.unwrap().unwrap();
            let mut runs = Vec::new();
            for (i, g) in generators.iter().enumerate() {
                let (tx, rx) = pieces::channel(256);
                let sampler = Sampler::new(
                    model.clone(),
                    &native::SamplerParams::default(),
                    &native::SamplerCaps::default(),
                )
                .unwrap();
                let prompt: Vec<Token> = (0..16)
                    .map(|j| (trial * 131 + i as i32 * 17 + j * 7).rem_euclid(n_vocab))
                    .collect();
                runs.push((g.generate(sampler, request(prompt, 64), CancelFlag::new(), tx), rx));
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
            steps.lock().unwrap().clear();
            let token = CancelFlag::new();
            token.trip_after(1 + rng.next_u64() % 600);
            let prompt: Vec<Token> =
                (0..500).map(|j| (trial * 977 + j * 31).rem_euclid(n_vocab)).collect();
            let result = victim.decode(Batch::sequence(&prompt, 0, 0), token).await.unwrap();
            assert_eq!(result, Err(Error::Cancelled));
            for (call, rx) in runs {
                read_all(rx).await;
                call.await.unwrap().unwrap();
            }
            let seen = steps.lock().unwrap().clone();
            lost.extend(
                seen.iter().filter(|s| s.rolled_back).map(|s| s.elapsed.as_secs_f64() * 1e3),
            );
            gen_steps.extend(
                seen.iter()
                    .filter(|s| !s.rolled_back && s.rows == 3)
                    .map(|s| s.elapsed.as_secs_f64() * 1e3),
            );
            // Steps the generations shared with the prompt: how long they waited for a token.
            shared_steps
                .extend(seen.iter().filter(|s| s.rows > 3).map(|s| s.elapsed.as_secs_f64() * 1e3));
        }
        let q = |v: &mut Vec<f64>, p: f64| {
            v.sort_by(f64::total_cmp);
            v[((v.len() - 1) as f64 * p).round() as usize]
        };
        println!(
            "threads {threads}: a cancelled step cost its survivors p50 {:.2} ms, p99 {:.2} ms ({} cancels); a 3-seat generation step takes p50 {:.2} ms; \
             beside the 500-row prompt a generating seat waited for its next token p50 {:.2} ms, p99 {:.2} ms, at most {:.2} ms (step target {:?})",
            q(&mut lost, 0.5),
            q(&mut lost, 0.99),
            lost.len(),
            q(&mut gen_steps, 0.5),
            q(&mut shared_steps, 0.5),
            q(&mut shared_steps, 0.99),
            q(&mut shared_steps, 1.0),
            policy.step_target,
        );
    }
}
