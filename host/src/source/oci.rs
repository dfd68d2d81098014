//! Pulls from OCI registries: manifests and the component's layer, checked against their
//! digests, the signatures beside them, and the cache of pulled plugins.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError, OciErrorCode};
use oci_client::manifest::{OciImageManifest, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_MEDIA_TYPE};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest as _, Sha256};

use super::signature::{self, Signature, TrustedKeys};
use super::{Pulled, RegistryOptions, Resolved, SignaturePolicy, SourceError, URL_PREFIX};
use super::{WASM_CONFIG_MEDIA_TYPE, WASM_LAYER_MEDIA_TYPE};

/// The longest a manifest may be: a Wasm artifact's is a few hundred bytes.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;

pub(super) async fn resolve(
    text: &str,
    options: &RegistryOptions,
    compile_cache: Option<&Path>,
) -> Result<Resolved, SourceError> {
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
    let trust = Trust { keys: TrustedKeys::load(&options.keys)?, policy: options.signatures };
    if trust.policy == SignaturePolicy::Require && trust.keys.is_empty() {
        return Err(SourceError::NoTrustedKeys { reference: shown });
    }
    let cache = Cache {
        dir: options
            .cache_dir(compile_cache)
            .ok_or_else(|| SourceError::NoCache { reference: shown.clone() })?,
    };
    // A digest that the cache holds, with a signature that still verifies, needs no
    // network at all.
    if let Some(digest) = reference.digest() {
        let found = cache.lookup_trusted(
            &repository(&reference),
            digest,
            options.max_bytes(),
            &shown,
            &trust,
        );
        if let Some(resolved) = found {
            tracing::info!(reference = %shown, %digest, "plugin from the cache of pulled plugins");
            return Ok(resolved);
        }
    }
    let timeout_ms = options.timeout_ms;
    let pull = pull(&reference, &shown, options, &trust, &cache);
    match tokio::time::timeout(Duration::from_millis(timeout_ms), pull).await {
        Ok(pulled) => pulled,
        Err(_) => Err(SourceError::Timeout { reference: shown, timeout_ms }),
    }
}

/// The keys trusted to sign plugins, and whether a signature is required.
struct Trust {
    keys: TrustedKeys,
    policy: SignaturePolicy,
}

impl Trust {
    /// The signer of the manifest `digest` among `signatures`: its key's id; `None` for
    /// an unsigned plugin that the policy allows (logged), else an error with why.
    fn check(
        &self,
        signatures: &[Signature],
        digest: &str,
        shown: &str,
    ) -> Result<Option<String>, SourceError> {
        match self.keys.verify(signatures, digest) {
            Ok(signer) => Ok(Some(signer)),
            Err(reason) if self.policy == SignaturePolicy::AllowUnsigned => {
                tracing::warn!(reference = %shown, %digest, "running an unsigned plugin (signatures = allow-unsigned): {reason}");
                Ok(None)
            }
            Err(reason) => Err(SourceError::Unsigned {
                reference: shown.into(),
                digest: digest.into(),
                reason,
            }),
        }
    }
}

