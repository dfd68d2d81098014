//! Where a plugin comes from: a local file, or an OCI registry (`oci://REGISTRY/REPO@sha256:DIGEST`
//! or `oci://REGISTRY/REPO:TAG`). This room turns either into the path of a file whose bytes
//! are known, before the component layer compiles it; it never reaches into the layers below.
//!
//! A pulled plugin is trusted by digest, not by name: the manifest must hash to the digest
//! asked for (a tag is resolved to one first, and logged), the one layer must hash to the
//! digest the manifest names, and both are hashed again whenever they are read back from
//! the cache. A pulled plugin must also carry a cosign signature by a key the operator
//! trusts (`signature`), unless its policy is `allow-unsigned`; a file is the operator's
//! own and is not.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The CNCF TAG Runtime Wasm artifact layout (what `wkg oci push` and Spin publish): the
/// config's media type, and the media type of the manifest's one layer, the component.
pub const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.wasm.config.v0+json";
/// The media type of the one layer of a Wasm artifact: the component's bytes.
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
    pub cache: Option<PathBuf>,
    /// The longest one pull (manifest and layer) may take.
    #[serde(default = "default_pull_timeout_ms")]
    pub timeout_ms: u64,
    /// cosign public keys (PEM files, `cosign.pub`) trusted to sign pulled plugins.
    #[serde(default)]
    pub keys: Vec<PathBuf>,
    /// Whether a pulled plugin must be signed by one of `keys` (default: `require`).
    #[serde(default)]
    pub signatures: SignaturePolicy,
}

/// Whether a plugin pulled from a registry must carry a signature by a trusted key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SignaturePolicy {
    /// Refuse it unless a trusted key signed its digest: the default.
    #[default]
    Require,
    /// Run it signed or not (logged at start); a signature present is still checked
    /// and reported.
    AllowUnsigned,
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
            keys: Vec::new(),
            signatures: SignaturePolicy::Require,
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
    /// The `oci://` reference does not parse, names no registry, or has a digest that
    /// is not sha256.
    #[error("{reference}: not an OCI reference ({reason}); expected oci://REGISTRY/REPO@sha256:DIGEST or oci://REGISTRY/REPO:TAG")]
    BadReference {
        /// The plugin's reference (`oci://...`).
        reference: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An `oci://` plugin, in a build without the `oci` feature (the reference).
    #[error("{0}: oci:// plugins need llamabox's `oci` feature")]
    NoOciSupport(String),
    /// The registry could not be reached (connection refused, no such host, a timeout).
    #[error("{reference}: registry {registry} is unreachable: {reason}")]
    Unreachable {
        /// The plugin's reference (`oci://...`).
        reference: String,
        /// The registry (`HOST` or `HOST:PORT`).
        registry: String,
        /// The error, with its causes.
        reason: String,
    },
    /// The manifest or the layer does not hash to the digest it was asked for by (in the
    /// pull, or read back from the cache).
    #[error("{reference}: digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The plugin's reference (`oci://...`).
        reference: String,
        /// The digest asked for (`sha256:HEX`).
        expected: String,
        /// The digest of the bytes received.
        actual: String,
    },
    /// The artifact is not a Wasm component by the CNCF layout (its manifest, media
    /// types or layers).
    #[error("not a Wasm component: {reference}: {reason}")]
    NotWasm {
        /// The plugin's reference (`oci://...`).
        reference: String,
        /// What in it is not.
        reason: String,
    },
    /// The component layer is over `max_plugin_mib` (as its manifest declares, or as
    /// the cache holds it).
    #[error(
        "{reference}: the plugin is {size} bytes, over the limit of {limit} bytes (max_plugin_mib)"
    )]
    TooLarge {
        /// The plugin's reference (`oci://...`).
        reference: String,
        /// Its size in bytes.
        size: u64,
        /// The limit in bytes.
        limit: u64,
    },
    /// The pull (manifest and layer) took longer than the registry's timeout.
    #[error("{reference}: the pull took longer than {timeout_ms} ms")]
    Timeout {
        /// The plugin's reference (`oci://...`).
        reference: String,
        /// The timeout, in milliseconds.
        timeout_ms: u64,
    },
    /// The registry refused or answered wrongly (an error status, a tag resolved to no
    /// sha256 digest, more bytes than declared, an unreadable signature manifest).
    #[error("{reference}: the registry answered: {reason}")]
    Registry {
        /// The plugin's reference (`oci://...`).
        reference: String,
        /// What it answered.
        reason: String,
    },
    /// No cache folder is set and there is no default one (no `HOME`).
    #[error("{reference}: no folder for pulled plugins: set --plugin-cache (or [registry] cache), or HOME")]
    NoCache {
        /// The plugin's reference (`oci://...`).
        reference: String,
    },
    /// The cache could not be read or written.
    #[error("the pulled plugins' cache {path}: {source}")]
    Cache {
        /// The file or folder in the cache.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Signatures are required but no key is trusted, so no pulled plugin could run.
    #[error("{reference}: signatures are required, but no key is trusted: name cosign public keys with --trust-key (or [registry] keys), or allow unsigned plugins explicitly (--allow-unsigned, signatures = \"allow-unsigned\")")]
    NoTrustedKeys {
        /// The plugin's reference (`oci://...`).
        reference: String,
    },
    /// Signatures are required and no trusted key's signature verifies for the digest.
    #[error("{reference}{} is refused: {reason}", if reference.ends_with(digest.as_str()) { String::new() } else { format!(" ({digest})") })]
    Unsigned {
        /// The plugin's reference (`oci://...`).
        reference: String,
        /// The manifest's digest the signature must be for.
        digest: String,
        /// Why no signature verifies (none found, or which check failed).
        reason: String,
    },
    /// A trusted key file could not be read or is not a cosign (P-256) public key.
    #[error("the trusted key {path}: {reason}")]
    BadKey {
        /// The key's file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// A plugin ready to compile: its file, and for a pulled one what was verified.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The component's file (the operator's own, or the cache's copy).
    pub path: PathBuf,
    /// For an `oci://` plugin: its manifest's digest and its signer.
    pub pulled: Option<Pulled>,
}

/// What is known of a plugin pulled from a registry.
#[derive(Clone, Debug)]
pub struct Pulled {
    /// The manifest's digest (`sha256:HEX`), which a tag was resolved to.
    pub digest: String,
    /// The id of the trusted key whose signature verified (`sha256:` and the hex digest
    /// of its DER), or `None` for an unsigned plugin run under `allow-unsigned`.
    pub signer: Option<String>,
    /// The grant the artifact asks for (its manifest's [`GRANT_ANNOTATION`]), as written.
    /// Never applied unless the operator's grant is [`GrantChoice::Requested`].
    pub requested: Option<String>,
}

/// The manifest annotation in which a plugin's publisher writes the grant it asks for:
/// interface names, comma-separated (`cancel,llm,generate`).
pub const GRANT_ANNOTATION: &str = "dev.llamabox.grant";

/// The grant an operator gives a plugin: interfaces by name, or the one its artifact
/// requests (applied only because the operator said so, as Wassette does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrantChoice {
    /// This grant, whatever the artifact asks for.
    Given(crate::Grant),
    /// What the pulled artifact's `dev.llamabox.grant` annotation asks for.
    Requested,
}

