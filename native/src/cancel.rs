//! The cancel byte: a latch read by llama.cpp's abort callback after every graph node.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// A latch shared between everyone who may cancel a call and the native call itself.
///
/// Cloning shares the latch. Once set it stays set. Reads and writes are single relaxed
/// atomic operations: the abort callback runs after every graph node and must cost
/// nothing measurable, and a cancel only needs to be seen "soon", not ordered with
/// other memory.
#[derive(Clone, Debug, Default)]
pub struct CancelFlag(Arc<FlagState>);

#[derive(Debug, Default)]
struct FlagState {
    cancelled: AtomicBool,
    /// Test hook: when non-zero, the `trip_at`-th poll sets the flag (see [`CancelFlag::trip_after`]).
    trip_at: AtomicU64,
    polls: AtomicU64,
}

impl CancelFlag {
    /// A latch not yet set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Set the latch. Every call polling this flag stops at its next check.
    pub fn cancel(&self) {
        self.0.cancelled.store(true, Relaxed);
    }

    /// Whether the latch is set (a plain read: it does not count as a native poll).
    pub fn is_cancelled(&self) -> bool {
        self.0.cancelled.load(Relaxed)
    }

    /// Test hook for deterministic cancels: the `n`-th poll from native code (1-based;
    /// a decode polls once after every graph node) sets the flag, as if `cancel()` had
    /// been called right after that node. `n == 0` disarms.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn trip_after(&self, n: u64) {
        self.0.polls.store(0, Relaxed);
        self.0.trip_at.store(n, Relaxed);
    }

    /// Test hook: a flag that never trips and counts its polls, to learn how many
    /// graph nodes (or boundaries) a call has before tripping it at one of them.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn counting() -> Self {
        let flag = Self::new();
        flag.trip_after(u64::MAX);
        flag
    }

    /// How many times native code has polled this flag since the last `trip_after`.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn polls(&self) -> u64 {
        self.0.polls.load(Relaxed)
    }

    /// A handle that does not keep the latch alive (for registries of shared tokens).
    pub fn downgrade(&self) -> WeakCancelFlag {
        WeakCancelFlag(Arc::downgrade(&self.0))
    }

    /// Whether two handles share one latch.
    pub fn same_as(&self, other: &CancelFlag) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The read native code does: the latch, plus the test hook when armed (which then
    /// counts every poll, set or not, so a test can tell that no graph ran at all).
    fn poll(&self) -> bool {
        let state = &*self.0;
        let trip_at = state.trip_at.load(Relaxed);
        if trip_at != 0 && state.polls.fetch_add(1, Relaxed) + 1 >= trip_at {
            self.cancel();
        }
        state.cancelled.load(Relaxed)
    }
}

/// A [`CancelFlag`] that lives only as long as some strong handle does.
#[derive(Clone, Debug)]
pub struct WeakCancelFlag(std::sync::Weak<FlagState>);

impl WeakCancelFlag {
    /// The latch, if some strong handle still holds it.
    pub fn upgrade(&self) -> Option<CancelFlag> {
        self.0.upgrade().map(CancelFlag)
    }
}

/// What a running native call checks: the caller's token, or the call's own flag (set
/// when the call is abandoned: its future dropped, its context or store torn down); or,
/// for a step that computes several callers' rows at once, any of theirs.
#[derive(Clone, Copy, Debug)]
pub enum Stop<'a> {
    /// One caller's call.
    Call {
        /// The caller's cancel token.
        token: &'a CancelFlag,
        /// The call's own flag, set when the call is abandoned; `None` when it has none.
        call: Option<&'a CancelFlag>,
    },
    /// Stop when any of these would (a batched step: one member's cancel stops it).
    Any(&'a [Stop<'a>]),
}

impl<'a> Stop<'a> {
    /// Stop when `token` is cancelled.
    pub fn on(token: &'a CancelFlag) -> Self {
        Self::Call { token, call: None }
    }

