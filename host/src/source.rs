//! Where a plugin comes from: a local file, or an OCI registry (`oci://REGISTRY/REPO@sha256:DIGEST`
//! or `oci://REGISTRY/REPO:TAG`). This room turns either into the path of a file whose bytes
//! are known, before the component layer compiles it; it never reaches into the layers below.
//!
//! A pulled plugin is trusted by digest, not by name: the manifest must hash to the digest
//! asked for (a tag is resolved to one first, and logged), the one layer must hash to the
//! digest the manifest names, and both are hashed again whenever they are read back from
//! the cache. Signatures are not checked yet (docs: SECURITY.md).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The CNCF TAG Runtime Wasm artifact layout (what `wkg oci push` and Spin publish): the
/// config's media type, and the media type of the manifest's one layer, the component.
pub const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.wasm.config.v0+json";
pub const WASM_LAYER_MEDIA_TYPE: &str = "application/wasm";

/// The largest plugin pulled by default, in MiB: the CPython plugin is ~18 MB.
pub const DEFAULT_MAX_PLUGIN_MIB: u64 = 64;

const URL_PREFIX: &str = "oci://";

/// How plugins are pulled from registries (`[registry]` in serve.toml, the `--plugin-cache`,
/// `--max-plugin-mib` and `--insecure-registry` flags).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryOptions {
    /// Largest plugin (the component layer) in MiB; a larger one is refused before it is
    /// downloaded (by its manifest) or while it is (by its bytes).
    #[serde(default = "default_max_plugin_mib")]
    pub max_plugin_mib: u64,
    /// Registries (`HOST` or `HOST:PORT`) reached over plain HTTP. Loopback registries
    /// always are; every other registry is reached over HTTPS only.
    #[serde(default)]
    pub insecure: Vec<String>,
    /// Pulled plugins by digest (default: `oci-plugins` beside the compile cache). Like the
    /// compile cache, it must be writable by the host's user only.
    #[serde(default)]
    pub cache: Option<PathBuf>,
    /// The longest one pull (manifest and layer) may take.
    #[serde(default = "default_pull_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_max_plugin_mib() -> u64 {
    DEFAULT_MAX_PLUGIN_MIB
}

fn default_pull_timeout_ms() -> u64 {
    120_000
}

impl Default for RegistryOptions {
    fn default() -> Self {
        Self {
            max_plugin_mib: default_max_plugin_mib(),
            insecure: Vec::new(),
            cache: None,
            timeout_ms: default_pull_timeout_ms(),
        }
    }
}

impl RegistryOptions {
    /// The cache folder: `cache`, else `oci-plugins` beside `compile_cache` (the one in
    /// use, else the per-user default one).
    pub fn cache_dir(&self, compile_cache: Option<&Path>) -> Option<PathBuf> {
        if let Some(dir) = &self.cache {
            return Some(dir.clone());
        }
        let compiled = compile_cache
            .map(Path::to_path_buf)
            .or_else(crate::HostOptions::default_compile_cache)?;
        Some(compiled.parent().unwrap_or(Path::new(".")).join("oci-plugins"))
    }

    #[cfg(feature = "oci")]
    fn max_bytes(&self) -> u64 {
        self.max_plugin_mib.saturating_mul(1 << 20)
    }
}

/// Why a plugin could not be had from where it was said to come from. Each is raised before
/// the plugin is compiled, let alone run.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{reference}: not an OCI reference ({reason}); expected oci://REGISTRY/REPO@sha256:DIGEST or oci://REGISTRY/REPO:TAG")]
    BadReference { reference: String, reason: String },
    #[error("{0}: oci:// plugins need llamabox's `oci` feature")]
    NoOciSupport(String),
    #[error("{reference}: registry {registry} is unreachable: {reason}")]
    Unreachable { reference: String, registry: String, reason: String },
    #[error("{reference}: digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch { reference: String, expected: String, actual: String },
    #[error("not a Wasm component: {reference}: {reason}")]
    NotWasm { reference: String, reason: String },
    #[error(
        "{reference}: the plugin is {size} bytes, over the limit of {limit} bytes (max_plugin_mib)"
    )]
    TooLarge { reference: String, size: u64, limit: u64 },
    #[error("{reference}: the pull took longer than {timeout_ms} ms")]
    Timeout { reference: String, timeout_ms: u64 },
    #[error("{reference}: the registry answered: {reason}")]
    Registry { reference: String, reason: String },
    #[error("{reference}: no folder for pulled plugins: set --plugin-cache (or [registry] cache), or HOME")]
    NoCache { reference: String },
    #[error("the pulled plugins' cache {path}: {source}")]
    Cache { path: PathBuf, source: std::io::Error },
}

