//! The overlay-copy export stream.
//!
//! Format (version 1), all JSON lines except file data:
//!
//! ```text
//! {"format":"crab-overlay-copy","version":1,"name":N,"parent":P|null,"deleted":[hexpath…]}\n
//! {"path":hex,"kind":K,"mode":M,"uid":U,"gid":G,"rdev":R,"mtime":[s,ns],"xattrs":[[hexname,hexvalue]…],
//!  "target":hex|null,"link":hex|null,"size":S}\n  <S bytes of file data>
//! … one record per entry, parents before children …
//! {"end":true,"entries":N}\n
//! ```
//!
//! Paths are hex-encoded bytes relative to the tree root, so any name
//! survives; import rejects absolute paths and `..` components. `link` names
//! an earlier entry of the same stream (a hard link). With a parent, entries
//! whose file is shared with the parent's (same inode) are left out, and
//! `deleted` lists the parent's paths the snapshot lacks. A missing end
//! record means a truncated stream.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use walkdir::WalkDir;

use super::tree::{apply_meta, make_node, remove_any, Kind, Meta};
use crate::{Error, Result, SnapshotName};

const FORMAT: &str = "crab-overlay-copy";

#[derive(Serialize, Deserialize)]
struct Head {
    format: String,
    version: u32,
    name: String,
    parent: Option<String>,
    deleted: Vec<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Record {
    Entry(EntryRecord),
    End { end: bool, entries: u64 },
}

#[derive(Serialize, Deserialize)]
struct EntryRecord {
    path: String,
    kind: String,
    mode: u32,
    uid: u32,
    gid: u32,
    rdev: u64,
    mtime: (i64, i64),
    xattrs: Vec<(String, String)>,
    target: Option<String>,
    link: Option<String>,
    size: u64,
}

/// Writes snapshot tree `dir` (named `name`) to `out`, relative to the
/// parent tree `parent` when given.
pub fn export(
    dir: &Path,
    name: &SnapshotName,
    parent: Option<(&SnapshotName, &Path)>,
    out: &mut dyn Write,
) -> Result<()> {
    let mut deleted = Vec::new();
    if let Some((_, pdir)) = parent {
        for entry in WalkDir::new(pdir)
            .min_depth(1)
            .follow_links(false)
            .sort_by_file_name()
        {
            let entry = entry.map_err(|e| stream_io(pdir, e.into()))?;
            let rel = entry
                .path()
                .strip_prefix(pdir)
                .expect("walkdir yields paths under its root");
            if std::fs::symlink_metadata(dir.join(rel)).is_err() {
                deleted.push(hex(rel.as_os_str().as_bytes()));
            }
        }
    }
    let head = Head {
        format: FORMAT.to_owned(),
        version: 1,
        name: name.to_string(),
        parent: parent.map(|(p, _)| p.to_string()),
        deleted,
    };
    write_line(out, &head, dir)?;
    let mut n_entries = 0u64;
    let mut groups: HashMap<u64, String> = HashMap::new();
    for entry in WalkDir::new(dir).follow_links(false).sort_by_file_name() {
        let entry = entry.map_err(|e| stream_io(dir, e.into()))?;
        let rel = entry
            .path()
            .strip_prefix(dir)
            .expect("walkdir yields paths under its root");
        let meta = Meta::read(entry.path())?;
        let path = hex(rel.as_os_str().as_bytes());
        if meta.kind == Kind::File {
            if let Some((_, pdir)) = parent {
                let shared =
                    Meta::read(&pdir.join(rel)).is_ok_and(|p| p.ino == meta.ino && p.dev == meta.dev);
                if shared {
                    continue;
                }
            }
        }
        let link = if meta.kind == Kind::File {
            groups.get(&meta.ino).cloned()
        } else {
            None
        };
        let target = match meta.kind {
            Kind::Symlink => Some(hex(std::fs::read_link(entry.path())
                .map_err(Error::io("read link", entry.path()))?
                .as_os_str()
                .as_bytes())),
            _ => None,
        };
        let size = if meta.kind == Kind::File && link.is_none() {
            meta.size
        } else {
            0
        };
        let rec = Record::Entry(EntryRecord {
            path: path.clone(),
            kind: kind_name(meta.kind).to_owned(),
            mode: meta.mode,
            uid: meta.uid,
            gid: meta.gid,
            rdev: meta.rdev,
            mtime: meta.mtime,
            xattrs: meta
                .xattrs
                .iter()
                .map(|(n, v)| (hex(n.as_bytes()), hex(v)))
                .collect(),
            target,
            link: link.clone(),
            size,
        });
        write_line(out, &rec, entry.path())?;
        if size > 0 {
            let mut f = std::fs::File::open(entry.path()).map_err(Error::io("open", entry.path()))?;
            let copied =
                std::io::copy(&mut (&mut f).take(size), out).map_err(Error::io("export", entry.path()))?;
            if copied != size {
                return Err(Error::Io {
                    op: "export (file shrank while being read)",
                    path: entry.path().to_owned(),
                    source: std::io::ErrorKind::UnexpectedEof.into(),
                });
            }
        }
        if meta.kind == Kind::File && link.is_none() {
            groups.insert(meta.ino, path);
        }
        n_entries += 1;
    }
    write_line(
        out,
        &Record::End {
            end: true,
            entries: n_entries,
        },
        dir,
    )?;
    out.flush().map_err(Error::io("export", dir))
}

/// What an import needs to know before it applies a stream.
pub struct StreamHead {
    /// The parent the stream is relative to.
    pub parent: Option<String>,
    deleted: Vec<String>,
}

/// Reads the head of a stream.
pub fn read_head(input: &mut BufReader<&mut dyn Read>) -> Result<StreamHead> {
    let head: Head = read_line(input)?.ok_or_else(|| bad("empty stream"))?;
    if head.format != FORMAT || head.version != 1 {
        return Err(bad(&format!(
            "format {} version {} is not {FORMAT} version 1",
            head.format, head.version
        )));
    }
    Ok(StreamHead {
        parent: head.parent,
        deleted: head.deleted,
    })
}

/// What a stream from elsewhere may hold besides plain files,
/// directories, symlinks, fifos and sockets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamPolicy {
    /// Device nodes (other than overlayfs whiteouts), setuid/setgid bits,
    /// and `security.*` / `trusted.*` xattrs (other than overlayfs' own):
    /// what a sandbox's root may make and a host user must not find in a
    /// store. Refused unless true.
    pub privileged: bool,
}

