//! Where a computation may stop on a backend the abort callback does not reach (mtmd's
//! encodes, and decodes on a GPU): the decision logic of the eval callback
//! (`eval_scope`), as a pure state machine with no llama.cpp in it.
//!
//! ggml's scheduler asks the eval callback, node by node, "do you want this node's
//! output?" (`ask`). On the first yes it computes up to that node, then calls back
//! with `ask == false`; answering false there stops the split. So every yes is a point
//! where a computation can stop, and every yes costs a synchronisation. We say yes:
//! - once per budget of work units, set by [`Pace`] from how fast the context computes,
//!   so that a cancel waits about one latency target and boundaries cost nothing
//!   measurable; a computation smaller than the budget (a generation step) gets none.
//!   Those boundaries fall only where no backend fuses ops across them, so chunked
//!   output stays bitwise that of an unchunked run: after FLASH_ATTN_EXT (fused with
//!   nothing), after an attention SOFT_MAX (one with a mask: ggml-vulkan fuses only the
//!   mask-less MoE router softmax with the top-k after it), and after a MUL_MAT of
//!   more than one row (ggml-vulkan fuses one-row matmuls with the ADD after them, and
//!   splitting that moves the next RMS_NORM onto another summation order). The CPU
//!   backend fuses only RMS_NORM + MUL (`ggml_cpu_try_fuse_ops`), which none of these
//!   splits. tests/native/media_encode.rs and tests/gpu.rs cut after every such op;
//! - at the next computed node once a cancel is seen: the output is thrown away then,
//!   so no fusion matters, and a cancel never waits for the work budget to fill.

use std::time::Duration;

use llama_cpp_sys_2 as sys;

/// Work units between two boundaries before a media context has measured its own
/// speed (its first encode). clip's F32 matmuls run at ~4 G units/s on two cores of
/// this project's CI machine, so 2.5e8 units is ~60 ms. Boundaries also need a matmul
/// or attention op, so a chunk is never less than one of those, which bounds the
/// latency when one is bigger than the budget. A boundary costs a synchronisation
/// and, on clip's CPU backend, a fresh thread pool: ~16 µs at 1 thread, ~80 µs at 2
/// on the 2-vCPU bench VM (bench/RESULTS-t2.md, one boundary's cost).
pub const CHUNK_WORK: u64 = 250_000_000;

/// The default wait a cancel may see before an encode returns (store → return).
pub const DEFAULT_LATENCY_TARGET: Duration = Duration::from_millis(10);

/// The fewest work units a budget may have: below this a boundary (tens of µs) would
/// cost more than 1% of the compute between two boundaries even on a slow core.
const MIN_BUDGET: u64 = 1_000_000;

/// How fast one media context computes, learned from its own encodes, and the work
/// budget between boundaries that meets a latency target at that speed.
///
/// The scheduler decides each range before it computes it, so a cancel waits for the
/// rest of the range in flight: a budget of `speed × target` units makes that wait at
/// most about the target (half of it on average). The speed is measured, not assumed,
/// because it moves by 20× between builds (SSE2 vs AVX-512) and with the thread count.
#[derive(Clone, Copy, Debug)]
pub struct Pace {
    target: Duration,
    /// Work units per second, from the last encodes; `None` before the first.
    units_per_sec: Option<f64>,
}

impl Pace {
    /// A pace that aims at `target` between a cancel and the encode's return; until
    /// the first encode is timed its budget is [`CHUNK_WORK`].
    pub fn new(target: Duration) -> Self {
        Self { target, units_per_sec: None }
    }

    /// The latency target this pace sizes its budgets for.
    pub fn target(&self) -> Duration {
        self.target
    }

    /// Units between boundaries for the next encode.
    pub fn budget(&self) -> u64 {
        self.budget_within(self.target)
    }

    /// Units between boundaries that come at most `most` apart (and the target).
    pub fn budget_within(&self, most: Duration) -> u64 {
        match self.units_per_sec {
            None => CHUNK_WORK,
            Some(rate) => ((rate * self.target.min(most).as_secs_f64()) as u64).max(MIN_BUDGET),
        }
    }

    /// An encode computed `units` in `elapsed` (stopped or not). Encodes too short to
    /// time are ignored; otherwise the estimate moves halfway to the new speed, so one
    /// encode disturbed by a busy machine does not swing the budget.
    pub fn observe(&mut self, units: u64, elapsed: Duration) {
        if units == 0 || elapsed < Duration::from_micros(500) {
            return;
        }
        let rate = units as f64 / elapsed.as_secs_f64();
        self.units_per_sec = Some(match self.units_per_sec {
            None => rate,
            Some(old) => (old + rate) / 2.0,
        });
    }
}

