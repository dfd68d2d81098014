//! Plugins pulled from an OCI registry (issue 36): a real registry on loopback (Debian's
//! `docker-registry`, the CNCF distribution registry) that the test starts and stops by its
//! own process id, artifacts pushed to it by a real client (skopeo, from an OCI image
//! layout directory the test writes: index.json and blobs), and `llamabox run oci://...`.
//!
//! Signatures are cosign's key-pair signatures in cosign's registry layout (the
//! `sha256-HEX.sig` tag), signed with OpenSSL's ECDSA P-256: Debian packages no cosign,
//! and its skopeo is built with sigstore signing disabled.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

use super::{assert_fails_saying, common, stderr};
use llamabox::WIT_VERSION as WIT;

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

/// A scratch folder `name`, and a registry keeping its storage there.
fn scratch_with_registry(name: &str) -> (Scratch, Registry) {
    let scratch = Scratch::new(name);
    let registry = Registry::start(&scratch.0);
    (scratch, registry)
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
    write_layout_annotated(dir, tag, config, layer, Annotations::default())
}

/// An image's annotations: on its layer and on its manifest (none where null).
#[derive(Default)]
struct Annotations {
    layer: serde_json::Value,
    manifest: serde_json::Value,
}

/// `write_layout`, with `annotations`.
fn write_layout_annotated(
    dir: &Path,
    tag: &str,
    config: (&str, &[u8]),
    layer: (&str, &[u8]),
    annotations: Annotations,
) -> String {
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
    let mut layer_descriptor = descriptor(layer.0, layer.1);
    if !annotations.layer.is_null() {
        layer_descriptor["annotations"] = annotations.layer;
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": layer.0,
        "config": descriptor(config.0, config.1),
        "layers": [layer_descriptor],
    });
    let mut manifest = manifest;
    if !annotations.manifest.is_null() {
        manifest["annotations"] = annotations.manifest;
    }
    let manifest = serde_json::to_vec(&manifest).unwrap();
    let digest = sha256(&manifest);
    let mut entry = descriptor("application/vnd.oci.image.manifest.v1+json", &manifest);
    entry["annotations"] = serde_json::json!({ "org.opencontainers.image.ref.name": tag });
    let index = serde_json::json!({ "schemaVersion": 2, "manifests": [entry] });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    digest
}

/// An ECDSA P-256 key pair made by OpenSSL (cosign's key type): `NAME.key`, `NAME.pub`.
struct Signer {
    key: PathBuf,
    public: PathBuf,
}

impl Signer {
    fn new(dir: &Path, name: &str) -> Signer {
        let (key, public) = (dir.join(format!("{name}.key")), dir.join(format!("{name}.pub")));
        openssl(&["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", p(&key)]);
        openssl(&["ec", "-in", p(&key), "-pubout", "-out", p(&public)]);
        Signer { key, public }
    }

    /// The key's id as llamabox shows it: the SHA-256 of the public key's DER.
    fn key_id(&self) -> String {
        let der = self.public.with_extension("der");
        openssl(&["pkey", "-pubin", "-in", p(&self.public), "-outform", "DER", "-out", p(&der)]);
        sha256(&std::fs::read(der).unwrap())
    }

