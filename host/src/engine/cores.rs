//! The cores, shared by turns. A batching host runs every batch (one per model and seat
//! size) on all of its threads, and contexts of their own beside them, so two of them
//! computing at once would run more ggml threads than there are cores. ggml's threads
//! meet at a spinning barrier after every graph node; oversubscribed, each barrier waits
//! for a descheduled thread, and one step can take a hundred times as long. So each
//! native computation takes the cores for its duration, in turn: first come, first
//! served, which alternates whoever is busy at once and lets one alone take every turn.
//!
//! A long computation (a whole embedding input, an image encode, a big decode of a
//! context of its own) does not keep its turn for its whole length: at the boundaries
//! of its graph (`eval_scope`) it passes the cores to whoever waits once it has held
//! them for the turn length its owner set ([`Cores::set_turn`], a batch's step target),
//! and queues again behind them. So a batch beside it waits about one turn, not the
//! computation. A long input is also cut into decodes of about a turn each ([`Pacer`]).
//!
//! Native contexts see these through `native`'s [`SharedCores`] trait: the policy lives
//! here, native code only takes its turns.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::native::{CoreTurn, Pieces, SharedCores};

/// Turns on the cores, first come first served (a ticket lock).
pub struct Cores {
    tickets: Mutex<Tickets>,
    served: Condvar,
    /// Nanoseconds a computation keeps the cores at most while someone waits.
    turn_nanos: AtomicU64,
}

impl Default for Cores {
    /// Turns of at most 250 ms while someone waits (a batch's default step target).
    fn default() -> Self {
        let turn_nanos = AtomicU64::new(Duration::from_millis(250).as_nanos() as u64);
        Self { tickets: Mutex::default(), served: Condvar::new(), turn_nanos }
    }
}

#[derive(Default)]
struct Tickets {
    /// The next ticket to hand out.
    next: u64,
    /// The ticket whose turn it is.
    serving: u64,
}

/// The cores, held until dropped.
pub struct Turn<'a> {
    cores: &'a Cores,
    /// When this turn (or its last pass) began.
    since: Instant,
    /// Time spent waiting for others in passes (not computing).
    waited: Duration,
}

impl Cores {
    /// Wait for the cores, behind everyone who asked before.
    pub fn turn(&self) -> Turn<'_> {
        let mut tickets = self.lock();
        let ticket = tickets.next;
        tickets.next += 1;
        self.wait_for(tickets, ticket);
        Turn { cores: self, since: Instant::now(), waited: Duration::ZERO }
    }

    /// How long a computation keeps the cores while someone waits, from now on.
    pub fn set_turn(&self, turn: Duration) {
        self.turn_nanos.store(turn.as_nanos().min(u128::from(u64::MAX)) as u64, Relaxed);
    }

    /// How long a computation keeps the cores while someone waits, now.
    pub fn turn_length(&self) -> Duration {
        Duration::from_nanos(self.turn_nanos.load(Relaxed))
    }

    fn wait_for(&self, mut tickets: MutexGuard<'_, Tickets>, ticket: u64) {
        while tickets.serving != ticket {
            tickets = self.served.wait(tickets).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Turns asked for and not yet ended (the one held included).
    #[cfg(test)]
    pub fn waiting(&self) -> u64 {
        let tickets = self.lock();
        tickets.next - tickets.serving
    }

    fn lock(&self) -> MutexGuard<'_, Tickets> {
        // A panic while holding the lock leaves the counters whole (two plain adds).
        self.tickets.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Turn<'_> {
    /// At a boundary of a computation: if it has held the cores for a turn and someone
    /// waits, let everyone waiting go first, then go on. Returns whether it passed.
    pub fn pass_if_due(&mut self) -> bool {
        let turn = Duration::from_nanos(self.cores.turn_nanos.load(Relaxed));
        if self.since.elapsed() < turn {
            return false;
        }
        let mut tickets = self.cores.lock();
        if tickets.next - tickets.serving <= 1 {
            self.since = Instant::now(); // nobody waits: a fresh turn, asked again later
            return false;
        }
        // End this turn and take the next ticket in one step under the lock, so that
        // exactly the ones waiting now go first.
        tickets.serving += 1;
        let ticket = tickets.next;
        tickets.next += 1;
        self.cores.served.notify_all();
        let asked = Instant::now();
        self.cores.wait_for(tickets, ticket);
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

impl SharedCores for Cores {
    fn turn(&self) -> Box<dyn CoreTurn + '_> {
        Box::new(Cores::turn(self))
    }

    fn pieces(&self, most: usize) -> Box<dyn Pieces> {
        Box::new(Pacer::new(most, self.turn_length()))
    }
}

impl CoreTurn for Turn<'_> {
    fn pass_if_due(&mut self) -> bool {
        Turn::pass_if_due(self)
    }

    fn waited(&self) -> Duration {
        Turn::waited(self)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.cores.lock().serving += 1;
        self.cores.served.notify_all();
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
    /// Fewest rows of a later piece: below this a decode's fixed cost dominates.
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
    fn a_turn_passes_to_those_waiting_once_it_is_due_and_then_goes_on() {
        let cores = Arc::new(Cores::default());
        cores.set_turn(Duration::from_secs(3600));
        let mut long = cores.turn();
        assert!(!long.pass_if_due(), "not due: nobody goes first");
        cores.set_turn(Duration::ZERO);
        assert!(!long.pass_if_due(), "due, but nobody waits");
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
        assert!(long.pass_if_due(), "due and someone waits");
        // Back only once the waiter's turn ended.
        order_tx.send("long again").unwrap();
        waiter.join().unwrap();
        assert_eq!(order.try_iter().collect::<Vec<_>>(), ["waiter", "long again"]);
        assert_eq!(cores.waiting(), 1, "only the long turn is held");
        drop(long);
        assert_eq!(cores.waiting(), 0);
    }
}
