//! A version's export archive (`crabctl export`) as an OCI artifact. Each
//! member of the archive is a blob, so a member that did not change since
//! a version already pushed (the filesystem stream of a turn that only
//! ran processes, most small CRIU images, the transcript's shared prefix
//! is not: it is one member) is not sent again; the archive's own manifest
//! (`crab-export.json`, which names every member's sha256 and which the
//! exporting host signed) is the artifact's config; the OCI manifest lists
//! the members in the archive's order, each named by its title.
//!
//! Pulling first downloads the archive's manifest and its signature and
//! checks them ([`check_signed`]): signed by a key this host trusts, naming
//! exactly the members the artifact lists. Only then does it download the
//! rest, writes the members back into an archive in that order, the
//! archive's manifest last, and crabd's import checks it as it checks any
//! archive: a registry can withhold a version, never change one, and
//! cannot make a host download the bulk of one it would refuse.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use oci_spec::image::{Descriptor, Digest, ImageManifest, ImageManifestBuilder, MediaType};
use sha2::{Digest as _, Sha256};

use super::client::hex;

/// The artifact's type.
pub const ARTIFACT_TYPE: &str = "application/vnd.crab.version.v1";
/// The config's type: the archive's manifest.
pub const CONFIG_TYPE: &str = "application/vnd.crab.export.manifest.v1+json";
/// A member's type.
pub const MEMBER_TYPE: &str = "application/vnd.crab.export.member.v1";
/// The OCI manifest's own type.
pub const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// The annotation naming a member.
const TITLE: &str = "org.opencontainers.image.title";
/// The archive's manifest, its last member.
const EXPORT_MANIFEST: &str = crab_api::export::MANIFEST;
/// The most members an artifact may have.
const MAX_MEMBERS: usize = 100_000;

/// One member of an archive, in a file of its own.
#[derive(Debug, Clone)]
pub struct Blob {
    /// Its name in the archive.
    pub name: String,
    /// `sha256:<hex>` of its content.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
    /// The file holding it.
    pub path: PathBuf,
}

/// Splits the archive `archive` into one file per member in `dir`;
/// answers the members in the archive's order (its manifest last).
pub fn split(archive: &Path, dir: &Path) -> io::Result<Vec<Blob>> {
    let mut tar = tar::Archive::new(File::open(archive)?);
    let mut blobs = Vec::new();
    for (n, entry) in tar.entries()?.enumerate() {
        let mut entry = entry?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = entry.path()?.to_string_lossy().into_owned();
        let path = dir.join(format!("member-{n}"));
        let mut out = private_file(&path)?;
        let (mut hasher, mut size, mut buf) = (Sha256::new(), 0u64, vec![0u8; 1 << 16]);
        loop {
            let k = entry.read(&mut buf)?;
            if k == 0 {
                break;
            }
            hasher.update(&buf[..k]);
            out.write_all(&buf[..k])?;
            size += k as u64;
        }
        out.sync_all()?;
        blobs.push(Blob {
            name,
            digest: format!("sha256:{}", hex(&hasher.finalize())),
            size,
            path,
        });
    }
    match blobs.last() {
        Some(b) if b.name == EXPORT_MANIFEST => Ok(blobs),
        _ => Err(io::Error::other(format!(
            "the export has no {EXPORT_MANIFEST} last"
        ))),
    }
}

/// The OCI manifest of `blobs` (from [`split`]), with `annotations`.
pub fn manifest(blobs: &[Blob], annotations: HashMap<String, String>) -> Vec<u8> {
    let (config, members) = blobs.split_last().expect("split answers the archive's manifest");
    let descriptor = |b: &Blob, media_type: &str, title: bool| {
        let mut d = Descriptor::new(
            MediaType::Other(media_type.to_owned()),
            b.size,
            Digest::from_str(&b.digest).expect("a sha256 digest this module made"),
        );
        if title {
            d.set_annotations(Some(HashMap::from([(TITLE.to_owned(), b.name.clone())])));
        }
        d
    };
    let manifest: ImageManifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .artifact_type(MediaType::Other(ARTIFACT_TYPE.to_owned()))
        .config(descriptor(config, CONFIG_TYPE, false))
        .layers(
            members
                .iter()
                .map(|b| descriptor(b, MEMBER_TYPE, true))
                .collect::<Vec<_>>(),
        )
        .annotations(annotations)
        .build()
        .expect("every field of the manifest is set");
    // Keys sorted: the same version pushed twice is the same manifest (its
    // annotations are a hash map, whose order is not).
    let value = serde_json::to_value(&manifest).expect("a manifest serializes");
    serde_json::to_vec(&sorted(value)).expect("a manifest serializes")
}