    /// Sign the manifest `digest` of `repo` as cosign does, and push the signature to
    /// `repo:sha256-HEX.sig` (for `signed_as`, another digest: a signature moved to an
    /// artifact it was not made for).
    fn sign(&self, registry: &Registry, repo: &str, digest: &str, signed_as: Option<&str>) {
        let dir = self.key.with_file_name(format!("sig-{}", &digest[7..19]));
        std::fs::create_dir_all(&dir).unwrap();
        let payload = serde_json::json!({
            "critical": {
                "identity": { "docker-reference": format!("{}/{repo}", registry.host()) },
                "image": { "docker-manifest-digest": digest },
                "type": "cosign container image signature",
            },
            "optional": null,
        });
        let payload_file = dir.join("payload.json");
        std::fs::write(&payload_file, serde_json::to_vec(&payload).unwrap()).unwrap();
        let sig = dir.join("payload.sig");
        openssl(&["dgst", "-sha256", "-sign", p(&self.key), "-out", p(&sig), p(&payload_file)]);
        let b64 = dir.join("payload.sig.b64");
        openssl(&["base64", "-A", "-in", p(&sig), "-out", p(&b64)]);
        let signature = std::fs::read_to_string(b64).unwrap();
        let layout = dir.join("layout");
        let tag = format!("{}.sig", signed_as.unwrap_or(digest).replacen(':', "-", 1));
        let config = br#"{"architecture":"","os":"","rootfs":{"type":"layers","diff_ids":[]}}"#;
        write_layout_annotated(
            &layout,
            &tag,
            ("application/vnd.oci.image.config.v1+json", config),
            (
                "application/vnd.dev.cosign.simplesigning.v1+json",
                &std::fs::read(&payload_file).unwrap(),
            ),
            Annotations {
                layer: serde_json::json!({ "dev.cosignproject.cosign/signature": signature.trim() }),
                ..Annotations::default()
            },
        );
        registry.push(&layout, &tag, repo);
    }
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn openssl(args: &[&str]) {
    let out = bounded(Command::new("openssl").args(args), Duration::from_secs(30));
    assert!(out.status.success(), "openssl {args:?}: {}", stderr(&out));
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
    let (scratch, registry) = scratch_with_registry("pull");
    let layout = scratch.0.join("layout");
    let (digest, layer) = demo_layout(&layout);
    // skopeo keeps the Wasm artifact's manifest byte for byte.
    assert_eq!(registry.push(&layout, "v1", "plugins/demo"), digest);
    let signer = Signer::new(&scratch.0, "cosign");
    signer.sign(&registry, "plugins/demo", &digest, None);
    let host = registry.host();
    // The compile cache in use decides where pulled plugins go: `oci-plugins` beside it.
    let compiled = scratch.0.join("cache/compiled");
    let (compiled, key) = (p(&compiled), p(&signer.public));
    let grant = "cancel,llm,media,generate";
    let cache_flags = ["--compile-cache", compiled, "--trust-key", key, "--grant", grant];
    let by_digest = format!("oci://{host}/plugins/demo@{digest}");

    let (out, pulled) = run_demo(&by_digest, &cache_flags);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("generated-tokens: 16"));
    let log = stderr(&out);
    assert!(log.contains("pulled the plugin") && log.contains(&signer.key_id()), "{log}");

    // Grants, deny by default for a pulled plugin: refused at load, naming the import.
    for (flags, refusal) in [
        (
            &["--compile-cache", compiled, "--trust-key", key][..],
            format!("it imports llamabox:inference/cancel@{WIT} but is not granted cancel (its grant: none)"),
        ),
        (
            &["--compile-cache", compiled, "--trust-key", key, "--grant", "cancel,llm,generate"],
            format!("it imports llamabox:inference/media@{WIT} but is not granted media"),
        ),
    ] {
        let (out, _) = run_demo(&by_digest, flags);
        assert!(!out.status.success() && out.stdout.is_empty(), "{}", stderr(&out));
        assert!(stderr(&out).contains(&refusal), "{}", stderr(&out));
    }
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
    let (scratch, registry) = scratch_with_registry("refuse");
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
        let cache_flags = [
            "--plugin-cache",
            p(&cache),
            "--no-compile-cache",
            "--allow-unsigned",
            "--grant",
            "all",
        ];
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
            .args(["serve", "--listen", "127.0.0.1:0", "--plugin", &plugin, "--allow-unsigned"])
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
             timeout_ms = 20000\nsignatures = \"allow-unsigned\"\n[[plugins]]\nname = \"chat\"\n\
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
    let (scratch, registry) = scratch_with_registry("serve-pull");
    let layout = scratch.0.join("layout");
    let wasm = std::fs::read(common::serve::openai_plugin()).unwrap();
    let config = br#"{"architecture":"wasm","os":"wasip2"}"#;
    let digest = write_layout(&layout, "v1", (WASM_CONFIG, config), (WASM_LAYER, &wasm));
    assert_eq!(registry.push(&layout, "v1", "plugins/openai"), digest);
    let signer = Signer::new(&scratch.0, "cosign");
    signer.sign(&registry, "plugins/openai", &digest, None);
    let plugin = format!("oci://{}/plugins/openai@{digest}", registry.host());
    let cache = scratch.0.join("plugins");

