//! `crabctl export --format checkpointctl`: a version in the container
//! checkpoint archive layout of Kubernetes' forensic checkpointing (what
//! containerd's and CRI-O's `CheckpointContainer` and Podman write, and
//! `checkpointctl show`, `inspect` and `memparse` read):
//!
//! ```text
//! config.dump       id, name, image, runtime, creation time
//! spec.dump         the container's OCI runtime spec (a pod's container
//!                   keeps CRI's annotations: its pod and namespace show)
//! checkpoint/…      the version's CRIU images (a pod's version: its
//!                   sandbox container's; the layout holds one container)
//! rootfs-diff.tar   the files the container changed (its overlay upper:
//!                   owners, modes, times, xattrs, hard links)
//! deleted.files     the image's files it deleted (JSON, `/`-rooted paths)
//! ```
//!
//! It is made from crabd's own export of the version, on this side; it is
//! for inspection by those tools, not for `crabctl import` (no signature:
//! that is Crab's own format). The file changes are the overlay upper's
//! as the engines write them; a directory the container made opaque (it
//! removed one of the image's and made it again) hides the image's
//! entries under it without listing them in `deleted.files`.

use std::fs::File;
use std::io::{self, Read, Seek};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crab_snapshotter::{EntryKind, StreamEntry};

use crab_api::{Crabd, Progress, SandboxSelector, VersionSel};
use serde_json::Value;

use crate::transfer::{self, TransferError};

/// The runtime name `config.dump` gives (what `checkpointctl show` lists).
const RUNTIME: &str = "containerd-shim-crab-v2";

/// Writes version `version` of `sandbox` to the new file `file` in the
/// checkpoint archive layout (telling `progress` of the export); answers
/// its size.
pub async fn export(
    crabd: &Crabd,
    sandbox: &SandboxSelector,
    version: VersionSel,
    file: &Path,
    progress: Progress<'_>,
) -> Result<u64, TransferError> {
    let (_dir, archive) = transfer::exported(crabd, sandbox, version, progress).await?;
    let file = file.to_owned();
    tokio::task::spawn_blocking(move || {
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&file)?;
        let written = convert(&archive, out);
        if written.is_err() {
            // No half archive left behind (this one's own: it made it).
            let _ = std::fs::remove_file(&file);
        }
        written
    })
    .await
    .expect("the conversion does not panic")
    .map_err(|source| TransferError::Local {
        what: "write the checkpoint archive",
        source,
    })
}

/// Rewrites Crab's export `archive` in the checkpoint layout into `out`.
fn convert(archive: &Path, out: File) -> io::Result<u64> {
    let mut tar = tar::Builder::new(out);
    // The tools look for the directory itself.
    let mut dir = tar::Header::new_gnu();
    dir.set_entry_type(tar::EntryType::Directory);
    dir.set_mode(0o700);
    dir.set_size(0);
    tar.append_data(&mut dir, "checkpoint/", io::empty())?;
    let mut manifest = None;
    let mut crab = tar::Archive::new(File::open(archive)?);
    for entry in crab.entries()? {
        let mut entry = entry?;
        let name = entry.path()?.to_string_lossy().into_owned();
        let pod_members = format!("images/{}/", crab_api::shim::POD_MEMBERS_DIR);
        if name.starts_with(&pod_members) {
            // The layout holds one container: the pod's sandbox.
            continue;
        } else if let Some(image) = name.strip_prefix("images/") {
            let mut header = tar::Header::new_gnu();
            header.set_size(entry.size());
            header.set_mode(0o600);
            tar.append_data(&mut header, format!("checkpoint/{image}"), &mut entry)?;
        } else if name == crab_api::export::FS_STREAM {
            let (mut diff, deleted) = rootfs_diff(&mut entry, archive)?;
            let mut header = tar::Header::new_gnu();
            header.set_size(diff.metadata()?.len());
            header.set_mode(0o600);
            tar.append_data(&mut header, "rootfs-diff.tar", &mut diff)?;
            let bytes = serde_json::to_vec(&deleted).expect("paths serialize");
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o600);
            tar.append_data(&mut header, "deleted.files", bytes.as_slice())?;
        } else if name == crab_api::export::MANIFEST {
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes)?;
            manifest = Some(serde_json::from_slice::<Value>(&bytes).map_err(io::Error::other)?);
        }
    }
    let manifest = manifest.ok_or_else(|| io::Error::other("the export has no manifest"))?;
    let (config, spec) = dumps(&manifest)?;
    for (name, json) in [("config.dump", config), ("spec.dump", spec)] {
        let bytes = serde_json::to_vec_pretty(&json).expect("JSON serializes");
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o600);
        tar.append_data(&mut header, name, bytes.as_slice())?;
    }
    let out = tar.into_inner()?;
    out.sync_all()?;
    Ok(out.metadata()?.len())
}

