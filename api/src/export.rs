//! What an export archive is made of, as both its reader (crabd's import)
//! and a pull that checks a version before downloading it need it: the
//! members' names, the manifest's signature and what the manifest says
//! each member must be.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ImageFile;

/// The manifest's member name (the archive's last member).
pub const MANIFEST: &str = "crab-export.json";
/// The filesystem stream's member name.
pub const FS_STREAM: &str = "fs.stream";
/// The conversation's member name.
pub const TRANSCRIPT: &str = "transcript.jsonl";
/// The signature's member name.
pub const SIGNATURE: &str = "crab-export.sig";
/// The most the manifest or the signature may weigh (read into memory).
pub const MAX_METADATA: u64 = 64 << 20;
/// What a signature signs before the manifest's bytes: it never passes
/// for a signature of anything else the key might sign.
const SIGNING_CONTEXT: &[u8] = b"crab-export-v2\0";
/// The one signature algorithm.
const ED25519: &str = "ed25519";

/// What a manifest's signature signs: the context, then its bytes.
pub fn signed_message(manifest: &[u8]) -> Vec<u8> {
    [SIGNING_CONTEXT, manifest].concat()
}

/// A host's signature of an archive's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signature {
    /// The algorithm (`ed25519`).
    pub algorithm: String,
    /// The signing host's public key, lower-case hex.
    pub key: String,
    /// The signature of the manifest's bytes, lower-case hex.
    pub signature: String,
}

/// Why a signature does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// It is no signature this version reads.
    #[error("{0}")]
    Invalid(String),
    /// It is well formed and does not sign the manifest.
    #[error("the manifest does not match its signature (key {key})")]
    Mismatch {
        /// The key it names, lower-case hex.
        key: String,
    },
}

impl Signature {
    /// An Ed25519 signature `signature` by public key `key`.
    pub fn ed25519(key: &[u8], signature: &[u8]) -> Signature {
        Signature {
            algorithm: ED25519.to_owned(),
            key: hex(key),
            signature: hex(signature),
        }
    }

    /// Checks that this signs `message`; answers the signing key
    /// (lower-case hex).
    ///
    /// # Errors
    /// [`SignatureError`].
    pub fn verify(&self, message: &[u8]) -> Result<String, SignatureError> {
        use ring::signature::{UnparsedPublicKey, ED25519 as RING_ED25519};
        if self.algorithm != ED25519 {
            return Err(SignatureError::Invalid(format!(
                "signature algorithm {:?} (this version reads {ED25519})",
                self.algorithm
            )));
        }
        let (Some(key), Some(sig)) = (unhex(&self.key), unhex(&self.signature)) else {
            return Err(SignatureError::Invalid(
                "the signature's key or value is not hex".to_owned(),
            ));
        };
        if key.len() != 32 {
            return Err(SignatureError::Invalid(format!(
                "the signature's key is {} bytes, not an Ed25519 key's 32",
                key.len()
            )));
        }
        UnparsedPublicKey::new(&RING_ED25519, &key)
            .verify(message, &sig)
            .map_err(|_| SignatureError::Mismatch { key: hex(&key) })?;
        Ok(hex(&key))
    }
}

/// The part of a manifest that names the archive's other members (the
/// rest of it is crabd's).
#[derive(Debug, Clone, Deserialize)]
pub struct ManifestMembers {
    /// The process image's files.
    pub images: Vec<ImageFile>,
    /// The filesystem stream.
    pub fs: MemberSum,
    /// The conversation, if there is one.
    #[serde(default)]
    pub transcript: Option<MemberSum>,
}

/// A member's size and sha256 as a manifest records them.
#[derive(Debug, Clone, Deserialize)]
pub struct MemberSum {
    /// Its size.
    pub bytes: u64,
    /// Its sha256, lower-case hex.
    pub sha256: String,
}

impl ManifestMembers {
    /// Every member but the manifest and its signature, by name: (size,
    /// sha256 in lower-case hex).
    pub fn expected(&self) -> BTreeMap<String, (u64, String)> {
        let mut expected: BTreeMap<String, (u64, String)> = self
            .images
            .iter()
            .map(|f| (format!("images/{}", f.path), (f.bytes, f.sha256.clone())))
            .collect();
        expected.insert(FS_STREAM.to_owned(), (self.fs.bytes, self.fs.sha256.clone()));
        if let Some(t) = &self.transcript {
            expected.insert(TRANSCRIPT.to_owned(), (t.bytes, t.sha256.clone()));
        }
        expected
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: impl AsRef<[u8]>) -> String {
    bytes.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of hex string `s` (either case); `None` if it is not hex.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() & 1 == 1 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_holds_for_its_message_and_key_only() {
        use ring::signature::{Ed25519KeyPair, KeyPair};
        let rng = ring::rand::SystemRandom::new();
        let pair =
            |rng| Ed25519KeyPair::from_pkcs8(Ed25519KeyPair::generate_pkcs8(rng).unwrap().as_ref()).unwrap();
        let (ours, theirs) = (pair(&rng), pair(&rng));
        let message = signed_message(b"{\"format\":2}");
        let sig = Signature::ed25519(ours.public_key().as_ref(), ours.sign(&message).as_ref());
        assert_eq!(sig.verify(&message), Ok(hex(ours.public_key())));
        // Upper-case hex is read too, and answered in lower case.
        let upper = Signature {
            key: sig.key.to_uppercase(),
            ..sig.clone()
        };
        assert_eq!(upper.verify(&message), Ok(hex(ours.public_key())));
        assert!(matches!(
            sig.verify(&signed_message(b"{\"format\":1}")),
            Err(SignatureError::Mismatch { .. })
        ));
        // Another host's key named with our signature: it does not hold.
        let swapped = Signature {
            key: hex(theirs.public_key()),
            ..sig.clone()
        };
        assert!(matches!(
            swapped.verify(&message),
            Err(SignatureError::Mismatch { .. })
        ));
        let other = Signature {
            algorithm: "rsa".to_owned(),
            ..sig.clone()
        };
        assert!(matches!(other.verify(&message), Err(SignatureError::Invalid(_))));
        let garbled = Signature {
            signature: "zz".to_owned(),
            ..sig
        };
        assert!(matches!(
            garbled.verify(&message),
            Err(SignatureError::Invalid(_))
        ));
    }

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        assert_eq!(unhex(&hex([0u8, 0xab, 0xff])), Some(vec![0, 0xab, 0xff]));
        assert_eq!(unhex("ABcd"), Some(vec![0xab, 0xcd]));
        for bad in ["abc", "+a", "zz", "a "] {
            assert_eq!(unhex(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_manifest_names_its_members() {
        let m: ManifestMembers = serde_json::from_str(
            r#"{"format":2,"images":[{"path":"pages-1.img","bytes":4,"sha256":"aa"}],
                "fs":{"name":"x","bytes":9,"sha256":"bb"},"container":{}}"#,
        )
        .unwrap();
        let e = m.expected();
        assert_eq!(e["images/pages-1.img"], (4, "aa".to_owned()));
        assert_eq!(e[FS_STREAM], (9, "bb".to_owned()));
        assert!(!e.contains_key(TRANSCRIPT));
    }
}