    // serve.toml's grant for the plugin withholds what it imports: no start.
    let config = scratch.0.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\n[models]\ntiny = {:?}\n[registry]\ncache = {cache:?}\n\
             keys = [{:?}]\n[[plugins]]\nname = \"chat\"\npath = \"{plugin}\"\ngrant = [\"llm\", \"generate\"]\n",
            common::tiny_model(),
            signer.public,
        ),
    )
    .unwrap();
    let out = bounded(
        Command::new(env!("CARGO_BIN_EXE_llamabox")).args(["serve", "--config", p(&config)]),
        Duration::from_secs(120),
    );
    assert!(!out.status.success());
    let log = stderr(&out);
    assert!(log.contains("plugin \"chat\""), "{log}");
    assert!(
        log.contains(&format!("imports llamabox:inference/cancel@{WIT} but is not granted cancel")),
        "{log}"
    );

    let args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--plugin",
        &format!("openai={plugin}"),
        "--model",
        &format!("tiny={}", common::tiny_model().display()),
        "--plugin-cache",
        p(&cache),
        "--trust-key",
        p(&signer.public),
        "--grant",
        "cancel,llm,media,generate,embeddings",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut server = common::serve::Server::spawn(&args);
    let (status, body) = common::serve::curl(&[&server.url("/v1/models")]);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"tiny\""), "{body}");
    assert!(server.terminate().success());

    // Served by tag, the tag moved to a new digest: a reload pulls, verifies and serves
    // it; one whose new digest nobody signed is refused and the old digest serves on.
    let by_tag = format!("oci://{}/plugins/openai:v1", registry.host());
    let mut tagged = args.clone();
    tagged[3] = format!("openai={by_tag}");
    tagged.extend(["--admin-key".into(), "oci-admin-key-0123456789".into()]);
    let mut server = common::serve::Server::spawn(&tagged);
    let reload = || {
        common::serve::curl(&[
            "-X",
            "POST",
            &server.url("/admin/reload"),
            "-H",
            "authorization: Bearer oci-admin-key-0123456789",
        ])
    };
    let republish = |created: &str| {
        let layout = scratch.0.join(format!("layout-{}", &created[..10]));
        let config = format!(r#"{{"architecture":"wasm","os":"wasip2","created":"{created}"}}"#);
        let digest =
            write_layout(&layout, "v1", (WASM_CONFIG, config.as_bytes()), (WASM_LAYER, &wasm));
        assert_eq!(registry.push(&layout, "v1", "plugins/openai"), digest);
        digest
    };
    let unsigned = republish("2026-03-03T00:00:00Z");
    let (status, body) = reload();
    assert_eq!(status, 422, "{body}");
    assert!(body.contains(&unsigned) && body.contains("it has no signature"), "{body}");
    let signed = republish("2026-04-04T00:00:00Z");
    signer.sign(&registry, "plugins/openai", &signed, None);
    let (status, body) = reload();
    assert_eq!(status, 200, "{body}");
    let reloaded: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(reloaded["reloaded"][0]["digest"], signed.as_str(), "{body}");
    assert_eq!(reloaded["reloaded"][0]["signer"], signer.key_id().as_str(), "{body}");
    let (status, _) = common::serve::curl(&[&server.url("/v1/models")]);
    assert_eq!(status, 200);
    assert!(server.terminate().success());
}