/// Whether `path` names a registry artifact (`oci://...`) rather than a file.
pub fn is_oci(path: &Path) -> bool {
    path.to_str().is_some_and(|s| s.starts_with(URL_PREFIX))
}

/// A short name for the plugin at `path` (its file name, or its repository's last part), as
/// a command's `argv[0]`.
pub fn display_name(path: &Path) -> String {
    match path.to_str().and_then(|s| s.strip_prefix(URL_PREFIX)) {
        Some(reference) => {
            let repo = reference.split(['@']).next().unwrap_or(reference);
            let last = repo.rsplit('/').next().unwrap_or(repo);
            // A `:TAG` after the last `/` is the tag, not a port.
            last.split(':').next().unwrap_or(last).to_string()
        }
        None => path.file_name().map_or("plugin".into(), |n| n.to_string_lossy().into_owned()),
    }
}

/// The local file to compile for `path`: `path` itself, or for `oci://...` the pulled and
/// verified component in the cache (pulled only when the cache does not hold its digest).
/// `compile_cache` is the compile cache in use, beside which pulled plugins are kept.
pub async fn resolve(
    path: &Path,
    options: &RegistryOptions,
    compile_cache: Option<&Path>,
) -> Result<PathBuf, SourceError> {
    let Some(reference) = path.to_str().and_then(|s| s.strip_prefix(URL_PREFIX)) else {
        return Ok(path.to_path_buf());
    };
    #[cfg(feature = "oci")]
    {
        oci::resolve(reference, options, compile_cache).await
    }
    #[cfg(not(feature = "oci"))]
    {
        let _ = (options, compile_cache);
        Err(SourceError::NoOciSupport(format!("{URL_PREFIX}{reference}")))
    }
}

#[cfg(feature = "oci")]
mod oci {
    use std::io::Write as _;
    use std::path::{Path, PathBuf};
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use oci_client::client::{ClientConfig, ClientProtocol};
    use oci_client::errors::{DigestError, OciDistributionError};
    use oci_client::manifest::{OciImageManifest, OCI_IMAGE_MEDIA_TYPE};
    use oci_client::secrets::RegistryAuth;
    use oci_client::{Client, Reference};
    use sha2::{Digest as _, Sha256};

    use super::WASM_LAYER_MEDIA_TYPE;
    use super::{RegistryOptions, SourceError, URL_PREFIX, WASM_CONFIG_MEDIA_TYPE};

    /// The longest a manifest may be: a Wasm artifact's is a few hundred bytes.
    const MAX_MANIFEST_BYTES: u64 = 1 << 20;

    pub(super) async fn resolve(
        text: &str,
        options: &RegistryOptions,
        compile_cache: Option<&Path>,
    ) -> Result<PathBuf, SourceError> {
        let shown = format!("{URL_PREFIX}{text}");
        let bad = |reason: String| SourceError::BadReference { reference: shown.clone(), reason };
        let reference: Reference = text.parse().map_err(|e| bad(format!("{e}")))?;
        if !text.starts_with(reference.registry()) {
            return Err(bad("name the registry (oci://HOST[:PORT]/REPO...)".into()));
        }
        if let Some(digest) = reference.digest() {
            if !digest.strip_prefix("sha256:").is_some_and(is_sha256_hex) {
                return Err(bad(format!("{digest} is not a sha256 digest")));
            }
        }
        let cache = Cache {
            dir: options
                .cache_dir(compile_cache)
                .ok_or_else(|| SourceError::NoCache { reference: shown.clone() })?,
        };
        // A digest that the cache holds needs no network at all.
        if let Some(digest) = reference.digest() {
            if let Some(path) = cache.lookup(digest, options.max_bytes(), &shown) {
                tracing::info!(reference = %shown, %digest, "plugin from the cache of pulled plugins");
                return Ok(path);
            }
        }
        let timeout_ms = options.timeout_ms;
        let pull = pull(&reference, &shown, options, &cache);
        match tokio::time::timeout(Duration::from_millis(timeout_ms), pull).await {
            Ok(pulled) => pulled,
            Err(_) => Err(SourceError::Timeout { reference: shown, timeout_ms }),
        }
    }