/// What a graph node costs and whether a boundary may follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeWork {
    /// The node's work units (0 for views and no-ops).
    pub units: u64,
    /// Whether the computation may stop right after this node without changing any
    /// output (no backend fuses it with the ops after it).
    pub boundary_allowed: bool,
}

impl NodeWork {
    /// Work of a node: MUL_MAT and FLASH_ATTN_EXT are output elements × `inner`, the
    /// multiply-adds of each (a matmul's inner dimension; attention's keys twice, for
    /// Q·K and for the weights · V); views and no-ops are free; any other computed op
    /// costs its element count. `rows` is the output's second dimension, `masked`
    /// whether a SOFT_MAX has a mask: where a boundary may fall depends on both (the
    /// module doc says why).
    pub fn of(op: sys::ggml_op, out_elements: u64, rows: u64, inner: u64, masked: bool) -> Self {
        let units = match op {
            sys::GGML_OP_NONE
            | sys::GGML_OP_VIEW
            | sys::GGML_OP_RESHAPE
            | sys::GGML_OP_PERMUTE
            | sys::GGML_OP_TRANSPOSE => 0,
            sys::GGML_OP_MUL_MAT | sys::GGML_OP_FLASH_ATTN_EXT => {
                out_elements.saturating_mul(inner)
            }
            _ => out_elements,
        };
        let boundary_allowed = match op {
            sys::GGML_OP_FLASH_ATTN_EXT => true,
            sys::GGML_OP_SOFT_MAX => masked,
            sys::GGML_OP_MUL_MAT => rows > 1,
            _ => false,
        };
        Self { units, boundary_allowed }
    }
}

/// The callback's state for one encode.
#[derive(Debug)]
pub struct Chunker {
    budget: u64,
    spent: u64,
    /// Units of every node asked about so far (all of them computed once the encode
    /// returns): what [`Pace::observe`] learns from.
    total: u64,
    /// End the computation after the model's hidden states ([`Chunker::hidden_states_only`]).
    hidden_only: bool,
    /// The boundary due is right after the hidden states: the computation ends there.
    ending: bool,
}

impl Chunker {
    /// A fresh encode's state, with a boundary due every `budget` units (see
    /// [`Pace::budget`]).
    pub fn with_budget(budget: u64) -> Self {
        Self { budget, spent: 0, total: 0, hidden_only: false, ending: false }
    }

    /// Also end the computation (its split) right after the model's hidden states, for
    /// a decode that reads nothing after them (per-row embeddings): the output head is
    /// work thrown away, and one node no boundary splits (3-4% of a 1900-token
    /// embedding on SmolLM2 at 2 threads; more where the vocabulary is larger beside
    /// the hidden size).
    pub fn hidden_states_only(self) -> Self {
        Self { hidden_only: true, ..self }
    }

    /// Whether this computation ends after the hidden states.
    pub fn ends_at_hidden_states(&self) -> bool {
        self.hidden_only
    }

    /// `ask == true` for the node that holds the model's hidden states (its final norm):
    /// as [`Chunker::ask`], and a boundary after it that ends the computation if it
    /// reads nothing after them.
    pub fn ask_hidden_states(&mut self, node: NodeWork, cancelled: bool) -> bool {
        let ask = self.ask(node, cancelled);
        self.ending = self.hidden_only;
        ask || self.ending
    }

    /// `ask == true`: should the scheduler stop after this node and call back?
    pub fn ask(&mut self, node: NodeWork, cancelled: bool) -> bool {
        self.spent = self.spent.saturating_add(node.units);
        self.total = self.total.saturating_add(node.units);
        (cancelled && node.units > 0) || (node.boundary_allowed && self.spent >= self.budget)
    }

