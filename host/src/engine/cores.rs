//! The cores, shared by turns. A batching host runs every batch (one per model and seat
//! size) on all of its threads, and contexts of their own beside them, so two of them
//! computing at once would run more ggml threads than there are cores. ggml's threads
//! meet at a spinning barrier after every graph node; oversubscribed, each barrier waits
//! for a descheduled thread, and one step can take a hundred times as long. So each
//! native computation takes the cores for its duration, in turn.
//!
//! Turns go round the flows that wait, one turn each per round ([`Flow`]: a batch's
//! steps, or one tenant's work beside the batches), first come first served within a
//! round. So a tenant that runs several contexts of its own at once (two long embedding
//! inputs) gets one turn per round between a batch's steps, not one per context, and a
//! stream in the batch waits for one turn per other tenant. One flow alone takes every
//! turn.
//!
//! A long computation (a whole embedding input, an image encode, a big decode of a
//! context of its own) does not keep its turn for its whole length: at the boundaries
//! of its graph (`eval_scope`) it passes the cores to whoever waits once it has held
//! them for the turn length its owner set ([`Cores::set_turn`], from a batch's step),
//! and queues again behind them. So a batch beside it waits about one turn, not the
//! computation. A long input is also cut into decodes of about a turn each ([`Pacer`]).
//!
//! Native contexts see these through `native`'s [`SharedCores`] trait: the policy lives
//! here, native code only takes its turns.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::native::{CoreTurn, Pieces, SharedCores};

/// Whose turns these are: the cores serve the flows that wait in rounds, one turn each.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Flow {
    /// One batch's steps, whichever tenants' rows they hold (its scheduler shares
    /// those out).
    Batch(u64),
    /// One tenant's computations beside the batches: contexts of their own (embeddings
    /// included) and media encodes.
    Tenant(Arc<str>),
}

impl Flow {
    /// A flow of its own for a new batch.
    pub(crate) fn new_batch() -> Self {
        static BATCHES: AtomicU64 = AtomicU64::new(0);
        Flow::Batch(BATCHES.fetch_add(1, Relaxed))
    }
}

/// Turns on the cores, by rounds of flows.
pub struct Cores {
    queue: Mutex<Queue>,
    served: Condvar,
    /// Nanoseconds a computation keeps the cores at most while someone waits.
    turn_nanos: AtomicU64,
}

impl Default for Cores {
    /// Turns of at most 250 ms while someone waits (a batch's default step target).
    fn default() -> Self {
        let turn_nanos = AtomicU64::new(Duration::from_millis(250).as_nanos() as u64);
        Self { queue: Mutex::default(), served: Condvar::new(), turn_nanos }
    }
}

/// Who holds the cores and who waits: start-time fair queueing with a turn as the unit.
/// A turn asked for goes in its flow's next round (the one after its flow's last turn),
/// and not before the round being served; the least round goes first, and within a
/// round the turn asked first. So a flow that queues several turns at once books one per
/// round, and a flow asking again after its turn (a batch between steps) joins the
/// round being served. A turn asked with no flow joins the round being served.
#[derive(Default)]
struct Queue {
    next_ticket: u64,
    /// The ticket whose turn it is, if any.
    serving: Option<u64>,
    /// The round of the turn being served, or of the last one.
    round: u64,
    /// Turns asked for and not begun, as (round, ticket).
    waiting: BTreeSet<(u64, u64)>,
    /// The next round of each flow whose next round is later than `round`; any other
    /// flow's next turn goes in `round`. Bounded by `waiting` and the one served.
    next_round: HashMap<Flow, u64>,
}

impl Queue {
    /// Queue a turn for `flow`, and begin it if the cores are free. Returns its ticket.
    fn ask(&mut self, flow: Option<&Flow>) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let next = flow.and_then(|f| self.next_round.get(f)).copied().unwrap_or(0);
        let round = next.max(self.round);
        if let Some(flow) = flow {
            self.next_round.insert(flow.clone(), round + 1);
        }
        self.waiting.insert((round, ticket));
        self.begin_next();
        ticket
    }

    /// Take back `ticket`, asked as `flow` and not begun: it leaves the queue, and the
    /// flow's next turn goes in the round this one would have had.
    fn withdraw(&mut self, ticket: u64, flow: &Flow) {
        let Some(&(round, _)) = self.waiting.iter().find(|&&(_, t)| t == ticket) else { return };
        self.waiting.remove(&(round, ticket));
        if round > self.round {
            self.next_round.insert(flow.clone(), round);
        } else {
            self.next_round.remove(flow);
        }
    }

    /// The turn being served ends: the next one begins.
    fn end(&mut self) {
        self.serving = None;
        self.begin_next();
    }

    fn begin_next(&mut self) {
        if self.serving.is_some() {
            return;
        }
        if let Some((round, ticket)) = self.waiting.pop_first() {
            self.serving = Some(ticket);
            self.round = round;
            self.next_round.retain(|_, next| *next > round);
        }
    }
}

