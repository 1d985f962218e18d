//! The few filesystem steps that make a write durable.
//!
//! Linux makes a new or renamed directory entry durable only when the
//! directory itself is fsynced (fsync(2), "Calling fsync() does not
//! necessarily ensure that the entry in the directory containing the file
//! has also reached disk"), so every create, rename and remove here is
//! followed by an fsync of its parent.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;

use super::StoreError;

/// Fsyncs directory `dir`.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(StoreError::io("fsync directory", dir))
}

/// Creates `dir` and its missing parents, fsyncing the parent of each
/// directory it creates.
pub(crate) fn create_dir(dir: &Path) -> Result<(), StoreError> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        create_dir(parent)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => sync_parent(dir),
        // Another thread made it first; it fsyncs the parent.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(StoreError::Io {
            op: "create directory",
            path: dir.to_owned(),
            source: e,
        }),
    }
}

/// Fsyncs the directory holding `path`.
pub(crate) fn sync_parent(path: &Path) -> Result<(), StoreError> {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => sync_dir(parent),
        _ => sync_dir(Path::new(".")),
    }
}

/// Replaces `path` with `bytes` atomically: a reader sees the old content
/// or the new one, after a crash too.
///
/// Invariant: the new file is fsynced before the rename that replaces the
/// old one, and the directory is fsynced after it.
///
/// A failed write (a full disk) removes its temporary file: the old
/// content stays, and nothing else.
pub(crate) fn replace_file(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let tmp = tmp_path(path);
    let written = write_synced(&tmp, bytes)
        .and_then(|()| fs::rename(&tmp, path).map_err(StoreError::io("rename into place", path)));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_parent(path)
}

/// Writes `bytes` as file `path` (made or cut) and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(StoreError::io("create", path))?;
    file.write_all(bytes).map_err(StoreError::io("write", path))?;
    file.sync_all().map_err(StoreError::io("fsync", path))
}

/// The temporary name [`replace_file`] writes `path` under.
pub(crate) fn tmp_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Removes a temporary directory `dir` (`.tmp-*`) that no one should be
/// writing; answers whether it is gone. A writer may still be in it all
/// the same (a killed crabd's checkpoint goes on in the shim, CRIU
/// writing its images there), and removing under a writer fails
/// (`ENOTEMPTY`): the directory is then moved aside as `.stale.tmp-*`,
/// never swept again under its `.tmp-` name, and removed by a later
/// sweep (logged).
pub(crate) fn clear_tmp(dir: &Path) -> Result<bool, StoreError> {
    match fs::remove_dir_all(dir) {
        Ok(()) => return Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
        Err(e) => {
            tracing::warn!(path = %dir.display(), error = %e, "a temporary directory is moved aside (a writer may still be in it)")
        }
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    // Moved once: a sweep removes `.stale*` entries, never renames them.
    let mut name = std::ffi::OsString::from(STALE);
    name.push(dir.file_name().unwrap_or_default());
    name.push(format!("-{nanos}"));
    let aside = dir.with_file_name(name);
    fs::rename(dir, &aside).map_err(StoreError::io("move aside", dir))?;
    sync_parent(dir)?;
    Ok(false)
}

/// The prefix of a temporary directory [`clear_tmp`] moved aside.
pub(crate) const STALE: &str = ".stale";

/// Removes entry `path` if [`clear_tmp`] moved it aside (its name starts
/// with [`STALE`]); answers whether it had that name. One whose writer is
/// still in it stays for the next sweep (logged).
pub(crate) fn sweep_stale(path: &Path) -> bool {
    let stale = path
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with(STALE));
    if stale {
        if let Err(e) = fs::remove_dir_all(path) {
            tracing::warn!(path = %path.display(), error = %e, "a temporary directory moved aside stays for the next sweep");
        }
    }
    stale
}

/// Removes directory tree `dir`, if present, and fsyncs its parent.
pub(crate) fn remove_dir(dir: &Path) -> Result<(), StoreError> {
    match fs::remove_dir_all(dir) {
        Ok(()) => sync_parent(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::Io {
            op: "remove directory",
            path: dir.to_owned(),
            source: e,
        }),
    }
}