/// The longest JSON line a stream may hold (a head lists deleted paths).
const MAX_LINE: u64 = 64 << 20;

/// Applies the rest of a stream to `dst`, which holds a hard-linked copy of
/// the parent tree (or is a new empty directory). Nothing is written
/// outside `dst`: no path of the stream may pass through a symlink (or
/// anything but a directory), whatever the stream made before it.
pub fn apply(
    head: &StreamHead,
    input: &mut BufReader<&mut dyn Read>,
    dst: &Path,
    policy: StreamPolicy,
) -> Result<()> {
    for d in &head.deleted {
        let rel = safe_path(d)?;
        if rel.as_os_str().is_empty() {
            return Err(bad("the root cannot be deleted"));
        }
        match beneath(dst, &rel) {
            Ok(path) => remove_any(&path)?,
            // Under a directory deleted before it: gone already.
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    let mut dirs: Vec<(PathBuf, Meta)> = Vec::new();
    // Every path once, parents before children: a later record can then
    // never turn a directory that earlier ones went through into a link.
    let mut seen: std::collections::HashSet<PathBuf> = std::collections::HashSet::new();
    let mut n_entries = 0u64;
    loop {
        let rec: Record = read_line(input)?.ok_or_else(|| bad("truncated: no end record"))?;
        let e = match rec {
            Record::End { entries, .. } if entries == n_entries => break,
            Record::End { entries, .. } => {
                return Err(bad(&format!(
                    "end record counts {entries} entries, stream had {n_entries}"
                )))
            }
            Record::Entry(e) => e,
        };
        n_entries += 1;
        let rel = safe_path(&e.path)?;
        if !seen.insert(rel.clone()) {
            return Err(bad(&format!("{rel:?} appears twice in the stream")));
        }
        if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !seen.contains(parent)
                && !std::fs::symlink_metadata(dst.join(parent)).is_ok_and(|m| m.is_dir())
            {
                return Err(bad(&format!("{rel:?} comes before its directory")));
            }
        }
        let to = beneath(dst, &rel)?;
        let meta = e.meta()?;
        check_privileges(&rel, &meta, policy)?;
        let real_dir = std::fs::symlink_metadata(&to).is_ok_and(|m| m.is_dir());
        if meta.kind != Kind::Dir || !real_dir {
            // Never write through an existing entry: it may be a hard link
            // shared with the parent snapshot.
            if rel.as_os_str().is_empty() {
                return Err(bad("the root must be a directory"));
            }
            remove_any(&to)?;
        }
        match meta.kind {
            Kind::Dir => {
                std::fs::create_dir_all(&to).map_err(Error::io("create directory", &to))?;
                dirs.push((to, meta));
                continue;
            }
            Kind::File if e.link.is_some() => {
                let first = beneath(dst, &safe_path(e.link.as_deref().unwrap_or_default())?)?;
                if !std::fs::symlink_metadata(&first).is_ok_and(|m| m.is_file()) {
                    return Err(bad(&format!(
                        "{rel:?} links to {first:?}, not a file of the stream"
                    )));
                }
                std::fs::hard_link(&first, &to).map_err(Error::io("link", &to))?;
                continue;
            }
            Kind::File => {
                // A new file, never one reached through a link.
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags(nix::libc::O_NOFOLLOW)
                    .open(&to)
                    .map_err(Error::io("create", &to))?;
                let n = std::io::copy(&mut input.take(e.size), &mut f).map_err(Error::io("import", &to))?;
                if n != e.size {
                    return Err(bad("truncated file data"));
                }
            }
            Kind::Symlink => {
                let target = OsString::from_vec(unhex(e.target.as_deref().unwrap_or_default())?);
                std::os::unix::fs::symlink(&target, &to).map_err(Error::io("create symlink", &to))?;
            }
            _ => make_node(&to, &meta)?,
        }
        apply_meta(&to, &meta)?;
    }
    for (dir, meta) in dirs.iter().rev() {
        // Checked again: still a directory, reached through directories.
        let rel = dir
            .strip_prefix(dst)
            .map_err(|_| bad("a directory outside the tree"))?;
        let again = beneath(dst, rel)?;
        if !std::fs::symlink_metadata(&again).is_ok_and(|m| m.is_dir()) {
            return Err(bad(&format!("{rel:?} is no longer a directory")));
        }
        apply_meta(&again, meta)?;
    }
    Ok(())
}

/// `dst/rel`, once every directory on the way there is a real directory
/// (not a symlink, which would take what follows out of `dst`). The tree
/// under `dst` is the import's own: nothing else changes it meanwhile.
fn beneath(dst: &Path, rel: &Path) -> Result<PathBuf> {
    let mut at = dst.to_owned();
    let mut parts = rel.components().peekable();
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            at.push(part);
            break;
        }
        at.push(part);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(bad(&format!(
                    "{rel:?} passes through {at:?}, which is not a directory"
                )))
            }
            Err(e) => return Err(Error::io("stat", &at)(e)),
        }
    }
    Ok(at)
}