/// The cores, held until dropped.
pub struct Turn<'a> {
    cores: &'a Cores,
    /// Whose turn: a pass queues again as this flow.
    flow: Option<Flow>,
    /// When this turn (or its last pass) began.
    since: Instant,
    /// Time spent waiting for others in passes (not computing).
    waited: Duration,
}

impl Cores {
    /// Wait for the cores as a flow of its own (first come, first served): what tests
    /// hold to stand for someone else's computation.
    #[cfg(test)]
    pub fn turn(&self) -> Turn<'_> {
        self.take(None)
    }

    /// Wait for the cores as `flow`: behind the flows whose round comes first.
    pub(crate) fn turn_as(&self, flow: &Flow) -> Turn<'_> {
        self.take(Some(flow.clone()))
    }

    fn take(&self, flow: Option<Flow>) -> Turn<'_> {
        let mut queue = self.lock();
        let ticket = queue.ask(flow.as_ref());
        self.turn_when_served(queue, ticket, flow)
    }

    /// `ticket`'s turn as `flow`'s, once it is served.
    fn turn_when_served(
        &self,
        queue: MutexGuard<'_, Queue>,
        ticket: u64,
        flow: Option<Flow>,
    ) -> Turn<'_> {
        self.wait_for(queue, ticket);
        Turn { cores: self, flow, since: Instant::now(), waited: Duration::ZERO }
    }

    /// Queue a turn for `flow` now and take it later ([`Cores::take_booked`]): a batch
    /// books its next step's turn before its step's turn ends, so the work that goes
    /// next passes back once it has held the cores a turn, whether or not the batch's
    /// thread has had a core yet to ask. Beside an embedding at 2 threads, asking after
    /// the step's sampling, that thread waited behind the embedding's spinning threads
    /// (a step's end to its trace line: 2.9 ms p50 and 12.8 p99, 0.04 alone), and the
    /// embedding held the cores 4.7 ms p50 of a 3.7 ms turn, 10.6 p99.
    pub(crate) fn book(self: &Arc<Self>, flow: &Flow) -> Booking {
        let ticket = self.lock().ask(Some(flow));
        Booking { cores: self.clone(), flow: flow.clone(), ticket: Some(ticket) }
    }

    /// `flow`'s turn: the one it `booked`, if any, else one asked for now.
    pub(crate) fn turn_of(&self, flow: &Flow, booked: Option<Booking>) -> Turn<'_> {
        match booked {
            Some(booking) => self.take_booked(booking),
            None => self.turn_as(flow),
        }
    }

    /// Take the turn `booking` queued, waiting for it if others go first.
    fn take_booked(&self, mut booking: Booking) -> Turn<'_> {
        assert!(std::ptr::eq(self, &*booking.cores), "a booking is taken on its own cores");
        let ticket = booking.ticket.take().expect("a booking is taken once");
        self.turn_when_served(self.lock(), ticket, Some(booking.flow.clone()))
    }

    /// The turn being served ends: whoever's ticket comes next is woken.
    fn end_turn(&self, queue: &mut Queue) {
        queue.end();
        self.served.notify_all();
    }

    /// How long a computation keeps the cores while someone waits, from now on.
    pub fn set_turn(&self, turn: Duration) {
        self.turn_nanos.store(turn.as_nanos().min(u128::from(u64::MAX)) as u64, Relaxed);
    }

    /// How long a computation keeps the cores while someone waits, now.
    pub fn turn_length(&self) -> Duration {
        Duration::from_nanos(self.turn_nanos.load(Relaxed))
    }

    fn wait_for(&self, mut queue: MutexGuard<'_, Queue>, ticket: u64) {
        while queue.serving != Some(ticket) {
            queue = self.served.wait(queue).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether a turn is asked for and not begun: whoever ends a turn then rests its
    /// idle threads, which would spin on the cores the next one needs.
    pub(crate) fn others_wait(&self) -> bool {
        !self.lock().waiting.is_empty()
    }

    /// Turns asked for and not yet ended (the one held included).
    #[cfg(test)]
    pub fn waiting(&self) -> u64 {
        let queue = self.lock();
        queue.waiting.len() as u64 + u64::from(queue.serving.is_some())
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding the lock leaves the queue whole: no method of it panics
        // between its changes.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Turn<'_> {
    /// At a boundary of a computation: if it has held the cores for a turn and someone
    /// waits, call `hand_over` (the computation's idle threads rest), queue again as its
    /// flow and let whoever comes first go, then go on. Returns whether it passed.
    pub fn pass_if_due(&mut self, hand_over: &mut dyn FnMut()) -> bool {
        let turn = Duration::from_nanos(self.cores.turn_nanos.load(Relaxed));
        if self.since.elapsed() < turn {
            return false;
        }
        let mut queue = self.cores.lock();
        if queue.waiting.is_empty() {
            // Nobody waits: go on, still due, so that whoever asks next waits for one
            // boundary, not another turn (a fresh turn here made a stream's step that
            // asked just after a due boundary wait a whole turn more).
            return false;
        }
        hand_over();
        // Queue again and end this turn in one step under the lock, so that exactly the
        // ones whose round comes first go before it.
        let ticket = queue.ask(self.flow.as_ref());
        self.cores.end_turn(&mut queue);
        let asked = Instant::now();
        self.cores.wait_for(queue, ticket);
        self.since = Instant::now();
        self.waited += self.since - asked;
        true
    }

    /// How long this turn's passes waited for others: what a pace measuring the
    /// computation leaves out.
    pub fn waited(&self) -> Duration {
        self.waited
    }
}

/// A turn queued and not yet taken ([`Cores::book`]). Dropped untaken, it leaves the
/// queue, giving its flow back its place in the rounds, or, if it is already being
/// served, ends: the cores never wait for a booking nobody will take.
pub(crate) struct Booking {
    cores: Arc<Cores>,
    flow: Flow,
    ticket: Option<u64>,
}

impl Drop for Booking {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket else { return };
        let mut queue = self.cores.lock();
        if queue.serving == Some(ticket) {
            self.cores.end_turn(&mut queue);
        } else {
            queue.withdraw(ticket, &self.flow);
        }
    }
}

/// The cores as one flow's computations take them (a tenant's contexts of their own and
/// media encodes): what native contexts are given to share.
pub(crate) struct FlowCores {
    cores: Arc<Cores>,
    flow: Flow,
}

impl FlowCores {
    pub(crate) fn shared(cores: Arc<Cores>, flow: Flow) -> Arc<dyn SharedCores> {
        Arc::new(Self { cores, flow })
    }
}

impl SharedCores for FlowCores {
    fn turn(&self) -> Box<dyn CoreTurn + '_> {
        Box::new(self.cores.turn_as(&self.flow))
    }

    fn pieces(&self, most: usize) -> Box<dyn Pieces> {
        Box::new(Pacer::new(most, self.cores.turn_length()))
    }
}

