//! What the engine gives a context, written here as the tests need it: counts of the
//! work a context reports (`Tally`), and cores that never make anyone wait but count the
//! turns taken and cut inputs into pieces of a fixed size (`SharedCores`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use llamabox_native::{CoreTurn, Pieces, SharedCores, Tally};

/// What a context reported, counted.
#[derive(Debug, Default)]
pub struct Counts {
    pub decoded: AtomicU64,
    pub generated: AtomicU64,
    pub reused: AtomicU64,
    pub cancels: AtomicU64,
}

impl Counts {
    pub fn decoded(&self) -> u64 {
        self.decoded.load(Relaxed)
    }

    pub fn reused(&self) -> u64 {
        self.reused.load(Relaxed)
    }
}

impl Tally for Counts {
    fn decoded(&self, rows: u64) {
        self.decoded.fetch_add(rows, Relaxed);
    }

    fn generated(&self, tokens: u64) {
        self.generated.fetch_add(tokens, Relaxed);
    }

    fn cancelled(&self) {
        self.cancels.fetch_add(1, Relaxed);
    }

    fn reused(&self, tokens: u64) {
        self.reused.fetch_add(tokens, Relaxed);
    }
}

/// Cores that are always free: each turn is counted, and inputs are cut into pieces of
/// `piece_rows` rows.
#[derive(Debug)]
pub struct CountedTurns {
    pub piece_rows: usize,
    pub turns: AtomicU64,
}

impl CountedTurns {
    pub fn new(piece_rows: usize) -> Self {
        Self { piece_rows, turns: AtomicU64::new(0) }
    }

    pub fn turns(&self) -> u64 {
        self.turns.load(Relaxed)
    }
}

struct FreeTurn;

impl CoreTurn for FreeTurn {
    fn pass_if_due(&mut self) -> bool {
        false
    }

    fn waited(&self) -> Duration {
        Duration::ZERO
    }

    fn length(&self) -> Duration {
        Duration::MAX
    }
}

struct Fixed(usize);

impl Pieces for Fixed {
    fn rows(&self) -> usize {
        self.0
    }

    fn observe(&mut self, _rows: usize, _took: Duration) {}
}

impl SharedCores for CountedTurns {
    fn turn(&self) -> Box<dyn CoreTurn + '_> {
        self.turns.fetch_add(1, Relaxed);
        Box::new(FreeTurn)
    }

    fn pieces(&self, _most: usize) -> Box<dyn Pieces> {
        Box::new(Fixed(self.piece_rows))
    }
}
