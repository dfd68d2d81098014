//! The scheduler's eval callback, and the scope that ties it to one computation: how a
//! cancel reaches work the abort callback does not (the CPU backend alone exports that
//! hook): mtmd's encodes, and decodes on a GPU backend.
//!
//! ggml's scheduler, given an eval callback, asks it node by node whether it wants to
//! see a node's output; on the first yes it computes the nodes up to that one as a view
//! of the graph, synchronises the backend, and calls back; a false there ends the
//! *current split* only. So a stop is only ever noticed at a boundary, and a stopped
//! decode's later splits still run and `llama_decode` returns success with garbage:
//! whoever runs a computation in a scope reads [`ScopeReport::stopped`] and treats the
//! call as cancelled (a decode is then rolled back). Where boundaries fall is
//! [`Chunker`]'s decision.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;

use llama_cpp_sys_2 as sys;

use super::cancel::Stop;
use super::chunker::{Chunker, NodeWork};

/// The running computation's state, reachable from the eval callback through `SCOPE`.
struct ScopeState<'a> {
    stop: Stop<'a>,
    chunker: RefCell<Chunker>,
    /// Called at every boundary the computation goes on from (the cores' turn passes
    /// there: [`super::CoreTurn::pass_if_due`]).
    on_boundary: Option<RefCell<&'a mut dyn FnMut()>>,
    boundaries: Cell<u64>,
    stopped: Cell<bool>,
}

std::thread_local! {
    /// The computation running on this thread, if any (null outside `in_eval_scope`).
    static SCOPE: Cell<*const ScopeState<'static>> = const { Cell::new(std::ptr::null()) };
}

/// What the eval callback saw during one [`in_eval_scope`] call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScopeReport {
    /// Whether the callback stopped the computation at a boundary.
    pub stopped: bool,
    /// Boundaries the computation reached (each one a point where it could stop).
    pub boundaries: u64,
    /// Work units of the nodes computed (what the pace learns from).
    pub units: u64,
}

/// Run `f` with this thread's eval callbacks tied to `stop` and `chunker`, and only for
/// the duration of `f`; `on_boundary` runs at every boundary it goes on from. The state lives on this function's stack and the thread-local
/// points at it only between entry and exit (restored on unwind too), so no order of
/// drops or `mem::forget` can leave the callback holding freed state.
pub(crate) fn in_eval_scope<'a, R>(
    stop: Stop<'a>,
    chunker: Chunker,
    on_boundary: Option<&'a mut dyn FnMut()>,
    f: impl FnOnce() -> R,
) -> (R, ScopeReport) {
    let state = ScopeState {
        stop,
        chunker: RefCell::new(chunker),
        on_boundary: on_boundary.map(RefCell::new),
        boundaries: Cell::new(0),
        stopped: Cell::new(false),
    };
    /// Restores the outer scope when `in_eval_scope` returns or unwinds.
    struct Restore(*const ScopeState<'static>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPE.with(|s| s.set(self.0));
        }
    }
    // The lifetime is erased only while `state` is alive: `_restore` (declared after
    // it, so dropped before it) takes the pointer out of the thread-local first.
    let ptr = (&state as *const ScopeState<'_>).cast::<ScopeState<'static>>();
    let _restore = Restore(SCOPE.with(|s| s.replace(ptr)));
    let out = f();
    let units = state.chunker.borrow().total();
    (out, ScopeReport { stopped: state.stopped.get(), boundaries: state.boundaries.get(), units })
}

