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
    match level {
        sys::GGML_LOG_LEVEL_ERROR => tracing::error!(target: "llama_cpp", "{text}"),
        sys::GGML_LOG_LEVEL_WARN => tracing::warn!(target: "llama_cpp", "{text}"),
        sys::GGML_LOG_LEVEL_INFO => tracing::debug!(target: "llama_cpp", "{text}"),
        _ => tracing::trace!(target: "llama_cpp", "{text}"),
    }
}
