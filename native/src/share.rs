//! What a context asks of whoever runs it beside others: turns on the cores, the pieces
//! a long input is cut into, and where its work is counted. These are the engine's
//! policy (who goes when, for how long, whose usage it is), so here they are traits
//! that the engine implements; native code only computes and reports.

use std::time::Duration;

/// The cores as a context shares them with others who use every thread (a batch): a
/// context given one computes only in its turns ([`crate::Context::share_cores`]).
pub trait SharedCores: Send + Sync {
    /// Wait for a turn on the cores; it ends when the turn is dropped.
    fn turn(&self) -> Box<dyn CoreTurn + '_>;

    /// How an input of up to `most` rows is cut into decodes, each about one turn of
    /// work, so that others compute between them instead of waiting for the whole input.
    fn pieces(&self, most: usize) -> Box<dyn Pieces>;
}

/// A turn on shared cores, held until dropped.
pub trait CoreTurn {
    /// At a boundary of the computation: if the turn is due and someone waits, call
    /// `hand_over` (what the computation does before others take the cores: its idle
    /// threads rest), let them go first and then go on. Returns whether it passed.
    fn pass_if_due(&mut self, hand_over: &mut dyn FnMut()) -> bool;

    /// Whether someone waits for the cores: a computation ending its turn then rests
    /// its idle threads rather than let them spin on the cores the next one needs.
    fn others_wait(&self) -> bool;

    /// How long the passes waited for others: what a pace measuring the computation
    /// leaves out.
    fn waited(&self) -> Duration;

    /// How long a turn lasts while others wait (it may change as it goes): a
    /// computation places its boundaries well within it, so that it passes on time.
    fn length(&self) -> Duration;
}

/// The sizes of the decodes an input is cut into ([`SharedCores::pieces`]).
pub trait Pieces {
    /// Rows of the next piece (at least 1).
    fn rows(&self) -> usize;

    /// The last piece, of `rows` rows, took `took` on the cores.
    fn observe(&mut self, rows: usize, took: Duration);
}

/// Where a context counts the work it did, for whoever answers for it (a run, a tenant).
pub trait Tally: Send + Sync {
    /// Rows a successful decode computed (tokens or media embeddings).
    fn decoded(&self, rows: u64);

    /// Tokens a generation delivered ([`crate::generate()`]).
    fn generated(&self, tokens: u64);

    /// A call that ended cancelled, before or during its work.
    fn cancelled(&self);

    /// Prompt tokens a parked context already held, kept instead of decoded again.
    fn reused(&self, tokens: u64);
}
