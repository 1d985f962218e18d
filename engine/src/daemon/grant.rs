//! Grants of restores ([`crab_api::shim::RestoreGrant`]): before it has a
//! shim restore a container's init (a fork, an import, a resume), crabd
//! writes the grant under its root and names its token in the container's
//! annotations; the shim restores only with a grant that names its
//! container, namespace and images. The grant goes when its start is over.

use std::path::{Path, PathBuf};

use crab_api::shim::RestoreGrant;
use crab_api::SandboxId;

use super::{host_listener, ApiError};

/// A grant on disk, removed when dropped.
#[derive(Debug)]
pub(super) struct Grant {
    path: PathBuf,
    token: String,
}

impl Grant {
    /// Grants the shim of container `sandbox` in `namespace` the restore of
    /// `images`, under crabd's `root`.
    pub(super) fn write(
        root: &Path,
        sandbox: &SandboxId,
        namespace: &str,
        images: &Path,
    ) -> Result<Grant, ApiError> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let io = |op| move |source| ApiError::Io { op, source };
        let token = host_listener::nonce().map_err(io("read /dev/urandom"))?;
        let path = RestoreGrant::path(root, &token).expect("a nonce is a token");
        let dir = path.parent().expect("a grant has a directory");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io("create the grants' directory"))?;
        let grant = RestoreGrant {
            sandbox: sandbox.as_str().to_owned(),
            namespace: namespace.to_owned(),
            images: images.to_owned(),
        };
        let bytes = serde_json::to_vec(&grant).expect("a grant serializes");
        // A new name: a file of that name cannot be there to follow.
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(&bytes))
            .map_err(io("write a restore grant"))?;
        Ok(Grant { path, token })
    }

    /// The token the container's annotations name.
    pub(super) fn token(&self) -> &str {
        &self.token
    }
}

impl super::Daemon {
    /// [`Grant::write`] under crabd's root, off the runtime.
    pub(super) async fn grant_restore(
        &self,
        sandbox: &SandboxId,
        namespace: &str,
        images: &Path,
    ) -> Result<Grant, ApiError> {
        let (root, sandbox, namespace, images) = (
            self.config.root.clone(),
            sandbox.clone(),
            namespace.to_owned(),
            images.to_owned(),
        );
        super::work::blocking_io(move || Grant::write(&root, &sandbox, &namespace, &images)).await
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            // The shim took it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %self.path.display(), error = %e, "a restore grant stays"),
        }
    }
}
