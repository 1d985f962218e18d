//! One manifest line: a version record or the header, with its checksum.
//!
//! ```text
//! line    = sha256-hex SP json LF
//! sha256-hex: 64 lower-case hex digits, the sha256 of the json bytes exactly
//!             as written (the line's checksum)
//! json    = header | version, compact (it never holds a LF)
//! header  = {"v":1,"kind":"header","sandbox":"s1","next_version":8}
//! version = {"v":1,"kind":"version","sandbox":"s1","version":7,
//!            "created_unix_ms":1764417600000,"turn":7,"branch":0,"class":"fs",
//!            "parent":6,                              // or null (or absent)
//!            "process_image":5,                       // or null
//!            "fs_snapshot":{"backend":"zfs","name":"crab-7"},   // or null
//!            "transcript_turns":7,
//!            "images":[{"path":"pages-1.img","bytes":4096,"sha256":"…"}]}
//! ```
//!
//! `branch` is the branch of the sandbox's conversation its turn is on (0,
//! the root, when absent: lines written before branches).
//! `parent` is the version this one descends from (the sandbox's head when
//! it was taken); lines written before parents were recorded have none.
//! `process_image` is the version whose images directory holds the process
//! image this version uses: itself when it wrote one (then `images` lists
//! every file of it: relative path, size, sha256), an older version when it
//! reuses one (then `images` is empty), or null. `fs_snapshot` names the
//! filesystem backend's snapshot. A line whose checksum fails, whose json
//! does not parse, or whose record contradicts itself (an image path that
//! leaves its directory, a reused image from a newer version, files listed
//! by a version that reuses an image) is corrupt.

use std::path::{Component, Path};

pub use crab_api::{Class, FsSnapshot, ImageFile, VersionRecord};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{SandboxId, StoreError};

/// The format written in each line's `v`.
const FORMAT: u32 = 1;

/// A manifest's first line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Header {
    /// The sandbox the manifest belongs to.
    pub sandbox: SandboxId,
    /// No version numbered below this may be given out again (it survives
    /// compactions that drop the newest versions).
    pub next_version: u64,
}

/// A line, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decoded {
    Header(Header),
    Version(VersionRecord),
    Corrupt,
}

#[derive(Serialize, Deserialize)]
struct Envelope<T> {
    v: u32,
    #[serde(flatten)]
    body: T,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Body {
    Header(Header),
    Version(VersionRecord),
}

/// Whether `r` contradicts itself (see the module doc).
fn is_consistent(r: &VersionRecord) -> bool {
    let image_ok = match r.process_image {
        Some(h) if h == r.version => true,
        Some(h) => h < r.version && r.images.is_empty(),
        None => r.images.is_empty(),
    };
    image_ok
        && r.version >= 1
        && r.parent.is_none_or(|p| p < r.version)
        && r.images.iter().all(|f| is_safe_relative(&f.path))
}

/// Whether `path` is a relative path that stays inside its directory.
pub(crate) fn is_safe_relative(path: &str) -> bool {
    !path.is_empty()
        && Path::new(path)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}

/// The sha256 of `bytes`, lower-case hex.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// Encodes a header line, LF included.
pub(crate) fn encode_header(header: &Header) -> Result<Vec<u8>, StoreError> {
    encode(Body::Header(header.clone()))
}

/// Encodes a version line, LF included.
pub(crate) fn encode_version(record: &VersionRecord) -> Result<Vec<u8>, StoreError> {
    encode(Body::Version(record.clone()))
}

fn encode(body: Body) -> Result<Vec<u8>, StoreError> {
    let json = serde_json::to_vec(&Envelope { v: FORMAT, body }).map_err(StoreError::Encode)?;
    let mut line = sha256_hex(&json).into_bytes();
    line.push(b' ');
    line.extend_from_slice(&json);
    line.push(b'\n');
    Ok(line)
}

/// Decodes one line, without its LF.
pub(crate) fn decode(line: &[u8]) -> Decoded {
    let Some((sum, json)) = line.split_at_checked(64) else {
        return Decoded::Corrupt;
    };
    let Some(json) = json.strip_prefix(b" ") else {
        return Decoded::Corrupt;
    };
    if sum != sha256_hex(json).as_bytes() {
        return Decoded::Corrupt;
    }
    match serde_json::from_slice::<Envelope<Body>>(json) {
        Ok(Envelope {
            v: FORMAT,
            body: Body::Header(h),
        }) => Decoded::Header(h),
        Ok(Envelope {
            v: FORMAT,
            body: Body::Version(r),
        }) if is_consistent(&r) => Decoded::Version(r),
        _ => Decoded::Corrupt,
    }
}

#[cfg(test)]
mod tests {
    use crab_api::{BackendKind, SnapshotName};