/// The overlay-copy file stream `stream` as a tar of the container's
/// changed files, in an unnamed file beside `archive` (in the export's
/// private directory), and the paths it deleted: its whiteouts, but those
/// under a directory it made opaque (the whole directory is replaced) and
/// those not in UTF-8 (JSON cannot name them).
fn rootfs_diff(stream: &mut dyn Read, archive: &Path) -> io::Result<(File, Vec<String>)> {
    let dir = archive.parent().unwrap_or(Path::new("."));
    let mut out = tar::Builder::new(tempfile::tempfile_in(dir)?);
    let mut whiteouts = Vec::new();
    let mut opaque: Vec<PathBuf> = Vec::new();
    // The tar's own errors (a full disk, a name too long) as they are.
    let mut failed = None;
    let read = crab_snapshotter::read_stream(stream, |e, data| {
        if e.kind == EntryKind::Char && e.rdev == 0 {
            if !opaque.iter().any(|o| e.path.starts_with(o)) {
                whiteouts.extend(e.path.to_str().map(|p| format!("/{p}")));
            }
            return Ok(());
        }
        let is_opaque = |(n, v): &(std::ffi::OsString, Vec<u8>)| n == OPAQUE && v == b"y";
        if e.kind == EntryKind::Dir && e.xattrs.iter().any(is_opaque) {
            opaque.push(e.path.clone());
        }
        append_entry(&mut out, e, data).inspect_err(|e| {
            failed = Some(io::Error::new(e.kind(), e.to_string()));
        })
    });
    if let Some(e) = failed {
        return Err(e);
    }
    read.map_err(|e| {
        io::Error::other(format!(
            "the version's files are not an overlay-copy stream ({e}): only an overlayfs sandbox's files \
             convert to rootfs-diff.tar (a ZFS or btrfs sandbox's are a zfs or btrfs send stream)"
        ))
    })?;
    let mut file = out.into_inner()?;
    file.rewind()?;
    Ok((file, whiteouts))
}

/// overlayfs' mark of a directory that hides the lower one's entries.
const OPAQUE: &str = "trusted.overlay.opaque";

/// Appends stream entry `e` (its file data from `data`) to `out`, as
/// `tar` and containers' own diffs write it; a socket is no archive
/// entry, and the root is the archive's own. Names are written as their
/// bytes (a GNU long-name entry before one of 100 bytes or more), never
/// through a conversion that a name in no encoding could fail.
fn append_entry(out: &mut tar::Builder<File>, e: &StreamEntry, data: &mut dyn Read) -> io::Result<()> {
    if e.path.as_os_str().is_empty() || e.kind == EntryKind::Socket {
        return Ok(());
    }
    let xattrs = pax_xattrs(&e.xattrs);
    if !xattrs.is_empty() {
        let mut header = tar::Header::new_ustar();
        header.set_entry_type(tar::EntryType::XHeader);
        header.set_size(xattrs.len() as u64);
        header.set_mode(0o600);
        header.as_old_mut().name[..12].copy_from_slice(b"PaxHeaders/x");
        header.set_cksum();
        out.append(&header, xattrs.as_slice())?;
    }
    let mut header = tar::Header::new_gnu();
    header.set_mode(e.mode);
    header.set_uid(e.uid.into());
    header.set_gid(e.gid.into());
    header.set_mtime(u64::try_from(e.mtime.0).unwrap_or(0));
    header.set_size(0);
    let mut name = e.path.as_os_str().as_bytes().to_vec();
    let mut link: Option<&[u8]> = None;
    match e.kind {
        EntryKind::Dir => {
            header.set_entry_type(tar::EntryType::Directory);
            name.push(b'/');
        }
        EntryKind::File if e.link.is_some() => {
            header.set_entry_type(tar::EntryType::Link);
            link = e.link.as_deref().map(|l| l.as_os_str().as_bytes());
        }
        EntryKind::File => {
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(e.size);
        }
        EntryKind::Symlink => {
            header.set_entry_type(tar::EntryType::Symlink);
            link = e.target.as_deref().map(|t| t.as_os_str().as_bytes());
        }
        EntryKind::Char | EntryKind::Block => {
            header.set_entry_type(match e.kind {
                EntryKind::Char => tar::EntryType::Char,
                _ => tar::EntryType::Block,
            });
            let dev = e.rdev as nix::libc::dev_t;
            header.set_device_major(nix::sys::stat::major(dev) as u32)?;
            header.set_device_minor(nix::sys::stat::minor(dev) as u32)?;
        }
        EntryKind::Fifo => header.set_entry_type(tar::EntryType::Fifo),
        EntryKind::Socket => unreachable!("skipped above"),
    }
    set_name(out, &mut header, &name, false)?;
    if let Some(link) = link {
        set_name(out, &mut header, link, true)?;
    }
    header.set_cksum();
    out.append(&header, data)
}