async fn pull(
    reference: &Reference,
    shown: &str,
    options: &RegistryOptions,
    trust: &Trust,
    cache: &Cache,
) -> Result<Resolved, SourceError> {
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
            let digest = client.fetch_manifest_digest(reference, &auth).await.map_err(failed)?;
            if !digest.strip_prefix("sha256:").is_some_and(is_sha256_hex) {
                return Err(SourceError::Registry {
                    reference: shown.into(),
                    reason: format!("the tag resolved to {digest:?}, not a sha256 digest"),
                });
            }
            tracing::info!(reference = %shown, %digest, "resolved the plugin's tag to a digest");
            let found = cache.lookup_trusted(
                &repository(reference),
                &digest,
                options.max_bytes(),
                shown,
                trust,
            );
            if let Some(resolved) = found {
                return Ok(resolved);
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
    // The signature is checked before the component is downloaded at all.
    let signatures = signatures(&client, &reference, &auth, shown, &registry).await?;
    let signer = trust.check(&signatures, &digest, shown)?;
    let limit = options.max_bytes();
    let declared = u64::try_from(layer.size).unwrap_or(u64::MAX);
    if declared > limit {
        return Err(SourceError::TooLarge { reference: shown.into(), size: declared, limit });
    }
    // No more than the manifest declared is taken in: a registry that sends on past it
    // (a blob of gigabytes behind a small size) is cut off at that byte.
    let mut out = Capped { bytes: Vec::new(), limit: declared, over: false };
    let pulled = client.pull_blob(&reference, &layer, &mut out).await;
    if out.over {
        return Err(SourceError::Registry {
            reference: shown.into(),
            reason: format!(
                "the registry sent more than the {declared} bytes its manifest declares for the component"
            ),
        });
    }
    pulled.map_err(failed)?;
    check_digest(&out.bytes, &layer.digest, shown)?;
    let requested = requested_grant(&manifest_bytes);
    let path = cache.store(
        &repository(&reference),
        &digest,
        &manifest_bytes,
        &layer.digest,
        &out.bytes,
        &signatures,
    )?;
    tracing::info!(reference = %shown, %digest, bytes = out.bytes.len(), signer = signer.as_deref().unwrap_or("none"), "pulled the plugin");
    Ok(Resolved { path, pulled: Some(Pulled { digest, signer, requested }) })
}

/// The cosign signatures published for `reference`'s digest (the `sha256-HEX.sig` tag of
/// its repository); none if there is no such tag. Each payload is bounded and checked
/// against its layer's digest; a layer that is not a signature is skipped.
async fn signatures(
    client: &Client,
    reference: &Reference,
    auth: &RegistryAuth,
    shown: &str,
    registry: &str,
) -> Result<Vec<Signature>, SourceError> {
    let digest = reference.digest().unwrap_or_default();
    let tag = format!("{}.sig", digest.replacen(':', "-", 1));
    let signed =
        Reference::with_tag(reference.registry().into(), reference.repository().into(), tag);
    let media_types = [OCI_IMAGE_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE];
    let manifest = match client.pull_manifest_raw(&signed, auth, &media_types).await {
        Ok((bytes, _)) => bytes,
        Err(e) if is_not_found(&e) => return Ok(Vec::new()),
        Err(e) => return Err(classify(e, shown, registry)),
    };
    let refused = |reason: String| SourceError::Registry {
        reference: shown.into(),
        reason: format!("its signatures ({}): {reason}", signed.whole()),
    };
    if manifest.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(refused(format!("a manifest of {} bytes", manifest.len())));
    }
    let manifest: OciImageManifest =
        serde_json::from_slice(&manifest).map_err(|e| refused(e.to_string()))?;
    let mut found = Vec::new();
    let layers =
        manifest.layers.iter().filter(|l| l.media_type == signature::SIMPLE_SIGNING_MEDIA_TYPE);
    for layer in layers.take(signature::MAX_SIGNATURES) {
        let Some(text) =
            layer.annotations.as_ref().and_then(|a| a.get(signature::SIGNATURE_ANNOTATION))
        else {
            continue;
        };
        if u64::try_from(layer.size).map_or(true, |size| size > signature::MAX_PAYLOAD_BYTES) {
            continue;
        }
        let mut payload =
            Capped { bytes: Vec::new(), limit: signature::MAX_PAYLOAD_BYTES, over: false };
        client
            .pull_blob(&signed, layer, &mut payload)
            .await
            .map_err(|e| classify(e, shown, registry))?;
        check_digest(&payload.bytes, &layer.digest, shown)?;
        found.push(Signature { payload: payload.bytes, signature: text.clone() });
    }
    Ok(found)
}

