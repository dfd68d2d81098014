//! cosign key-pair signatures of pulled plugins. cosign publishes the signatures of the
//! manifest `sha256:HEX` as an OCI artifact tagged `sha256-HEX.sig` in the same
//! repository: one layer per signature, each a "simple signing" JSON payload that names
//! the manifest's digest, with the ECDSA P-256 signature of the payload (base64 of its
//! DER) in the layer's `dev.cosignproject.cosign/signature` annotation. A plugin is
//! signed when one such payload names its digest and verifies under a trusted key.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use p256::ecdsa::signature::Verifier as _;
use p256::pkcs8::{DecodePublicKey as _, EncodePublicKey as _};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::SourceError;

/// The media type of a cosign signature's layer.
pub(super) const SIMPLE_SIGNING_MEDIA_TYPE: &str =
    "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation that holds the signature.
pub(super) const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The `critical.type` of a cosign image signature's payload.
const PAYLOAD_TYPE: &str = "cosign container image signature";
/// A payload is a few hundred bytes; anything larger is not one.
pub(super) const MAX_PAYLOAD_BYTES: u64 = 64 << 10;
/// Signatures read per plugin: one per signer is usual.
pub(super) const MAX_SIGNATURES: usize = 16;

/// The public keys an operator trusts to sign plugins (cosign's `cosign.pub`: a PEM
/// `PUBLIC KEY` of ECDSA P-256).
pub(super) struct TrustedKeys(Vec<(KeyId, p256::ecdsa::VerifyingKey)>);

/// A key's id, as `inspect` and the logs show it: `sha256:` and the hex SHA-256 of the
/// key's DER (SubjectPublicKeyInfo), what `openssl pkey -pubin -outform DER | sha256sum`
/// prints for the same PEM.
pub(super) type KeyId = String;

impl TrustedKeys {
    pub(super) fn load(paths: &[PathBuf]) -> Result<Self, SourceError> {
        paths.iter().map(|path| load_key(path)).collect::<Result<_, _>>().map(TrustedKeys)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The id of the first trusted key under which one of `signatures` verifies and
    /// names `digest`; else why none did.
    pub(super) fn verify(&self, signatures: &[Signature], digest: &str) -> Result<KeyId, String> {
        if signatures.is_empty() {
            return Err("it has no signature".into());
        }
        let mut reasons = Vec::new();
        for signature in signatures {
            match signature.check(digest) {
                Err(reason) => reasons.push(reason),
                Ok(der) => match self
                    .0
                    .iter()
                    .find(|(_, key)| key.verify(&signature.payload, &der).is_ok())
                {
                    Some((id, _)) => return Ok(id.clone()),
                    None => reasons.push("signed by no trusted key".into()),
                },
            }
        }
        reasons.dedup();
        Err(format!("no signature verifies: {}", reasons.join("; ")))
    }
}

fn load_key(path: &Path) -> Result<(KeyId, p256::ecdsa::VerifyingKey), SourceError> {
    let bad = |reason: String| SourceError::BadKey { path: path.to_path_buf(), reason };
    let pem = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let key = p256::ecdsa::VerifyingKey::from_public_key_pem(pem.trim())
        .map_err(|e| bad(format!("not a PEM ECDSA P-256 public key (cosign.pub): {e}")))?;
    let der = key.to_public_key_der().map_err(|e| bad(e.to_string()))?;
    Ok((key_id(der.as_bytes()), key))
}

fn key_id(der: &[u8]) -> KeyId {
    let hash = Sha256::digest(der);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// One signature as read from the registry, kept beside the pulled plugin so that a
/// start from the cache verifies it again against the keys trusted then.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Signature {
    /// The simple-signing payload's bytes, base64 in the cache.
    #[serde(with = "base64_bytes")]
    pub(super) payload: Vec<u8>,
    /// The annotation's text: base64 of the DER signature.
    pub(super) signature: String,
}

/// The part of a simple-signing payload that is checked.
#[derive(Deserialize)]
struct Payload {
    critical: Critical,
}

#[derive(Deserialize)]
struct Critical {
    #[serde(rename = "type")]
    kind: String,
    image: Image,
}

#[derive(Deserialize)]
struct Image {
    #[serde(rename = "docker-manifest-digest")]
    digest: String,
}

impl Signature {
    /// The DER signature, if the payload is a cosign image signature of `digest`.
    fn check(&self, digest: &str) -> Result<p256::ecdsa::DerSignature, String> {
        let payload: Payload = serde_json::from_slice(&self.payload)
            .map_err(|e| format!("a payload that is not cosign's: {e}"))?;
        if payload.critical.kind != PAYLOAD_TYPE {
            return Err(format!("a payload of type {:?}", payload.critical.kind));
        }
        if payload.critical.image.digest != digest {
            return Err(format!(
                "a signature of {}, not of {digest}",
                payload.critical.image.digest
            ));
        }
        let der = base64::engine::general_purpose::STANDARD
            .decode(self.signature.trim())
            .map_err(|e| format!("a signature that is not base64: {e}"))?;
        p256::ecdsa::DerSignature::from_bytes(&der)
            .map_err(|e| format!("a signature that is not ECDSA DER: {e}"))
    }
}

mod base64_bytes {
    use base64::Engine as _;