#[test]
fn only_a_plugin_signed_by_a_trusted_key_runs_unless_unsigned_ones_are_allowed() {
    let (scratch, registry) = scratch_with_registry("signatures");
    let host = registry.host();
    let trusted = Signer::new(&scratch.0, "trusted");
    let stranger = Signer::new(&scratch.0, "stranger");
    // The same component four times: signed by the trusted key, unsigned, signed by a key
    // nobody trusts, and carrying a signature made for another artifact; and at the end,
    // changed in the registry after it was signed.
    let (digest, layer) = demo_layout(&scratch.0.join("demo"));
    for repo in ["plugins/signed", "plugins/unsigned", "plugins/stranger"] {
        assert_eq!(registry.push(&scratch.0.join("demo"), "v1", repo), digest);
    }
    trusted.sign(&registry, "plugins/signed", &digest, None);
    stranger.sign(&registry, "plugins/stranger", &digest, None);
    let wasm = std::fs::read(common::demo_plugin()).unwrap();
    let other = write_layout(
        &scratch.0.join("other"),
        "v1",
        (WASM_CONFIG, br#"{"architecture":"wasm","os":"wasip2","created":"2026-02-02T00:00:00Z"}"#),
        (WASM_LAYER, &wasm),
    );
    assert_eq!(registry.push(&scratch.0.join("other"), "v1", "plugins/moved"), other);
    trusted.sign(&registry, "plugins/moved", &digest, Some(&other));

    let cache = scratch.0.join("plugins");
    let compiled = scratch.0.join("compiled");
    let run = |repo: &str, at: &str, flags: &[&str]| {
        let base = ["--plugin-cache", p(&cache), "--compile-cache", p(&compiled), "--grant", "all"];
        let (out, _) = run_demo(&format!("oci://{host}/{repo}@{at}"), &[&base[..], flags].concat());
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), stderr(&out))
    };
    let trust = ["--trust-key", p(&trusted.public)];

    let (ran, stdout, log) = run("plugins/signed", &digest, &trust);
    assert!(ran && stdout.contains("generated-tokens: 16"), "{log}");
    assert!(log.contains(&trusted.key_id()), "{log}");

    // The same bytes are in the cache by now, pulled from the signed repository: that
    // signature does not vouch for a pull from a repository that has none.
    for (repo, at, refusal) in [
        ("plugins/unsigned", &digest, "it has no signature"),
        ("plugins/stranger", &digest, "signed by no trusted key"),
        ("plugins/moved", &other, &format!("a signature of {digest}, not of {other}")[..]),
    ] {
        let (ran, stdout, log) = run(repo, at, &trust);
        assert!(!ran && stdout.is_empty(), "{repo} ran: {log}");
        assert!(log.contains(&format!("{repo}@{at} is refused: ")), "{log}");
        assert!(log.contains(refusal), "{repo}: {log}");
    }
    // No trusted key at all: refused before the registry is asked anything.
    let (ran, _, log) = run("plugins/signed", &digest, &[]);
    assert!(!ran && log.contains("signatures are required, but no key is trusted"), "{log}");
    // Unsigned plugins run when the operator says so, and the start says it.
    let (ran, stdout, log) = run("plugins/unsigned", &digest, &["--allow-unsigned"]);
    assert!(ran && stdout.contains("generated-tokens: 16"), "{log}");
    assert!(log.contains("running an unsigned plugin (signatures = allow-unsigned)"), "{log}");

    // `inspect` names the signer and checks the grant against the imports.
    let inspect = bounded(
        Command::new(env!("CARGO_BIN_EXE_llamabox"))
            .args(["inspect", &format!("oci://{host}/plugins/signed@{digest}")])
            .args(["--plugin-cache", p(&cache), "--compile-cache", p(&compiled)])
            .args(trust)
            .args(["--grant", "llm,generate"]),
        Duration::from_secs(60),
    );
    let printed = String::from_utf8_lossy(&inspect.stdout);
    assert!(inspect.status.success(), "{}", stderr(&inspect));
    assert!(printed.contains(&format!("signer    {}", trusted.key_id())), "{printed}");
    assert!(printed.contains("grant     llm,generate"), "{printed}");
    assert!(
        printed.contains(&format!("refused: it imports llamabox:inference/cancel@{WIT}")),
        "{printed}"
    );

    // The component changed in the registry after it was signed (same size, one byte):
    // its signature still names the manifest, but the bytes no longer hash to the layer's
    // digest. Pulled afresh (another cache), it is refused.
    let blob = registry.blob_file(&layer);
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&blob, &bytes).unwrap();
    let fresh = scratch.0.join("fresh");
    let (out, _) = run_demo(
        &format!("oci://{host}/plugins/signed@{digest}"),
        &["--plugin-cache", p(&fresh), "--grant", "all", "--trust-key", p(&trusted.public)],
    );
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(
        stderr(&out).contains(&format!("digest mismatch: expected {layer}")),
        "{}",
        stderr(&out)
    );

    // The cache keeps the signatures and checks them again under the keys trusted now:
    // with the registry gone, the trusted key still runs it, a stranger's does not.
    drop(registry);
    let (ran, _, log) = run("plugins/signed", &digest, &trust);
    assert!(ran && log.contains("from the cache of pulled plugins"), "{log}");
    let (ran, _, log) = run("plugins/signed", &digest, &["--trust-key", p(&stranger.public)]);
    assert!(!ran && log.contains("is unreachable"), "{log}");
}

