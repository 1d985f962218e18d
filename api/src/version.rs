//! Versions as they cross the API: a published version's record, the file
//! snapshot it names, and how a caller picks one.

use serde::{Deserialize, Serialize};

use crate::{BackendKind, Class, SandboxId, SnapshotName};

/// A filesystem snapshot in a backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsSnapshot {
    /// Which backend holds it.
    pub backend: BackendKind,
    /// Its name in that backend.
    pub name: SnapshotName,
}

/// One file of a process image, as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageFile {
    /// Path relative to the images directory, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// sha256 of the content, lower-case hex.
    pub sha256: String,
}

/// A published version, as its manifest line records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionRecord {
    /// The sandbox it belongs to.
    pub sandbox: SandboxId,
    /// Its number: from 1, increasing with each version of the sandbox.
    pub version: u64,
    /// When it was published, in milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The turn that ended at this version, if a turn did.
    pub turn: Option<u64>,
    /// The branch of the sandbox's conversation that turn is on (the
    /// transcript's tree; 0: the root, and lines written before branches).
    #[serde(default)]
    pub branch: u64,
    /// The class of the change it captured.
    pub class: Class,
    /// The version it descends from: the sandbox's head when it was taken
    /// (see `crabctl versions`). None for a first version, one after a
    /// restart, and lines written before versions named their parent.
    #[serde(default)]
    pub parent: Option<u64>,
    /// The version whose images directory holds its process image.
    pub process_image: Option<u64>,
    /// The filesystem snapshot it uses.
    pub fs_snapshot: Option<FsSnapshot>,
    /// How many turns of the transcript belong to it (the prefix length).
    pub transcript_turns: u64,
    /// The process image's files, when this version holds them.
    pub images: Vec<ImageFile>,
}

// === impl VersionRecord ===

impl VersionRecord {
    /// Whether this version's own images directory holds its process image.
    pub fn holds_images(&self) -> bool {
        self.process_image == Some(self.version)
    }
}

/// Which version: a number, or the newest valid one. On the wire a number
/// or the string `"latest"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionSel {
    /// The newest version that passes verification.
    Latest,
    /// This version number.
    Number(u64),
}

/// Text that names no version.
#[derive(Debug, thiserror::Error)]
#[error("invalid version {text:?}: a version number from `crabctl versions`, or `latest`")]
pub struct InvalidVersionSel {
    /// The text given.
    pub text: String,
}

// === impl VersionSel ===

impl std::str::FromStr for VersionSel {
    type Err = InvalidVersionSel;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "latest" {
            return Ok(VersionSel::Latest);
        }
        s.parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .map(VersionSel::Number)
            .ok_or_else(|| InvalidVersionSel { text: s.to_owned() })
    }
}

impl std::fmt::Display for VersionSel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VersionSel::Latest => f.write_str("latest"),
            VersionSel::Number(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for VersionSel {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            VersionSel::Latest => s.serialize_str("latest"),
            VersionSel::Number(n) => s.serialize_u64(*n),
        }
    }
}

impl<'de> Deserialize<'de> for VersionSel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => n.to_string().parse().map_err(serde::de::Error::custom),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expected: Option<VersionSel>) {
        assert_eq!(text.parse::<VersionSel>().ok(), expected, "{text:?}");
    }

    #[test]
    fn selections() {
        check("latest", Some(VersionSel::Latest));
        check("3", Some(VersionSel::Number(3)));
        check("0", None);
        check("-1", None);
        check("v3", None);
        assert_eq!(
            serde_json::from_str::<VersionSel>("7").unwrap(),
            VersionSel::Number(7)
        );
        assert_eq!(serde_json::to_string(&VersionSel::Latest).unwrap(), "\"latest\"");
    }
}
