//! One OS thread per native context. The thread owns the context, runs one call at a
//! time, and is stopped when its `Worker` is dropped: native objects are only ever
//! freed on their own thread, after the call using them has returned.
//!
//! Dropping a `Worker` never blocks (it is dropped on async executor threads, e.g.
//! when a deadline drops a whole store): it stops the running call and lets the thread
//! wind down on its own. Whoever must know that the native work has ended awaits
//! [`Worker::stop`] for one worker or [`Tracker::all_stopped`] for a group of them.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{ready, Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, Notify};

use crate::native::CancelFlag;

/// A queued call. It runs on the worker's state and calls `finished` once its work is
/// done, before its caller hears back, so the caller sees the time counted.
type Job<S> = Box<dyn FnOnce(&mut S, &dyn Fn()) + Send>;

/// Counts threads (workers, and blocking calls run with [`Tracker::blocking`]) from
/// their start to the end of their native state's drop. A store has one (its run
/// returns only once it reads zero) and a host has one over all its stores.
#[derive(Clone, Default)]
pub struct Tracker {
    counts: Vec<Arc<Count>>,
}

#[derive(Default)]
struct Count {
    live: AtomicUsize,
    zero: Notify,
    /// Nanoseconds the counted threads spent running calls (not waiting for them).
    busy_ns: AtomicU64,
}

impl Tracker {
    pub fn new() -> Self {
        Self { counts: vec![Arc::default()] }
    }

    /// A tracker of its own whose threads also count in `self`.
    pub fn child(&self) -> Self {
        let mut counts = vec![Arc::default()];
        counts.extend(self.counts.iter().cloned());
        Self { counts }
    }

    /// Threads alive now that count in this tracker.
    pub fn live(&self) -> usize {
        self.counts.first().map_or(0, |c| c.live.load(SeqCst))
    }

    /// Time the threads counted here spent running native calls (jobs of workers and
    /// blocking calls), summed over threads.
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.counts.first().map_or(0, |c| c.busy_ns.load(Relaxed)))
    }

    /// Add `since`'s elapsed time to every tracker this one counts in.
    fn add_busy(counts: &[Arc<Count>], since: Instant) {
        let ns = since.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        for count in counts {
            count.busy_ns.fetch_add(ns, Relaxed);
        }
    }

    /// Resolves once no thread counted here is alive.
    pub async fn all_stopped(&self) {
        let Some(count) = self.counts.first() else { return };
        loop {
            let notified = count.zero.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if count.live.load(SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Count one more thread here until the returned guard is dropped: for work that
    /// runs on a thread this tracker does not own (a seat of a batched context), so a
    /// run still waits for it.
    pub(crate) fn count(&self) -> Alive {
        self.alive()
    }

    fn alive(&self) -> Alive {
        for count in &self.counts {
            count.live.fetch_add(1, SeqCst);
        }
        Alive(self.counts.clone())
    }

    /// Run `f` on a blocking thread, counted here until it returns. For native calls
    /// that cannot be stopped midway (tokenizing): they leave the executor free, and
    /// a run still waits for them before it returns.
    /// Runs inside the caller's `tracing` span (a run's), so what it logs is attributed.
    pub async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Option<R> {
        let alive = self.alive();
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            let _in_span = span.enter();
            let started = Instant::now();
            let out = f();
            Self::add_busy(&alive.0, started);
            drop(alive);
            out
        })
        .await
        .ok()
    }
}

/// One counted thread; dropped last on that thread.
pub(crate) struct Alive(Vec<Arc<Count>>);

impl Alive {
    /// Add `busy` to the native time of every tracker this counts in.
    pub(crate) fn add_busy(&self, busy: Duration) {
        let ns = busy.as_nanos().min(u64::MAX as u128) as u64;
        for count in &self.0 {
            count.busy_ns.fetch_add(ns, Relaxed);
        }
    }
}