/// The cores as anonymous computations take them (tests: each turn a flow of its own).
#[cfg(test)]
impl SharedCores for Cores {
    fn turn(&self) -> Box<dyn CoreTurn + '_> {
        Box::new(Cores::turn(self))
    }

    fn pieces(&self, most: usize) -> Box<dyn Pieces> {
        Box::new(Pacer::new(most, self.turn_length()))
    }
}

impl CoreTurn for Turn<'_> {
    fn pass_if_due(&mut self, hand_over: &mut dyn FnMut()) -> bool {
        Turn::pass_if_due(self, hand_over)
    }

    fn others_wait(&self) -> bool {
        self.cores.others_wait()
    }

    fn waited(&self) -> Duration {
        Turn::waited(self)
    }

    fn length(&self) -> Duration {
        self.cores.turn_length()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.cores.end_turn(&mut self.cores.lock());
    }
}

/// The pieces a long input is decoded in beside a batch (a context that shares the
/// cores): each about one turn of work, so the batch's steps run between them instead of
/// waiting for the whole input. The first piece is small; each later one is sized from
/// the pace of the one before (attention grows with the position, so the pace is
/// measured again each time).
pub(crate) struct Pacer {
    rows: usize,
    most: usize,
    /// About how long one piece holds the cores: the turn length (a batch's step
    /// target), so that streams beside it wait about one step for their next token.
    target: Duration,
}

impl Pacer {
    /// Rows of the first piece.
    const FIRST_ROWS: usize = 32;
    /// Fewest rows of a later piece: below this a decode's fixed cost dominates. Not 64,
    /// though ggml's CPU attention is untiled below 64 query rows (`GGML_FA_TILE_Q`) and
    /// a 2000-token embedding alone took 38% longer in 16-to-40-row pieces than in one
    /// decode: a piece's matmuls are nodes no boundary splits, and beside a stream at 1
    /// thread 64-row pieces put its ITL p99 at 54-58 ms, 16-row ones at 34-36.
    const MIN_ROWS: usize = 16;

