//! Counters of native work, shared by the contexts of one run (each context adds to the
//! meter it was given) and read by whoever runs them: usage per run or per tenant.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::native::Tally;

/// Counts of one run's native work (rows decoded, tokens generated, cancels, reuse,
/// peak KV cells), added to by its contexts from any thread.
#[derive(Debug, Default)]
pub struct Meter {
    decoded: AtomicU64,
    generated: AtomicU64,
    cancels: AtomicU64,
    peak_kv_cells: AtomicU64,
    reused: AtomicU64,
}

impl Meter {
    /// A meter with every count at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows a successful `llama_decode` computed (tokens or media embeddings).
    pub fn add_decoded(&self, rows: u64) {
        self.decoded.fetch_add(rows, Relaxed);
    }

    /// Tokens a generation delivered.
    pub fn add_generated(&self, tokens: u64) {
        self.generated.fetch_add(tokens, Relaxed);
    }

    /// One native call that ended cancelled (before or during its work).
    pub fn add_cancel(&self) {
        self.cancels.fetch_add(1, Relaxed);
    }

    /// Prompt tokens a parked context already held, kept instead of decoded again.
    pub fn add_reused(&self, tokens: u64) {
        self.reused.fetch_add(tokens, Relaxed);
    }

    /// KV cells held now; the meter keeps the largest value it saw.
    pub fn note_kv_cells(&self, held: u64) {
        self.peak_kv_cells.fetch_max(held, Relaxed);
    }

    /// Rows decoded so far (see [`Meter::add_decoded`]).
    pub fn decoded(&self) -> u64 {
        self.decoded.load(Relaxed)
    }

    /// Tokens generations delivered so far.
    pub fn generated(&self) -> u64 {
        self.generated.load(Relaxed)
    }

    /// Native calls that ended cancelled so far.
    pub fn cancels(&self) -> u64 {
        self.cancels.load(Relaxed)
    }

    /// Prompt tokens reused from parked contexts so far.
    pub fn reused(&self) -> u64 {
        self.reused.load(Relaxed)
    }

    /// The most KV cells held at once so far.
    pub fn peak_kv_cells(&self) -> u64 {
        self.peak_kv_cells.load(Relaxed)
    }
}

/// Native contexts count their work here (`native`'s [`Tally`]).
impl Tally for Meter {
    fn decoded(&self, rows: u64) {
        self.add_decoded(rows);
    }

    fn generated(&self, tokens: u64) {
        self.add_generated(tokens);
    }

    fn cancelled(&self) {
        self.add_cancel();
    }

    fn reused(&self, tokens: u64) {
        self.add_reused(tokens);
    }
}