/// Refuses what `policy` does not allow in entry `rel`.
fn check_privileges(rel: &Path, meta: &Meta, policy: StreamPolicy) -> Result<()> {
    if policy.privileged {
        return Ok(());
    }
    let refuse = |what: &str| {
        Err(Error::Refused {
            reason: format!("{rel:?} is {what}; import with privileged files allowed to keep it"),
        })
    };
    let whiteout = meta.kind == Kind::Char && meta.rdev == 0;
    if matches!(meta.kind, Kind::Char | Kind::Block) && !whiteout {
        return refuse("a device node");
    }
    // A setgid directory only passes its group on; setuid/setgid files
    // run with their owner's rights.
    let setgid_dir = meta.kind == Kind::Dir && meta.mode & 0o6000 == 0o2000;
    if meta.kind != Kind::Symlink && meta.mode & 0o6000 != 0 && !setgid_dir {
        return refuse("setuid or setgid");
    }
    for (name, _) in &meta.xattrs {
        let name = name.as_bytes();
        let overlay = name.starts_with(b"trusted.overlay.");
        if !overlay && (name.starts_with(b"security.") || name.starts_with(b"trusted.")) {
            return refuse(&format!("marked with xattr {:?}", String::from_utf8_lossy(name)));
        }
    }
    Ok(())
}