impl std::str::FromStr for GrantChoice {
    type Err = String;

    /// `requested`, or what [`crate::Grant`] parses.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "requested" => Ok(GrantChoice::Requested),
            other => other.parse().map(GrantChoice::Given),
        }
    }
}

/// In a config file: `"requested"`, or what a grant is written as.
impl<'de> Deserialize<'de> for GrantChoice {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Word(String),
            Grant(crate::Grant),
        }
        match Written::deserialize(deserializer)? {
            Written::Word(word) => word.parse().map_err(serde::de::Error::custom),
            Written::Grant(grant) => Ok(GrantChoice::Given(grant)),
        }
    }
}

/// The grant of the plugin `path` (found as `resolved`) under the operator's `choice`:
/// the choice, the artifact's request if the operator chose that, else the default for
/// where it comes from: every llamabox interface for a file (what the README's commands
/// run), none for a plugin pulled from a registry.
pub fn grant_for(
    choice: Option<GrantChoice>,
    path: &Path,
    resolved: &Resolved,
) -> Result<crate::Grant, String> {
    match choice {
        Some(GrantChoice::Given(grant)) => Ok(grant),
        None if is_oci(path) => Ok(crate::Grant::none()),
        None => Ok(crate::Grant::all()),
        Some(GrantChoice::Requested) => {
            let requested = resolved.pulled.as_ref().and_then(|p| p.requested.as_deref());
            let text = requested.ok_or_else(|| {
                format!("the grant is \"requested\", but the plugin requests none (no {GRANT_ANNOTATION} annotation)")
            })?;
            let grant = text
                .parse()
                .map_err(|e| format!("the grant it requests ({text:?}) does not parse: {e}"))?;
            tracing::info!(plugin = %path.display(), %grant, "applying the grant the plugin requests, as the operator chose");
            Ok(grant)
        }
    }
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
) -> Result<Resolved, SourceError> {
    let Some(reference) = path.to_str().and_then(|s| s.strip_prefix(URL_PREFIX)) else {
        return Ok(Resolved { path: path.to_path_buf(), pulled: None });
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
mod oci;
#[cfg(feature = "oci")]
mod signature;
