//! The WIT is versioned (wit/CHANGELOG.md): a plugin built against an earlier release of
//! `llamabox:inference` links and runs unchanged, and one built against a release this
//! host does not link is refused at load, naming its import and the versions linked.

use llamabox::{Error, Limits, ModelRegistry, PluginHost, RunOutcome};

use crate::common;
use crate::polyglot::{assert_same_field, PROMPT};

/// guest/compat-0.1.0 is built from wit/released/0.1.0: it imports `...@0.1.0`, which
/// this host serves as 0.1.1. It generates exactly what the current demo does, and its
/// cancel still stops a decode with memory untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_built_against_the_previous_version_runs_unchanged() {
    let model = common::slow_model();
    let plugin = common::guest_plugin("llamabox-compat-0-1-0.wasm");
    let engine = llamabox::wasmtime::Engine::default();
    let component = llamabox::wasmtime::component::Component::from_file(&engine, &plugin).unwrap();
    let ty = component.component_type();
    let imports: Vec<String> = ty.imports(&engine).map(|(name, _)| name.to_string()).collect();
    assert!(imports.iter().any(|i| i == "llamabox:inference/generate@0.1.0"), "{imports:?}");
    assert_eq!(llamabox::OLDEST_WIT_VERSION, "0.1.0");
    assert_ne!(llamabox::WIT_VERSION, "0.1.0", "the test is about an earlier version");

    let args = ["--model", "slow", "--prompt", PROMPT, "--generate", "8"];
    let (outcome, out) = common::run_plugin(&plugin, &[("slow", model)], &[], &args).await;
    assert_eq!(outcome, RunOutcome::Success, "{out}");
    let demo = crate::polyglot::rust_demo(model, "8").await;
    let why = "a 0.1.0 plugin generates what a current one does";
    assert_same_field(&out, &demo, "host-generated-ids", why);
    assert_eq!(common::field(&out, "host-finish"), "max-tokens");
    assert_eq!(common::field(&out, "cancelled-decode"), "cancelled, seq-pos-max=-1");
}

/// A command component importing one llamabox interface at `version`, with `func`.
fn importing(version: &str, func: &str) -> Vec<u8> {
    format!(
        r#"(component
            (import "llamabox:inference/cancel@{version}" (instance (export "{func}" (func))))
            (core module $m (func (export "run") (result i32) i32.const 0))
            (core instance $i (instantiate $m))
            (func $run (result (result)) (canon lift (core func $i "run")))
            (instance $cli (export "run" (func $run)))
            (export "wasi:cli/run@0.2.0" (instance $cli)))"#
    )
    .into_bytes()
}

#[test]
fn a_plugin_of_a_version_this_host_does_not_link_is_refused_naming_it() {
    let host = PluginHost::new(ModelRegistry::new(), Limits::default()).unwrap();
    // A later minor (another line), a later patch that needs what this host lacks, and
    // one older than the oldest linked.
    for version in ["0.2.0", "0.1.99", "0.0.1"] {
        let import = format!("llamabox:inference/cancel@{version}");
        match host.load_bytes(&importing(version, "frobnicate")) {
            Err(e @ Error::WitVersion { .. }) => {
                let message = e.to_string();
                assert!(message.contains(&import), "{message}");
                assert!(
                    message.contains(&format!(
                        "links llamabox:inference {} to {}",
                        llamabox::OLDEST_WIT_VERSION,
                        llamabox::WIT_VERSION
                    )),
                    "{message}"
                );
            }
            other => panic!("{version}: expected a version error, got {:?}", other.err()),
        }
    }
    // The same function under a version this host links is an ordinary link error: the
    // version is not what is wrong.
    let version = llamabox::WIT_VERSION;
    match host.load_bytes(&importing(version, "frobnicate")) {
        Err(Error::Link { missing, .. }) => {
            assert_eq!(missing, [format!("llamabox:inference/cancel@{version}")])
        }
        other => panic!("expected a link error, got {:?}", other.err()),
    }
}