/// One entry of a stream, as [`read_stream`] hands it on.
#[derive(Debug, Clone)]
pub struct StreamEntry {
    /// Its path relative to the tree's root (no `..`, never absolute;
    /// empty for the root itself).
    pub path: PathBuf,
    /// Its kind (an overlayfs whiteout is a `Char` of device 0).
    pub kind: Kind,
    /// Permission bits (and setuid/setgid/sticky).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Device number (a node's).
    pub rdev: u64,
    /// Modification time (seconds, nanoseconds).
    pub mtime: (i64, i64),
    /// Extended attributes.
    pub xattrs: Vec<(OsString, Vec<u8>)>,
    /// A symlink's target.
    pub target: Option<PathBuf>,
    /// The earlier entry of the stream this file is a hard link to.
    pub link: Option<PathBuf>,
    /// Bytes of file data that follow it (a file that is no link).
    pub size: u64,
}

/// Reads a whole stream from `input`, handing each entry and its data to
/// `visit` in the stream's order. Only a whole tree's stream is read (one
/// relative to a parent snapshot holds only what changed). It writes
/// nothing, and holds the stream to the shape a real
/// tree has, which [`apply`] gets from the filesystem: the root first and
/// a directory, every other path once, under a directory the stream made
/// before it, with no NUL; a hard link to an earlier file other than
/// itself; data for files only; a target for symlinks only; the end
/// record's count. Data `visit` leaves unread is skipped.
///
/// # Errors
/// [`Error::BadStream`] for a malformed or truncated stream; `visit`'s own
/// errors as [`Error::Io`] naming the entry.
pub fn read_stream(
    input: &mut dyn Read,
    mut visit: impl FnMut(&StreamEntry, &mut dyn Read) -> std::io::Result<()>,
) -> Result<()> {
    let mut input = BufReader::new(input);
    let head = read_head(&mut input)?;
    if let Some(parent) = head.parent {
        return Err(bad(&format!(
            "a stream relative to snapshot {parent} (only a whole tree's is read)"
        )));
    }
    if !head.deleted.is_empty() {
        return Err(bad("a whole tree's stream deletes nothing"));
    }
    // Every path so far, with its kind.
    let mut seen: HashMap<PathBuf, Kind> = HashMap::new();
    let mut n_entries = 0u64;
    loop {
        let rec: Record = read_line(&mut input)?.ok_or_else(|| bad("truncated: no end record"))?;
        let e = match rec {
            Record::End { entries, .. } if entries == n_entries => return Ok(()),
            Record::End { entries, .. } => {
                return Err(bad(&format!(
                    "end record counts {entries} entries, stream had {n_entries}"
                )))
            }
            Record::Entry(e) => e,
        };
        n_entries += 1;
        let path = safe_path(&e.path)?;
        let meta = e.meta()?;
        if path.as_os_str().as_bytes().contains(&0) {
            return Err(bad(&format!("{path:?} holds a NUL")));
        }
        match path.parent() {
            None if meta.kind != Kind::Dir => return Err(bad("the root must be a directory")),
            None => {}
            Some(parent) if seen.get(parent) != Some(&Kind::Dir) => {
                return Err(bad(&format!(
                    "{path:?} is not under a directory the stream made before it"
                )))
            }
            Some(_) => {}
        }
        if seen.insert(path.clone(), meta.kind).is_some() {
            return Err(bad(&format!("{path:?} appears twice in the stream")));
        }
        let link = e.link.as_deref().map(safe_path).transpose()?;
        if let Some(l) = &link {
            if meta.kind != Kind::File || l == &path || seen.get(l) != Some(&Kind::File) {
                return Err(bad(&format!(
                    "{path:?} links to an entry that is no earlier file"
                )));
            }
        }
        let carries_data = meta.kind == Kind::File && link.is_none();
        if !carries_data && e.size != 0 {
            return Err(bad(&format!("{path:?} has data but is no file")));
        }
        let target = e
            .target
            .as_deref()
            .map(|t| unhex(t).map(|b| PathBuf::from(OsString::from_vec(b))))
            .transpose()?;
        if target.is_some() != (meta.kind == Kind::Symlink)
            || target
                .as_ref()
                .is_some_and(|t| t.as_os_str().as_bytes().contains(&0))
        {
            return Err(bad(&format!(
                "{path:?}: a target for symlinks only, and for every one"
            )));
        }
        let entry = StreamEntry {
            path,
            kind: meta.kind,
            mode: meta.mode,
            uid: meta.uid,
            gid: meta.gid,
            rdev: meta.rdev,
            mtime: meta.mtime,
            xattrs: meta.xattrs,
            target,
            link,
            size: e.size,
        };
        let mut data = (&mut input).take(entry.size);
        visit(&entry, &mut data).map_err(Error::io("convert", &entry.path))?;
        std::io::copy(&mut data, &mut std::io::sink()).map_err(|e| bad(&format!("read: {e}")))?;
        if data.limit() != 0 {
            return Err(bad("truncated file data"));
        }
    }
}

