//! One OS thread per native context. The thread owns the context, runs one call at a
//! time, and is stopped and joined when its `Worker` is dropped: native objects are only
//! ever freed on their own thread, after the call using them has returned.

use std::future::Future;
use std::pin::Pin;
use std::sync::{mpsc, Arc, Mutex};
use std::task::{ready, Context as TaskContext, Poll};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use crate::native::CancelFlag;

type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

/// Worker threads alive in this process: an embedder (or a test) can check that
/// tearing down a store left no native work running.
static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

pub fn live_workers() -> usize {
    LIVE.load(std::sync::atomic::Ordering::SeqCst)
}

/// Counts a worker thread from its start to the end of its state's drop.
struct Alive;

impl Alive {
    fn new() -> Self {
        LIVE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Alive
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Why a worker did not start, other than its state's own error.
#[derive(Debug, thiserror::Error)]
pub enum StartFailed {
    /// The OS gave no thread (thread or memory limits of the process).
    #[error("could not start a worker thread: {0}")]
    NoThread(std::io::Error),
    #[error("a worker thread panicked while building its state")]
    Panicked,
}

impl From<StartFailed> for crate::native::Error {
    fn from(e: StartFailed) -> Self {
        Self::Backend(e.to_string())
    }
}

/// A thread that owns a `S` and runs calls on it in order.
pub struct Worker<S: 'static> {
    jobs: Option<mpsc::Sender<(Job<S>, CancelFlag)>>,
    thread: Option<JoinHandle<()>>,
    running: Arc<Mutex<Running>>,
}

/// Which call is running, so that dropping the worker can stop it.
#[derive(Default)]
struct Running {
    shutting_down: bool,
    call: Option<CancelFlag>,
}

impl<S: 'static> Worker<S> {
    /// Start the thread and build its state on it. Blocks until `init` has returned.
    /// A thread the OS refuses, or an `init` that panics, is an error, not a panic.
    pub fn spawn<E: From<StartFailed> + Send + 'static>(
        name: &str,
        init: impl FnOnce() -> Result<S, E> + Send + 'static,
    ) -> Result<Self, E> {
        let (jobs_tx, jobs_rx) = mpsc::channel::<(Job<S>, CancelFlag)>();
        let (init_tx, init_rx) = mpsc::sync_channel::<Result<(), E>>(1);
        let running = Arc::new(Mutex::new(Running::default()));
        let thread_running = running.clone();
        let alive = Alive::new();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let _alive = alive; // dropped last, after `state`
                let mut state = match init() {
                    Ok(state) => {
                        let _ = init_tx.send(Ok(()));
                        state
                    }
                    Err(e) => {
                        let _ = init_tx.send(Err(e));
                        return;
                    }
                };
                for (job, call) in jobs_rx {
                    {
                        let mut running = lock(&thread_running);
                        if running.shutting_down {
                            break; // drops the job: its caller sees the call end
                        }
                        running.call = Some(call);
                    }
                    job(&mut state);
                    lock(&thread_running).call = None;
                }
                // `state` (the native context) is dropped here, on its own thread.
            })
            .map_err(StartFailed::NoThread)?;
        let worker = Self { jobs: Some(jobs_tx), thread: Some(thread), running };
        match init_rx.recv() {
            Ok(Ok(())) => Ok(worker),
            Ok(Err(e)) => Err(e),
            // The thread ended without a word: `init` panicked (dropping `worker` joins it).
            Err(_) => Err(StartFailed::Panicked.into()),
        }
    }

    /// `spawn` from async code: the state is built off the executor (creating a llama
    /// context allocates its memory; loading a projector reads its weights).
    pub async fn start<E: From<StartFailed> + Send + 'static>(
        name: &'static str,
        init: impl FnOnce() -> Result<S, E> + Send + 'static,
    ) -> Result<Self, E>
    where
        S: Send,
    {
        match tokio::task::spawn_blocking(move || Self::spawn(name, init)).await {
            Ok(result) => result,
            Err(_) => Err(StartFailed::Panicked.into()),
        }
    }

    /// Queue `f`. It gets the call's own flag, set if the returned [`Call`] is dropped
    /// before it finished or the worker shuts down; pass it to the native call's `Stop`.
    pub fn call<R: Send + 'static>(&self, f: impl FnOnce(&mut S, &CancelFlag) -> R + Send + 'static) -> Call<R> {
        let abandoned = CancelFlag::new();
        let (tx, rx) = oneshot::channel();
        let flag = abandoned.clone();
        let job: Job<S> = Box::new(move |state| {
            // A caller that is already gone gets no compute.
            if !tx.is_closed() {
                let _ = tx.send(f(state, &flag));
            }
        });
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send((job, abandoned.clone()));
        }
        Call { result: rx, abandoned, done: false }
    }
}

