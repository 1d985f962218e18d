//! Room for checkpoints: a floor of free space on the filesystem of
//! crabd's root (`[crabd] store_min_free_bytes`), and a ceiling on what one
//! sandbox's versions hold there (`[crabd] sandbox_store_max_bytes`). A
//! capture is refused while either is passed: the sandbox runs on, and the
//! error says which limit and how to make room. Checked before each
//! capture a person, a turn or a files-only rollback asks for (a person's
//! before it queues, a rollback's before it touches a file), so one
//! version may overrun the
//! ceiling by its own size; a drain is not held to them (the host is going
//! away: only a full disk stops it).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crab_api::{Class, SandboxId};

use super::work::blocking_io;
use super::{ApiError, Daemon};

// === impl Daemon ===

impl Daemon {
    /// Whether the store has room for another version of sandbox `id` of
    /// `class` (a `none` version is a manifest line: always).
    pub(super) async fn room_for_capture(&self, id: &SandboxId, class: Class) -> Result<(), ApiError> {
        let floor = self.config.store_min_free_bytes;
        let ceiling = self.config.sandbox_store_max_bytes;
        if class == Class::None || (floor == 0 && ceiling == 0) {
            return Ok(());
        }
        let root = self.config.root.clone();
        let dirs = [self.store.images_of(id), self.files.store_dir(id)];
        let (free, used) = blocking_io(move || {
            let free = match floor {
                0 => None,
                _ => Some(free_bytes(&root).map_err(|source| ApiError::Io {
                    op: "measure the free space of the checkpoint store",
                    source,
                })?),
            };
            let used = match ceiling {
                0 => None,
                _ => Some(allocated(&dirs).map_err(|source| ApiError::Io {
                    op: "measure the sandbox's checkpoint store",
                    source,
                })?),
            };
            Ok((free, used))
        })
        .await?;
        let why = match (free, used) {
            (Some(free), _) if free < floor => format!(
                "the checkpoint store's filesystem has {} free, under [crabd] store_min_free_bytes ({})",
                mib(free),
                mib(floor)
            ),
            (_, Some(used)) if used >= ceiling => format!(
                "its versions take {}, at or over [crabd] sandbox_store_max_bytes ({})",
                mib(used),
                mib(ceiling)
            ),
            _ => return Ok(()),
        };
        self.metrics.store_full.inc();
        Err(ApiError::StoreFull { id: id.clone(), why })
    }
}

/// Bytes a non-root user could still write on the filesystem of `path`.
pub(super) fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(path)?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// Bytes allocated on disk to the files under `dirs` (holes take none; a
/// file linked twice counts once); a directory that is not there, none.
/// Never follows a symlink.
fn allocated(dirs: &[std::path::PathBuf]) -> std::io::Result<u64> {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    let mut todo: Vec<std::path::PathBuf> = dirs.to_vec();
    while let Some(dir) = todo.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let md = match entry.metadata() {
                Ok(md) => md,
                // Removed meanwhile (gc, retention): it takes nothing now.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            if md.is_dir() {
                todo.push(entry.path());
            }
            if seen.insert((md.dev(), md.ino())) {
                total += md.blocks() * 512;
            }
        }
    }
    Ok(total)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocated_counts_blocks_once_and_holes_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let base = allocated(&[dir.path().to_owned()]).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let data = dir.path().join("sub/data");
        std::fs::write(&data, vec![7u8; 1 << 20]).unwrap();
        std::fs::hard_link(&data, dir.path().join("again")).unwrap();
        // 1 GiB of hole.
        std::fs::File::create(dir.path().join("sparse"))
            .unwrap()
            .set_len(1 << 30)
            .unwrap();
        std::os::unix::fs::symlink("/usr", dir.path().join("link")).unwrap();
        let used = allocated(&[dir.path().to_owned(), dir.path().join("missing")]).unwrap() - base;
        assert!((1 << 20..(1 << 20) + (64 << 10)).contains(&used), "{used}");
    }
}
