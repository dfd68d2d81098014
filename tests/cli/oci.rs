//! Plugins pulled from an OCI registry (issue 36): a real registry on loopback (Debian's
//! `docker-registry`, the CNCF distribution registry) that the test starts and stops by its
//! own process id, artifacts pushed to it by a real client (skopeo, from an OCI image
//! layout directory the test writes: index.json and blobs), and `llamabox run oci://...`.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

use super::{common, stderr};

const WASM_CONFIG: &str = "application/vnd.wasm.config.v0+json";
const WASM_LAYER: &str = "application/wasm";

/// A scratch folder under target/, removed with the guard.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = common::repo_root()
            .join("target")
            .join("test-oci")
            .join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `docker-registry serve` on a free loopback port, its storage in `dir`; killed (by its
/// pid) and reaped when dropped, also when the test fails.
struct Registry {
    child: Child,
    port: u16,
    storage: PathBuf,
}

impl Registry {
    fn start(dir: &Path) -> Registry {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let storage = dir.join("registry");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: 127.0.0.1:{port}\n",
                storage.display()
            ),
        )
        .unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("registry.log")).unwrap())
            .spawn()
            .expect("running docker-registry (scripts/install-deps.sh installs it)");
        let registry = Registry { child, port, storage };
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the registry did not listen within 15 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        registry
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Push the image at `layout:tag` to `repo:tag` with skopeo, bounded in time; the
    /// digest of the manifest the registry now holds (skopeo's `--digestfile`).
    fn push(&self, layout: &Path, tag: &str, repo: &str) -> String {
        let digestfile = layout.with_extension("digest");
        let out = bounded(
            Command::new("skopeo")
                .args(["copy", "--quiet", "--dest-tls-verify=false", "--digestfile"])
                .arg(&digestfile)
                .args([
                    format!("oci:{}:{tag}", layout.display()),
                    format!("docker://{}/{repo}:{tag}", self.host()),
                ]),
            Duration::from_secs(60),
        );
        assert!(out.status.success(), "skopeo copy: {}", stderr(&out));
        std::fs::read_to_string(&digestfile).unwrap().trim().to_string()
    }

    /// The registry's own copy of a blob (its filesystem storage layout).
    fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.storage.join(format!("docker/registry/v2/blobs/sha256/{}/{hex}/data", &hex[..2]))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run a command, killed (by its pid) if it takes longer than `limit`.
fn bounded(command: &mut Command, limit: Duration) -> Output {
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("{command:?} took longer than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// An OCI image layout directory holding one image tagged `tag`: a config and one layer of
/// the given media types. The manifest's digest.
fn write_layout(dir: &Path, tag: &str, config: (&str, &[u8]), layer: (&str, &[u8])) -> String {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let blob = |bytes: &[u8]| {
        let digest = sha256(bytes);
        std::fs::write(blobs.join(digest.trim_start_matches("sha256:")), bytes).unwrap();
        serde_json::json!({ "digest": digest, "size": bytes.len() })
    };
    let descriptor = |media: &str, bytes: &[u8]| {
        let mut d = blob(bytes);
        d["mediaType"] = media.into();
        d
    };
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": layer.0,
        "config": descriptor(config.0, config.1),
        "layers": [descriptor(layer.0, layer.1)],
    });
    let manifest = serde_json::to_vec(&manifest).unwrap();
    let digest = sha256(&manifest);
    let mut entry = descriptor("application/vnd.oci.image.manifest.v1+json", &manifest);
    entry["annotations"] = serde_json::json!({ "org.opencontainers.image.ref.name": tag });
    let index = serde_json::json!({ "schemaVersion": 2, "manifests": [entry] });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    digest
}

/// The demo plugin in the Wasm artifact layout (the config `wkg` writes, abridged).
fn demo_layout(dir: &Path) -> (String, String) {
    let wasm = std::fs::read(common::demo_plugin()).unwrap();
    let config = br#"{"created":"2026-01-01T00:00:00Z","architecture":"wasm","os":"wasip2","layerDigests":[],"component":{"exports":[],"imports":[],"target":null}}"#;
    let digest = write_layout(dir, "v1", (WASM_CONFIG, config), (WASM_LAYER, &wasm));
    (digest, sha256(&wasm))
}