impl Drop for Alive {
    /// Outermost tracker first: whoever sees a store's count reach zero must also see
    /// the thread gone from the host's count.
    fn drop(&mut self) {
        for count in self.0.iter().rev() {
            if count.live.fetch_sub(1, SeqCst) == 1 {
                count.zero.notify_waiters();
            }
        }
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
    /// Resolves when the thread has dropped its state and is about to end.
    exited: Option<oneshot::Receiver<()>>,
    running: Arc<Mutex<Running>>,
    /// Where the thread is counted now ([`Worker::retrack`]); the thread drops it last.
    alive: Arc<Mutex<Alive>>,
    /// Calls queued or running.
    queued: Arc<AtomicUsize>,
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
        tracker: &Tracker,
        init: impl FnOnce() -> Result<S, E> + Send + 'static,
    ) -> Result<Self, E> {
        let (jobs_tx, jobs_rx) = mpsc::channel::<(Job<S>, CancelFlag)>();
        let (init_tx, init_rx) = mpsc::sync_channel::<Result<(), E>>(1);
        let (exit_tx, exit_rx) = oneshot::channel();
        let running = Arc::new(Mutex::new(Running::default()));
        let thread_running = running.clone();
        let alive = Arc::new(Mutex::new(tracker.alive()));
        let thread_alive = alive.clone();
        let queued = Arc::new(AtomicUsize::new(0));
        // The thread works for the caller's run: llama.cpp's log lines from its calls
        // (routed to `tracing` on this thread) carry the run's span.
        let span = tracing::Span::current();
        // Detached: nobody joins it; `exited` and the tracker say when it is done.
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let _alive = thread_alive; // dropped last, after `state`
                let _in_span = span.entered();
                let _exit = ExitSignal(Some(exit_tx));
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
                while let Some((job, call)) = next_job(&jobs_rx) {
                    {
                        let mut running = lock(&thread_running);
                        if running.shutting_down {
                            break; // drops the job: its caller sees the call end
                        }
                        running.call = Some(call);
                    }
                    let started = Instant::now();
                    job(&mut state, &|| Tracker::add_busy(&lock(&_alive).0, started));
                    lock(&thread_running).call = None;
                }
                // `state` (the native context) is dropped here, on its own thread.
            })
            .map_err(StartFailed::NoThread)?;
        let worker = Self { jobs: Some(jobs_tx), exited: Some(exit_rx), running, alive, queued };
        match init_rx.recv() {
            Ok(Ok(())) => Ok(worker),
            Ok(Err(e)) => Err(e),
            // The thread ended without a word: `init` panicked.
            Err(_) => Err(StartFailed::Panicked.into()),
        }
    }

    /// Stop the running call, close the queue, and wait (without blocking the
    /// executor) until the thread has dropped its state.
    pub async fn stop(mut self) {
        let exited = self.exited.take();
        drop(self);
        if let Some(exited) = exited {
            let _ = exited.await;
        }
    }

    /// `spawn` from async code: the state is built off the executor (creating a llama
    /// context allocates its memory; loading a projector reads its weights).
    pub async fn start<E: From<StartFailed> + Send + 'static>(
        name: &'static str,
        tracker: &Tracker,
        init: impl FnOnce() -> Result<S, E> + Send + 'static,
    ) -> Result<Self, E>
    where
        S: Send,
    {
        let (tracker, span) = (tracker.clone(), tracing::Span::current());
        match tokio::task::spawn_blocking(move || {
            span.in_scope(|| Self::spawn(name, &tracker, init))
        })
        .await
        {
            Ok(result) => result,
            Err(_) => Err(StartFailed::Panicked.into()),
        }
    }

    /// Count the thread in `tracker` from now on instead of where it was counted: an
    /// idle worker handed from one store to another (or to nobody: `Tracker::default()`)
    /// between calls. The old trackers see it gone once the new ones count it.
    pub fn retrack(&self, tracker: &Tracker) {
        let counted = tracker.alive();
        let before = std::mem::replace(&mut *lock(&self.alive), counted);
        drop(before);
    }

    /// Whether no call is queued or running now.
    pub fn is_idle(&self) -> bool {
        self.queued.load(SeqCst) == 0
    }

    /// Queue `f`. It gets the call's own flag, set if the returned [`Call`] is dropped
    /// before it finished or the worker shuts down; pass it to the native call's `Stop`.
    /// It runs in the caller's `tracing` span.
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut S, &CancelFlag) -> R + Send + 'static,
    ) -> Call<R> {
        let abandoned = CancelFlag::new();
        let (tx, rx) = oneshot::channel();
        let flag = abandoned.clone();
        let span = tracing::Span::current();
        let queued = self.queued.clone();
        let job: Job<S> = Box::new(move |state, finished| {
            let _in_span = span.enter();
            // A caller that is already gone gets no compute.
            let result = (!tx.is_closed()).then(|| f(state, &flag));
            // Before the caller hears back: whoever has the result sees the call's time
            // counted (in the run it was for, not one the worker is handed to next) and
            // the worker idle.
            finished();
            queued.fetch_sub(1, SeqCst);
            if let Some(result) = result {
                let _ = tx.send(result);
            }
        });
        if let Some(jobs) = &self.jobs {
            self.queued.fetch_add(1, SeqCst);
            let _ = jobs.send((job, abandoned.clone()));
        }
        Call { result: rx, abandoned, done: false }
    }
}

