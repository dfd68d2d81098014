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
            .and_then(|info| info.lines().find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|(_, v)| v.trim().to_string())))
            .unwrap_or_else(|| "unknown CPU".into());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ggml_features = llamabox::native::cpu_features();
        use crate::reference::{cache_value, crate_cmake_cache, ggml_cpu_options_on};
        let build_config = crate_cmake_cache().map_or_else(
            || "unknown (no CMake cache beside this binary)".into(),
            |cache| {
                let on: Vec<String> = ggml_cpu_options_on(&cache).map(|o| format!("GGML_{o}")).collect();
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
    let ticks: Vec<f64> = rest.split_whitespace().skip(11).take(4).filter_map(|v| v.parse().ok()).collect();
    (ticks.len() == 4).then(|| ticks.iter().sum::<f64>() / 100.0)
}
