//! Host-wide exclusive locks: a file under a root-only directory in
//! `/run/crab`, locked with `flock`, released when its holder drops it or
//! dies.

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use nix::fcntl::{Flock, FlockArg, OFlag};

use crate::{Error, Result};

/// Locks `path` exclusively, waiting for its holder; makes its directory
/// (0700) and the file (0600) when absent, and never follows a symlink.
///
/// # Errors
/// [`Error::Io`] when the directory or file cannot be made or locked.
pub(crate) fn lock(path: &Path) -> Result<Flock<std::fs::File>> {
    Flock::lock(open(path)?, FlockArg::LockExclusive).map_err(|(_, e)| Error::io("lock", path)(e.into()))
}

/// As [`lock`], without waiting: `None` while another holds it.
///
/// # Errors
/// As [`lock`].
pub(crate) fn try_lock(path: &Path) -> Result<Option<Flock<std::fs::File>>> {
    match Flock::lock(open(path)?, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(Error::io("lock", path)(e.into())),
    }
}

fn open(path: &Path) -> Result<std::fs::File> {
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(Error::io("create", dir))?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(Error::io("open", path))
}