/// `llamabox run PLUGIN` of the demo on the tiny model, with `flags`; its time.
fn run_demo(plugin: &str, flags: &[&str]) -> (Output, Duration) {
    let model = format!("tiny={}", common::tiny_model().display());
    let started = Instant::now();
    let out = bounded(
        Command::new(env!("CARGO_BIN_EXE_llamabox"))
            .args(["run", plugin, "--model", &model])
            .args(flags)
            .args(["--", "--model", "tiny", "--long-tokens", "8"])
            .env("RUST_LOG", "warn,llama_cpp=off,llamabox=info"),
        Duration::from_secs(120),
    );
    (out, started.elapsed())
}

#[test]
fn a_plugin_pulled_by_digest_or_tag_runs_and_starts_again_from_the_cache_without_the_registry() {
    let scratch = Scratch::new("pull");
    let registry = Registry::start(&scratch.0);
    let layout = scratch.0.join("layout");
    let (digest, layer) = demo_layout(&layout);
    // skopeo keeps the Wasm artifact's manifest byte for byte.
    assert_eq!(registry.push(&layout, "v1", "plugins/demo"), digest);
    let host = registry.host();
    // The compile cache in use decides where pulled plugins go: `oci-plugins` beside it.
    let compiled = scratch.0.join("cache/compiled");
    let cache_flags = ["--compile-cache", compiled.to_str().unwrap()];
    let by_digest = format!("oci://{host}/plugins/demo@{digest}");

    let (out, pulled) = run_demo(&by_digest, &cache_flags);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("generated-tokens: 16"));
    assert!(stderr(&out).contains("pulled the plugin"), "{}", stderr(&out));
    let cached = scratch.0.join("cache/oci-plugins/blobs");
    let cached = cached.join(format!("{}.wasm", layer.trim_start_matches("sha256:")));
    assert_eq!(std::fs::read(&cached).unwrap(), std::fs::read(common::demo_plugin()).unwrap());

    // A tag is resolved to its digest, which is logged, and then found in the cache.
    let (out, _) = run_demo(&format!("oci://{host}/plugins/demo:v1"), &cache_flags);
    assert!(out.status.success(), "{}", stderr(&out));
    let log = stderr(&out);
    assert!(
        log.contains("resolved the plugin's tag to a digest") && log.contains(&digest),
        "{log}"
    );

    // Without the registry: the digest is in the cache and runs; a tag cannot be resolved.
    drop(registry);
    let (out, cached_start) = run_demo(&by_digest, &cache_flags);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("from the cache of pulled plugins"), "{}", stderr(&out));
    let (out, _) = run_demo(&format!("oci://{host}/plugins/demo:v1"), &cache_flags);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "nothing ran");
    let log = stderr(&out);
    assert!(log.contains(&format!("registry {host} is unreachable")), "{log}");
    assert!(log.contains("Connection refused"), "{log}");
    eprintln!(
        "oci: pulled and ran the demo in {:.0} ms; from the cache, registry stopped, in {:.0} ms",
        pulled.as_secs_f64() * 1e3,
        cached_start.as_secs_f64() * 1e3
    );
}