/// How long a worker that finished a call keeps looking for the next one before it
/// sleeps. A guest's calls come in runs (`decode`, then `logits-ith`, then the next
/// `decode` after its sampling), and waking a sleeping thread costs tens of µs on a VM:
/// a few % of a generated token at a few hundred tokens/s (bench/RESULTS-t2.md, guest
/// loop). Spinning costs a core for at most this long after each call, far less than
/// ggml's own idle polling.
const SPIN_FOR_NEXT_CALL: Duration = Duration::from_micros(200);

/// The next call for a worker: spin a while for it, then sleep until it comes. `None`
/// once the `Worker` is gone.
fn next_job<T>(jobs: &mpsc::Receiver<T>) -> Option<T> {
    let started = Instant::now();
    loop {
        match jobs.try_recv() {
            Ok(job) => return Some(job),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) if started.elapsed() < SPIN_FOR_NEXT_CALL => {
                std::hint::spin_loop()
            }
            Err(mpsc::TryRecvError::Empty) => return jobs.recv().ok(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sends on the worker's `exited` channel when the thread ends (after its state).
struct ExitSignal(Option<oneshot::Sender<()>>);

impl Drop for ExitSignal {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

impl<S: 'static> Drop for Worker<S> {
    /// Never blocks: stops the running call and closes the queue; the thread drops its
    /// state and ends on its own (see [`Worker::stop`], [`Tracker::all_stopped`]).
    fn drop(&mut self) {
        let mut running = lock(&self.running);
        running.shutting_down = true;
        if let Some(call) = &running.call {
            call.cancel();
        }
        drop(running);
        self.jobs = None; // closes the queue: the thread leaves its loop
    }
}

/// A call queued on a worker. Resolves to `None` if the worker stopped before
/// running it. Dropping an unfinished `Call` stops the native work it started.
pub struct Call<R> {
    result: oneshot::Receiver<R>,
    abandoned: CancelFlag,
    done: bool,
}

/// The other end of a [`Call`] made by [`Call::channel`]: whoever runs the call sends
/// its result here, and reads the call's own flag (set when the `Call` is dropped).
pub(crate) struct Reply<R> {
    result: oneshot::Sender<R>,
    abandoned: CancelFlag,
}

impl<R> Reply<R> {
    pub(crate) fn send(self, result: R) {
        let _ = self.result.send(result);
    }

    /// Set once the caller dropped its `Call` unfinished (or the caller is gone).
    pub(crate) fn abandoned(&self) -> &CancelFlag {
        &self.abandoned
    }
}

impl<R> Call<R> {
    /// A call run by someone other than a [`Worker`] (a batch's thread): the same
    /// future, resolving to `None` if the `Reply` is dropped unsent.
    pub(crate) fn channel() -> (Self, Reply<R>) {
        let (tx, rx) = oneshot::channel();
        let abandoned = CancelFlag::new();
        (
            Call { result: rx, abandoned: abandoned.clone(), done: false },
            Reply { result: tx, abandoned },
        )
    }
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
        let worker =
            Worker::spawn("test", &Tracker::new(), || Ok::<_, Error>(Vec::<u32>::new())).unwrap();
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
        assert_eq!(
            Worker::<()>::spawn("test", &Tracker::new(), move || Err(returned)).err(),
            Some(refused)
        );
    }

    #[test]
    fn a_panicking_init_is_an_error_not_a_panic() {
        let started = Worker::<()>::spawn("test", &Tracker::new(), || -> Result<(), Error> {
            panic!("init failed")
        });
        assert!(matches!(started, Err(Error::Backend(m)) if m.contains("panicked")));
    }

    #[test]
    fn dropping_a_call_sets_its_flag_while_the_worker_lives_on() {
        let (started_tx, started_rx) = mpsc::channel();
        let (seen_tx, seen_rx) = mpsc::channel();
        let worker = Worker::spawn("test", &Tracker::new(), || Ok::<_, Error>(())).unwrap();
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
        let worker = Worker::spawn("test", &Tracker::new(), || Ok::<_, Error>(())).unwrap();
        let call = worker.call(move |_, abandoned| {
            started_tx.send(()).unwrap();
            if wait_for(abandoned) {
                "stopped"
            } else {
                "ran on"
            }
        });
        started_rx.recv().unwrap();
        drop(worker);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(rt.block_on(call), Some("stopped"));
    }

    /// A state whose drop says when it happened.
    struct Reports(mpsc::Sender<&'static str>);

    impl Drop for Reports {
        fn drop(&mut self) {
            let _ = self.0.send("state dropped");
        }
    }

    /// Teardown on the executor's only thread: the worker's call is stuck in native
    /// work that ignores its stop (one long graph node, say). Dropping the worker must
    /// not wait for it: another task's timer keeps ticking, and only once the call is
    /// let go do the state drop and the tracker reach zero.
    #[test]
    fn dropping_a_worker_with_a_call_in_flight_never_blocks_the_executor() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(async {
            let tracker = Tracker::new();
            let (events_tx, events) = mpsc::channel();
            let state_events = events_tx.clone();
            let worker =
                Worker::spawn("test", &tracker, move || Ok::<_, Error>(Reports(state_events)))
                    .unwrap();
            let (started_tx, started_rx) = mpsc::channel();
            let (release_tx, release_rx) = mpsc::channel::<()>();
            let call = worker.call(move |_, _| {
                started_tx.send(()).unwrap();
                release_rx.recv().unwrap();
            });
            started_rx.recv().unwrap();
            let ticks = Arc::new(AtomicUsize::new(0));
            let ticking = ticks.clone();
            let ticker = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    ticking.fetch_add(1, SeqCst);
                }
            });
            drop(call);
            drop(worker); // on the executor thread, with the call still running
            while ticks.load(SeqCst) < 3 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            events_tx.send("timer ticked with the call in flight").unwrap();
            assert_eq!(tracker.live(), 1, "the thread is still winding down");
            release_tx.send(()).unwrap();
            tracker.all_stopped().await;
            ticker.abort();
            let order: Vec<_> = events.try_iter().collect();
            assert_eq!(order, ["timer ticked with the call in flight", "state dropped"]);
        });
    }

    #[tokio::test]
    async fn stop_waits_for_the_state_to_be_dropped() {
        let (events_tx, events) = mpsc::channel();
        let worker =
            Worker::spawn("test", &Tracker::new(), move || Ok::<_, Error>(Reports(events_tx)))
                .unwrap();
        worker.stop().await;
        assert_eq!(events.try_iter().collect::<Vec<_>>(), ["state dropped"]);
    }

    #[tokio::test]
    async fn a_retracked_worker_counts_only_where_it_was_moved() {
        let host = Tracker::new();
        let (store_a, store_b) = (host.child(), host.child());
        let worker = Worker::spawn("test", &store_a, || Ok::<_, Error>(0u32)).unwrap();
        worker.retrack(&Tracker::default()); // idle, counted nowhere
        store_a.all_stopped().await;
        assert_eq!((host.live(), store_a.live()), (0, 0));
        worker.retrack(&store_b);
        assert_eq!((host.live(), store_b.live()), (1, 1));
        let call = worker.call(|n, _| {
            std::thread::sleep(Duration::from_millis(2));
            *n += 1;
            *n
        });
        assert_eq!(call.await, Some(1));
        assert!(
            store_b.busy() >= Duration::from_millis(2),
            "its calls' time counts where it is now"
        );
        assert_eq!(store_a.busy(), Duration::ZERO);
        worker.stop().await;
        store_b.all_stopped().await; // the innermost count goes last
        assert_eq!((host.live(), store_a.live(), store_b.live()), (0, 0, 0));
    }

    #[tokio::test]
    async fn a_worker_is_idle_as_soon_as_its_callers_have_their_results() {
        let worker = Worker::spawn("test", &Tracker::new(), || Ok::<_, Error>(())).unwrap();
        assert!(worker.is_idle());
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let held = worker.call(move |_, _| release_rx.recv().unwrap());
        let queued = worker.call(|_, _| ());
        assert!(!worker.is_idle(), "a call is running and one is queued");
        release_tx.send(()).unwrap();
        held.await.unwrap();
        queued.await.unwrap();
        assert!(worker.is_idle(), "no window after the last result in which it looks busy");
    }

    #[tokio::test]
    async fn a_child_tracker_counts_in_its_parent_too() {
        let host = Tracker::new();
        let (store_a, store_b) = (host.child(), host.child());
        let a = Worker::spawn("test", &store_a, || Ok::<_, Error>(())).unwrap();
        let b = Worker::spawn("test", &store_b, || Ok::<_, Error>(())).unwrap();
        assert_eq!((host.live(), store_a.live(), store_b.live()), (2, 1, 1));
        a.stop().await;
        store_a.all_stopped().await;
        assert_eq!((host.live(), store_a.live(), store_b.live()), (1, 0, 1));
        let blocked = store_b.blocking(|| 7).await;
        assert_eq!(blocked, Some(7));
        drop(b);
        host.all_stopped().await;
        assert_eq!(host.live(), 0);
    }
}