/// `ggml_backend_sched_eval_callback`, installed on every media context and on every
/// text context whose model has layers on a device.
///
/// # Safety
///
/// When `ask` is true, `t` must be null or point at a live graph node whose `src`
/// pointers are null or live tensors (what the scheduler passes). With `ask` false `t` is
/// not read. The user data is ignored.
pub(crate) unsafe extern "C" fn eval_callback(
    t: *mut sys::ggml_tensor,
    ask: bool,
    _: *mut c_void,
) -> bool {
    SCOPE.with(|scope| {
        // SAFETY: non-null only inside `in_eval_scope` on this thread, whose stack
        // frame owns the state.
        let Some(state) = (unsafe { scope.get().as_ref() }) else {
            return !ask; // outside a scope: want nothing, stop nothing
        };
        if ask {
            // SAFETY: by this function's contract, `t` is null or a live node of the graph
            // the scheduler is computing, with live or null sources.
            let node = unsafe { node_work(t) };
            let mut chunker = state.chunker.borrow_mut();
            // SAFETY: `t` is null or a live node the scheduler is not writing while it
            // asks (this function's contract), as `holds_hidden_states` requires.
            if chunker.ends_at_hidden_states() && unsafe { holds_hidden_states(t) } {
                chunker.ask_hidden_states(node, state.stop.is_set())
            } else {
                chunker.ask(node, state.stop.is_set())
            }
        } else {
            state.boundaries.set(state.boundaries.get() + 1);
            let cancelled = state.stop.requested();
            state.stopped.set(state.stopped.get() || cancelled);
            let go_on = state.chunker.borrow_mut().at_boundary(cancelled);
            if let (true, Some(hook)) = (go_on, &state.on_boundary) {
                // Never re-entered: the callback runs on this thread, between graph views.
                if let Ok(mut hook) = hook.try_borrow_mut() {
                    (*hook)();
                }
            }
            go_on
        }
    })
}

/// Whether `t` is the node llama.cpp's model graphs name `result_norm`: the final norm,
/// whose output is the hidden states an embedding reads (`t_embd`); only the output
/// head comes after it.
///
/// # Safety
///
/// `t` must be null or point at a tensor that is live and not written during the call.
unsafe fn holds_hidden_states(t: *const sys::ggml_tensor) -> bool {
    // SAFETY: null or live and unchanging (this function's contract).
    let Some(t) = (unsafe { t.as_ref() }) else { return false };
    let name = t.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8);
    name.eq(b"result_norm".iter().copied())
}

