//! A call started without waiting (`start-decode`, `start-encode-chunk`): pollable
//! until done, finished once, and stopped in flight if dropped unfinished.
//!
//! Pollables here are never children of the resource they watch (wasmtime_wasi's
//! `subscribe` makes them so, and then dropping the resource first traps the plugin
//! with "resource has children"). Garbage-collected guests (Python, JavaScript) drop
//! in any order, so the call's state is shared instead: the resource owns it, the
//! pollable holds a weak reference, and a pollable whose resource was dropped is
//! simply ready.

use std::sync::{Arc, Weak};

use tokio::sync::Mutex;
use wasmtime::component::{Resource, ResourceTable};
use wasmtime_wasi::p2::{subscribe, DynPollable, Pollable};

use super::{Error, PendingSlot};
use crate::native;
use crate::worker::Call;

pub struct Pending<T> {
    state: Arc<Mutex<State<T>>>,
    /// Counts against max-pending-calls until the resource is dropped.
    _slot: PendingSlot,
}

enum State<T> {
    Running(Call<native::Result<T>>),
    Finished(Result<T, Error>),
    Taken,
}

impl<T: Send + 'static> Pending<T> {
    pub(crate) fn new(call: Call<native::Result<T>>, slot: PendingSlot) -> Self {
        Self { state: Arc::new(Mutex::new(State::Running(call))), _slot: slot }
    }

    /// The call's result, waiting for it if needed; an error if already taken.
    pub(crate) async fn finish(&mut self) -> Result<T, Error> {
        let mut state = self.state.lock().await;
        state.ready().await;
        match std::mem::replace(&mut *state, State::Taken) {
            State::Finished(result) => result,
            State::Taken => Err(Error::InvalidArgument("finish was already called".into())),
            State::Running(_) => unreachable!("ready() leaves no call running"),
        }
    }

    /// A pollable ready once the call has ended (or the pending resource was dropped).
    pub(crate) fn subscribe(
        table: &mut ResourceTable,
        pending: &Resource<Self>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        let state = Arc::downgrade(&table.get(pending)?.state);
        subscribe_shared(table, state)
    }
}

#[wasmtime_wasi::async_trait]
impl<T: Send + 'static> Pollable for State<T> {
    async fn ready(&mut self) {
        if let State::Running(call) = self {
            // Cancel-safe: `poll` drops this future every round it is not ready, and
            // awaiting `&mut Call` neither consumes nor abandons the call.
            let outcome = call.await;
            *self = State::Finished(finished(outcome));
        }
    }
}

/// A `pollable` watching state that a resource owns, without being that resource's
/// child: either may be dropped first. Ready at once if the state is gone.
struct Watch<S>(Weak<Mutex<S>>);

#[wasmtime_wasi::async_trait]
impl<S: Pollable> Pollable for Watch<S> {
    async fn ready(&mut self) {
        // The strong reference lives only while `poll` waits on this future, and no
        // other host call on the store runs then (`poll` holds it), so the owner's
        // drop is never delayed by it in practice. Locking is cancel-safe.
        if let Some(state) = self.0.upgrade() {
            state.lock().await.ready().await;
        }
    }
}

/// A new `pollable` for `state` that is not a child of the resource owning it; ready
/// at once if `state` is already gone (`Weak::new()` for a pollable that is ready).
pub(crate) fn subscribe_shared<S: Pollable>(
    table: &mut ResourceTable,
    state: Weak<Mutex<S>>,
) -> wasmtime::Result<Resource<DynPollable>> {
    // The watch is owned by the pollable: deleting the pollable deletes it.
    let watch = table.push(Watch(state))?;
    subscribe(table, watch)
}

/// The result of a worker call, which is `None` if its worker stopped first.
pub(crate) fn finished<T>(outcome: Option<native::Result<T>>) -> Result<T, Error> {
    match outcome {
        Some(result) => result.map_err(Error::from),
        None => Err(Error::Backend("the context was dropped before the call finished".into())),
    }
}
