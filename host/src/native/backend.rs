//! Process-wide llama.cpp setup: backend initialisation and log routing to `tracing`.

use std::ffi::{c_char, c_void, CStr};
use std::sync::Once;

use llama_cpp_sys_2 as sys;

/// Initialise llama.cpp once per process and route its (and mtmd's) logs to `tracing`
/// under the target `llama_cpp`. Every native entry point calls this first.
pub fn init() {
    static INIT: Once = Once::new();
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
    /// The last error line llama.cpp logged on this thread (see [`take_last_error`]).
    static LAST_ERROR: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// The last error line llama.cpp logged on the calling thread since the previous call,
/// for calls that fail with only a null result (a grammar that does not parse, say):
/// call it once before such a call to clear, and once after to read the reason.
pub(crate) fn take_last_error() -> Option<String> {
    LAST_ERROR.with(|e| e.borrow_mut().take())
}

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
    // SAFETY: llama.cpp passes a NUL-terminated string valid for this call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let text = text.trim_end();
    if text.is_empty() {
        return;
    }
    // llama.cpp is chatty at INFO (every tensor on load): keep that at DEBUG.
    if level == sys::GGML_LOG_LEVEL_ERROR {
        LAST_ERROR.with(|e| *e.borrow_mut() = Some(text.to_string()));
    }
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
    // SAFETY: returns a pointer to a static NUL-terminated string.
    let info = unsafe { CStr::from_ptr(sys::llama_print_system_info()) }.to_string_lossy();
    // "CPU : SSE3 = 1 | AVX2 = 1 | ... | REPACK = 1 |"
    info.split('|')
        .filter_map(|entry| entry.split_once('='))
        .filter(|(_, on)| on.trim() == "1")
        .map(|(name, _)| name.rsplit(':').next().unwrap_or(name).trim().to_string())
        .collect()
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
        assert!(
            features.iter().any(|f| f == "REPACK"),
            "no features parsed: {features:?}"
        );
        let chosen = [
            ("AVX", option_env!("GGML_AVX")),
            ("AVX2", option_env!("GGML_AVX2")),
            ("BMI2", option_env!("GGML_BMI2")),
            ("FMA", option_env!("GGML_FMA")),
            ("F16C", option_env!("GGML_F16C")),
        ];
        for (feature, choice) in chosen {
            let built = features.iter().any(|f| f == feature);
            match choice {
                Some("ON") => assert!(
                    built,
                    "GGML_{feature}=ON but ggml was built without it: {features:?}"
                ),
                Some("OFF") => assert!(
                    !built,
                    "GGML_{feature}=OFF but ggml was built with it: {features:?}"
                ),
                _ => {}
            }
        }
    }
}
