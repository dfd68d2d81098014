//! llama.cpp's own `llama-bench` (built by bench/llama-bench.sh), run on the same model
//! with the same threads, and which llama.cpp each side is.

use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};
use serde_json::Value;

use crate::stats::Samples;
use crate::workload::Shape;

/// llama-bench's pp and tg figures for one model.
pub struct LlamaBench {
    /// Seconds per prompt decode of `shape.prompt_tokens` tokens, one per repetition.
    pub prompt: Samples,
    /// Seconds per generation of `shape.gen_tokens` tokens.
    pub generation: Samples,
}

/// Run `llama-bench -p P -n N -t T -r RUNS -o json` on `model`.
pub fn run_llama_bench(bin: &Path, model: &Path, shape: &Shape, runs: usize) -> anyhow::Result<LlamaBench> {
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args(["-p", &shape.prompt_tokens.to_string(), "-n", &shape.gen_tokens.to_string()])
        .args(["-t", &shape.threads.to_string(), "-r", &runs.to_string(), "-o", "json"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("llama-bench failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    let tests: Vec<Value> = serde_json::from_slice(&out.stdout).context("llama-bench printed no JSON array")?;
    let find = |prompt: u32, gen: u32| {
        tests
            .iter()
            .find(|t| t["n_prompt"] == prompt && t["n_gen"] == gen)
            .with_context(|| format!("llama-bench printed no test with n_prompt={prompt} n_gen={gen}"))
    };
    let samples = |t: &Value| -> anyhow::Result<Samples> {
        let mut s = Samples::default();
        for ns in t["samples_ns"].as_array().context("llama-bench test without samples_ns")? {
            s.push_secs(ns.as_f64().context("samples_ns holds a non-number")? / 1e9);
        }
        Ok(s)
    };
    let pp = find(shape.prompt_tokens, 0)?;
    let tg = find(0, shape.gen_tokens)?;
    Ok(LlamaBench {
        prompt: samples(pp)?,
        generation: samples(tg)?,
    })
}

/// Where a llama.cpp build came from, for the report.
pub struct Provenance {
    pub ggml_version: String,
    pub detail: String,
}

/// The llama.cpp linked into llamabox (through llama-cpp-sys-2), as it reports itself,
/// with the CMake build type the crate's build script chose (it picks RelWithDebInfo,
/// i.e. -O2, whenever the cargo profile has debug info).
pub fn linked_llama_cpp() -> Provenance {
    // SAFETY: both return pointers to static NUL-terminated strings.
    let text = |p: *const std::ffi::c_char| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    let (version, commit) = unsafe { (text(llama_cpp_sys_2::ggml_version()), text(llama_cpp_sys_2::ggml_commit())) };
    let build_type = crate_cmake_cache()
        .and_then(|cache| cache_value(&cache, "CMAKE_BUILD_TYPE:STRING").map(str::to_string))
        .unwrap_or_else(|| "?".into());
    Provenance {
        ggml_version: version,
        detail: format!("llama.cpp vendored in crates.io llama-cpp-sys-2 0.1.161 (ggml commit {commit}), CMake {build_type}"),
    }
}

/// The CMake cache of the llama.cpp build this binary links: the newest
/// `<profile dir>/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt` beside the executable.
fn crate_cmake_cache() -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    let builds = exe.parent()?.join("build");
    let newest = std::fs::read_dir(builds)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("llama-cpp-sys-2-"))
        .map(|e| e.path().join("out/build/CMakeCache.txt"))
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .max()?;
    std::fs::read_to_string(newest.1).ok()
}

/// The value of `KEY:TYPE=value` in a CMake cache.
fn cache_value<'a>(cache: &'a str, key: &str) -> Option<&'a str> {
    cache.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// The llama.cpp llama-bench was built from, read from the source tree its CMake cache
/// names (`<build>/CMakeCache.txt` → `ggml/CMakeLists.txt`, and llama-cpp-python's
/// CHANGELOG for the llama.cpp commit it vendors).
pub fn llama_bench_tree(bin: &Path) -> anyhow::Result<Provenance> {
    let build = bin.parent().and_then(Path::parent).context("llama-bench is not in <build>/bin")?;
    let cache = std::fs::read_to_string(build.join("CMakeCache.txt")).context("reading llama-bench's CMakeCache.txt")?;
    let source = cache_value(&cache, "CMAKE_HOME_DIRECTORY:INTERNAL")
        .map(PathBuf::from)
        .context("CMakeCache.txt names no source directory")?;
    let ggml = std::fs::read_to_string(source.join("ggml/CMakeLists.txt")).context("reading ggml/CMakeLists.txt")?;
    let part = |name: &str| {
        ggml.lines()
            .find_map(|l| l.trim().strip_prefix(&format!("set(GGML_VERSION_{name} ")))
            .map(|v| v.trim_end_matches(')').trim().to_string())
            .with_context(|| format!("no GGML_VERSION_{name} in ggml/CMakeLists.txt"))
    };
    let ggml_version = format!("{}.{}.{}", part("MAJOR")?, part("MINOR")?, part("PATCH")?);
    // <sdist>/vendor/llama.cpp: the sdist's CHANGELOG names the llama.cpp commit.
    let sdist = source.parent().and_then(Path::parent).context("llama.cpp tree outside an sdist")?;
    let commit = std::fs::read_to_string(sdist.join("CHANGELOG.md"))
        .ok()
        .and_then(|log| log.lines().find_map(|l| l.split("llama.cpp@").nth(1).map(|c| c.trim().to_string())))
        .unwrap_or_else(|| "unknown".into());
    let sdist_name = sdist.file_name().map_or("?".into(), |n| n.to_string_lossy().into_owned());
    let build_type = cache_value(&cache, "CMAKE_BUILD_TYPE:STRING").unwrap_or("?");
    Ok(Provenance {
        ggml_version,
        detail: format!("llama.cpp {commit} vendored in PyPI sdist {sdist_name}, CMake {build_type}"),
    })
}
