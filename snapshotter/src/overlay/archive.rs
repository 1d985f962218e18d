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

/// Applies the rest of a stream to `dst`, which holds a hard-linked copy of
/// the parent tree (or is a new empty directory).
pub fn apply(head: &StreamHead, input: &mut BufReader<&mut dyn Read>, dst: &Path) -> Result<()> {
    for d in &head.deleted {
        remove_any(&dst.join(safe_path(d)?))?;
    }
    let mut dirs: Vec<(PathBuf, Meta)> = Vec::new();
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
        let to = dst.join(&rel);
        let meta = e.meta()?;
        if meta.kind != Kind::Dir || !to.is_dir() {
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
                let first = dst.join(safe_path(e.link.as_deref().unwrap_or_default())?);
                std::fs::hard_link(&first, &to).map_err(Error::io("link", &to))?;
                continue;
            }
            Kind::File => {
                let mut f = std::fs::File::create(&to).map_err(Error::io("create", &to))?;
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
        apply_meta(dir, meta)?;
    }
    Ok(())
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
        .read_until(b'\n', &mut line)
        .map_err(|e| bad(&format!("read: {e}")))?;
    if n == 0 {
        return Ok(None);
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
    if !s.len().is_multiple_of(2) {
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
