//! Process image directories: sealing one at publish (hash, fsync), checking
//! one against its manifest line.
//!
//! The files are opaque (CRIU writes them); a directory may hold regular
//! files and directories, nothing else.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::Path;

use sha2::{Digest, Sha256};

use super::record::ImageFile;
use super::{durable, Defect, StoreError};

/// How hard to look at an images directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Depth {
    /// Every file is present with its recorded size.
    Sizes,
    /// And its content has its recorded sha256.
    Hashes,
}

/// Hashes and fsyncs every file under `dir`, and fsyncs every directory
/// under it and `dir` itself, so that what a manifest line will name is
/// durable; returns the files sorted by path.
pub(crate) fn seal(dir: &Path) -> Result<Vec<ImageFile>, StoreError> {
    let mut files = Vec::new();
    seal_tree(dir, "", &mut files)?;
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

fn seal_tree(dir: &Path, prefix: &str, files: &mut Vec<ImageFile>) -> Result<(), StoreError> {
    let entries = fs::read_dir(dir).map_err(StoreError::io("read directory", dir))?;
    for entry in entries {
        let entry = entry.map_err(StoreError::io("read directory", dir))?;
        let path = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            return Err(StoreError::UnsupportedImageEntry { path });
        };
        let rel = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let kind = entry.file_type().map_err(StoreError::io("stat", &path))?;
        if kind.is_dir() {
            seal_tree(&path, &rel, files)?;
        } else if kind.is_file() {
            let file = File::open(&path).map_err(StoreError::io("open image file", &path))?;
            let (bytes, sha256) = hash(&file).map_err(StoreError::io("read image file", &path))?;
            // fsync(2) on a read-only descriptor flushes the inode's dirty
            // pages too, whoever wrote them.
            file.sync_all()
                .map_err(StoreError::io("fsync image file", &path))?;
            files.push(ImageFile {
                path: rel,
                bytes,
                sha256,
            });
        } else {
            return Err(StoreError::UnsupportedImageEntry { path });
        }
    }
    durable::sync_dir(dir)
}

/// Checks the files of `holder`'s images directory `dir` against `files`.
pub(crate) fn check(dir: &Path, holder: u64, files: &[ImageFile], depth: Depth) -> Result<(), Defect> {
    for f in files {
        let path = dir.join(&f.path);
        let missing = || Defect::MissingImage {
            holder,
            file: f.path.clone(),
        };
        let corrupt = || Defect::CorruptImage {
            holder,
            file: f.path.clone(),
        };
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_file() => meta,
            Ok(_) => return Err(corrupt()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(missing()),
            Err(_) => return Err(corrupt()),
        };
        if meta.len() != f.bytes {
            return Err(corrupt());
        }
        if depth == Depth::Hashes {
            let sum = File::open(&path).and_then(|file| hash(&file));
            match sum {
                Ok((bytes, sha256)) if bytes == f.bytes && sha256 == f.sha256 => {}
                _ => return Err(corrupt()),
            }
        }
    }
    Ok(())
}

/// The size and sha256 of what `file` holds.
fn hash(mut file: &File) -> io::Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0; 256 * 1024];
    let mut bytes = 0;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok((bytes, format!("{:x}", hasher.finalize())))
}