    /// Stop when `token` is cancelled or the call is abandoned.
    pub fn on_either(token: &'a CancelFlag, call: &'a CancelFlag) -> Self {
        Self::Call { token, call: Some(call) }
    }

    /// The read done after every graph node (a poll, as far as the test hook counts).
    pub fn requested(&self) -> bool {
        match self {
            Self::Call { token, call } => token.poll() || call.is_some_and(CancelFlag::poll),
            Self::Any(stops) => stops.iter().any(Stop::requested),
        }
    }

    /// `requested` without counting a poll: for the entry check and for deciding a
    /// call's status afterwards.
    pub fn is_set(&self) -> bool {
        match self {
            Self::Call { token, call } => {
                token.is_cancelled() || call.is_some_and(CancelFlag::is_cancelled)
            }
            Self::Any(stops) => stops.iter().any(Stop::is_set),
        }
    }
}

/// `ggml_abort_callback`: `data` points at the running call's [`Stop`].
///
/// # Safety
///
/// `data` must be null or point at a live `Stop` for the whole call. ggml calls it on
/// the decoding thread (graph thread 0), which `Stop` allows anyway: it only reads atomics.
pub(crate) unsafe extern "C" fn abort_callback(data: *mut std::ffi::c_void) -> bool {
    // SAFETY: by this function's contract. It is installed only by `AbortCallback`
    // (context.rs) with a pointer to a `Stop` that outlives the `llama_decode` call, and
    // removed before that `Stop` is dropped.
    match unsafe { data.cast::<Stop>().as_ref() } {
        Some(stop) => stop.requested(),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latch_is_shared_and_stays_set() {
        let a = CancelFlag::new();
        let b = a.clone();
        assert!(!b.is_cancelled());
        a.cancel();
        assert!(b.is_cancelled() && a.same_as(&b));
        assert!(Stop::on(&b).requested());
    }

    #[test]
    fn trip_wire_sets_the_flag_at_the_nth_poll() {
        let token = CancelFlag::new();
        token.trip_after(3);
        let stop = Stop::on(&token);
        assert!(!stop.requested());
        assert!(!stop.requested());
        assert!(!token.is_cancelled());
        assert!(stop.requested());
        assert!(token.is_cancelled());
        assert_eq!(token.polls(), 3);
    }

    #[test]
    fn either_flag_stops_a_call() {
        let token = CancelFlag::new();
        let call = CancelFlag::new();
        let stop = Stop::on_either(&token, &call);
        assert!(!stop.requested() && !stop.is_set());
        call.cancel();
        assert!(stop.requested() && stop.is_set());
        assert!(!token.is_cancelled(), "abandoning a call must not cancel the caller's token");
    }

    #[test]
    fn any_member_stops_a_step_and_each_member_can_tell_whether_it_was_the_one() {
        let (a, b, c) = (CancelFlag::new(), CancelFlag::new(), CancelFlag::new());
        let members = [Stop::on(&a), Stop::on(&b), Stop::on(&c)];
        let step = Stop::Any(&members);
        b.trip_after(2);
        assert!(!step.requested(), "poll 1: nobody is cancelled");
        assert!(step.requested(), "poll 2 trips b");
        assert!(step.is_set());
        assert_eq!(members.map(|m| m.is_set()), [false, true, false]);
    }

    #[test]
    fn abort_callback_reads_the_stop_and_tolerates_null() {
        let token = CancelFlag::new();
        let stop = Stop::on(&token);
        let data = &stop as *const Stop as *mut std::ffi::c_void;
        // SAFETY: `data` points at `stop`, alive until the end of the test.
        assert!(!unsafe { abort_callback(data) });
        token.cancel();
        // SAFETY: as above.
        assert!(unsafe { abort_callback(data) });
        // SAFETY: null is allowed by the contract.
        assert!(!unsafe { abort_callback(std::ptr::null_mut()) });
    }
}