/// The grant the manifest's annotation asks for, if any (at most 256 characters).
fn requested_grant(manifest: &[u8]) -> Option<String> {
    let manifest: OciImageManifest = serde_json::from_slice(manifest).ok()?;
    let text = manifest.annotations?.remove(super::GRANT_ANNOTATION)?;
    (text.len() <= 256).then_some(text)
}

/// `REGISTRY/REPO`: where a plugin's signatures are looked up.
fn repository(reference: &Reference) -> String {
    format!("{}/{}", reference.registry(), reference.repository())
}

/// Whether a registry said there is no such manifest (a plugin nobody signed).
fn is_not_found(e: &OciDistributionError) -> bool {
    match e {
        OciDistributionError::ImageManifestNotFoundError(_) => true,
        OciDistributionError::RegistryError { envelope, .. } => envelope.errors.iter().any(|e| {
            matches!(
                e.code,
                OciErrorCode::ManifestUnknown | OciErrorCode::NotFound | OciErrorCode::NameUnknown
            )
        }),
        _ => false,
    }
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
    if let OciDistributionError::DigestError(DigestError::VerificationError { expected, actual }) =
        e
    {
        return SourceError::DigestMismatch { reference: shown.into(), expected, actual };
    }
    let mut reason = e.to_string();
    let mut unreachable =
        matches!(e, OciDistributionError::RequestError(ref r) if r.is_connect() || r.is_timeout());
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
            return Poll::Ready(Err(std::io::Error::other("the plugin is over its size limit")));
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

/// Pulled plugins by digest: `manifests/<hex>` (the manifest's bytes),
/// `blobs/<hex>.wasm` (the component's) and `signatures/<hex>.json` (what the registry
/// published as its signatures when it was pulled). The first two are hashed again on
/// every lookup and the signatures verified again, so a changed entry, or one no longer
/// signed by a trusted key, is pulled afresh rather than run.
struct Cache {
    dir: PathBuf,
}

impl Cache {
    fn manifest_path(&self, digest: &str) -> PathBuf {
        self.dir.join("manifests").join(digest.trim_start_matches("sha256:"))
    }

    /// Signatures are kept per repository: they are looked up in the repository a plugin
    /// is pulled from, so the same bytes pulled from a repository that holds no
    /// signature must not pass on the strength of another repository's.
    fn signatures_path(&self, repository: &str, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        let repository = sha256(repository.as_bytes());
        let repository = &repository["sha256:".len()..][..16];
        self.dir.join("signatures").join(format!("{hex}-{repository}.json"))
    }

    /// The cached plugin `digest`, if `lookup` has it and the signatures cached for it
    /// from `repository` satisfy `trust` now.
    fn lookup_trusted(
        &self,
        repository: &str,
        digest: &str,
        limit: u64,
        shown: &str,
        trust: &Trust,
    ) -> Option<Resolved> {
        let path = self.lookup(digest, limit, shown)?;
        let signatures: Vec<Signature> = std::fs::read(self.signatures_path(repository, digest))
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        match trust.check(&signatures, digest, shown) {
            Ok(signer) => {
                let manifest = std::fs::read(self.manifest_path(digest)).unwrap_or_default();
                let requested = requested_grant(&manifest);
                let pulled = Pulled { digest: digest.into(), signer, requested };
                Some(Resolved { path, pulled: Some(pulled) })
            }
            Err(e) => {
                tracing::info!(reference = %shown, "the cached plugin's signatures do not do ({e}); asking the registry");
                None
            }
        }
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
        repository: &str,
        digest: &str,
        manifest: &[u8],
        layer_digest: &str,
        bytes: &[u8],
        signatures: &[Signature],
    ) -> Result<PathBuf, SourceError> {
        let blob = self.blob_path(layer_digest);
        write_atomically(&blob, bytes)?;
        let signatures = serde_json::to_vec(signatures).unwrap_or_default();
        write_atomically(&self.signatures_path(repository, digest), &signatures)?;
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
            format!(r#"{{"mediaType":"{media}","digest":"sha256:{}","size":9}}"#, "1".repeat(64))
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
