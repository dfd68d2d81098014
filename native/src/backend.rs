//! Process-wide llama.cpp setup: backend initialisation and log routing to `tracing`.

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, Once, PoisonError};

use llama_cpp_sys_2 as sys;

/// Initialise llama.cpp once per process and route its (and mtmd's) logs to `tracing`
/// under the target `llama_cpp`. Every native entry point calls this first.
pub fn init() {
    static INIT: Once = Once::new();
    // SAFETY: `Once` runs this exactly once, before any other llama.cpp call of ours (each
    // entry point calls `init` first), as llama.h asks of llama_backend_init and of the
    // log setters (the logger state is global and not thread-safe). `log_callback` is a
    // `'static` fn matching ggml_log_callback, and its user data is unused (null).
    INIT.call_once(|| unsafe {
        sys::llama_log_set(Some(log_callback), std::ptr::null_mut());
        sys::mtmd_log_set(Some(log_callback), std::ptr::null_mut());
        sys::llama_backend_init();
    });
}

std::thread_local! {
    /// `GGML_LOG_LEVEL_CONT` continues the previous line at its level.
    static LAST_LEVEL: std::cell::Cell<sys::ggml_log_level> =
        const { std::cell::Cell::new(sys::GGML_LOG_LEVEL_INFO) };
    /// The last error llama.cpp or mtmd logged on this thread inside [`with_errors`].
    static LAST_ERROR: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` (a llama.cpp or mtmd call) and return, with its result, the last error it
/// logged: those libraries say why they failed only in their log, which the CLI hides
/// by default, so a failure's message carries the reason itself.
pub(crate) fn with_errors<T>(f: impl FnOnce() -> T) -> (T, String) {
    LAST_ERROR.with(|e| e.borrow_mut().take());
    let out = f();
    let reason = LAST_ERROR.with(|e| e.borrow_mut().take());
    (out, reason.unwrap_or_else(|| "no reason logged".into()))
}

/// `ggml_log_callback` for llama.cpp and mtmd.
///
/// # Safety
///
/// `text` must be null or a NUL-terminated string valid for the duration of the call
/// (what ggml's logger passes); the user data is ignored.
unsafe extern "C" fn log_callback(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    let level = if level == sys::GGML_LOG_LEVEL_CONT {
        LAST_LEVEL.with(|l| l.get())
    } else {
        LAST_LEVEL.with(|l| l.set(level));
        level
    };
    // SAFETY: non-null (checked above) and, by this function's contract, NUL-terminated
    // and valid for this call; copied out before returning.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let text = text.trim_end();
    if text.is_empty() {
        return;
    }
    if level == sys::GGML_LOG_LEVEL_ERROR {
        LAST_ERROR.with(|e| *e.borrow_mut() = Some(text.to_string()));
    }
    // llama.cpp is chatty at INFO (every tensor on load): keep that at DEBUG.
    match level {
        sys::GGML_LOG_LEVEL_ERROR => tracing::error!(target: "llama_cpp", "{text}"),
        sys::GGML_LOG_LEVEL_WARN => tracing::warn!(target: "llama_cpp", "{text}"),
        sys::GGML_LOG_LEVEL_INFO => tracing::debug!(target: "llama_cpp", "{text}"),
        _ => tracing::trace!(target: "llama_cpp", "{text}"),
    }
}

/// The CPU features the linked ggml was compiled for (`SSE3`, `AVX2`, `FMA`, ...), as
/// ggml reports them. Which ones a build gets is a build-time choice (`make CPU=...`,
/// .cargo/config.toml): without AVX2 every matrix product runs several times slower.
pub fn cpu_features() -> Vec<String> {
    init();
    // llama_print_system_info rebuilds one static std::string on every call: two threads
    // in it at once would race (one clearing what the other reads), so calls take turns.
    static SYSTEM_INFO: Mutex<()> = Mutex::new(());
    let turn = SYSTEM_INFO.lock().unwrap_or_else(PoisonError::into_inner);
    // SAFETY: llama_print_system_info returns that string's NUL-terminated buffer (never
    // null); only this function calls it, under `turn`, and copies the text out before
    // releasing it, so the buffer is neither rewritten nor freed while read.
    let info =
        unsafe { CStr::from_ptr(sys::llama_print_system_info()) }.to_string_lossy().into_owned();
    drop(turn);
    // "CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 |"
    info.split('|')
        .filter_map(|entry| entry.split_once('='))
        .filter(|(_, on)| on.trim() == "1")
        .map(|(name, _)| name.rsplit(':').next().unwrap_or(name).trim().to_string())
        .collect()
}

/// The C flags this build added for the machine it was built on, as the Makefile gave
/// them to cc, which compiles llama.cpp with them (and scripts/ggml-config.sh rebuilds it
/// when they change): `-mtune=native` for `CPU=native`, `-march=native ...` for
/// `CPU=native-march`; empty for avx2, portable and plain cargo builds.
pub fn build_c_flags() -> &'static str {
    option_env!("CFLAGS_x86_64_unknown_linux_gnu").map_or("", str::trim)
}

/// The widest vector instructions a ggml build uses: what its speed mostly depends on,
/// and what the Makefile's `CPU` choices differ in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum InstructionLevel {
    /// Baseline x86-64 (SSE2 to SSSE3): `CPU=portable`, runs on any x86-64 CPU.
    Baseline,
    /// AVX2 with FMA and F16C (x86-64-v3): `CPU=avx2`, and `CPU=native` on such CPUs.
    Avx2,
    /// AVX-512: `CPU=native` on CPUs that have it.
    Avx512,
}

impl InstructionLevel {
    /// The level of a build with these `cpu_features()`.
    pub fn of(features: &[String]) -> Self {
        let has = |name: &str| features.iter().any(|f| f == name);
        if has("AVX512") {
            Self::Avx512
        } else if has("AVX2") {
            Self::Avx2
        } else {
            Self::Baseline
        }
    }

    /// A short name for files and tables: `avx512`, `avx2`, `portable`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for InstructionLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Baseline => "portable (baseline x86-64, no AVX2)",
            Self::Avx2 => "AVX2 (x86-64-v3)",
            Self::Avx512 => "AVX-512",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama-cpp-sys-2 configures CMake once per build folder, so a changed GGML_*
    /// choice can silently leave the previous build linked: the Makefile cleans it then
    /// (scripts/ggml-config.sh), and this test sees it when that did not happen.
    #[test]
    fn ggml_is_built_for_the_chosen_cpu_features() {
        let features = cpu_features();
        assert!(features.iter().any(|f| f == "REPACK"), "no features parsed: {features:?}");
        let chosen = [
            ("AVX", option_env!("GGML_AVX")),
            ("AVX2", option_env!("GGML_AVX2")),
            ("BMI2", option_env!("GGML_BMI2")),
            ("FMA", option_env!("GGML_FMA")),
            ("F16C", option_env!("GGML_F16C")),
            ("AVX512", option_env!("GGML_AVX512")),
            ("AVX512_VBMI", option_env!("GGML_AVX512_VBMI")),
            ("AVX512_VNNI", option_env!("GGML_AVX512_VNNI")),
            ("AVX512_BF16", option_env!("GGML_AVX512_BF16")),
            ("AVX_VNNI", option_env!("GGML_AVX_VNNI")),
            // Always OFF (scripts/cpu-flags.sh: ggml's AMX kernels die of SIGILL).
            ("AMX_INT8", option_env!("GGML_AMX_INT8")),
        ];
        for (feature, choice) in chosen {
            let built = features.iter().any(|f| f == feature);
            match choice {
                Some("ON") => {
                    assert!(built, "GGML_{feature}=ON but ggml was built without it: {features:?}")
                }
                Some("OFF") => {
                    assert!(!built, "GGML_{feature}=OFF but ggml was built with it: {features:?}")
                }
                _ => {}
            }
        }
    }

    #[test]
    fn instruction_level_is_the_widest_vector_set() {
        let of = |names: &[&str]| {
            InstructionLevel::of(&names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(
            of(&["SSE3", "AVX", "AVX2", "FMA", "AVX512", "AVX512_VNNI"]),
            InstructionLevel::Avx512
        );
        assert_eq!(of(&["SSE3", "AVX", "AVX2", "FMA"]), InstructionLevel::Avx2);
        assert_eq!(of(&["SSE3", "AVX"]), InstructionLevel::Baseline);
        assert_eq!(of(&[]).name(), "portable");
    }
}