// === impl EntryRecord ===

impl EntryRecord {
    fn meta(&self) -> Result<Meta> {
        let kind = match self.kind.as_str() {
            "dir" => Kind::Dir,
            "file" => Kind::File,
            "symlink" => Kind::Symlink,
            "char" => Kind::Char,
            "block" => Kind::Block,
            "fifo" => Kind::Fifo,
            "socket" => Kind::Socket,
            other => return Err(bad(&format!("unknown entry kind {other:?}"))),
        };
        let mut xattrs = Vec::new();
        for (n, v) in &self.xattrs {
            // The kernel's own bounds: a name of 255 bytes, a value of 64 KiB.
            if n.len() > 2 * 255 || v.len() > 2 * 65536 {
                return Err(bad("an xattr longer than the kernel allows"));
            }
            xattrs.push((OsString::from_vec(unhex(n)?), unhex(v)?));
        }
        Ok(Meta {
            kind,
            mode: self.mode & 0o7777,
            uid: self.uid,
            gid: self.gid,
            rdev: self.rdev,
            size: self.size,
            ino: 0,
            dev: 0,
            nlink: 1,
            ctime: (0, 0),
            atime: self.mtime,
            mtime: self.mtime,
            xattrs,
        })
    }
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Dir => "dir",
        Kind::File => "file",
        Kind::Symlink => "symlink",
        Kind::Char => "char",
        Kind::Block => "block",
        Kind::Fifo => "fifo",
        Kind::Socket => "socket",
    }
}

/// A relative path from the stream that cannot leave the tree.
fn safe_path(h: &str) -> Result<PathBuf> {
    let p = PathBuf::from(OsString::from_vec(unhex(h)?));
    if p.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(bad(&format!("unsafe path {:?}", p)));
    }
    Ok(p)
}

fn write_line<T: Serialize>(out: &mut dyn Write, v: &T, path: &Path) -> Result<()> {
    let mut line = serde_json::to_vec(v).map_err(|e| stream_io(path, std::io::Error::other(e)))?;
    line.push(b'\n');
    out.write_all(&line).map_err(Error::io("export", path))
}