    /// Units of every node asked about so far (what [`Pace::observe`] learns from).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// `ask == false`, at a boundary: go on (true) or stop the encode (false).
    pub fn at_boundary(&mut self, cancelled: bool) -> bool {
        self.spent = 0;
        let end = std::mem::take(&mut self.ending);
        !cancelled && !end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ATTN: NodeWork = NodeWork { units: 10, boundary_allowed: true };
    const NORM: NodeWork = NodeWork { units: 60, boundary_allowed: false };

    #[test]
    fn work_units_by_op() {
        assert_eq!(NodeWork::of(sys::GGML_OP_MUL_MAT, 100, 10, 64, false).units, 6400);
        assert_eq!(NodeWork::of(sys::GGML_OP_ADD, 100, 10, 64, false).units, 100);
        // 16 queries of 9 heads of 64 over 2000 keys: 2 × 16 × 9 × 64 × 2000 multiply-adds.
        let attention = NodeWork::of(sys::GGML_OP_FLASH_ATTN_EXT, 64 * 9 * 16, 9, 2 * 2000, false);
        assert_eq!(attention.units, 2 * 16 * 9 * 64 * 2000);
        for view in [
            sys::GGML_OP_VIEW,
            sys::GGML_OP_RESHAPE,
            sys::GGML_OP_PERMUTE,
            sys::GGML_OP_TRANSPOSE,
            sys::GGML_OP_NONE,
        ] {
            assert_eq!(NodeWork::of(view, 100, 10, 64, false).units, 0);
        }
    }

    #[test]
    fn boundaries_fall_only_where_no_backend_fuses_across_them() {
        let allowed = |op, rows, masked| NodeWork::of(op, 8, rows, 1, masked).boundary_allowed;
        assert!(allowed(sys::GGML_OP_FLASH_ATTN_EXT, 1, false));
        assert!(allowed(sys::GGML_OP_SOFT_MAX, 1, true), "attention's softmax");
        assert!(
            !allowed(sys::GGML_OP_SOFT_MAX, 1, false),
            "never inside ggml-vulkan's MoE top-k fusion"
        );
        assert!(allowed(sys::GGML_OP_MUL_MAT, 2, false));
        assert!(
            !allowed(sys::GGML_OP_MUL_MAT, 1, false),
            "never between a one-row matmul and the ADD ggml-vulkan fuses with it"
        );
        assert!(
            !allowed(sys::GGML_OP_RMS_NORM, 8, false),
            "never between RMS_NORM and the MUL fused with it"
        );
        assert!(!allowed(sys::GGML_OP_ADD, 8, false));
    }

    #[test]
    fn a_cancel_stops_at_the_next_computed_node_whatever_its_op() {
        let mut c = Chunker::with_budget(u64::MAX);
        assert!(!c.ask(NORM, false));
        assert!(
            c.ask(NORM, true),
            "cancelled: the output is thrown away, so any node may end the chunk"
        );
        assert!(
            !c.ask(NodeWork { units: 0, boundary_allowed: false }, true),
            "but not a view, which computes nothing"
        );
        assert!(!c.at_boundary(true));
    }

    #[test]
    fn boundary_only_after_an_allowed_op_once_the_budget_is_spent() {
        let mut c = Chunker::with_budget(100);
        assert!(!c.ask(NORM, false));
        assert!(!c.ask(ATTN, false), "70 < 100: no boundary yet");
        assert!(!c.ask(NORM, false), "budget spent, but RMS_NORM may not end a chunk");
        assert!(c.ask(ATTN, false), "first allowed op after the budget");
        assert!(c.at_boundary(false));
    }

    #[test]
    fn a_decode_of_hidden_states_only_ends_right_after_them() {
        let mut c = Chunker::with_budget(u64::MAX);
        assert!(!c.ask_hidden_states(NORM, false), "reading on: no boundary there");
        let mut c = Chunker::with_budget(u64::MAX).hidden_states_only();
        assert!(c.ends_at_hidden_states());
        assert!(!c.ask(ATTN, false));
        assert!(c.ask_hidden_states(NORM, false), "a boundary right after them");
        assert!(!c.at_boundary(false), "which ends the computation");
        assert!(!c.ask(ATTN, false), "a later graph (the next ubatch) runs as before");
        assert!(c.ask_hidden_states(NORM, false));
        assert_eq!(c.total(), 2 * 10 + 2 * 60);
    }

    #[test]
    fn budget_resets_at_each_boundary() {
        let mut c = Chunker::with_budget(100);
        c.ask(NORM, false);
        c.ask(NORM, false);
        assert!(c.ask(ATTN, false));
        assert!(c.at_boundary(false));
        assert!(!c.ask(ATTN, false), "10 spent since the boundary");
    }

    #[test]
    fn pace_sets_the_budget_from_the_measured_speed_and_target() {
        let mut pace = Pace::new(Duration::from_millis(10));
        assert_eq!(pace.budget(), CHUNK_WORK, "before any encode");
        pace.observe(4_000_000_000, Duration::from_secs(1));
        assert_eq!(pace.budget(), 40_000_000, "4e9 units/s x 10 ms");
        assert_eq!(pace.budget_within(Duration::from_millis(2)), 8_000_000, "x 2 ms");
        assert_eq!(pace.budget_within(Duration::from_secs(1)), 40_000_000, "never past 10 ms");
        pace.observe(2_000_000_000, Duration::from_secs(1));
        assert_eq!(pace.budget(), 30_000_000, "halfway to the new speed");
        pace.observe(5, Duration::from_micros(10));
        assert_eq!(pace.budget(), 30_000_000, "too short to time: ignored");
        for _ in 0..20 {
            pace.observe(1, Duration::from_secs(100));
        }
        assert_eq!(pace.budget(), MIN_BUDGET, "never below the floor");
        let mut c = Chunker::with_budget(100);
        c.ask(NORM, false);
        c.ask(ATTN, false);
        assert_eq!(c.total(), 70, "every node's units count toward the speed");
    }
}