#[test]
fn a_registry_artifact_that_is_not_the_plugin_asked_for_is_refused_before_anything_runs() {
    let scratch = Scratch::new("refuse");
    let registry = Registry::start(&scratch.0);
    let host = registry.host();
    let layout = scratch.0.join("layout");
    let (digest, layer) = demo_layout(&layout);
    assert_eq!(registry.push(&layout, "v1", "plugins/demo"), digest);
    // A container image (OCI image config, a tar layer) is not a component.
    let image = scratch.0.join("image");
    let config =
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
    write_layout(
        &image,
        "v1",
        ("application/vnd.oci.image.config.v1+json", config),
        ("application/vnd.oci.image.layer.v1.tar", &[0u8; 1024]),
    );
    // skopeo may rewrite a container image's manifest: ask for the digest it pushed.
    let image_digest = registry.push(&image, "v1", "images/base");
    let refused = |plugin: &str, flags: &[&str]| {
        let cache = scratch.0.join("plugins");
        let cache_flags = ["--plugin-cache", cache.to_str().unwrap(), "--no-compile-cache"];
        let (out, _) = run_demo(plugin, &[&cache_flags[..], flags].concat());
        assert!(!out.status.success(), "{plugin} ran");
        assert!(out.stdout.is_empty(), "{plugin}: nothing may run");
        let _ = std::fs::remove_dir_all(&cache);
        stderr(&out)
    };

    let log = refused(&format!("oci://{host}/images/base@{image_digest}"), &[]);
    assert!(log.contains("not a Wasm component: "), "{log}");
    assert!(log.contains("application/vnd.oci.image.config.v1+json"), "{log}");

    let demo = format!("oci://{host}/plugins/demo@{digest}");
    let log = refused(&demo, &["--max-plugin-mib", "0"]);
    assert!(log.contains("over the limit of 0 bytes (max_plugin_mib)"), "{log}");

    // The registry's copy of the component changed after the push: same size, one byte.
    let blob = registry.blob_file(&layer);
    let mut bytes = std::fs::read(&blob).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&blob, &bytes).unwrap();
    let log = refused(&demo, &[]);
    assert!(log.contains("digest mismatch") && log.contains(&layer), "{log}");

    // A reference that is no registry artifact at all.
    let log = refused("oci://plugins", &[]);
    assert!(log.contains("name the registry") || log.contains("not an OCI reference"), "{log}");
}

#[test]
fn serve_refuses_a_plugin_whose_registry_is_down_before_it_serves() {
    // Nothing listens on a port that was just free.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let digest = format!("sha256:{}", "ab".repeat(32));
    let scratch = Scratch::new("serve");
    let plugin = format!("openai=oci://127.0.0.1:{port}/plugins/openai@{digest}");
    let out = bounded(
        Command::new(env!("CARGO_BIN_EXE_llamabox"))
            .args(["serve", "--listen", "127.0.0.1:0", "--plugin", &plugin])
            .args(["--plugin-cache", scratch.0.join("plugins").to_str().unwrap()]),
        Duration::from_secs(60),
    );
    assert!(!out.status.success());
    let log = stderr(&out);
    assert!(log.contains(&format!("registry 127.0.0.1:{port} is unreachable")), "{log}");
    assert!(log.contains("plugin \"openai\""), "{log}");

    // The same from serve.toml: the plugin's `path`, and the pull's knobs in [registry].
    let config = scratch.0.join("serve.toml");
    let cache = scratch.0.join("plugins");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\n[registry]\ncache = {cache:?}\nmax_plugin_mib = 8\n\
             timeout_ms = 20000\n[[plugins]]\nname = \"chat\"\n\
             path = \"oci://127.0.0.1:{port}/plugins/openai@{digest}\"\n"
        ),
    )
    .unwrap();
    let out = bounded(
        Command::new(env!("CARGO_BIN_EXE_llamabox")).args([
            "serve",
            "--config",
            config.to_str().unwrap(),
        ]),
        Duration::from_secs(60),
    );
    assert!(!out.status.success());
    let log = stderr(&out);
    assert!(log.contains(&format!("registry 127.0.0.1:{port} is unreachable")), "{log}");
    assert!(log.contains("plugin \"chat\""), "{log}");
}

#[test]
fn serve_pulls_its_plugin_from_the_registry_and_answers_with_it() {
    let scratch = Scratch::new("serve-pull");
    let registry = Registry::start(&scratch.0);
    let layout = scratch.0.join("layout");
    let wasm = std::fs::read(common::serve::openai_plugin()).unwrap();
    let config = br#"{"architecture":"wasm","os":"wasip2"}"#;
    let digest = write_layout(&layout, "v1", (WASM_CONFIG, config), (WASM_LAYER, &wasm));
    assert_eq!(registry.push(&layout, "v1", "plugins/openai"), digest);
    let args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--plugin",
        &format!("openai=oci://{}/plugins/openai@{digest}", registry.host()),
        "--model",
        &format!("tiny={}", common::tiny_model().display()),
        "--plugin-cache",
        scratch.0.join("plugins").to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut server = common::serve::Server::spawn(&args);
    let (status, body) = common::serve::curl(&[&server.url("/v1/models")]);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"tiny\""), "{body}");
    assert!(server.terminate().success());
}