fn read_line<T: for<'de> Deserialize<'de>>(input: &mut BufReader<&mut dyn Read>) -> Result<Option<T>> {
    let mut line = Vec::new();
    let n = input
        .take(MAX_LINE + 1)
        .read_until(b'\n', &mut line)
        .map_err(|e| bad(&format!("read: {e}")))?;
    if n == 0 {
        return Ok(None);
    }
    if n as u64 > MAX_LINE {
        return Err(bad(&format!("a record is longer than {MAX_LINE} bytes")));
    }
    serde_json::from_slice(&line)
        .map(Some)
        .map_err(|e| bad(&format!("bad record: {e}")))
}

fn stream_io(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        op: "export",
        path: path.to_owned(),
        source,
    }
}

fn bad(reason: &str) -> Error {
    Error::BadStream {
        reason: reason.to_owned(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    if !s.is_ascii() || !s.len().is_multiple_of(2) {
        return Err(bad("odd-length hex"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| bad("invalid hex")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One entry of a hand-written stream.
    struct E<'a> {
        path: &'a str,
        kind: &'a str,
        mode: u32,
        rdev: u64,
        target: Option<&'a str>,
        link: Option<&'a str>,
        xattrs: Vec<(&'a str, &'a str)>,
        data: &'a [u8],
    }

    fn e<'a>(path: &'a str, kind: &'a str) -> E<'a> {
        E {
            path,
            kind,
            mode: 0o644,
            rdev: 0,
            target: None,
            link: None,
            xattrs: vec![],
            data: b"",
        }
    }

    /// A stream of `entries`, deleting `deleted`.
    fn stream(deleted: &[&str], entries: &[E]) -> Vec<u8> {
        let head = serde_json::json!({"format": FORMAT, "version": 1, "name": "s1", "parent": null,
            "deleted": deleted.iter().map(|d| hex(d.as_bytes())).collect::<Vec<_>>()});
        let mut out = serde_json::to_vec(&head).unwrap();
        out.push(b'\n');
        for x in entries {
            let rec = EntryRecord {
                path: hex(x.path.as_bytes()),
                kind: x.kind.into(),
                mode: x.mode,
                uid: 0,
                gid: 0,
                rdev: x.rdev,
                mtime: (0, 0),
                xattrs: x
                    .xattrs
                    .iter()
                    .map(|(n, v)| (hex(n.as_bytes()), hex(v.as_bytes())))
                    .collect(),
                target: x.target.map(|t| hex(t.as_bytes())),
                link: x.link.map(|l| hex(l.as_bytes())),
                size: x.data.len() as u64,
            };
            out.extend(serde_json::to_vec(&rec).unwrap());
            out.push(b'\n');
            out.extend(x.data);
        }
        out.extend(format!("{{\"end\":true,\"entries\":{}}}\n", entries.len()).as_bytes());
        out
    }

    /// Applies `bytes` to a fresh tree beside an `outside` directory;
    /// answers the result and the two directories.
    fn apply_to(bytes: &[u8], policy: StreamPolicy) -> (Result<()>, tempfile::TempDir) {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("tree")).unwrap();
        std::fs::create_dir(root.path().join("outside")).unwrap();
        std::fs::write(root.path().join("outside/keep"), "host").unwrap();
        let mut input: &[u8] = bytes;
        let mut reader: &mut dyn Read = &mut input;
        let mut buf = BufReader::new(&mut reader as &mut dyn Read);
        let res = read_head(&mut buf).and_then(|h| apply(&h, &mut buf, &root.path().join("tree"), policy));
        (res, root)
    }

    fn outside_untouched(root: &tempfile::TempDir) {
        let names: Vec<_> = std::fs::read_dir(root.path().join("outside"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("keep")],
            "something was written outside the tree"
        );
        assert_eq!(
            std::fs::read_to_string(root.path().join("outside/keep")).unwrap(),
            "host"
        );
        let meta = std::fs::metadata(root.path().join("outside")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_ne!(
            meta.permissions().mode() & 0o7777,
            0o4777,
            "the outside directory's mode changed"
        );
    }

    #[test]
    fn nothing_is_written_through_a_symlink_the_stream_made() {
        let up = "../outside";
        let cases: Vec<Vec<u8>> = vec![
            // x -> outside, then x/evil.
            stream(
                &[],
                &[
                    E {
                        target: Some(up),
                        ..e("x", "symlink")
                    },
                    E {
                        data: b"root",
                        mode: 0o4755,
                        ..e("x/evil", "file")
                    },
                ],
            ),
            // x -> outside, then x as a directory (its mode must not land on outside), then x/evil.
            stream(
                &[],
                &[
                    E {
                        target: Some(up),
                        ..e("x", "symlink")
                    },
                    E {
                        mode: 0o4777,
                        ..e("x", "dir")
                    },
                    E {
                        data: b"a",
                        ..e("x/evil", "file")
                    },
                ],
            ),
            // A hard link through the symlink to a host file.
            stream(
                &[],
                &[
                    E {
                        target: Some(up),
                        ..e("x", "symlink")
                    },
                    E {
                        link: Some("x/keep"),
                        ..e("l", "file")
                    },
                ],
            ),
            // A file whose name is a symlink already there.
            stream(
                &[],
                &[
                    E {
                        target: Some("../outside/keep"),
                        ..e("f", "symlink")
                    },
                    E {
                        data: b"overwritten",
                        ..e("f", "file")
                    },
                ],
            ),
        ];
        for (i, bytes) in cases.iter().enumerate() {
            let (res, root) = apply_to(bytes, StreamPolicy { privileged: true });
            outside_untouched(&root);
            let err = res.expect_err(&format!("case {i} was applied")).to_string();
            assert!(
                err.contains("not a directory") || err.contains("not a file") || err.contains("twice"),
                "case {i}: {err}"
            );
        }
        // A symlink of the parent tree replaced by a directory of the
        // stream: the directory is made inside, its mode lands there.
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("tree")).unwrap();
        std::fs::create_dir_all(root.path().join("outside")).unwrap();
        std::fs::write(root.path().join("outside/keep"), "host").unwrap();
        std::os::unix::fs::symlink("../outside", root.path().join("tree/x")).unwrap();
        let bytes = stream(
            &[],
            &[
                E {
                    mode: 0o777,
                    ..e("x", "dir")
                },
                E {
                    data: b"a",
                    ..e("x/evil", "file")
                },
            ],
        );
        let mut input: &[u8] = &bytes;
        let mut reader: &mut dyn Read = &mut input;
        let mut buf = BufReader::new(&mut reader as &mut dyn Read);
        let head = read_head(&mut buf).unwrap();
        apply(
            &head,
            &mut buf,
            &root.path().join("tree"),
            StreamPolicy::default(),
        )
        .unwrap();
        assert!(std::fs::symlink_metadata(root.path().join("tree/x"))
            .unwrap()
            .is_dir());
        assert!(root.path().join("tree/x/evil").exists());
        outside_untouched(&root);
        // A deleted path through a symlink of the parent tree.
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("tree")).unwrap();
        std::fs::create_dir_all(root.path().join("outside")).unwrap();
        std::fs::write(root.path().join("outside/keep"), "host").unwrap();
        std::os::unix::fs::symlink("../outside", root.path().join("tree/x")).unwrap();
        let bytes = stream(&["x/keep"], &[]);
        let mut input: &[u8] = &bytes;
        let mut reader: &mut dyn Read = &mut input;
        let mut buf = BufReader::new(&mut reader as &mut dyn Read);
        let head = read_head(&mut buf).unwrap();
        assert!(apply(
            &head,
            &mut buf,
            &root.path().join("tree"),
            StreamPolicy::default()
        )
        .is_err());
        outside_untouched(&root);
    }

    #[test]
    fn a_directory_turned_into_a_link_later_takes_nothing_outside() {
        let up = "../outside";
        for bytes in [
            // a, a/etc, then a again as a link: a/etc's deferred metadata must not land outside.
            stream(
                &[],
                &[
                    E {
                        mode: 0o755,
                        ..e("a", "dir")
                    },
                    E {
                        mode: 0o777,
                        ..e("a/keep", "dir")
                    },
                    E {
                        target: Some(up),
                        ..e("a", "symlink")
                    },
                ],
            ),
            // A child before its directory.
            stream(
                &[],
                &[E {
                    data: b"x",
                    ..e("b/c", "file")
                }],
            ),
            // The root deleted.
            stream(&[""], &[]),
        ] {
            let (res, root) = apply_to(&bytes, StreamPolicy { privileged: true });
            assert!(res.is_err(), "applied");
            outside_untouched(&root);
        }
        assert!(unhex("é0").is_err(), "non-ASCII hex is an error, not a panic");
    }

    #[test]
    fn privileged_entries_need_the_importers_consent() {
        let strict = StreamPolicy::default();
        let cases = [
            (
                "a device node",
                stream(
                    &[],
                    &[E {
                        rdev: (1 << 8) | 3,
                        ..e("null", "char")
                    }],
                ),
            ),
            (
                "a setuid file",
                stream(
                    &[],
                    &[E {
                        mode: 0o4755,
                        data: b"#!/bin/sh",
                        ..e("su", "file")
                    }],
                ),
            ),
            (
                "a setuid directory",
                stream(
                    &[],
                    &[E {
                        mode: 0o6755,
                        ..e("d", "dir")
                    }],
                ),
            ),
            (
                "a file capability",
                stream(
                    &[],
                    &[E {
                        xattrs: vec![("security.capability", "x")],
                        ..e("cap", "file")
                    }],
                ),
            ),
            (
                "a trusted xattr",
                stream(
                    &[],
                    &[E {
                        xattrs: vec![("trusted.evil", "x")],
                        ..e("t", "file")
                    }],
                ),
            ),
        ];
        for (what, bytes) in &cases {
            let (res, root) = apply_to(bytes, strict);
            let err = res.expect_err(what).to_string();
            assert!(
                err.contains("refused") && err.contains("privileged"),
                "{what}: {err}"
            );
            outside_untouched(&root);
            let (res, _root) = apply_to(bytes, StreamPolicy { privileged: true });
            if *what != "a file capability" && *what != "a trusted xattr" {
                res.unwrap_or_else(|e| panic!("{what} with consent: {e}"));
            }
        }
        // What an overlay upper directory holds is not privileged.
        let upper = stream(
            &[],
            &[
                e("gone", "char"),
                E {
                    mode: 0o755,
                    xattrs: vec![("trusted.overlay.opaque", "y")],
                    ..e("opaque", "dir")
                },
            ],
        );
        let (res, root) = apply_to(&upper, strict);
        res.unwrap();
        assert!(root.path().join("tree/gone").exists());
    }

    #[test]
    fn an_endless_record_is_refused_not_buffered() {
        let mut bytes = stream(&[], &[]);
        let head_end = bytes.iter().position(|b| *b == b'\n').unwrap() + 1;
        bytes.truncate(head_end);
        bytes.extend(std::iter::repeat_n(b'x', (MAX_LINE + 10) as usize));
        let (res, _root) = apply_to(&bytes, StreamPolicy::default());
        let err = res.unwrap_err().to_string();
        assert!(err.contains("longer than"), "{err}");
    }

    #[test]
    fn hex_round_trip_and_safe_paths() {
        assert_eq!(unhex(&hex(b"a/\xff\n")).unwrap(), b"a/\xff\n");
        assert!(safe_path(&hex(b"a/b")).is_ok());
        assert!(safe_path(&hex(b"")).is_ok());
        for evil in [&b"../x"[..], b"/etc/passwd", b"a/../../b", b"./a"] {
            assert!(safe_path(&hex(evil)).is_err(), "{evil:?}");
        }
        assert!(unhex("zz").is_err());
        assert!(unhex("abc").is_err());
    }
}