/// `value` with every object's keys in order.
fn sorted(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// A member an artifact names: its name, digest and size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its name in the archive.
    pub name: String,
    /// `sha256:<hex>`.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
}

/// The members the OCI manifest `bytes` names, in the archive's order (its
/// manifest last), each name one safe relative path, each once.
pub fn members(bytes: &[u8]) -> Result<Vec<Member>, String> {
    let manifest: ImageManifest =
        serde_json::from_slice(bytes).map_err(|e| format!("not an OCI image manifest: {e}"))?;
    if manifest.config().media_type() != &MediaType::Other(CONFIG_TYPE.to_owned()) {
        return Err(format!(
            "not a Crab version (its config is {}, not {CONFIG_TYPE})",
            manifest.config().media_type()
        ));
    }
    if manifest.layers().len() >= MAX_MEMBERS {
        return Err(format!(
            "{} members: more than {MAX_MEMBERS}",
            manifest.layers().len()
        ));
    }
    let sha256 = |d: &Descriptor| -> Result<String, String> {
        let digest = d.digest().to_string();
        let hex = digest.strip_prefix("sha256:").unwrap_or_default();
        if hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            Ok(digest)
        } else {
            Err(format!("{digest}: only sha256 digests are read"))
        }
    };
    let mut out = Vec::with_capacity(manifest.layers().len() + 1);
    let mut seen = std::collections::HashSet::new();
    for layer in manifest.layers() {
        if layer.media_type() != &MediaType::Other(MEMBER_TYPE.to_owned()) {
            return Err(format!(
                "a member of type {}, not {MEMBER_TYPE}",
                layer.media_type()
            ));
        }
        let name = layer
            .annotations()
            .as_ref()
            .and_then(|a| a.get(TITLE))
            .ok_or("a member without a title")?;
        let safe = Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
            && !name.is_empty()
            && name != EXPORT_MANIFEST;
        if !safe || !seen.insert(name.clone()) {
            return Err(format!("member {name:?}: not one relative path of its own"));
        }
        out.push(Member {
            name: name.clone(),
            digest: sha256(layer)?,
            size: layer.size(),
        });
    }
    out.push(Member {
        name: EXPORT_MANIFEST.to_owned(),
        digest: sha256(manifest.config())?,
        size: manifest.config().size(),
    });
    Ok(out)
}

/// Writes the archive of `members`, whose contents are the files `files`
/// (in the same order), to the new file `to`.
pub fn join(members: &[Member], files: &[PathBuf], to: &Path) -> io::Result<()> {
    let mut tar = tar::Builder::new(private_file(to)?);
    for (m, file) in members.iter().zip(files) {
        let mut header = tar::Header::new_gnu();
        header.set_size(m.size);
        header.set_mode(0o600);
        header.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut header, &m.name, File::open(file)?)?;
    }
    tar.into_inner()?.sync_all()
}

