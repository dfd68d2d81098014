//! llama.cpp's own `llama-bench` (built by bench/llama-bench.sh), run on the same model
//! with the same threads, and which llama.cpp each side is.

use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

/// llama.cpp's llama-bench on one model and thread count, one repetition per call so
/// that its runs can take turns with ours (each call repeats llama-bench's own
/// warm-up: a whole prompt decode for pp, one token for tg).
pub struct LlamaBench {
    pub bin: PathBuf,
    pub model: PathBuf,
    pub threads: u32,
}

impl LlamaBench {
    /// One `pp<tokens>` run: a prompt decode of `tokens` random tokens.
    pub fn prompt(&self, tokens: u32) -> anyhow::Result<Duration> {
        self.once(tokens, 0)
    }

    /// One `tg<tokens>` run: `tokens` one-token decodes.
    pub fn generation(&self, tokens: u32) -> anyhow::Result<Duration> {
        self.once(0, tokens)
    }

    fn once(&self, prompt: u32, gen: u32) -> anyhow::Result<Duration> {
        let stdout = tool_output(
            "llama-bench",
            &self.bin,
            &self.model,
            &[
                "-p",
                &prompt.to_string(),
                "-n",
                &gen.to_string(),
                "-t",
                &self.threads.to_string(),
                "-r",
                "1",
                "-o",
                "json",
            ],
        )?;
        let tests: Vec<Value> =
            serde_json::from_slice(&stdout).context("llama-bench printed no JSON array")?;
        let ns = tests
            .iter()
            .find(|t| t["n_prompt"] == prompt && t["n_gen"] == gen)
            .and_then(|t| t["samples_ns"].get(0)?.as_u64())
            .with_context(|| {
                format!("llama-bench printed no sample for n_prompt={prompt} n_gen={gen}")
            })?;
        Ok(Duration::from_nanos(ns))
    }
}