    /// Pieces of at most `most` rows (the context's n-batch or n-ubatch), each about
    /// `target` of work.
    pub(crate) fn new(most: usize, target: Duration) -> Self {
        let most = most.max(1);
        Self { rows: Self::FIRST_ROWS.min(most), most, target }
    }
}

impl Pieces for Pacer {
    fn rows(&self) -> usize {
        self.rows
    }

    fn observe(&mut self, rows: usize, took: Duration) {
        let per_row = took.as_secs_f64() / rows.max(1) as f64;
        let fits = (self.target.as_secs_f64() / per_row.max(1e-9)) as usize;
        self.rows = fits.clamp(Self::MIN_ROWS.min(self.most), self.most);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{mpsc, Arc};

    #[test]
    fn pieces_start_small_then_fit_the_target_within_bounds() {
        let mut pacer = Pacer::new(512, Duration::from_millis(250));
        assert_eq!(pacer.rows(), 32);
        pacer.observe(32, Duration::from_millis(32)); // 1 ms a row: 250 rows fit
        assert_eq!(pacer.rows(), 250);
        pacer.observe(250, Duration::from_micros(250)); // fast: capped at n-batch
        assert_eq!(pacer.rows(), 512);
        pacer.observe(512, Duration::from_secs(10)); // slow: never below 16
        assert_eq!(pacer.rows(), 16);
        let short = Pacer::new(8, Duration::from_millis(250));
        assert_eq!(short.rows(), 8, "never past the context's own n-batch");
    }

    #[test]
    fn pieces_fit_the_turn_the_cores_give() {
        let cores = Cores::default();
        cores.set_turn(Duration::from_millis(100));
        let mut pieces = SharedCores::pieces(&cores, 512);
        pieces.observe(32, Duration::from_millis(32)); // 1 ms a row: a 100 ms turn
        assert_eq!(pieces.rows(), 100);
    }

    /// Turns served on `queue` while computations go on: each served one named in
    /// `passes` passes (queues again as its flow, then ends); any other ends, then asks
    /// again as its flow (a batch between steps). `who` names a ticket's computation.
    fn served(
        queue: &mut Queue,
        mut who: HashMap<u64, (&'static str, Flow)>,
        passes: &[&str],
        turns: usize,
    ) -> String {
        let mut order = String::new();
        for _ in 0..turns {
            let ticket = queue.serving.expect("someone holds the cores");
            let (name, flow) = who.remove(&ticket).unwrap();
            order += name;
            let again = if passes.contains(&name) {
                let again = queue.ask(Some(&flow));
                queue.end();
                again
            } else {
                queue.end();
                queue.ask(Some(&flow))
            };
            who.insert(again, (name, flow));
        }
        order
    }

    #[test]
    fn a_tenant_with_two_computations_gets_one_turn_between_a_batchs_steps() {
        let (tenant, batch) = (Flow::Tenant("attacker".into()), Flow::new_batch());
        let mut queue = Queue::default();
        let mut who = HashMap::new();
        who.insert(queue.ask(Some(&tenant)), ("a", tenant.clone()));
        who.insert(queue.ask(Some(&tenant)), ("A", tenant.clone()));
        who.insert(queue.ask(Some(&batch)), ("b", batch.clone()));
        // First come, first served would give the batch one turn in three: "aAbaAbaAbaAb".
        assert_eq!(served(&mut queue, who, &["a", "A"], 12), "abAbabAbabAb");
        assert!(queue.next_round.len() <= 2, "only flows with a turn queued are kept");
    }

    #[test]
    fn turns_go_round_the_flows_that_wait() {
        let flows = [Flow::new_batch(), Flow::Tenant("x".into()), Flow::Tenant("y".into())];
        let mut queue = Queue::default();
        let mut who = HashMap::new();
        // Tenant x asks for three turns at once, y for one: x books one per round.
        for (name, flow) in [("b", 0), ("x", 1), ("X", 1), ("z", 1), ("y", 2)] {
            who.insert(queue.ask(Some(&flows[flow])), (name, flows[flow].clone()));
        }
        // Rounds of one turn per flow: "bxy", "Xby", "zby", "xby".
        assert_eq!(served(&mut queue, who, &["x", "X", "z", "y"], 12), "bxyXbyzbyxby");
    }

    #[test]
    fn turns_are_served_in_the_order_asked_and_one_at_a_time() {
        let cores = Arc::new(Cores::default());
        let first = cores.turn();
        let (order_tx, order) = mpsc::channel();
        let mut waiters = Vec::new();
        for n in 0..3 {
            // Each asks only once the one before is queued, so the order asked is 0, 1, 2.
            let (mine, order_tx) = (cores.clone(), order_tx.clone());
            waiters.push(std::thread::spawn(move || {
                let _turn = mine.turn();
                order_tx.send(n).unwrap();
            }));
            while cores.waiting() != n + 2 {
                std::thread::yield_now();
            }
        }
        assert!(order.try_recv().is_err(), "nobody runs while the first turn is held");
        drop(first);
        waiters.into_iter().for_each(|w| w.join().unwrap());
        assert_eq!(order.try_iter().collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(cores.waiting(), 0);
    }

    #[test]
    fn a_turn_booked_before_a_step_ends_is_passed_back_to_once_due() {
        use std::sync::atomic::AtomicBool;
        let cores = Arc::new(Cores::default());
        cores.set_turn(Duration::ZERO);
        let (batch, tenant) = (Flow::new_batch(), Flow::Tenant("embedder".into()));
        let step = cores.turn_as(&batch);
        let handed_over = Arc::new(AtomicBool::new(false));
        let beside = {
            let (mine, tenant, handed_over) = (cores.clone(), tenant.clone(), handed_over.clone());
            std::thread::spawn(move || {
                let mut long = mine.turn_as(&tenant);
                long.pass_if_due(&mut || handed_over.store(true, Relaxed))
            })
        };
        while cores.waiting() != 2 {
            std::thread::yield_now();
        }
        // Booked under the step's turn: the long computation that goes next sees it
        // waiting, though this thread has not asked yet (asking only after the step,
        // the computation would find nobody waiting and keep the cores).
        let booking = cores.book(&batch);
        drop(step);
        let next = cores.turn_of(&batch, Some(booking));
        assert!(handed_over.load(Relaxed), "the computation passed to the booked turn");
        drop(next);
        assert!(beside.join().unwrap(), "and went on after it");
        assert_eq!(cores.waiting(), 0);
    }

    #[test]
    fn a_booking_dropped_untaken_gives_its_place_or_its_turn_up() {
        let cores = Arc::new(Cores::default());
        let batch = Flow::new_batch();
        // Queued behind a turn held: dropped, it leaves the queue.
        let held = cores.turn();
        let queued = cores.book(&batch);
        assert_eq!(cores.waiting(), 2);
        drop(queued);
        assert_eq!(cores.waiting(), 1);
        assert_eq!(cores.lock().next_round.get(&batch), None, "its next turn keeps its round");
        drop(held);
        // Served at once (the cores were free), never taken: dropped, the turn ends and
        // whoever waits goes.
        let served = cores.book(&batch);
        let waiter = {
            let mine = cores.clone();
            std::thread::spawn(move || drop(mine.turn()))
        };
        while cores.waiting() != 2 {
            std::thread::yield_now();
        }
        drop(served);
        waiter.join().unwrap();
        assert_eq!(cores.waiting(), 0);
    }

    #[test]
    fn a_turn_passes_to_those_waiting_once_it_is_due_and_then_goes_on() {
        let cores = Arc::new(Cores::default());
        cores.set_turn(Duration::from_secs(3600));
        let mut long = cores.turn();
        let mut handed_over = 0;
        assert!(!long.pass_if_due(&mut || handed_over += 1), "not due: nobody goes first");
        cores.set_turn(Duration::ZERO);
        assert!(!long.pass_if_due(&mut || handed_over += 1), "due, but nobody waits");
        assert!(!cores.others_wait());
        assert_eq!(handed_over, 0, "nothing to hand over to");
        let (order_tx, order) = mpsc::channel();
        let waiter = {
            let (mine, order_tx) = (cores.clone(), order_tx.clone());
            std::thread::spawn(move || {
                let _turn = mine.turn();
                order_tx.send("waiter").unwrap();
            })
        };
        while cores.waiting() != 2 {
            std::thread::yield_now();
        }
        assert!(cores.others_wait());
        assert!(long.pass_if_due(&mut || handed_over += 1), "due and someone waits");
        assert_eq!(handed_over, 1, "rested its threads before the waiter's turn");
        // Back only once the waiter's turn ended.
        order_tx.send("long again").unwrap();
        waiter.join().unwrap();
        assert_eq!(order.try_iter().collect::<Vec<_>>(), ["waiter", "long again"]);
        assert_eq!(cores.waiting(), 1, "only the long turn is held");
        drop(long);
        assert_eq!(cores.waiting(), 0);
    }
}