/// A registry that lies, on its own threads until dropped: each repository serves a
/// manifest of the Wasm layout whose layer declares `declared` bytes, no signatures, and
/// then sends the layer its own way: `endless` bytes at full speed, or a byte every
/// 100 ms (`drip`) for ever.
struct HostileRegistry {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Repository → (manifest digest, manifest bytes).
    manifests: std::collections::HashMap<String, (String, Vec<u8>)>,
}

impl HostileRegistry {
    fn start(repos: &[(&str, u64)]) -> HostileRegistry {
        use std::io::{BufRead as _, BufReader, Write as _};
        use std::sync::atomic::Ordering::Relaxed;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut manifests = std::collections::HashMap::new();
        for (repo, declared) in repos {
            let manifest = serde_json::json!({
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": { "mediaType": WASM_CONFIG, "digest": sha256(b"{}"), "size": 2 },
                "layers": [{ "mediaType": WASM_LAYER, "digest": sha256(repo.as_bytes()), "size": declared }],
            });
            let bytes = serde_json::to_vec(&manifest).unwrap();
            manifests.insert(repo.to_string(), (sha256(&bytes), bytes));
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        listener.set_nonblocking(true).unwrap();
        let (served, stopped) = (manifests.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopped.load(Relaxed) {
                let Ok((stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let (served, stopped) = (served.clone(), stopped.clone());
                std::thread::spawn(move || {
                    stream.set_nonblocking(false).unwrap();
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    let mut line = String::new();
                    reader.read_line(&mut line).unwrap_or_default();
                    let path = line.split(' ').nth(1).unwrap_or("").to_string();
                    while reader.read_line(&mut line).is_ok_and(|n| n > 2) {}
                    let mut out = stream;
                    let repo = path.trim_start_matches("/v2/").split('/').next().unwrap_or("");
                    let answer = |out: &mut std::net::TcpStream,
                                  status: &str,
                                  kind: &str,
                                  body: &[u8],
                                  extra: &str| {
                        let _ = write!(out, "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n{extra}connection: close\r\n\r\n", body.len());
                        let _ = out.write_all(body);
                    };
                    if path == "/v2/" {
                        answer(&mut out, "200 OK", "application/json", b"{}", "");
                    } else if path.contains("/manifests/sha256:") {
                        let (digest, bytes) = &served[repo];
                        let extra = format!("docker-content-digest: {digest}\r\n");
                        answer(
                            &mut out,
                            "200 OK",
                            "application/vnd.oci.image.manifest.v1+json",
                            bytes,
                            &extra,
                        );
                    } else if path.contains("/manifests/") {
                        let none = br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"no such manifest"}]}"#;
                        answer(&mut out, "404 Not Found", "application/json", none, "");
                    } else if path.contains("/blobs/") {
                        // No length: the body runs until the registry stops.
                        let _ = write!(out, "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\nconnection: close\r\n\r\n");
                        let chunk = vec![0u8; 64 << 10];
                        while !stopped.load(Relaxed) {
                            let sent = if repo == "drip" {
                                std::thread::sleep(Duration::from_millis(100));
                                out.write_all(&chunk[..1])
                            } else {
                                out.write_all(&chunk)
                            };
                            if sent.is_err() {
                                break;
                            }
                        }
                    } else {
                        answer(&mut out, "404 Not Found", "text/plain", b"", "");
                    }
                });
            }
        });
        HostileRegistry { port, stop, manifests }
    }

    fn reference(&self, repo: &str) -> String {
        format!("oci://127.0.0.1:{}/{repo}@{}", self.port, self.manifests[repo].0)
    }
}