fn lock(m: &Mutex<Running>) -> std::sync::MutexGuard<'_, Running> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<S: 'static> Drop for Worker<S> {
    fn drop(&mut self) {
        {
            let mut running = lock(&self.running);
            running.shutting_down = true;
            if let Some(call) = &running.call {
                call.cancel();
            }
        }
        self.jobs = None; // closes the queue: the thread leaves its loop
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A call queued on a worker. Resolves to `None` if the worker stopped before
/// running it. Dropping an unfinished `Call` stops the native work it started.
pub struct Call<R> {
    result: oneshot::Receiver<R>,
    abandoned: CancelFlag,
    done: bool,
}

impl<R> Future for Call<R> {
    type Output = Option<R>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<R>> {
        let out = ready!(Pin::new(&mut self.result).poll(cx)).ok();
        self.done = true;
        Poll::Ready(out)
    }
}

impl<R> Drop for Call<R> {
    fn drop(&mut self) {
        if !self.done {
            self.abandoned.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::Error;
    use std::time::{Duration, Instant};

    /// Wait (at most a few seconds, so a broken stop fails instead of hanging) for `flag`.
    fn wait_for(flag: &CancelFlag) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !flag.is_cancelled() && Instant::now() < deadline {
            std::thread::yield_now();
        }
        flag.is_cancelled()
    }

    #[tokio::test]
    async fn runs_calls_in_order_on_its_own_state() {
        let worker = Worker::spawn("test", || Ok::<_, Error>(Vec::<u32>::new())).unwrap();
        let a = worker.call(|v, _| {
            v.push(1);
            v.len()
        });
        let b = worker.call(|v, _| {
            v.push(2);
            v.clone()
        });
        assert_eq!(a.await, Some(1));
        assert_eq!(b.await, Some(vec![1, 2]));
    }

    #[test]
    fn init_error_is_returned() {
        let refused = Error::InvalidArgument("no".into());
        let returned = refused.clone();
        assert_eq!(Worker::<()>::spawn("test", move || Err(returned)).err(), Some(refused));
    }

    #[test]
    fn a_panicking_init_is_an_error_not_a_panic() {
        let started = Worker::<()>::spawn("test", || -> Result<(), Error> { panic!("init failed") });
        assert!(matches!(started, Err(Error::Backend(m)) if m.contains("panicked")));
    }

    #[test]
    fn dropping_a_call_sets_its_flag_while_the_worker_lives_on() {
        let (started_tx, started_rx) = mpsc::channel();
        let (seen_tx, seen_rx) = mpsc::channel();
        let worker = Worker::spawn("test", || Ok::<_, Error>(())).unwrap();
        let call = worker.call(move |_, abandoned| {
            started_tx.send(()).unwrap();
            seen_tx.send(wait_for(abandoned)).unwrap();
        });
        started_rx.recv().unwrap();
        drop(call);
        assert!(seen_rx.recv().unwrap(), "the running call must see its flag set");
        drop(worker);
    }

    #[test]
    fn dropping_the_worker_stops_the_running_call() {
        let (started_tx, started_rx) = mpsc::channel();
        let worker = Worker::spawn("test", || Ok::<_, Error>(())).unwrap();
        let call = worker.call(move |_, abandoned| {
            started_tx.send(()).unwrap();
            if wait_for(abandoned) { "stopped" } else { "ran on" }
        });
        started_rx.recv().unwrap();
        drop(worker);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(rt.block_on(call), Some("stopped"));
    }
}