    async fn pull(
        reference: &Reference,
        shown: &str,
        options: &RegistryOptions,
        cache: &Cache,
    ) -> Result<PathBuf, SourceError> {
        // reqwest is built without a crypto provider of its own (no aws-lc C build): ring's.
        // Installing it a second time fails harmlessly.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let registry = reference.resolve_registry().to_string();
        let plain = plain_http_allowed(&registry, &options.insecure);
        let client = Client::new(ClientConfig {
            protocol: if plain {
                ClientProtocol::HttpsExcept(vec![registry.clone()])
            } else {
                ClientProtocol::Https
            },
            connect_timeout: Some(Duration::from_secs(10)),
            read_timeout: Some(Duration::from_secs(30)),
            ..ClientConfig::default()
        });
        let auth = RegistryAuth::Anonymous;
        let failed = |e: OciDistributionError| classify(e, shown, &registry);
        let reference = match reference.digest() {
            Some(_) => reference.clone(),
            None => {
                let digest =
                    client.fetch_manifest_digest(reference, &auth).await.map_err(failed)?;
                if !digest.strip_prefix("sha256:").is_some_and(is_sha256_hex) {
                    return Err(SourceError::Registry {
                        reference: shown.into(),
                        reason: format!("the tag resolved to {digest:?}, not a sha256 digest"),
                    });
                }
                tracing::info!(reference = %shown, %digest, "resolved the plugin's tag to a digest");
                if let Some(path) = cache.lookup(&digest, options.max_bytes(), shown) {
                    return Ok(path);
                }
                reference.clone_with_digest(digest)
            }
        };
        // `digest()` is set on both arms above.
        let digest = reference.digest().unwrap_or_default().to_string();
        // oci-client checks the manifest's bytes against the digest asked for.
        let (manifest_bytes, _) = client
            .pull_manifest_raw(&reference, &auth, &[OCI_IMAGE_MEDIA_TYPE])
            .await
            .map_err(failed)?;
        if manifest_bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(SourceError::NotWasm {
                reference: shown.into(),
                reason: format!("a manifest of {} bytes", manifest_bytes.len()),
            });
        }
        check_digest(&manifest_bytes, &digest, shown)?;
        let layer = wasm_layer(&manifest_bytes, shown)?;
        let limit = options.max_bytes();
        let declared = u64::try_from(layer.size).unwrap_or(u64::MAX);
        if declared > limit {
            return Err(SourceError::TooLarge { reference: shown.into(), size: declared, limit });
        }
        let mut out = Capped { bytes: Vec::new(), limit, over: false };
        let pulled = client.pull_blob(&reference, &layer, &mut out).await;
        if out.over {
            let size = out.bytes.len() as u64 + 1;
            return Err(SourceError::TooLarge { reference: shown.into(), size, limit });
        }
        pulled.map_err(failed)?;
        check_digest(&out.bytes, &layer.digest, shown)?;
        let path = cache.store(&digest, &manifest_bytes, &layer.digest, &out.bytes)?;
        tracing::info!(reference = %shown, %digest, bytes = out.bytes.len(), "pulled the plugin");
        Ok(path)
    }

    /// The component's layer, if the manifest has the Wasm artifact layout.
    fn wasm_layer(
        manifest: &[u8],
        shown: &str,
    ) -> Result<oci_client::manifest::OciDescriptor, SourceError> {
        let not_wasm = |reason: String| SourceError::NotWasm { reference: shown.into(), reason };
        let manifest: OciImageManifest = serde_json::from_slice(manifest)
            .map_err(|e| not_wasm(format!("not an OCI image manifest: {e}")))?;
        if manifest.config.media_type != WASM_CONFIG_MEDIA_TYPE {
            return Err(not_wasm(format!(
                "its config is {:?}, not {WASM_CONFIG_MEDIA_TYPE:?}",
                manifest.config.media_type
            )));
        }
        match <[_; 1]>::try_from(manifest.layers) {
            Ok([layer]) if layer.media_type == WASM_LAYER_MEDIA_TYPE => {
                if !layer.digest.strip_prefix("sha256:").is_some_and(is_sha256_hex) {
                    return Err(not_wasm(format!(
                        "its layer's digest {:?} is not sha256",
                        layer.digest
                    )));
                }
                Ok(layer)
            }
            Ok([layer]) => Err(not_wasm(format!(
                "its layer is {:?}, not {WASM_LAYER_MEDIA_TYPE:?}",
                layer.media_type
            ))),
            Err(layers) => Err(not_wasm(format!("{} layers, not one", layers.len()))),
        }
    }

    fn check_digest(bytes: &[u8], expected: &str, shown: &str) -> Result<(), SourceError> {
        let actual = sha256(bytes);
        if actual != expected {
            return Err(SourceError::DigestMismatch {
                reference: shown.into(),
                expected: expected.into(),
                actual,
            });
        }
        Ok(())
    }

    fn sha256(bytes: &[u8]) -> String {
        let hash = Sha256::digest(bytes);
        let mut out = String::with_capacity(7 + 64);
        out.push_str("sha256:");
        for byte in hash {
            out.push_str(&format!("{byte:02x}"));
        }
        out
    }

    fn is_sha256_hex(hex: &str) -> bool {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }

    /// Plain HTTP only to a loopback registry or one the operator named insecure.
    fn plain_http_allowed(registry: &str, insecure: &[String]) -> bool {
        let host = match registry.strip_prefix('[') {
            Some(rest) => rest.split(']').next().unwrap_or(rest),
            None => registry.rsplit_once(':').map_or(registry, |(host, _)| host),
        };
        host == "localhost"
            || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
            || insecure.iter().any(|i| i == registry || i == host)
    }

    /// Which of the promised errors a failed request is: a registry that cannot be reached
    /// (connection refused, no such host, timeouts), bytes that do not hash to their digest,
    /// or anything else the registry answered.
    fn classify(e: OciDistributionError, shown: &str, registry: &str) -> SourceError {
        if let OciDistributionError::DigestError(DigestError::VerificationError {
            expected,
            actual,
        }) = e
        {
            return SourceError::DigestMismatch { reference: shown.into(), expected, actual };
        }
        let mut reason = e.to_string();
        let mut unreachable = matches!(e, OciDistributionError::RequestError(ref r) if r.is_connect() || r.is_timeout());
        let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&e);
        while let Some(c) = cause {
            reason.push_str(": ");
            reason.push_str(&c.to_string());
            if c.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    std::io::ErrorKind::ConnectionRefused
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::TimedOut
                )
            }) {
                unreachable = true;
            }
            cause = c.source();
        }
        if unreachable {
            SourceError::Unreachable { reference: shown.into(), registry: registry.into(), reason }
        } else {
            SourceError::Registry { reference: shown.into(), reason }
        }
    }

    /// A writer that keeps at most `limit` bytes and fails past them (a registry that sends
    /// more than the manifest said, or than the limit allows).
    struct Capped {
        bytes: Vec<u8>,
        limit: u64,
        over: bool,
    }

    impl tokio::io::AsyncWrite for Capped {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            if self.bytes.len() as u64 + buf.len() as u64 > self.limit {
                self.over = true;
                return Poll::Ready(Err(std::io::Error::other(
                    "the plugin is over its size limit",
                )));
            }
            self.bytes.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Pulled plugins by digest: `manifests/<hex>` (the manifest's bytes) and
    /// `blobs/<hex>.wasm` (the component's). Both are hashed again on every lookup, so a
    /// changed entry is pulled afresh rather than run.
    struct Cache {
        dir: PathBuf,
    }

    impl Cache {
        fn manifest_path(&self, digest: &str) -> PathBuf {
            self.dir.join("manifests").join(digest.trim_start_matches("sha256:"))
        }

        fn blob_path(&self, digest: &str) -> PathBuf {
            let hex = digest.trim_start_matches("sha256:");
            self.dir.join("blobs").join(format!("{hex}.wasm"))
        }

        /// The cached component of the manifest `digest`, if the cache holds both and they
        /// still hash to their digests.
        fn lookup(&self, digest: &str, limit: u64, shown: &str) -> Option<PathBuf> {
            let manifest = std::fs::read(self.manifest_path(digest)).ok()?;
            let checked = check_digest(&manifest, digest, shown)
                .and_then(|()| wasm_layer(&manifest, shown))
                .and_then(|layer| {
                    let path = self.blob_path(&layer.digest);
                    let len = std::fs::metadata(&path).map_or(u64::MAX, |m| m.len());
                    if len > limit {
                        return Err(SourceError::TooLarge {
                            reference: shown.into(),
                            size: len,
                            limit,
                        });
                    }
                    let bytes = std::fs::read(&path)
                        .map_err(|source| SourceError::Cache { path: path.clone(), source })?;
                    check_digest(&bytes, &layer.digest, shown)?;
                    Ok(path)
                });
            match checked {
                Ok(path) => Some(path),
                Err(e) => {
                    tracing::warn!(reference = %shown, "the cached plugin is not usable ({e}); pulling it again");
                    None
                }
            }
        }

        fn store(
            &self,
            digest: &str,
            manifest: &[u8],
            layer_digest: &str,
            bytes: &[u8],
        ) -> Result<PathBuf, SourceError> {
            let blob = self.blob_path(layer_digest);
            write_atomically(&blob, bytes)?;
            write_atomically(&self.manifest_path(digest), manifest)?;
            Ok(blob)
        }
    }

    /// Write through a temporary file and a rename, so that a reader (another host
    /// starting) never sees half a file; folders are made private to this user.
    fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), SourceError> {
        let io = |source| SourceError::Cache { path: path.to_path_buf(), source };
        if let Some(dir) = path.parent() {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io)?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let mut file = std::fs::File::create(&tmp).map_err(io)?;
        file.write_all(bytes).and_then(|()| file.sync_all()).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn plain_http_goes_only_to_loopback_or_named_registries() {
            assert!(plain_http_allowed("127.0.0.1:5000", &[]));
            assert!(plain_http_allowed("localhost:5000", &[]));
            assert!(plain_http_allowed("[::1]:5000", &[]));
            assert!(!plain_http_allowed("ghcr.io", &[]));
            assert!(!plain_http_allowed("10.0.0.1:5000", &[]));
            assert!(plain_http_allowed("10.0.0.1:5000", &["10.0.0.1".into()]));
            assert!(plain_http_allowed("reg.lan:80", &["reg.lan:80".into()]));
        }

        #[test]
        fn only_the_wasm_artifact_layout_is_a_plugin() {
            let manifest = |config: &str, layers: &str| {
                format!(
                    r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
                    "config":{{"mediaType":"{config}","digest":"sha256:{z}","size":2}},"layers":[{layers}]}}"#,
                    z = "0".repeat(64)
                )
            };
            let layer = |media: &str| {
                format!(
                    r#"{{"mediaType":"{media}","digest":"sha256:{}","size":9}}"#,
                    "1".repeat(64)
                )
            };
            let ok = manifest(WASM_CONFIG_MEDIA_TYPE, &layer(WASM_LAYER_MEDIA_TYPE));
            assert_eq!(wasm_layer(ok.as_bytes(), "x").map(|l| l.size).ok(), Some(9));
            for bad in [
                manifest("application/vnd.oci.image.config.v1+json", &layer(WASM_LAYER_MEDIA_TYPE)),
                manifest(WASM_CONFIG_MEDIA_TYPE, &layer("application/vnd.oci.image.layer.v1.tar")),
                manifest(WASM_CONFIG_MEDIA_TYPE, ""),
                "{}".to_string(),
            ] {
                let e = wasm_layer(bad.as_bytes(), "x").map(|_| ()).unwrap_err().to_string();
                assert!(e.starts_with("not a Wasm component: "), "{e}");
            }
        }
    }
}