/// A new file only its owner can read.
fn private_file(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(dir: &Path, members: &[(&str, &[u8])]) -> PathBuf {
        let path = dir.join("in.tar");
        let mut tar = tar::Builder::new(File::create(&path).unwrap());
        for (name, data) in members {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o600);
            tar.append_data(&mut h, name, *data).unwrap();
        }
        tar.finish().unwrap();
        path
    }

    #[test]
    fn an_archive_goes_through_a_manifest_and_back_member_for_member() {
        let dir = tempfile::tempdir().unwrap();
        let input: &[(&str, &[u8])] = &[
            ("images/pages-1.img", b"pages"),
            ("fs.stream", b"files"),
            ("crab-export.sig", b"sig"),
            ("crab-export.json", b"{}"),
        ];
        let path = archive(dir.path(), input);
        let split_dir = dir.path().join("split");
        std::fs::create_dir(&split_dir).unwrap();
        let blobs = split(&path, &split_dir).unwrap();
        let bytes = manifest(
            &blobs,
            HashMap::from([("io.crab.version".to_owned(), "3".to_owned())]),
        );
        let back = members(&bytes).unwrap();
        let names: Vec<&str> = back.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, input.iter().map(|(n, _)| *n).collect::<Vec<_>>());
        for (m, b) in back.iter().zip(&blobs) {
            assert_eq!((&m.digest, m.size), (&b.digest, b.size));
        }
        let out = dir.path().join("out.tar");
        let files: Vec<PathBuf> = blobs.iter().map(|b| b.path.clone()).collect();
        join(&back, &files, &out).unwrap();
        let mut again = tar::Archive::new(File::open(&out).unwrap());
        let got: Vec<(String, Vec<u8>)> = again
            .entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let mut data = Vec::new();
                e.read_to_end(&mut data).unwrap();
                (e.path().unwrap().to_string_lossy().into_owned(), data)
            })
            .collect();
        let want: Vec<(String, Vec<u8>)> = input.iter().map(|(n, d)| (n.to_string(), d.to_vec())).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_manifest_that_names_unsafe_or_foreign_members_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = archive(dir.path(), &[("a", b"1"), ("crab-export.json", b"{}")]);
        let split_dir = dir.path().join("split");
        std::fs::create_dir(&split_dir).unwrap();
        let good = String::from_utf8(manifest(&split(&path, &split_dir).unwrap(), HashMap::new())).unwrap();
        let title = r#""org.opencontainers.image.title":"a""#;
        for (what, bad) in [
            (
                "a path out",
                good.replace(title, r#""org.opencontainers.image.title":"../a""#),
            ),
            (
                "an absolute path",
                good.replace(title, r#""org.opencontainers.image.title":"/etc/a""#),
            ),
            (
                "the manifest twice",
                good.replace(title, r#""org.opencontainers.image.title":"crab-export.json""#),
            ),
            (
                "another config",
                good.replace(CONFIG_TYPE, "application/vnd.oci.image.config.v1+json"),
            ),
            (
                "another member type",
                good.replace(MEMBER_TYPE, "application/x-other"),
            ),
        ] {
            assert!(members(bad.as_bytes()).is_err(), "{what} passed: {bad}");
        }
        assert!(members(b"not json").is_err());
        // An archive without its manifest last is no export.
        let other = dir.path().join("other");
        std::fs::create_dir(&other).unwrap();
        let without_manifest = archive(&other, &[("a", b"1")]);
        let split2 = other.join("split");
        std::fs::create_dir(&split2).unwrap();
        assert!(split(&without_manifest, &split2).is_err());
    }
}

/// Whether member `name` is one a pull reads before the others: the
/// archive's manifest and its signature.
pub fn is_metadata(name: &str) -> bool {
    name == EXPORT_MANIFEST || name == crab_api::export::SIGNATURE
}

/// Checks, before the bulk of a version is downloaded, that its archive's
/// manifest (`manifest`) is signed (`signature`) by a key of `trusted`
/// and names exactly the other `members` the artifact lists, with their
/// sizes and digests; each member is then checked against its digest as
/// it arrives. crabd's import checks the archive whole again.
pub fn check_signed(
    manifest: &[u8],
    signature: Option<&[u8]>,
    trusted: &[String],
    members: &[Member],
) -> Result<(), String> {
    use crab_api::export::{signed_message, ManifestMembers, Signature};
    let signature =
        signature.ok_or("the version is unsigned (pull it with --insecure-unsigned to import it anyway)")?;
    let signature: Signature =
        serde_json::from_slice(signature).map_err(|e| format!("its signature is not one: {e}"))?;
    let key = signature
        .verify(&signed_message(manifest))
        .map_err(|e| e.to_string())?;
    if !trusted.iter().any(|t| t.eq_ignore_ascii_case(&key)) {
        return Err(format!(
            "it is signed by key {key}, which this host does not trust (see `crabctl keys`: put the key in a file \
             of the trusted directory, or pull with --insecure-unsigned)"
        ));
    }
    let named: ManifestMembers =
        serde_json::from_slice(manifest).map_err(|e| format!("its signed manifest names no members: {e}"))?;
    let mut expected = named.expected();
    for m in members.iter().filter(|m| !is_metadata(&m.name)) {
        let want = expected.remove(&m.name);
        let digest = m.digest.strip_prefix("sha256:").unwrap_or_default();
        if want.as_ref().map(|(size, sha)| (*size, sha.as_str())) != Some((m.size, digest)) {
            return Err(format!(
                "member {} ({} bytes, {}) is not what its signed manifest names",
                m.name, m.size, m.digest
            ));
        }
    }
    match expected.keys().next() {
        Some(missing) => Err(format!(
            "member {missing}, which its signed manifest names, is not listed"
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod signed_tests {
    use super::*;
    use crab_api::export::{signed_message, Signature};
    use ring::signature::{Ed25519KeyPair, KeyPair};

    fn key() -> Ed25519KeyPair {
        let rng = ring::rand::SystemRandom::new();
        Ed25519KeyPair::from_pkcs8(Ed25519KeyPair::generate_pkcs8(&rng).unwrap().as_ref()).unwrap()
    }

    fn member(name: &str, size: u64, hex: char) -> Member {
        Member {
            name: name.to_owned(),
            digest: format!("sha256:{}", hex.to_string().repeat(64)),
            size,
        }
    }

    #[test]
    fn only_a_trusted_signature_of_exactly_the_listed_members_passes() {
        let (ours, theirs) = (key(), key());
        let (a, f) = ("a".repeat(64), "f".repeat(64));
        let manifest = format!(
            r#"{{"format":2,"images":[{{"path":"pages-1.img","bytes":4,"sha256":"{a}"}}],"fs":{{"name":"s","bytes":9,"sha256":"{f}"}}}}"#
        )
        .into_bytes();
        let sign = |k: &Ed25519KeyPair| {
            let sig = Signature::ed25519(
                k.public_key().as_ref(),
                k.sign(&signed_message(&manifest)).as_ref(),
            );
            serde_json::to_vec(&sig).unwrap()
        };
        let trusted = [crab_api::export::hex(ours.public_key())];
        let listed = vec![
            member("images/pages-1.img", 4, 'a'),
            member("fs.stream", 9, 'f'),
            member("crab-export.sig", 100, 'c'),
            member("crab-export.json", manifest.len() as u64, 'd'),
        ];
        assert_eq!(
            check_signed(&manifest, Some(&sign(&ours)), &trusted, &listed),
            Ok(())
        );
        let e = check_signed(&manifest, Some(&sign(&theirs)), &trusted, &listed).unwrap_err();
        assert!(e.contains("does not trust"), "{e}");
        let e = check_signed(&manifest, None, &trusted, &listed).unwrap_err();
        assert!(e.contains("unsigned"), "{e}");
        // Another size, another digest, one more member, one fewer.
        for (n, bad) in [
            member("images/pages-1.img", 5, 'a'),
            member("images/pages-1.img", 4, 'b'),
        ]
        .into_iter()
        .enumerate()
        {
            let mut other = listed.clone();
            other[0] = bad;
            let e = check_signed(&manifest, Some(&sign(&ours)), &trusted, &other).unwrap_err();
            assert!(e.contains("is not what its signed manifest names"), "{n}: {e}");
        }
        let mut more = listed.clone();
        more.insert(0, member("images/extra.img", 1, 'e'));
        assert!(check_signed(&manifest, Some(&sign(&ours)), &trusted, &more).is_err());
        let fewer: Vec<Member> = listed[1..].to_vec();
        let e = check_signed(&manifest, Some(&sign(&ours)), &trusted, &fewer).unwrap_err();
        assert!(e.contains("is not listed"), "{e}");
        // A manifest altered after it was signed.
        let mut altered = manifest.clone();
        altered[2] ^= 1;
        assert!(check_signed(&altered, Some(&sign(&ours)), &trusted, &listed).is_err());
    }
}