/// The longest name (with its NUL) a GNU long-name entry may carry.
const MAX_LONG_NAME: usize = (1 << 20) - 1;

/// Writes `bytes` into `header`'s name (or link name) field, after a GNU
/// long-name (long-link) entry holding them when they do not fit.
fn set_name(
    out: &mut tar::Builder<File>,
    header: &mut tar::Header,
    bytes: &[u8],
    link: bool,
) -> io::Result<()> {
    let old = header.as_old_mut();
    let field: &mut [u8; 100] = if link { &mut old.linkname } else { &mut old.name };
    if bytes.len() < field.len() {
        field.fill(0);
        field[..bytes.len()].copy_from_slice(bytes);
        return Ok(());
    }
    // Go's archive/tar (podman, CRI-O, checkpointctl) reads a long name of
    // less than 1 MiB only, and then refuses the whole archive.
    if bytes.len() >= MAX_LONG_NAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a path of {} bytes in the sandbox's files: tar readers take less than {MAX_LONG_NAME}",
                bytes.len()
            ),
        ));
    }
    let mut long = tar::Header::new_gnu();
    long.as_old_mut().name[..13].copy_from_slice(b"././@LongLink");
    long.set_mode(0o644);
    long.set_entry_type(match link {
        true => tar::EntryType::GNULongLink,
        false => tar::EntryType::GNULongName,
    });
    long.set_size(bytes.len() as u64 + 1);
    long.set_cksum();
    out.append(&long, [bytes, b"\0"].concat().as_slice())?;
    // What a reader without GNU's entries sees: the name cut short.
    let old = header.as_old_mut();
    let field: &mut [u8; 100] = if link { &mut old.linkname } else { &mut old.name };
    field.copy_from_slice(&bytes[..100]);
    Ok(())
}

/// The most xattr bytes one entry carries (Go's archive/tar, which the
/// engines' restores read with, refuses a PAX header over 1 MiB).
const MAX_PAX: usize = 512 * 1024;

/// PAX records (`SCHILY.xattr.NAME`) of `xattrs` the engines restore
/// (`user.*` and `security.capability`, as containers' own diffs keep),
/// at most [`MAX_PAX`] bytes of them; a name that a record cannot hold
/// (`=`, NUL) is left out.
fn pax_xattrs(xattrs: &[(std::ffi::OsString, Vec<u8>)]) -> Vec<u8> {
    let mut records = Vec::new();
    for (name, value) in xattrs {
        let name = name.as_bytes();
        let kept = name.starts_with(b"user.") || name == b"security.capability";
        if !kept || name.contains(&b'=') || name.contains(&0) {
            continue;
        }
        // "LEN SCHILY.xattr.NAME=VALUE\n", LEN counting itself.
        let body = [b" SCHILY.xattr.".as_slice(), name, b"=", value, b"\n"].concat();
        let mut len = body.len() + 1;
        while len.to_string().len() + body.len() != len {
            len = len.to_string().len() + body.len();
        }
        if records.len() + len > MAX_PAX {
            continue;
        }
        records.extend_from_slice(len.to_string().as_bytes());
        records.extend_from_slice(&body);
    }
    records
}

/// `config.dump` and `spec.dump` from Crab's export manifest.
fn dumps(manifest: &Value) -> io::Result<(Value, Value)> {
    let missing = |what| io::Error::other(format!("the export's manifest has no {what}"));
    let container = manifest.get("container").ok_or_else(|| missing("container"))?;
    let version = manifest.get("version").ok_or_else(|| missing("version"))?;
    let spec = container.get("spec").cloned().ok_or_else(|| missing("spec"))?;
    let sandbox = version["sandbox"].as_str().ok_or_else(|| missing("sandbox"))?;
    // A pod's container is named as Kubernetes names it.
    let name = spec["annotations"]["io.kubernetes.cri.container-name"]
        .as_str()
        .unwrap_or(sandbox);
    let created = rfc3339(
        version["created_unix_ms"]
            .as_u64()
            .ok_or_else(|| missing("time"))?,
    );
    let config = serde_json::json!({
        "id": sandbox,
        "name": name,
        "rootfsImageName": container["image"],
        "runtime": RUNTIME,
        "createdTime": created,
        "checkpointedTime": created,
    });
    Ok((config, spec))
}

