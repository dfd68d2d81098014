//! A call started without waiting (`start-decode`, `start-encode-chunk`): pollable
//! until done, finished once, and stopped in flight if dropped unfinished.

use wasmtime_wasi::p2::Pollable;

use super::{Error, PendingSlot};
use crate::native;
use crate::worker::Call;

pub struct Pending<T> {
    state: State<T>,
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
        Self { state: State::Running(call), _slot: slot }
    }

    /// The call's result, waiting for it if needed; an error if already taken.
    pub(crate) async fn finish(&mut self) -> Result<T, Error> {
        self.ready().await;
        match std::mem::replace(&mut self.state, State::Taken) {
            State::Finished(result) => result,
            State::Taken => Err(Error::InvalidArgument("finish was already called".into())),
            State::Running(_) => unreachable!("ready() leaves no call running"),
        }
    }
}

#[wasmtime_wasi::async_trait]
impl<T: Send + 'static> Pollable for Pending<T> {
    async fn ready(&mut self) {
        if let State::Running(call) = &mut self.state {
            // Cancel-safe: `poll` drops this future every round it is not ready, and
            // awaiting `&mut Call` neither consumes nor abandons the call.
            let outcome = call.await;
            self.state = State::Finished(finished(outcome));
        }
    }
}

/// The result of a worker call, which is `None` if its worker stopped first.
pub(crate) fn finished<T>(outcome: Option<native::Result<T>>) -> Result<T, Error> {
    match outcome {
        Some(result) => result.map_err(Error::from),
        None => Err(Error::Backend("the context was dropped before the call finished".into())),
    }
}
