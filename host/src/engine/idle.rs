//! Contexts that runs dropped, kept idle for a later run of the same tenant that asks
//! for the same settings. Taking one skips creating a context (KV cache, compute
//! buffers, a thread team and a worker thread: ~6 ms for SmolLM2, more for larger
//! models) and, through the leftover `native::Context::park` keeps, recomputing the
//! start of a prompt the two runs share: a chat template's system part, the earlier
//! turns of a conversation.
//!
//! Each loaded model has its own pool (the registry's entry owns it), so unloading or
//! replacing a model frees its idle contexts with it. A context is only ever handed
//! to a run of the group (tenant) whose run left it: the leftover is invisible to the
//! next run except in how fast its prompt is evaluated, and that timing must not
//! cross tenants.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::native::{Context, ContextParams};
use crate::worker::{Tracker, Worker};

/// The idle contexts of one loaded model, most recently parked last.
pub struct IdleContexts {
    /// How many it keeps: the registry's setting, shared by all its entries.
    keep: Arc<AtomicUsize>,
    idle: Mutex<VecDeque<Idle>>,
}

struct Idle {
    group: String,
    /// The settings the run asked for (after the host's defaults), which is what a
    /// later `context.create` is matched on.
    params: ContextParams,
    worker: Worker<Context>,
}

impl IdleContexts {
    pub(crate) fn new(keep: Arc<AtomicUsize>) -> Self {
        Self { keep, idle: Mutex::default() }
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Idle>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a dropped context is worth parking at all.
    pub(crate) fn keeps_any(&self) -> bool {
        self.keep.load(Relaxed) > 0
    }

    /// The most recently parked context of `group` made with `params`, if any.
    pub(crate) fn take(&self, group: &str, params: &ContextParams) -> Option<Worker<Context>> {
        let mut idle = self.lock();
        let at = idle.iter().rposition(|e| e.group == group && e.params == *params)?;
        idle.remove(at).map(|e| e.worker)
    }

    /// Keep `worker`, whose context was parked and has no call queued, for `group`;
    /// the least recently parked go when more than the setting are idle.
    pub(crate) fn put(&self, group: String, params: ContextParams, worker: Worker<Context>) {
        worker.retrack(&Tracker::default()); // idle: no run waits for it
        let mut idle = self.lock();
        idle.push_back(Idle { group, params, worker });
        let evicted = self.trim(&mut idle);
        drop(idle);
        drop(evicted); // each thread frees its context on its own
    }

    /// Idle contexts beyond the setting, oldest first, taken out.
    fn trim(&self, idle: &mut VecDeque<Idle>) -> Vec<Idle> {
        let keep = self.keep.load(Relaxed);
        let over = idle.len().saturating_sub(keep);
        idle.drain(..over).collect()
    }

    /// Let go of contexts beyond the (maybe lowered) setting.
    pub(crate) fn shrink(&self) {
        let evicted = self.trim(&mut self.lock());
        drop(evicted);
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}
