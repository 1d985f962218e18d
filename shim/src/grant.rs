//! A restore asked for by a container's annotations happens only with
//! crabd's grant of it ([`crab_api::shim::RestoreGrant`]): anyone who can
//! set annotations (a docker user, a pod spec) could otherwise have this
//! root shim restore any directory, another sandbox's process images, into
//! their container. The grant is taken (removed) as it is checked, so it
//! serves one restore.

use std::collections::HashMap;
use std::path::Path;

use crab_api::shim::{RestoreGrant, RESTORE_TOKEN_ANNOTATION};

use crate::error::{Error, Result};

/// Takes crabd's grant (under its `root`) of container `id` in `namespace`
/// restoring `images`, as `annotations` name it.
///
/// # Errors
/// [`Error::RestoreNotGranted`], saying why.
pub fn take(
    root: &Path,
    annotations: Option<&HashMap<String, String>>,
    id: &str,
    namespace: &str,
    images: &Path,
) -> Result<()> {
    let refuse = |reason: &str| Error::RestoreNotGranted {
        id: id.to_owned(),
        reason: reason.to_owned(),
    };
    let token = annotations
        .and_then(|a| a.get(RESTORE_TOKEN_ANNOTATION))
        .ok_or_else(|| refuse("no grant token (only crabd starts restores: crabctl resume, fork, import)"))?;
    let path = RestoreGrant::path(root, token).ok_or_else(|| refuse("the grant token is malformed"))?;
    // Read with no symlink followed, checked, then removed: one restore
    // per grant, and a wrong claim leaves crabd's grant where it is.
    let bytes = read_nofollow(&path).map_err(|_| refuse("crabd holds no grant with this token"))?;
    let grant: RestoreGrant = serde_json::from_slice(&bytes).map_err(|_| refuse("the grant is corrupt"))?;
    if grant.sandbox != id || grant.namespace != namespace || grant.images != images {
        return Err(refuse("the grant is for another container or process image"));
    }
    std::fs::remove_file(&path).map_err(|_| refuse("the grant was taken already"))
}

/// The contents of the regular file `path` (a few KiB at most), its last
/// component not followed if it is a symlink.
fn read_nofollow(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(64 << 10).read_to_end(&mut bytes)?;
    Ok(bytes)
}