    pub fn serialize<S: serde::Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = <String as serde::Deserialize>::deserialize(d)?;
        base64::engine::general_purpose::STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use p256::ecdsa::signature::Signer as _;

    fn keypair(seed: u8) -> (p256::ecdsa::SigningKey, TrustedKeys) {
        let signing = p256::ecdsa::SigningKey::from_slice(&[seed; 32]).unwrap();
        let verifying = *signing.verifying_key();
        let der = verifying.to_public_key_der().unwrap();
        (signing, TrustedKeys(vec![(key_id(der.as_bytes()), verifying)]))
    }

    fn signed(key: &p256::ecdsa::SigningKey, digest: &str) -> Signature {
        let payload = format!(
            r#"{{"critical":{{"identity":{{"docker-reference":"r/p"}},"image":{{"docker-manifest-digest":"{digest}"}},"type":"{PAYLOAD_TYPE}"}},"optional":null}}"#
        )
        .into_bytes();
        let der: p256::ecdsa::DerSignature = key.sign(&payload);
        let signature = base64::engine::general_purpose::STANDARD.encode(der.as_bytes());
        Signature { payload, signature }
    }

    const DIGEST: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn a_signature_verifies_only_under_its_key_for_its_digest() {
        let (key, trusted) = keypair(7);
        let good = signed(&key, DIGEST);
        let id = trusted.verify(std::slice::from_ref(&good), DIGEST).unwrap();
        assert!(id.starts_with("sha256:") && id.len() == 71, "{id}");

        let (_, other) = keypair(8);
        let e = other.verify(std::slice::from_ref(&good), DIGEST).unwrap_err();
        assert!(e.contains("signed by no trusted key"), "{e}");

        let e = trusted.verify(&[signed(&key, &DIGEST.replace('1', "2"))], DIGEST).unwrap_err();
        assert!(e.contains("not of sha256:1111"), "{e}");

        let mut tampered = good.clone();
        tampered.payload =
            String::from_utf8(tampered.payload).unwrap().replace("r/p", "r/q").into_bytes();
        let e = trusted.verify(&[tampered], DIGEST).unwrap_err();
        assert!(e.contains("signed by no trusted key"), "{e}");

        assert_eq!(trusted.verify(&[], DIGEST).unwrap_err(), "it has no signature");
        // One good signature among bad ones is enough.
        let bad = Signature { payload: b"{}".to_vec(), signature: "x".into() };
        assert_eq!(trusted.verify(&[bad, good], DIGEST).unwrap(), id);
    }

    #[test]
    fn a_key_that_is_not_a_p256_pem_is_refused_by_path() {
        let dir = std::env::temp_dir().join(format!("llamabox-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cosign.pub");
        std::fs::write(&path, "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
            .unwrap();
        let e = TrustedKeys::load(std::slice::from_ref(&path)).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("cosign.pub") && e.contains("not a PEM ECDSA P-256 public key"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