/// Runs the llama.cpp tool `name` (at `bin`) on `model` with `args`, to its end: its
/// stdout, or its stderr in the error.
pub(crate) fn tool_output(
    name: &str,
    bin: &Path,
    model: &Path,
    args: &[&str],
) -> anyhow::Result<Vec<u8>> {
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args(args)
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("{name} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(out.stdout)
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
    let text =
        |p: *const std::ffi::c_char| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    let (version, commit) =
        unsafe { (text(llama_cpp_sys_2::ggml_version()), text(llama_cpp_sys_2::ggml_commit())) };
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
pub(crate) fn crate_cmake_cache() -> Option<String> {
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

/// How a CMake cache builds ggml for the CPU: `GGML_NATIVE=ON`, or the GGML_* extensions
/// it turned on, and its C flags where it has any.
fn cpu_flags(cache: &str) -> String {
    let mut parts = Vec::new();
    let on: Vec<&str> = ggml_cpu_options_on(cache).collect();
    if on.contains(&"NATIVE") {
        parts.push("GGML_NATIVE=ON".to_string());
    } else {
        parts.push(format!(
            "GGML_NATIVE=OFF, {}",
            if on.is_empty() { "no extensions".into() } else { on.join(" ") }
        ));
    }
    if let Some(flags) =
        cache_value(cache, "CMAKE_C_FLAGS:STRING").map(str::trim).filter(|f| !f.is_empty())
    {
        parts.push(format!("C flags {flags}"));
    }
    parts.join(", ")
}

/// ggml's x86 CPU options (scripts/cpu-flags.sh) and GGML_NATIVE.
const CPU_OPTIONS: [&str; 15] = [
    "NATIVE",
    "SSE42",
    "AVX",
    "AVX2",
    "BMI2",
    "FMA",
    "F16C",
    "AVX512",
    "AVX512_VBMI",
    "AVX512_VNNI",
    "AVX512_BF16",
    "AVX_VNNI",
    "AMX_TILE",
    "AMX_INT8",
    "AMX_BF16",
];

/// The ggml CPU options (without `GGML_`) a CMake cache has on, in its order.
pub(crate) fn ggml_cpu_options_on(cache: &str) -> impl Iterator<Item = &str> {
    cache.lines().filter_map(|l| {
        let (key, value) = l.split_once(":BOOL=")?;
        let option = key.strip_prefix("GGML_").filter(|o| CPU_OPTIONS.contains(o))?;
        matches!(value, "ON" | "on" | "1" | "TRUE" | "true").then_some(option)
    })
}

/// The value of `KEY:TYPE=value` in a CMake cache.
pub(crate) fn cache_value<'a>(cache: &'a str, key: &str) -> Option<&'a str> {
    cache.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// The llama.cpp llama-bench was built from, read from the source tree its CMake cache
/// names (`<build>/CMakeCache.txt` → `ggml/CMakeLists.txt`, and llama-cpp-python's
/// CHANGELOG for the llama.cpp commit it vendors).
pub fn llama_bench_tree(bin: &Path) -> anyhow::Result<Provenance> {
    let build = bin.parent().and_then(Path::parent).context("llama-bench is not in <build>/bin")?;
    let cache = std::fs::read_to_string(build.join("CMakeCache.txt"))
        .context("reading llama-bench's CMakeCache.txt")?;
    let source = cache_value(&cache, "CMAKE_HOME_DIRECTORY:INTERNAL")
        .map(PathBuf::from)
        .context("CMakeCache.txt names no source directory")?;
    let ggml = std::fs::read_to_string(source.join("ggml/CMakeLists.txt"))
        .context("reading ggml/CMakeLists.txt")?;
    let part = |name: &str| {
        ggml.lines()
            .find_map(|l| l.trim().strip_prefix(&format!("set(GGML_VERSION_{name} ")))
            .map(|v| v.trim_end_matches(')').trim().to_string())
            .with_context(|| format!("no GGML_VERSION_{name} in ggml/CMakeLists.txt"))
    };
    let ggml_version = format!("{}.{}.{}", part("MAJOR")?, part("MINOR")?, part("PATCH")?);
    // <sdist>/vendor/llama.cpp: the sdist's CHANGELOG names the llama.cpp commit.
    let sdist =
        source.parent().and_then(Path::parent).context("llama.cpp tree outside an sdist")?;
    let commit = std::fs::read_to_string(sdist.join("CHANGELOG.md"))
        .ok()
        .and_then(|log| {
            log.lines().find_map(|l| l.split("llama.cpp@").nth(1).map(|c| c.trim().to_string()))
        })
        .unwrap_or_else(|| "unknown".into());
    let sdist_name = sdist.file_name().map_or("?".into(), |n| n.to_string_lossy().into_owned());
    let build_type = cache_value(&cache, "CMAKE_BUILD_TYPE:STRING").unwrap_or("?");
    Ok(Provenance {
        ggml_version,
        detail: format!(
            "llama.cpp {commit} vendored in PyPI sdist {sdist_name}, CMake {build_type}, {}",
            cpu_flags(&cache)
        ),
    })
}

/// The prompt of the greedy agreement check: SmolLM2's chat format, as `make demo` asks.
pub const AGREEMENT_PROMPT: &str =
    "<|im_start|>user\nWhat is a llama?<|im_end|>\n<|im_start|>assistant\n";

/// Whether the host's generation loop (`native::generate`, greedy sampler: the loop the
/// `generate` interface runs) writes the text llama.cpp's own greedy example writes for
/// the same model, prompt and token count. llama-simple sits beside llama-bench.
pub struct Agreement {
    pub tokens: u32,
    pub ours: String,
    pub llama_simple: String,
}

impl Agreement {
    pub fn same(&self) -> bool {
        self.ours == self.llama_simple
    }
}

pub fn greedy_agreement(
    llama_bench: &Path,
    model_path: &Path,
    tokens: u32,
) -> anyhow::Result<Agreement> {
    use llamabox_native::{
        generate, Context, ContextParams, GenerateRequest, Model, Sampler, SamplerCaps,
        SamplerParams, Stop,
    };
    let simple = llama_bench.with_file_name("llama-simple");
    let out = std::process::Command::new(&simple)
        .arg("-m")
        .arg(model_path)
        .args(["-n", &tokens.to_string(), AGREEMENT_PROMPT])
        .stderr(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running {}", simple.display()))?;
    anyhow::ensure!(out.status.success(), "llama-simple failed ({})", out.status);
    // It prints the prompt (special tokens as text), then each generated piece.
    let printed = String::from_utf8_lossy(&out.stdout);
    let llama_simple =
        printed.strip_prefix(AGREEMENT_PROMPT).unwrap_or(&printed).trim().to_string();

    let model = std::sync::Arc::new(Model::load(model_path)?);
    let prompt = model.tokenize(AGREEMENT_PROMPT, true, true)?;
    let n_ctx = prompt.len() as u32 + tokens + 16;
    let params = ContextParams {
        n_ctx,
        n_batch: n_ctx,
        n_ubatch: n_ctx.min(512),
        n_seq_max: 1,
        n_threads: 1,
    };
    let mut ctx = Context::new(model.clone(), params)?;
    let mut sampler = Sampler::new(model, &SamplerParams::greedy(), &SamplerCaps::default())?;
    let request =
        GenerateRequest { prompt, seq: 0, max_tokens: tokens, stop: Vec::new(), logprobs: None };
    let mut ours = String::new();
    let never = llamabox_native::CancelFlag::new();
    generate(
        &mut ctx,
        &mut sampler,
        &request,
        Stop::on(&never),
        &mut |piece: llamabox_native::Piece| {
            ours.push_str(&piece.text);
            true
        },
    )?;
    Ok(Agreement { tokens, ours: ours.trim().to_string(), llama_simple })
}

#[cfg(test)]
mod tests {
    use super::cpu_flags;

    #[test]
    fn cpu_flags_name_native_or_the_extensions_with_any_c_flags() {
        let native =
            "GGML_AVX512:BOOL=OFF\nGGML_NATIVE:BOOL=ON\nCMAKE_C_FLAGS:STRING=-U__AMX_TILE__\n";
        assert_eq!(cpu_flags(native), "GGML_NATIVE=ON, C flags -U__AMX_TILE__");
        let named = "GGML_NATIVE:BOOL=OFF\nGGML_AVX2:BOOL=ON\nGGML_AVX512:BOOL=ON\nGGML_AMX_INT8:BOOL=OFF\n\
                     GGML_CPU:BOOL=ON\nGGML_FMA:BOOL=ON\nCMAKE_C_FLAGS:STRING=-mtune=native\n";
        assert_eq!(cpu_flags(named), "GGML_NATIVE=OFF, AVX2 AVX512 FMA, C flags -mtune=native");
        assert_eq!(cpu_flags("CMAKE_C_FLAGS:STRING=\n"), "GGML_NATIVE=OFF, no extensions");
    }
}