/// The work a graph node stands for, read from its shape and its sources'.
///
/// # Safety
///
/// `t` must be null or point at a tensor that is live and not written during the call,
/// whose `src[0]` and `src[1]` are null or such tensors too.
unsafe fn node_work(t: *const sys::ggml_tensor) -> NodeWork {
    // SAFETY: null or live and unchanging (this function's contract).
    let Some(t) = (unsafe { t.as_ref() }) else {
        return NodeWork { units: 0, boundary_allowed: false };
    };
    let elements = t.ne.iter().map(|&d| d.max(0) as u64).product::<u64>();
    // Multiply-adds an output element costs: a matmul's inner dimension (its first
    // source's rows), attention's keys (its second source, K: [head, keys, ...]) twice
    // (a computed node all the same if it has none).
    // Left out of the pace, attention at 2000 positions was ~40% of a layer's work that
    // the budget between boundaries did not see.
    let source = |i: usize| {
        // SAFETY: `src[0]` and `src[1]` are null or live tensors (this function's contract).
        unsafe { t.src[i].as_ref() }
    };
    let inner = match t.op {
        sys::GGML_OP_FLASH_ATTN_EXT => source(1).map_or(1, |k| 2 * k.ne[1].max(0) as u64),
        _ => source(0).map_or(0, |src| src.ne[0].max(0) as u64),
    };
    // A SOFT_MAX's mask is its second source (only its presence is read).
    NodeWork::of(t.op, elements, t.ne[1].max(0) as u64, inner, !t.src[1].is_null())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CancelFlag;

    fn node(op: sys::ggml_op) -> sys::ggml_tensor {
        // SAFETY: ggml_tensor is a plain C struct; all-zero is a valid (empty) value.
        let mut t: sys::ggml_tensor = unsafe { std::mem::zeroed() };
        t.op = op;
        t.ne = [4, 4, 1, 1];
        t
    }

    fn call(t: &mut sys::ggml_tensor, ask: bool) -> bool {
        // SAFETY: `t` is a live tensor (a borrow) whose sources are null (`node` zeroes
        // them), as `eval_callback` requires.
        unsafe { eval_callback(t, ask, std::ptr::null_mut()) }
    }

    #[test]
    fn outside_a_scope_the_callback_asks_for_nothing() {
        let mut attn = node(sys::GGML_OP_FLASH_ATTN_EXT);
        assert!(!call(&mut attn, true));
        assert!(call(&mut attn, false), "and never stops anything");
    }

    #[test]
    fn a_scope_routes_this_threads_callbacks_to_its_stop_until_it_ends() {
        let token = CancelFlag::new();
        let mut attn = node(sys::GGML_OP_FLASH_ATTN_EXT);
        let mut norm = node(sys::GGML_OP_RMS_NORM);
        let ((), report) =
            in_eval_scope(Stop::on(&token), Chunker::with_budget(u64::MAX), None, || {
                assert!(!call(&mut norm, true), "no cancel, budget not spent: no boundary");
                token.cancel();
                assert!(call(&mut attn, true), "a cancel asks at the next computed node");
                assert!(!call(&mut attn, false), "and stops there");
                // Another thread has no scope: its callbacks are idle.
                std::thread::scope(|s| {
                    s.spawn(|| assert!(!call(&mut node(sys::GGML_OP_FLASH_ATTN_EXT), true)));
                });
            });
        assert_eq!(
            report,
            ScopeReport { stopped: true, boundaries: 1, units: 32 },
            "units: RMS_NORM and FLASH_ATTN_EXT, 4x4 each"
        );
        assert!(!call(&mut attn, true), "the scope is gone with its call");
    }

    #[test]
    fn attention_counts_its_keys_twice_a_matmul_its_inner_dimension() {
        let mut keys = node(sys::GGML_OP_NONE);
        keys.ne = [4, 100, 1, 1];
        let mut attn = node(sys::GGML_OP_FLASH_ATTN_EXT);
        attn.src[1] = &mut keys;
        let mut weights = node(sys::GGML_OP_NONE);
        weights.ne = [50, 4, 1, 1];
        let mut matmul = node(sys::GGML_OP_MUL_MAT);
        matmul.src[0] = &mut weights;
        let none: [Stop<'_>; 0] = [];
        let ((), report) =
            in_eval_scope(Stop::Any(&none), Chunker::with_budget(u64::MAX), None, || {
                call(&mut attn, true);
                call(&mut matmul, true);
            });
        assert_eq!(report.units, 16 * 2 * 100 + 16 * 50, "4x4 outputs each");
    }

    #[test]
    fn nested_scopes_restore_the_outer_one_even_on_unwind() {
        let (outer_token, inner_token) = (CancelFlag::new(), CancelFlag::new());
        inner_token.cancel();
        let mut attn = node(sys::GGML_OP_FLASH_ATTN_EXT);
        let ((), outer) =
            in_eval_scope(Stop::on(&outer_token), Chunker::with_budget(u64::MAX), None, || {
                let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    in_eval_scope(
                        Stop::on(&inner_token),
                        Chunker::with_budget(u64::MAX),
                        None,
                        || panic!("inside the inner scope"),
                    )
                }));
                assert!(unwound.is_err());
                assert!(
                    !call(&mut attn, true),
                    "the outer scope is back: not cancelled, budget not spent"
                );
            });
        assert_eq!(outer, ScopeReport { stopped: false, boundaries: 0, units: 16 });
        assert!(!call(&mut attn, true) && call(&mut attn, false), "and no scope after it");
    }

    #[test]
    fn the_trip_wire_counts_boundaries() {
        let token = CancelFlag::new();
        token.trip_after(2);
        let mut attn = node(sys::GGML_OP_FLASH_ATTN_EXT);
        let ((), report) = in_eval_scope(Stop::on(&token), Chunker::with_budget(1), None, || {
            assert!(call(&mut attn, true) && call(&mut attn, false), "boundary 1 goes on");
            assert!(call(&mut attn, true) && !call(&mut attn, false), "boundary 2 stops");
        });
        assert!(report.stopped && token.is_cancelled());
    }
}
