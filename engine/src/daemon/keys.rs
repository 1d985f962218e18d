//! crabd's keys under its root (0600 in the 0700 root, made once, written
//! whole): the host listener's HMAC key (see `host_listener`) and the
//! Ed25519 key this host signs its exports with, and the keys whose
//! exports it imports.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use ring::signature::{Ed25519KeyPair, KeyPair};

use crate::archive::{self, Signature};

/// The signing key's file under crabd's root (PKCS#8).
const SIGNING_KEY_FILE: &str = "export-signing.pk8";
/// The directory of trusted public keys under crabd's root.
pub(super) const TRUSTED_DIR: &str = "trusted-keys";

/// The bytes of secret `name` under `root`, made by `make` (and kept,
/// 0600) if there is none.
pub(super) fn load_or_create(
    root: &Path,
    name: &str,
    make: impl FnOnce() -> std::io::Result<Vec<u8>>,
) -> std::io::Result<Vec<u8>> {
    let path = root.join(name);
    match std::fs::read(&path) {
        Ok(bytes) => return Ok(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let bytes = make()?;
    // Whole or not at all: written aside, then renamed into place.
    let tmp = root.join(format!("{name}.tmp"));
    // A stale one (a crash mid-write) goes; the new one is 0600 from birth.
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(root)?.sync_all()?;
    Ok(bytes)
}

/// `N` bytes from the kernel's random source.
pub(super) fn random<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut bytes)?;
    Ok(bytes)
}

/// The Ed25519 key this host signs its exports with.
pub(super) struct SigningKey(Ed25519KeyPair);

// === impl SigningKey ===

impl SigningKey {
    /// The key under `root`, made if there is none.
    pub(super) fn load_or_create(root: &Path) -> std::io::Result<SigningKey> {
        let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
        let pkcs8 = load_or_create(root, SIGNING_KEY_FILE, || {
            Ed25519KeyPair::generate_pkcs8(&ring::rand::SystemRandom::new())
                .map(|doc| doc.as_ref().to_vec())
                .map_err(|_| invalid("no randomness for a new signing key"))
        })?;
        Ed25519KeyPair::from_pkcs8(&pkcs8).map(SigningKey).map_err(|e| {
            invalid(&format!(
                "{}: not an Ed25519 key: {e}",
                root.join(SIGNING_KEY_FILE).display()
            ))
        })
    }

    /// The public key, lower-case hex (what another host trusts).
    pub(super) fn public(&self) -> String {
        self.0
            .public_key()
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// This host's signature of `message`.
    pub(super) fn sign(&self, message: &[u8]) -> Signature {
        Signature::ed25519(self.0.public_key().as_ref(), self.0.sign(message).as_ref())
    }
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKey({})", self.public())
    }
}

/// The directory of trusted keys under `root`.
pub(super) fn trusted_dir(root: &Path) -> PathBuf {
    root.join(TRUSTED_DIR)
}

/// The most a trusted key's file may hold.
const MAX_KEY_FILE: u64 = 4096;

/// The public keys (lower-case hex) whose exports this host imports: its
/// own, and one per `*.pub` file in `<root>/trusted-keys/`, holding the key
/// as `crabctl keys` prints it (blank lines and `#` comments aside). Only
/// root's: the directory and each file must be owned by root and writable
/// by no one else, and neither may be a symlink; anything else is skipped
/// with a warning. Read at each import (blocking), so a key added or
/// removed counts at once.
pub(super) fn trusted(root: &Path, own: &SigningKey) -> Vec<String> {
    let mut keys = vec![own.public()];
    let dir = trusted_dir(root);
    match std::fs::symlink_metadata(&dir) {
        Ok(md) if md.is_dir() && roots_alone(&md) => {}
        Ok(_) => {
            tracing::warn!(dir = %dir.display(), "trusted keys ignored: not a directory of root's that only root may write");
            return keys;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return keys,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "trusted keys unreadable: only this host's own is trusted");
            return keys;
        }
    }
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return keys;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "pub") {
            continue;
        }
        match read_key(&path) {
            Ok(key) => keys.push(key),
            Err(why) => tracing::warn!(file = %path.display(), %why, "not a trusted key: skipped"),
        }
    }
    keys
}

/// The key in file `path`: a regular file of root's that only root may
/// write, opened without following a symlink (nor blocking on a fifo),
/// bounded.
fn read_key(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let md = file.metadata().map_err(|e| e.to_string())?;
    if !md.is_file() || !roots_alone(&md) {
        return Err("not a regular file of root's that only root may write".to_owned());
    }
    let mut text = String::new();
    file.take(MAX_KEY_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_KEY_FILE {
        return Err(format!("over {MAX_KEY_FILE} bytes"));
    }
    parse_key(&text).ok_or_else(|| "no key (64 hex digits) alone in it".to_owned())
}

/// Owned by root and writable by no one else.
fn roots_alone(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    md.uid() == 0 && md.mode() & 0o022 == 0
}

/// The one Ed25519 public key in `text` (64 hex digits), lower-cased.
fn parse_key(text: &str) -> Option<String> {
    let mut lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    let key = lines.next()?;
    let bytes = archive::unhex(key)?;
    (bytes.len() == 32 && lines.next().is_none()).then(|| key.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signing_key_is_kept_private_and_survives_a_reload() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let key = SigningKey::load_or_create(root.path()).unwrap();
        let mode = std::fs::metadata(root.path().join(SIGNING_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = SigningKey::load_or_create(root.path()).unwrap();
        assert_eq!(key.public(), again.public());
        assert_eq!(key.public().len(), 64);
        std::fs::write(root.path().join(SIGNING_KEY_FILE), b"garbage").unwrap();
        let e = SigningKey::load_or_create(root.path()).unwrap_err();
        assert!(e.to_string().contains("not an Ed25519 key"), "{e}");
    }

    #[test]
    fn trusted_keys_are_the_hosts_own_and_the_well_formed_files() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let own = SigningKey::load_or_create(root.path()).unwrap();
        assert_eq!(trusted(root.path(), &own), vec![own.public()]);
        let dir = trusted_dir(root.path());
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let other = "AB".repeat(32);
        std::fs::write(dir.join("ci-host.pub"), format!("# the CI host\n\n{other}\n")).unwrap();
        // Not keys: a bad one, two, another name, a link, a file others write.
        std::fs::write(dir.join("short.pub"), "abcd\n").unwrap();
        std::fs::write(dir.join("two.pub"), format!("{other}\n{other}\n")).unwrap();
        let third = "cd".repeat(32);
        std::fs::write(dir.join("old.pub.bak"), &third).unwrap();
        std::fs::write(root.path().join("elsewhere"), &third).unwrap();
        std::os::unix::fs::symlink(root.path().join("elsewhere"), dir.join("link.pub")).unwrap();
        let open = dir.join("open.pub");
        std::fs::write(&open, &third).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(
            trusted(root.path(), &own),
            vec![own.public(), other.to_ascii_lowercase()]
        );
        // A directory others may write is not trusted at all.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(trusted(root.path(), &own), vec![own.public()]);
    }
}
