//! The ggml thread team a context computes with, kept for the context's whole life.
//!
//! Without one attached, ggml-cpu (built without OpenMP, as llama-cpp-sys-2 builds it)
//! makes a *disposable* team for every graph it computes: it starts and joins
//! `n_threads - 1` OS threads per token. At threads = cores that hand-off dominated
//! generation (FIELD-NOTES: 63 t/s where llama-bench, which attaches a persistent team,
//! made 470). llama-bench and llama.cpp's server attach one team per context, as here.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use llama_cpp_sys_2 as sys;

use super::{Error, Result};

/// The default of [`set_idle_poll`]: idle threads spin one unit (a few ms), longer than
/// the gap between two tokens of a generation, far shorter than llama.cpp's 50.
pub const DEFAULT_IDLE_POLL: u32 = 1;

static IDLE_POLL: AtomicU32 = AtomicU32::new(DEFAULT_IDLE_POLL);

/// How long the idle threads of contexts created from now on spin for the next graph
/// before they sleep, in ggml's units (0–100; each unit is 131072 `pause` rounds, a few
/// ms; llama.cpp's tools default to 50).
///
/// Spinning saves a wake-up (tens of µs on a VM) per graph, and costs a core for as long
/// as it spins, whether or not another graph comes. Generation computes a graph every
/// few ms, so one unit (131072 `pause`s: ~7 ms on a Sapphire Rapids Xeon, less on AMD
/// Zen) keeps a generating context's threads awake from token to token; 0 made
/// generation at 2 threads ~5% slower than llama-bench here (bench/RESULTS-t2.md). A
/// plugin host runs many contexts that sit idle between a guest's calls, and a spinning
/// thread takes a core from the others: one unit frees it within milliseconds, 50
/// (llama.cpp's tools) only after a tenth of a second or more.
pub fn set_idle_poll(level: u32) {
    IDLE_POLL.store(level.min(100), Relaxed);
}

/// The idle-poll level contexts created now get (see [`set_idle_poll`]).
pub fn idle_poll() -> u32 {
    IDLE_POLL.load(Relaxed)
}

/// A persistent ggml thread team (`ggml_threadpool`). The calling thread is thread 0
/// of every graph; the team owns the other `n_threads - 1`.
pub(crate) struct ThreadPool(NonNull<sys::ggml_threadpool>);

// SAFETY: a ggml_threadpool is driven by one thread at a time (the context's, through
// `&mut Context`) and may be freed from any thread once no graph runs on it.
unsafe impl Send for ThreadPool {}

impl ThreadPool {
    pub(crate) fn new(n_threads: i32) -> Result<Self> {
        Self::with_cpus(n_threads, &[])
    }

    /// A team whose threads each keep to one CPU, if this process may run on exactly as
    /// many CPUs as the team has threads; otherwise they go wherever the OS puts them.
    ///
    /// ggml's threads meet at a spinning barrier after every graph node. A team that
    /// sleeps between turns on shared cores ([`ThreadPool::rest`]) is woken at its next
    /// graph; the OS may queue the woken thread on the CPU its waker runs on while the
    /// other CPU idles, and then each barrier waits out a scheduler slice: traced at
    /// 2 threads (perf sched), an embedding's two threads took turns on one CPU in 4 ms
    /// slices for 30-40 ms while the other CPU idled. One CPU a thread cannot do that.
    /// Only where the team uses every allowed CPU: on fewer, pinning would stop the OS
    /// from spreading several processes' teams over the rest.
    pub(crate) fn pinned(n_threads: i32) -> Result<Self> {
        let cpus = allowed_cpus();
        Self::with_cpus(n_threads, if cpus.len() == n_threads as usize { &cpus } else { &[] })
    }

    fn with_cpus(n_threads: i32, cpus: &[usize]) -> Result<Self> {
        // SAFETY: start from ggml's defaults (the struct gains fields between versions);
        // ggml_threadpool_new copies the params.
        let ptr = unsafe {
            let mut params = sys::ggml_threadpool_params_default(n_threads);
            params.poll = idle_poll();
            if !cpus.is_empty() && cpus.iter().all(|&cpu| cpu < params.cpumask.len()) {
                for &cpu in cpus {
                    params.cpumask[cpu] = true;
                }
                // One CPU a thread. Created paused: ggml pins the calling thread as
                // thread 0 when it starts a paused team's graph, and would pin the
                // creating thread here otherwise (not always the one that computes).
                params.strict_cpu = true;
                params.paused = true;
            }
            sys::ggml_threadpool_new(&mut params)
        };
        NonNull::new(ptr).map(Self).ok_or_else(|| {
            Error::Backend(format!("ggml could not start a team of {n_threads} threads"))
        })
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ggml_threadpool {
        self.0.as_ptr()
    }

    /// Put the team's idle threads to sleep now, instead of spinning for the next graph
    /// (see [`set_idle_poll`]): for when the cores go to someone else's computation, on
    /// which a spinning thread would take a core from a team that needs every one.
    /// The next graph wakes them: ggml resumes a resting team when it starts a graph.
    pub(crate) fn rest(&self) {
        // SAFETY: the team is live (owned by `self`); pausing takes the team's own mutex,
        // and a graph in flight is not stopped by it (workers look only between graphs).
        unsafe { sys::ggml_threadpool_pause(self.0.as_ptr()) }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        // SAFETY: the owner detaches (frees) its context before dropping the team, so
        // no graph runs on it; ggml stops and joins the team's threads.
        unsafe { sys::ggml_threadpool_free(self.0.as_ptr()) }
    }
}

/// The CPUs this process may run on (Linux: `Cpus_allowed_list` of /proc/self/status);
/// empty where that cannot be read.
fn allowed_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"));
    cpu_list(list.unwrap_or(""))
}

/// CPU ids of a kernel CPU list ("0-3,8,10-11"); empty if any part does not parse.
fn cpu_list(list: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        match (first.parse::<usize>(), last.parse::<usize>()) {
            (Ok(first), Ok(last)) if first <= last => cpus.extend(first..=last),
            _ => return Vec::new(),
        }
    }
    cpus
}

#[cfg(test)]
mod tests {
    use super::cpu_list;

    #[test]
    fn cpu_lists_read_as_the_kernel_writes_them() {
        assert_eq!(cpu_list("0-1\n"), [0, 1]);
        assert_eq!(cpu_list("0,2-4,7"), [0, 2, 3, 4, 7]);
        assert_eq!(cpu_list(""), Vec::<usize>::new());
        assert_eq!(cpu_list("0-1,x"), Vec::<usize>::new(), "unreadable: no pinning at all");
        assert_eq!(cpu_list("3-1"), Vec::<usize>::new());
    }
}
