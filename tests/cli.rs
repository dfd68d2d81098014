//! The `llamabox` command line: clear errors for bad invocations, and a real run.

mod common;
#[path = "cli/oci.rs"]
mod oci;

use std::process::{Command, Output};

fn llamabox(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_llamabox")).args(args).output().expect("running llamabox")
}

/// `llamabox run PLUGIN --model NAME=PATH HOST_FLAGS -- PLUGIN_ARGS`.
fn run(
    plugin: &std::path::Path,
    (name, model): (&str, &std::path::Path),
    host_flags: &[&str],
    plugin_args: &[&str],
) -> Output {
    let model = format!("{name}={}", model.display());
    let run = ["run", plugin.to_str().unwrap(), "--model", &model];
    llamabox(&[&run[..], host_flags, &["--"], plugin_args].concat())
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts that the command failed and its stderr says `says`.
fn assert_fails_saying(out: &Output, says: &str) {
    let log = stderr(out);
    assert!(!out.status.success(), "it succeeded: {log}");
    assert!(log.contains(says), "{says:?} not in {log}");
}

#[test]
fn info_names_the_cpu_features_and_flags_ggml_was_built_for_and_the_devices() {
    let out = llamabox(&["info"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let (features, rest) = text
        .strip_prefix("ggml CPU features: ")
        .and_then(|rest| rest.split_once("\nbuild: "))
        .unwrap_or_else(|| panic!("unexpected output: {text}"));
    let (build, devices) = rest
        .split_once("\nGPU backends: ")
        .unwrap_or_else(|| panic!("no GPU backends line: {text}"));
    let devices: Vec<&str> = devices.lines().skip(1).collect();
    let listed = llamabox_native::devices();
    assert_eq!(devices.len(), listed.len(), "one line per device: {text}");
    for (line, device) in devices.iter().zip(&listed) {
        assert!(
            line.starts_with(&format!(
                "device {}: {} ({:?}",
                device.name, device.description, device.kind
            )),
            "{line}"
        );
    }
    assert!(listed.iter().any(|d| d.kind == llamabox_native::DeviceKind::Cpu), "{text}");
    if llamabox_native::gpu_backends().is_empty() {
        assert!(text.contains("GPU backends: none"), "{text}");
    }
    let features: Vec<String> = features.split_whitespace().map(String::from).collect();
    assert_eq!(features, llamabox_native::cpu_features(), "{text}");
    let level = llamabox_native::InstructionLevel::of(&features);
    let expected = match llamabox_native::build_c_flags() {
        "" => level.to_string(),
        flags => format!("{level}, C flags {flags}"),
    };
    assert_eq!(build.trim(), expected, "{text}");
}

#[test]
fn an_offload_this_machine_cannot_do_is_refused_by_name_before_anything_runs() {
    let out = llamabox(&["run", "/nonexistent/plugin.wasm", "--device", "NoSuchGpu"]);
    assert_fails_saying(&out, "no GPU named \"NoSuchGpu\"");
    if llamabox_native::devices().iter().all(|d| !d.kind.is_gpu()) {
        let out = llamabox(&["run", "/nonexistent/plugin.wasm", "--gpu-layers", "4"]);
        assert_fails_saying(
            &out,
            "GPU layers were asked for, but this build and machine have no GPU",
        );
    }
}

/// `llamabox inspect` names a plugin's digest (its bytes' SHA-256), its size, the
/// interfaces it imports and exports, and whether its grant allows the imports; a file
/// that is not a component is refused.
#[test]
fn inspect_prints_a_plugins_digest_size_imports_and_exports() {
    use sha2::{Digest as _, Sha256};
    let plugin = common::demo_plugin();
    let bytes = std::fs::read(plugin).unwrap();
    let out = llamabox(&["inspect", plugin.to_str().unwrap()]);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{printed}{}", stderr(&out));
    let digest: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    assert!(printed.contains(&format!("digest    sha256:{digest}\n")), "{printed}");
    assert!(printed.contains(&format!("size      {} bytes\n", bytes.len())), "{printed}");
    let lines = |kind: &str| -> Vec<String> {
        printed.lines().filter_map(|l| l.strip_prefix(kind)).map(String::from).collect()
    };
    let imports = lines("import    ");
    assert!(imports.iter().any(|i| i.starts_with("llamabox:inference/llm@")), "{imports:?}");
    assert!(lines("export    ").iter().any(|e| e.starts_with("wasi:cli/run@")), "{printed}");
    // A local file is granted every interface unless the operator says otherwise.
    assert!(printed.contains("grant     llm,generate,embeddings,media,cancel,async-calls\n"));
    assert!(printed.contains("verdict   its imports are granted\n"), "{printed}");
    let bogus = common::repo_root().join("README.md");
    let out = llamabox(&["inspect", bogus.to_str().unwrap()]);
    assert_fails_saying(&out, "is not a WebAssembly component");
}

/// A grant narrower than what a plugin imports refuses it at load, naming the import,
/// before it runs at all.
#[test]
fn a_plugin_that_imports_what_it_is_not_granted_is_refused_at_load() {
    let plugin = common::demo_plugin();
    let out = llamabox(&["run", plugin.to_str().unwrap(), "--grant", "cancel,llm,generate"]);
    assert!(!out.status.success() && out.stdout.is_empty());
    let log = stderr(&out);
    let refusal = format!("plugin llamabox-demo.wasm: it imports llamabox:inference/media@{} but is not granted media (its grant: llm,generate,cancel)", llamabox::WIT_VERSION);
    assert!(log.contains(&refusal), "{log}");
    let out = llamabox(&["run", plugin.to_str().unwrap(), "--grant", "llm,network"]);
    assert_fails_saying(&out, "\"network\" is no llamabox interface");
}

#[test]
fn missing_plugin_file_is_named() {
    let out = llamabox(&["run", "/nonexistent/plugin.wasm"]);
    assert_fails_saying(&out, "plugin /nonexistent/plugin.wasm not found");
}

#[test]
fn a_file_that_is_not_a_component_is_refused() {
    let bogus = common::repo_root().join("README.md");
    let out = llamabox(&["run", bogus.to_str().unwrap()]);
    assert_fails_saying(&out, "is not a valid WebAssembly component");
}

#[test]
fn model_flags_are_checked() {
    let plugin = common::demo_plugin().to_str().unwrap();
    let out = llamabox(&["run", plugin, "--model", "nameonly"]);
    assert_fails_saying(&out, "expected NAME=PATH");
    let out = llamabox(&["run", plugin, "--model", "m=/nonexistent/model.gguf"]);
    assert_fails_saying(&out, "model \"m\": file /nonexistent/model.gguf not found");
}

#[test]
fn runs_the_demo_and_reports_unknown_model_names() {
    let tiny = ("tiny", common::tiny_model());
    let ok = run(common::demo_plugin(), tiny, &[], &["--model", "tiny", "--long-tokens", "64"]);
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{stdout}\n{}", stderr(&ok));
    assert!(stdout.contains("generated-tokens: 16"), "{stdout}");
    assert!(stdout.contains("long-decode: "), "{stdout}");

    let unknown = run(common::demo_plugin(), tiny, &[], &["--model", "other"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(stderr(&unknown).contains("ModelNotFound(\"other\")"), "{}", stderr(&unknown));
}

#[test]
fn synth_model_writes_a_loadable_model() {
    let path = common::repo_root()
        .join("target/test-models")
        .join(format!("cli-synth-{}.gguf", std::process::id()));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let out = llamabox(&["synth-model", path.to_str().unwrap(), "--seed", "7"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let model = llamabox_native::Model::load(&path).unwrap();
    assert_eq!(model.n_embd(), llamabox_native::TextModelSpec::tiny().n_embd);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_deadline_stops_the_plugin_with_status_124() {
    // The plugin decodes until it is stopped: only the deadline can end it, however
    // fast or slow this machine is.
    let args = ["decode-until-stopped", "--model", "slow", "--long-tokens", "512"];
    let out = run(
        common::test_plugin(),
        ("slow", common::slow_model()),
        &["--deadline-ms", "200"],
        &args,
    );
    assert_eq!(out.status.code(), Some(124), "{}", stderr(&out));
    assert!(stderr(&out).contains("deadline of 200 ms passed"), "{}", stderr(&out));
}

#[test]
fn limit_flags_reach_the_plugin() {
    let out = run(
        common::demo_plugin(),
        ("tiny", common::tiny_model()),
        &["--max-n-ctx", "100"],
        &["--model", "tiny"],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("n-ctx 1024 is above this host's limit 100"), "{}", stderr(&out));
}