/// `unix_ms` as an RFC 3339 UTC time (`2026-12-03T12:20:45.123Z`).
fn rfc3339(unix_ms: u64) -> String {
    let (secs, ms) = (unix_ms / 1000, unix_ms % 1000);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_past_what_tar_readers_take_is_refused() {
        let file = tempfile::tempfile().unwrap();
        let mut out = tar::Builder::new(file);
        let mut header = tar::Header::new_gnu();
        let e = set_name(&mut out, &mut header, &vec![b'a'; MAX_LONG_NAME], false).unwrap_err();
        assert!(e.to_string().contains("tar readers take"), "{e}");
        set_name(&mut out, &mut header, &vec![b'a'; MAX_LONG_NAME - 1], false).unwrap();
    }

    /// A hand-written overlay-copy stream (the snapshotter's format).
    fn hex(s: impl AsRef<[u8]>) -> String {
        s.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn entry(path: impl AsRef<[u8]>, kind: &str, extra: &str, size: usize) -> String {
        format!(
            r#"{{"path":"{}","kind":"{kind}","mode":420,"uid":1,"gid":2,"rdev":0,"mtime":[1700000000,0],"xattrs":[{extra}],"target":null,"link":null,"size":{size}}}"#,
            hex(path)
        )
    }

    /// A long name in no encoding (the sandbox names its files).
    fn long_name() -> Vec<u8> {
        [&[0xffu8][..], &[b'n'; 120]].concat()
    }

    fn stream() -> Vec<u8> {
        let mut out =
            "{\"format\":\"crab-overlay-copy\",\"version\":1,\"name\":\"v1\",\"parent\":null,\"deleted\":[]}\n"
                .to_owned();
        out += &(entry("", "dir", "", 0) + "\n");
        out += &(entry(
            "d",
            "dir",
            &format!(r#"["{}","{}"]"#, hex("trusted.overlay.opaque"), hex("y")),
            0,
        ) + "\n");
        out += &(entry(
            "d/f",
            "file",
            &format!(r#"["{}","{}"]"#, hex("user.k"), hex("v")),
            3,
        ) + "\nabc");
        out += &(entry("d/g", "file", "", 0)
            .replace(r#""link":null"#, &format!(r#""link":"{}""#, hex("d/f")))
            + "\n");
        out += &(entry("s", "symlink", "", 0)
            .replace(r#""target":null"#, &format!(r#""target":"{}""#, hex("d/f")))
            + "\n");
        out += &(entry("w", "char", "", 0) + "\n");
        out += &(entry("d/hidden", "char", "", 0) + "\n");
        out += &(entry("p", "fifo", "", 0) + "\n");
        out += &(entry(long_name(), "symlink", "", 0)
            .replace(r#""target":null"#, &format!(r#""target":"{}""#, hex(long_name())))
            + "\n");
        out += "{\"end\":true,\"entries\":9}\n";
        out.into_bytes()
    }

    #[test]
    fn a_file_stream_becomes_the_engines_rootfs_diff() {
        let dir = tempfile::tempdir().unwrap();
        let (diff, deleted) = rootfs_diff(&mut stream().as_slice(), &dir.path().join("export.tar")).unwrap();
        // The whiteout under the opaque d is the directory's replacement's.
        assert_eq!(deleted, ["/w"]);
        let mut tar = tar::Archive::new(diff);
        let (mut seen, mut long) = (Vec::new(), false);
        for entry in tar.entries().unwrap() {
            let mut entry = entry.unwrap();
            if entry.path_bytes().as_ref() == long_name().as_slice() {
                assert_eq!(entry.link_name_bytes().unwrap().as_ref(), long_name().as_slice());
                long = true;
                continue;
            }
            let path = entry.path().unwrap().to_string_lossy().into_owned();
            let kind = entry.header().entry_type();
            let link = entry
                .link_name()
                .unwrap()
                .map(|l| l.to_string_lossy().into_owned());
            let xattrs: Vec<String> = entry
                .pax_extensions()
                .unwrap()
                .into_iter()
                .flatten()
                .map(|x| {
                    let x = x.unwrap();
                    format!(
                        "{}={}",
                        x.key().unwrap(),
                        String::from_utf8_lossy(x.value_bytes())
                    )
                })
                .collect();
            let mut data = String::new();
            entry.read_to_string(&mut data).unwrap();
            assert_eq!(entry.header().uid().unwrap(), 1, "{path}");
            seen.push((path, kind, link, xattrs, data));
        }
        let t = tar::EntryType::Regular;
        assert_eq!(
            seen,
            [
                (
                    "d/".into(),
                    tar::EntryType::Directory,
                    None,
                    vec![],
                    String::new()
                ),
                (
                    "d/f".into(),
                    t,
                    None,
                    vec!["SCHILY.xattr.user.k=v".into()],
                    "abc".into()
                ),
                (
                    "d/g".into(),
                    tar::EntryType::Link,
                    Some("d/f".into()),
                    vec![],
                    String::new()
                ),
                (
                    "s".into(),
                    tar::EntryType::Symlink,
                    Some("d/f".into()),
                    vec![],
                    String::new()
                ),
                ("p".into(), tar::EntryType::Fifo, None, vec![], String::new()),
            ]
        );
        assert!(long, "the long name in no encoding is in the archive, whole");
        // Shapes no tree has are refused: a child before its directory, a
        // link to a directory or to itself, a symlink with no target.
        let head = "{\"format\":\"crab-overlay-copy\",\"version\":1,\"name\":\"v1\",\"parent\":null,\"deleted\":[]}\n";
        let root = entry("", "dir", "", 0);
        let link = |p: &str, to: &str| {
            entry(p, "file", "", 0).replace(r#""link":null"#, &format!(r#""link":"{}""#, hex(to)))
        };
        for (n, body) in [
            vec![entry("a/b", "file", "", 0)],
            vec![entry("a", "dir", "", 0), link("b", "a")],
            vec![link("b", "b")],
            vec![entry("s", "symlink", "", 0)],
        ]
        .into_iter()
        .enumerate()
        {
            let text = format!(
                "{head}{root}\n{}\n{{\"end\":true,\"entries\":{}}}\n",
                body.join("\n"),
                body.len() + 1
            );
            assert!(
                rootfs_diff(&mut text.as_bytes(), &dir.path().join("export.tar")).is_err(),
                "{n}: {text}"
            );
        }
        // A stream cut short is refused, not half converted.
        let whole = stream();
        let cut = &whole[..whole.len() - 30];
        assert!(rootfs_diff(&mut &cut[..], &dir.path().join("export.tar")).is_err());
    }

    #[test]
    fn pax_records_count_their_own_length() {
        let records = pax_xattrs(&[
            ("user.a".into(), b"xyz".to_vec()),
            ("trusted.overlay.opaque".into(), b"y".to_vec()),
        ]);
        let text = String::from_utf8(records).unwrap();
        assert_eq!(text, "27 SCHILY.xattr.user.a=xyz\n");
        assert_eq!(text.len(), 27);
        // Where the length's own digits carry it over a power of ten.
        let value = vec![b'v'; 80];
        let record = pax_xattrs(&[("user.b".into(), value)]);
        let (len, _) = std::str::from_utf8(&record).unwrap().split_once(' ').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), record.len());
    }

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_300_445_123), "2026-12-03T12:20:45.123Z");
    }

    #[test]
    fn the_dumps_name_the_container_as_its_engine_would() {
        let manifest = serde_json::json!({
            "version": {"sandbox": "abc", "created_unix_ms": 0},
            "container": {"image": "docker.io/x:1", "spec": {"annotations": {
                "io.kubernetes.cri.container-name": "agent"}}},
        });
        let (config, spec) = dumps(&manifest).unwrap();
        assert_eq!(config["id"], "abc");
        assert_eq!(config["name"], "agent");
        assert_eq!(config["rootfsImageName"], "docker.io/x:1");
        assert_eq!(spec["annotations"]["io.kubernetes.cri.container-name"], "agent");
        let plain = serde_json::json!({
            "version": {"sandbox": "abc", "created_unix_ms": 0},
            "container": {"image": "i", "spec": {}},
        });
        assert_eq!(dumps(&plain).unwrap().0["name"], "abc");
        assert!(dumps(&serde_json::json!({"version": {}})).is_err());
    }
}
