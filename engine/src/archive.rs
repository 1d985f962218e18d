//! Export archives: one version of a sandbox, self-describing, so that it
//! can start on another host.
//!
//! An archive is a tar stream:
//!
//! ```text
//! images/<file>...     the version's CRIU image files
//! fs.stream            its filesystem snapshot (the backend's export stream)
//! transcript.jsonl     its conversation, when it has one: the turns of its
//!                      branch up to its turn (a new sandbox's transcript)
//! crab-export.sig      the exporting host's Ed25519 signature of the
//!                      manifest's bytes (after a context string), with its
//!                      public key
//! crab-export.json     the manifest, last: what the members are, with sizes
//!                      and sha256, the version's record, and the container
//!                      template (image, runtime, spec, snapshotter, parent)
//! ```
//!
//! Unpacking writes members into a staging directory while hashing them,
//! and accepts the archive only if the manifest arrived, its signature (if
//! any) holds, and every member matches it (and no other member exists): a
//! truncated or tampered archive is refused before anything is used. Since
//! the manifest names every member's sha256, its signature covers the whole
//! archive; whether the signing key is trusted is the importer's call
//! ([`Unpacked::signed_by`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use crab_api::shim::ConversationAt;
use crab_snapshotter::SnapshotName;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::containerd::ContainerTemplate;
use crate::{ImageFile, VersionRecord};

use crab_api::export::{hex, ManifestMembers, SignatureError, MAX_METADATA};
pub use crab_api::export::{signed_message, unhex, Signature, FS_STREAM, MANIFEST, SIGNATURE, TRANSCRIPT};

/// The format written: 2 adds the signature. Format 1 (unsigned) is read.
const FORMAT: u32 = 2;

/// Checks that `sig` signs `message`; answers the signing key (lower-case
/// hex).
fn verify(sig: &Signature, message: &[u8]) -> Result<String, ArchiveError> {
    sig.verify(message).map_err(|e| match e {
        SignatureError::Invalid(reason) => ArchiveError::Invalid { reason },
        mismatch @ SignatureError::Mismatch { .. } => ArchiveError::Tampered {
            reason: mismatch.to_string(),
        },
    })
}

/// What an archive holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The archive format (1).
    pub format: u32,
    /// The version as its source sandbox recorded it.
    pub version: VersionRecord,
    /// How to make the container on the importing host.
    pub container: ContainerTemplate,
    /// The filesystem snapshot's name and stream.
    pub fs: FsMember,
    /// The process image's files (the record's, or the reused image's).
    pub images: Vec<ImageFile>,
    /// The version's conversation, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transcript: Option<TranscriptMember>,
}

/// The conversation of an archive: a transcript whose turns are the
/// version's branch up to its turn, all on the root branch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TranscriptMember {
    /// Where the version stands in it.
    pub at: ConversationAt,
    /// The file's size.
    pub bytes: u64,
    /// The file's sha256, lower-case hex.
    pub sha256: String,
}

/// What an archive is made of.
#[derive(Debug)]
pub struct Contents<'a> {
    /// The version.
    pub version: &'a VersionRecord,
    /// How to make its container.
    pub container: &'a ContainerTemplate,
    /// The directory of its image files.
    pub images_dir: &'a Path,
    /// Its image files.
    pub images: &'a [ImageFile],
    /// Its filesystem snapshot's name.
    pub fs_name: &'a SnapshotName,
    /// The file holding the snapshot's export stream.
    pub fs_stream: &'a Path,
    /// Its conversation: a transcript file, and where the version stands
    /// in it.
    pub transcript: Option<(&'a Path, ConversationAt)>,
}

/// The filesystem stream of an archive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsMember {
    /// The snapshot's name.
    pub name: SnapshotName,
    /// The stream's size.
    pub bytes: u64,
    /// The stream's sha256, lower-case hex.
    pub sha256: String,
}