    use super::*;

    fn record(version: u64, process_image: Option<u64>, paths: &[&str]) -> VersionRecord {
        VersionRecord {
            sandbox: SandboxId::new("s1").unwrap(),
            version,
            created_unix_ms: 1,
            turn: Some(version),
            branch: 0,
            class: Class::Full,
            parent: None,
            process_image,
            fs_snapshot: Some(FsSnapshot {
                backend: BackendKind::Zfs,
                name: SnapshotName::new("crab-1").unwrap(),
            }),
            transcript_turns: version,
            images: paths
                .iter()
                .map(|p| ImageFile {
                    path: (*p).to_owned(),
                    bytes: 3,
                    sha256: sha256_hex(b"abc"),
                })
                .collect(),
        }
    }

    /// Encodes `r`, applies `edit` to the line (LF stripped), decodes.
    fn check(r: &VersionRecord, edit: impl FnOnce(&mut Vec<u8>), expected_intact: bool) {
        let mut line = encode_version(r).unwrap();
        assert_eq!(line.pop(), Some(b'\n'));
        assert!(!line.contains(&b'\n'));
        edit(&mut line);
        let decoded = decode(&line);
        if expected_intact {
            assert_eq!(decoded, Decoded::Version(r.clone()));
        } else {
            assert_eq!(decoded, Decoded::Corrupt, "{}", String::from_utf8_lossy(&line));
        }
    }

    #[test]
    fn lines() {
        let holder = record(3, Some(3), &["pages-1.img", "sub/core.img"]);
        check(&holder, |_| {}, true);
        check(&record(4, Some(3), &[]), |_| {}, true);
        check(&record(4, None, &[]), |_| {}, true);
        // Checksum, separator, json and truncation damage.
        check(&holder, |l| l[0] ^= 1, false);
        check(&holder, |l| l[64] = b'x', false);
        check(&holder, |l| *l.last_mut().unwrap() ^= 0x20, false);
        check(&holder, |l| l.truncate(100), false);
        check(&holder, |l| l.clear(), false);
        // A json edit with a matching checksum but a wrong format version.
        check(
            &holder,
            |l| {
                let json = String::from_utf8(l[65..].to_vec())
                    .unwrap()
                    .replace("\"v\":1", "\"v\":2");
                *l = format!("{} {json}", sha256_hex(json.as_bytes())).into_bytes();
            },
            false,
        );
        // Records that contradict themselves.
        check(&record(4, Some(5), &[]), |_| {}, false);
        check(&record(4, Some(3), &["a.img"]), |_| {}, false);
        check(&record(4, None, &["a.img"]), |_| {}, false);
        check(&record(4, Some(4), &["../escape"]), |_| {}, false);
        check(&record(4, Some(4), &["/etc/shadow"]), |_| {}, false);
        check(&record(4, Some(4), &["a/./b"]), |_| {}, true);
        check(&record(0, None, &[]), |_| {}, false);
        // A parent must be older.
        let mut own_parent = record(4, Some(4), &[]);
        own_parent.parent = Some(4);
        check(&own_parent, |_| {}, false);
    }

    #[test]
    fn header_round_trip() {
        let h = Header {
            sandbox: SandboxId::new("s1").unwrap(),
            next_version: 8,
        };
        let mut line = encode_header(&h).unwrap();
        line.pop();
        assert_eq!(decode(&line), Decoded::Header(h));
    }
}
