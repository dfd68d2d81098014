//! The machine line: which CPU, which CPU features ggml was built with, how loaded the
//! machine was. Figures from a shared 2-core box mean little without it.

pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    /// Features the linked ggml CPU backend was compiled for.
    pub ggml_features: Vec<String>,
    /// How the build chose them: the C compiler's -march and -mtune and the GGML_* CPU options in the
    /// linked llama.cpp's CMake cache (what `make CPU=...` passed), the ones that are ON.
    pub build_config: String,
}

impl Machine {
    pub fn read() -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| {
                info.lines().find_map(|l| {
                    l.strip_prefix("model name")?.split_once(':').map(|(_, v)| v.trim().to_string())
                })
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ggml_features = llamabox_native::cpu_features();
        use crate::reference::{cache_value, crate_cmake_cache, ggml_cpu_options_on};
        let build_config = crate_cmake_cache().map_or_else(
            || "unknown (no CMake cache beside this binary)".into(),
            |cache| {
                let on: Vec<String> =
                    ggml_cpu_options_on(&cache).map(|o| format!("GGML_{o}")).collect();
                // cc's -march=x86-64, then the choice's flags (-mtune=native for
                // CPU=native, -march=native for native-march): the last of each counts.
                let flags = cache_value(&cache, "CMAKE_C_FLAGS:STRING").unwrap_or("");
                let last = |prefix: &str| flags.split_whitespace().rfind(|f| f.starts_with(prefix));
                let march = last("-march=").unwrap_or("no -march");
                let mtune = last("-mtune=").map_or(String::new(), |t| format!(" {t}"));
                format!("{march}{mtune}, {} ON, the rest off", on.join(" "))
            },
        );
        Self { cpu, cores, ggml_features, build_config }
    }
}

/// The 1-, 5- and 15-minute load averages.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

/// How much of one core this process (with its finished children, llama-bench) got
/// over a stretch of wall time. Every measured way runs on one thread at a time, so an
/// undisturbed stretch gets about 1.0; less means other work took the CPU from us and
/// the stretch's times are inflated.
pub struct CpuShare {
    wall: std::time::Instant,
    cpu: Option<f64>,
}

impl CpuShare {
    pub fn start() -> Self {
        Self { wall: std::time::Instant::now(), cpu: process_cpu_secs() }
    }

    /// The share since `start`, if /proc could be read.
    pub fn share(&self) -> Option<f64> {
        Some((process_cpu_secs()? - self.cpu?) / self.wall.elapsed().as_secs_f64())
    }
}

/// utime + stime + cutime + cstime of this process from /proc/self/stat, in seconds
/// (clock ticks of 1/100 s, USER_HZ on Linux).
fn process_cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may contain spaces) start at field 3.
    let rest = stat.rsplit_once(')')?.1;
    let ticks: Vec<f64> =
        rest.split_whitespace().skip(11).take(4).filter_map(|v| v.parse().ok()).collect();
    (ticks.len() == 4).then(|| ticks.iter().sum::<f64>() / 100.0)
}

/// What the kernel's scheduler counted for the calling thread
/// (/proc/thread-self/schedstat): time on a CPU, time runnable but waiting for one, and
/// how many times it was switched in. For the thread that runs the guest, per token,
/// this is the work a plugin adds beside ggml's threads, and how often it woke.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ThreadSched {
    pub on_cpu_ns: f64,
    pub waiting_ns: f64,
    pub switches_in: f64,
}

impl ThreadSched {
    /// The calling thread's counts so far; `None` where the kernel keeps none.
    pub fn now() -> Option<Self> {
        // The kernel brings a running thread's time up to date when it schedules, else
        // at its next tick (4 ms at HZ=250: 30 µs a token over a 128-token run). A
        // yield makes it schedule now.
        std::thread::yield_now();
        let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        let v: Vec<f64> = stat.split_whitespace().filter_map(|v| v.parse().ok()).collect();
        match v[..] {
            [on_cpu_ns, waiting_ns, switches_in] => {
                Some(Self { on_cpu_ns, waiting_ns, switches_in })
            }
            _ => None,
        }
    }

    /// The counts between `earlier` and `self`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            on_cpu_ns: self.on_cpu_ns - earlier.on_cpu_ns,
            waiting_ns: self.waiting_ns - earlier.waiting_ns,
            switches_in: self.switches_in - earlier.switches_in,
        }
    }

    /// Per unit of `n` (tokens) of the difference `self − base`, clamped at zero.
    pub fn per(self, base: Self, n: f64) -> Self {
        let d = self.since(base);
        Self {
            on_cpu_ns: (d.on_cpu_ns / n).max(0.0),
            waiting_ns: (d.waiting_ns / n).max(0.0),
            switches_in: (d.switches_in / n).max(0.0),
        }
    }

    /// Field by field medians of `all`; `None` if empty.
    pub fn median(all: &[Self]) -> Option<Self> {
        let med = |f: fn(&Self) -> f64| {
            let mut v: Vec<f64> = all.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        (!all.is_empty()).then(|| Self {
            on_cpu_ns: med(|s| s.on_cpu_ns),
            waiting_ns: med(|s| s.waiting_ns),
            switches_in: med(|s| s.switches_in),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_counts_grow_with_work_and_per_token_figures_subtract_the_base() {
        let before = ThreadSched::now().expect("Linux keeps schedstat");
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let spent = ThreadSched::now().expect("Linux keeps schedstat").since(before);
        assert!(spent.on_cpu_ns > 0.0, "{spent:?}");
        let base = ThreadSched { on_cpu_ns: 100.0, waiting_ns: 10.0, switches_in: 1.0 };
        let run = ThreadSched { on_cpu_ns: 1100.0, waiting_ns: 5.0, switches_in: 11.0 };
        assert_eq!(
            run.per(base, 10.0),
            ThreadSched { on_cpu_ns: 100.0, waiting_ns: 0.0, switches_in: 1.0 }
        );
        let m = ThreadSched::median(&[run, base, run]).expect("three samples have a median");
        assert_eq!(m, run);
        assert!(ThreadSched::median(&[]).is_none());
    }
}
