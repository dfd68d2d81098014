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

/// Cores that never make anyone wait: each turn is counted, and inputs are cut into
/// pieces of `piece_rows` rows. Free, nobody else wants them; crowded, someone always
/// waits and every turn is due at once, so a computation passes at every boundary (the
/// others' turns take no time), each pass counted.
#[derive(Debug)]
pub struct CountedTurns {
    pub piece_rows: usize,
    pub crowded: bool,
    pub turns: AtomicU64,
    pub passes: AtomicU64,
}

impl CountedTurns {
    pub fn new(piece_rows: usize) -> Self {
        Self { piece_rows, crowded: false, turns: AtomicU64::new(0), passes: AtomicU64::new(0) }
    }

    pub fn crowded(piece_rows: usize) -> Self {
        Self { crowded: true, ..Self::new(piece_rows) }
    }

    pub fn turns(&self) -> u64 {
        self.turns.load(Relaxed)
    }
}

struct CountedTurn<'a>(&'a CountedTurns);

impl CoreTurn for CountedTurn<'_> {
    fn pass_if_due(&mut self, hand_over: &mut dyn FnMut()) -> bool {
        if self.0.crowded {
            hand_over();
            self.0.passes.fetch_add(1, Relaxed);
        }
        self.0.crowded
    }

    fn others_wait(&self) -> bool {
        self.0.crowded
    }

    fn waited(&self) -> Duration {
        Duration::ZERO
    }

    fn length(&self) -> Duration {
        if self.0.crowded {
            Duration::ZERO
        } else {
            Duration::MAX
        }
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
        Box::new(CountedTurn(self))
    }

    fn pieces(&self, _most: usize) -> Box<dyn Pieces> {
        Box::new(Fixed(self.piece_rows))
    }
}