/// What packing or unpacking can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// The archive ended early or is not a tar stream.
    #[error("the archive is truncated or not a crab export: {reason}")]
    Truncated {
        /// What was missing.
        reason: String,
    },
    /// A member differs from the manifest, or should not be there.
    #[error("the archive was tampered with: {reason}")]
    Tampered {
        /// What differs.
        reason: String,
    },
    /// The manifest is not one this crabd reads.
    #[error("the archive's manifest is invalid: {reason}")]
    Invalid {
        /// Why.
        reason: String,
    },
    /// Reading or writing failed.
    #[error("{op} {}", path.display())]
    Io {
        /// What was done.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

/// An unpacked, verified archive in a staging directory.
#[derive(Debug)]
pub struct Unpacked {
    /// Its manifest.
    pub manifest: Manifest,
    /// The directory holding the image files.
    pub images_dir: PathBuf,
    /// The filesystem stream.
    pub fs_stream: PathBuf,
    /// The conversation's transcript, if the archive has one.
    pub transcript: Option<PathBuf>,
    /// The public key (hex) whose signature of the manifest holds; `None`
    /// for an unsigned archive.
    pub signed_by: Option<String>,
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ArchiveError + 'a {
    move |source| ArchiveError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Writes an archive of `c` to `out`: the image files, the filesystem
/// stream, the transcript, `sign`'s signature of the manifest (of
/// [`signed_message`]), then the manifest.
pub fn pack(
    out: impl Write,
    c: &Contents<'_>,
    sign: impl FnOnce(&[u8]) -> Signature,
) -> Result<(), ArchiveError> {
    let mut tar = tar::Builder::new(out);
    for f in c.images {
        let path = c.images_dir.join(&f.path);
        tar.append_path_with_name(&path, format!("images/{}", f.path))
            .map_err(io("add", &path))?;
    }
    let (bytes, sha256) = hash_file(c.fs_stream)?;
    tar.append_path_with_name(c.fs_stream, FS_STREAM)
        .map_err(io("add", c.fs_stream))?;
    let transcript = match c.transcript {
        Some((path, at)) => {
            let (bytes, sha256) = hash_file(path)?;
            tar.append_path_with_name(path, TRANSCRIPT)
                .map_err(io("add", path))?;
            Some(TranscriptMember { at, bytes, sha256 })
        }
        None => None,
    };
    let manifest = Manifest {
        format: FORMAT,
        version: c.version.clone(),
        container: c.container.clone(),
        fs: FsMember {
            name: c.fs_name.clone(),
            bytes,
            sha256,
        },
        images: c.images.to_vec(),
        transcript,
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("a manifest serializes");
    let signature = serde_json::to_vec_pretty(&sign(&signed_message(&json))).expect("a signature serializes");
    // The manifest last: an archive cut anywhere before its end has none.
    for (name, bytes) in [(SIGNATURE, &signature), (MANIFEST, &json)] {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o600);
        header.set_cksum();
        tar.append_data(&mut header, name, bytes.as_slice())
            .map_err(io("add", Path::new(name)))?;
    }
    tar.into_inner()
        .and_then(|mut w| w.flush())
        .map_err(io("finish", Path::new("archive")))
}

/// Unpacks `input` into `staging` (which must be empty or absent) and
/// verifies it.
pub fn unpack(input: impl Read, staging: &Path) -> Result<Unpacked, ArchiveError> {
    std::fs::create_dir_all(staging.join("images")).map_err(io("create", staging))?;
    let mut seen: BTreeMap<String, (u64, String)> = BTreeMap::new();
    let mut manifest_bytes = None;
    let mut signature_bytes = None;
    let mut archive = tar::Archive::new(input);
    let truncated = |e: std::io::Error| ArchiveError::Truncated {
        reason: e.to_string(),
    };
    for entry in archive.entries().map_err(truncated)? {
        let mut entry = entry.map_err(truncated)?;
        let name = entry.path().map_err(truncated)?.to_string_lossy().into_owned();
        if !entry.header().entry_type().is_file() {
            return Err(ArchiveError::Tampered {
                reason: format!("{name} is not a regular file"),
            });
        }
        if name == MANIFEST || name == SIGNATURE {
            let slot = match name == MANIFEST {
                true => &mut manifest_bytes,
                false => &mut signature_bytes,
            };
            if slot.is_some() {
                return Err(ArchiveError::Tampered {
                    reason: format!("{name} is there twice"),
                });
            }
            // Bounded by what is read (a PAX header can say any size).
            let mut bytes = Vec::new();
            (&mut entry)
                .take(MAX_METADATA + 1)
                .read_to_end(&mut bytes)
                .map_err(truncated)?;
            if bytes.len() as u64 > MAX_METADATA {
                return Err(ArchiveError::Invalid {
                    reason: format!("{name} is over {MAX_METADATA} bytes"),
                });
            }
            *slot = Some(bytes);
            continue;
        }
        let dest = member_path(staging, &name)?;
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(io("create", parent))?;
        }
        let file = File::create(&dest).map_err(io("create", &dest))?;
        let mut w = HashingWriter::new(file);
        std::io::copy(&mut entry, &mut w).map_err(truncated)?;
        w.inner.sync_all().map_err(io("sync", &dest))?;
        seen.insert(name, (w.bytes, hex(w.hasher.finalize())));
    }
    let bytes = manifest_bytes.ok_or_else(|| ArchiveError::Truncated {
        reason: format!("no {MANIFEST} at its end"),
    })?;
    // The signature first: nothing of an altered manifest is read.
    let signed_by = match signature_bytes {
        Some(sig) => {
            let sig: Signature = serde_json::from_slice(&sig).map_err(|e| ArchiveError::Invalid {
                reason: format!("{SIGNATURE}: {e}"),
            })?;
            Some(verify(&sig, &signed_message(&bytes))?)
        }
        None => None,
    };
    let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| ArchiveError::Invalid {
        reason: e.to_string(),
    })?;
    if !(1..=FORMAT).contains(&manifest.format) {
        return Err(ArchiveError::Invalid {
            reason: format!("format {} (this crabd reads 1 to {FORMAT})", manifest.format),
        });
    }
    let members: ManifestMembers = serde_json::from_slice(&bytes).map_err(|e| ArchiveError::Invalid {
        reason: e.to_string(),
    })?;
    let expected = members.expected();
    for (name, want) in &expected {
        match seen.get(name) {
            None => {
                return Err(ArchiveError::Tampered {
                    reason: format!("{name} is missing"),
                })
            }
            Some(got) if got != want => {
                return Err(ArchiveError::Tampered {
                    reason: format!("{name} differs from its checksum"),
                })
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = seen.keys().find(|k| !expected.contains_key(*k)) {
        return Err(ArchiveError::Tampered {
            reason: format!("{extra} is not in the manifest"),
        });
    }
    let transcript = manifest.transcript.as_ref().map(|_| staging.join(TRANSCRIPT));
    Ok(Unpacked {
        manifest,
        images_dir: staging.join("images"),
        fs_stream: staging.join(FS_STREAM),
        transcript,
        signed_by,
    })
}

/// Where member `name` goes under `staging`: `fs.stream`,
/// `transcript.jsonl`, or a plain relative path under `images/`.
fn member_path(staging: &Path, name: &str) -> Result<PathBuf, ArchiveError> {
    if name == FS_STREAM || name == TRANSCRIPT {
        return Ok(staging.join(name));
    }
    let rel = name
        .strip_prefix("images/")
        .ok_or_else(|| ArchiveError::Tampered {
            reason: format!("unexpected member {name}"),
        })?;
    let plain = !rel.is_empty()
        && Path::new(rel)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return Err(ArchiveError::Tampered {
            reason: format!("member {name} leaves its directory"),
        });
    }
    Ok(staging.join("images").join(rel))
}

/// Size and sha256 of a file.
pub fn hash_file(path: &Path) -> Result<(u64, String), ArchiveError> {
    let mut f = File::open(path).map_err(io("open", path))?;
    let mut w = HashingWriter::new(std::io::sink());
    std::io::copy(&mut f, &mut w).map_err(io("read", path))?;
    Ok((w.bytes, hex(w.hasher.finalize())))
}

/// A writer that hashes and counts what passes through it.
pub struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    bytes: u64,
}

impl<W: Write> HashingWriter<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// The size and sha256 written so far, and the inner writer.
    pub fn finish(self) -> (W, u64, String) {
        (self.inner, self.bytes, hex(self.hasher.finalize()))
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_paths_stay_inside() {
        let s = Path::new("/stage");
        assert_eq!(
            member_path(s, "images/pages-1.img").unwrap(),
            s.join("images/pages-1.img")
        );
        assert_eq!(member_path(s, FS_STREAM).unwrap(), s.join(FS_STREAM));
        for bad in [
            "images/../x",
            "/etc/passwd",
            "images/",
            "other",
            "images//abs/../..",
        ] {
            assert!(member_path(s, bad).is_err(), "{bad}");
        }
    }
}