impl Drop for HostileRegistry {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A registry that declares a 10 GB component, one that sends gigabytes behind a small
/// declared size, and one that drips a byte at a time: each is cut off by the size or
/// time limit, its reload refused, and the server answers all along.
#[test]
fn a_hostile_registry_is_cut_off_by_the_limits_and_the_server_keeps_serving() {
    let scratch = Scratch::new("hostile");
    let hostile = HostileRegistry::start(&[("huge", 10 << 30), ("endless", 1000), ("drip", 1000)]);
    let config = scratch.0.join("serve.toml");
    let write = |plugin: &str| {
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:0\"\nadmin_key = \"hostile-admin-key-0123456789\"\n\
                 [models]\ntiny = {:?}\n[registry]\ncache = {:?}\ntimeout_ms = 3000\n\
                 signatures = \"allow-unsigned\"\n[[plugins]]\nname = \"chat\"\npath = \"{plugin}\"\n\
                 grant = \"all\"\n",
                common::tiny_model(),
                scratch.0.join("plugins"),
            ),
        )
        .unwrap()
    };
    write(common::serve::openai_plugin().to_str().unwrap());
    let mut server =
        common::serve::Server::spawn(&["--config".into(), config.display().to_string()]);
    let url = server.url("/admin/reload");
    let reload = move || {
        common::serve::curl(&[
            "-X",
            "POST",
            &url,
            "-H",
            "authorization: Bearer hostile-admin-key-0123456789",
        ])
    };
    for (repo, refusal) in [
        ("huge", "the plugin is 10737418240 bytes, over the limit of 67108864 bytes"),
        ("endless", "the registry sent more than the 1000 bytes its manifest declares"),
        ("drip", "the pull took longer than 3000 ms"),
    ] {
        write(&hostile.reference(repo));
        let pending = std::thread::spawn(reload.clone());
        // The server answers while the reload is cut off.
        let (status, _) = common::serve::curl(&[&server.url("/v1/models")]);
        assert_eq!(status, 200);
        let (status, body) = pending.join().unwrap();
        assert_eq!(status, 422, "{repo}: {body}");
        assert!(body.contains(refusal), "{repo}: {body}");
        let (status, _) = common::serve::curl(&[&server.url("/v1/models")]);
        assert_eq!(status, 200, "{repo}: the old plugin serves on");
    }
    assert!(server.rss_kib() < 2 << 20, "no blob was taken in whole");
    assert!(server.terminate().success());
}

/// A plugin may carry the grant it asks for (`dev.llamabox.grant` on its manifest):
/// `inspect` shows it, and it applies only when the operator's grant is `requested`.
#[test]
fn a_grant_the_artifact_requests_applies_only_when_the_operator_says_so() {
    let (scratch, registry) = scratch_with_registry("requested");
    let host = registry.host();
    let wasm = std::fs::read(common::demo_plugin()).unwrap();
    let layout = scratch.0.join("asking");
    let asking = write_layout_annotated(
        &layout,
        "v1",
        (WASM_CONFIG, br#"{"architecture":"wasm","os":"wasip2"}"#),
        (WASM_LAYER, &wasm),
        Annotations {
            manifest: serde_json::json!({ "dev.llamabox.grant": "cancel,llm,media,generate" }),
            ..Annotations::default()
        },
    );
    assert_eq!(registry.push(&layout, "v1", "plugins/asking"), asking);
    let (plain, _) = demo_layout(&scratch.0.join("plain"));
    assert_eq!(registry.push(&scratch.0.join("plain"), "v1", "plugins/plain"), plain);
    let cache = scratch.0.join("plugins");
    let run = |repo: &str, digest: &str, grant: &[&str]| {
        let flags = [&["--plugin-cache", p(&cache), "--allow-unsigned"][..], grant].concat();
        run_demo(&format!("oci://{host}/{repo}@{digest}"), &flags).0
    };

    let out = run("plugins/asking", &asking, &[]);
    assert!(!out.status.success(), "a request is not a grant");
    assert!(stderr(&out).contains("is not granted cancel (its grant: none)"), "{}", stderr(&out));
    let inspect = bounded(
        Command::new(env!("CARGO_BIN_EXE_llamabox"))
            .args(["inspect", &format!("oci://{host}/plugins/asking@{asking}")])
            .args(["--plugin-cache", p(&cache), "--allow-unsigned"]),
        Duration::from_secs(60),
    );
    let printed = String::from_utf8_lossy(&inspect.stdout);
    assert!(
        printed
            .contains("requests  cancel,llm,media,generate (applied only with --grant requested)"),
        "{printed}"
    );
    assert!(printed.contains("grant     none\n"), "{printed}");

    let out = run("plugins/asking", &asking, &["--grant", "requested"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("generated-tokens: 16"));
    let out = run("plugins/plain", &plain, &["--grant", "requested"]);
    assert_fails_saying(&out, "the plugin requests none");
}
