//! Reading versions back: listing them with their validity, getting one
//! verified, finding the newest valid one.

use std::collections::HashMap;
use std::path::PathBuf;

use super::images::{self, Depth};
use super::manifest::{Entry, Lookup, Manifest};
use super::record::VersionRecord;
use super::{Defect, Inner, SandboxId, StoreError, VersionStore};

/// A manifest line as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionInfo {
    /// The line, from 1 (line numbers change at compaction).
    pub line: u64,
    /// The version's record, unless the line is corrupt or foreign.
    pub record: Option<VersionRecord>,
    /// Why the version cannot be restored, if it cannot.
    pub defect: Option<Defect>,
}

/// A verified version: its record, and where its process image is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// Its record.
    pub record: VersionRecord,
    /// The images directory holding its process image (its own or an older
    /// version's), if it has one.
    pub images_dir: Option<PathBuf>,
}

// === impl VersionInfo ===

impl VersionInfo {
    /// Whether the version can be restored.
    pub fn is_valid(&self) -> bool {
        self.defect.is_none()
    }
}

// === impl VersionStore ===

impl VersionStore {
    /// Every manifest line of `sandbox`, oldest first, with its validity:
    /// checksums, dependencies, and the presence and size of image files.
    /// Image contents are not hashed; see [`VersionStore::verified_versions`].
    pub fn versions(&self, sandbox: &SandboxId) -> Result<Vec<VersionInfo>, StoreError> {
        self.list(sandbox, Depth::Sizes)
    }

    /// Like [`VersionStore::versions`], re-hashing every image file.
    pub fn verified_versions(&self, sandbox: &SandboxId) -> Result<Vec<VersionInfo>, StoreError> {
        self.list(sandbox, Depth::Hashes)
    }

    /// Version `version` of `sandbox`, after checking its manifest line and
    /// re-hashing its process image files.
    ///
    /// # Errors
    /// [`StoreError::UnknownSandbox`], [`StoreError::UnknownVersion`],
    /// [`StoreError::CorruptManifestLine`] (the line that may hold it is
    /// corrupt), [`StoreError::NotOfSandbox`], [`StoreError::MissingImage`],
    /// [`StoreError::CorruptImage`] (naming the version that holds the
    /// image), [`StoreError::MissingDependency`].
    pub fn get(&self, sandbox: &SandboxId, version: u64) -> Result<Version, StoreError> {
        let m = self.inner.manifest_of(sandbox)?;
        let record = match m.lookup(version) {
            Lookup::Found(r) => r,
            Lookup::Bad { defect } => return Err(StoreError::from_defect(sandbox, version, defect)),
            Lookup::Unknown => {
                return Err(StoreError::UnknownVersion {
                    sandbox: sandbox.clone(),
                    version,
                })
            }
        };
        let mut checker = Checker::new(&self.inner, sandbox, &m, Depth::Hashes);
        match checker.check(record) {
            Ok(()) => Ok(self.inner.version_of(sandbox, record)),
            Err(defect) => Err(StoreError::from_defect(sandbox, version, &defect)),
        }
    }

    /// The manifest record of version `version` of `sandbox`, unchecked
    /// beyond its line's checksum (None when no intact line holds it).
    ///
    /// # Errors
    /// [`StoreError::UnknownSandbox`], or the manifest cannot be read.
    pub fn record(&self, sandbox: &SandboxId, version: u64) -> Result<Option<VersionRecord>, StoreError> {
        let m = self.inner.manifest_of(sandbox)?;
        Ok(match m.lookup(version) {
            Lookup::Found(r) => Some(r.clone()),
            Lookup::Bad { .. } | Lookup::Unknown => None,
        })
    }

    /// The newest version of `sandbox` that [`VersionStore::get`] accepts.
    ///
    /// # Errors
    /// [`StoreError::NoValidVersion`] when none is.
    pub fn latest_valid(&self, sandbox: &SandboxId) -> Result<Version, StoreError> {
        Ok(self.latest_valid_passing(sandbox)?.0)
    }

    /// Like [`VersionStore::latest_valid`], with the errors of the newer
    /// versions passed over, newest first.
    ///
    /// # Errors
    /// [`StoreError::NoValidVersion`] when no version is valid.
    pub fn latest_valid_passing(
        &self,
        sandbox: &SandboxId,
    ) -> Result<(Version, Vec<StoreError>), StoreError> {
        let m = self.inner.manifest_of(sandbox)?;
        let mut checker = Checker::new(&self.inner, sandbox, &m, Depth::Hashes);
        let mut passed = Vec::new();
        for record in m.records().rev() {
            match checker.check(record) {
                Ok(()) => return Ok((self.inner.version_of(sandbox, record), passed)),
                Err(defect) => {
                    tracing::warn!(sandbox = %sandbox, version = record.version, ?defect, "version not valid, trying an older one");
                    passed.push(StoreError::from_defect(sandbox, record.version, &defect));
                }
            }
        }
        Err(StoreError::NoValidVersion {
            sandbox: sandbox.clone(),
        })
    }

    /// Version `version` of `sandbox` if [`VersionStore::get`] accepts it,
    /// else its nearest ancestor that it accepts (a corrupt head falls back
    /// to its parent), with the errors of the versions passed over, newest
    /// first.
    ///
    /// # Errors
    /// [`StoreError::UnknownVersion`] when no intact line holds `version`;
    /// [`StoreError::NoValidVersion`] when neither it nor an ancestor is
    /// valid.
    pub fn nearest_valid(
        &self,
        sandbox: &SandboxId,
        version: u64,
    ) -> Result<(Version, Vec<StoreError>), StoreError> {
        let m = self.inner.manifest_of(sandbox)?;
        let mut checker = Checker::new(&self.inner, sandbox, &m, Depth::Hashes);
        let mut passed = Vec::new();
        let mut next = Some(version);
        while let Some(n) = next {
            let record = match m.lookup(n) {
                Lookup::Found(r) => r,
                Lookup::Bad { defect } => {
                    passed.push(StoreError::from_defect(sandbox, n, defect));
                    break;
                }
                Lookup::Unknown if n == version => {
                    return Err(StoreError::UnknownVersion {
                        sandbox: sandbox.clone(),
                        version,
                    })
                }
                // Its parent was removed (retention): no older one to try.
                Lookup::Unknown => break,
            };
            match checker.check(record) {
                Ok(()) => return Ok((self.inner.version_of(sandbox, record), passed)),
                Err(defect) => {
                    tracing::warn!(sandbox = %sandbox, version = n, ?defect, "version not valid, trying its parent");
                    passed.push(StoreError::from_defect(sandbox, n, &defect));
                    next = record.parent;
                }
            }
        }
        Err(StoreError::NoValidVersion {
            sandbox: sandbox.clone(),
        })
    }

    fn list(&self, sandbox: &SandboxId, depth: Depth) -> Result<Vec<VersionInfo>, StoreError> {
        let m = self.inner.manifest_of(sandbox)?;
        let mut checker = Checker::new(&self.inner, sandbox, &m, depth);
        Ok(m.lines
            .iter()
            .map(|line| match &line.entry {
                Entry::Version(r) => VersionInfo {
                    line: line.number,
                    record: Some(r.clone()),
                    defect: checker.check(r).err(),
                },
                Entry::Bad(defect) => VersionInfo {
                    line: line.number,
                    record: None,
                    defect: Some(defect.clone()),
                },
            })
            .collect())
    }
}

// === impl Inner ===

impl Inner {
    /// The manifest of `sandbox`, read under its lock (so no append or
    /// compaction is half-way).
    fn manifest_of(&self, sandbox: &SandboxId) -> Result<Manifest, StoreError> {
        let state = self.sandbox(sandbox)?;
        let _guard = state.lock();
        self.read_manifest(sandbox)
    }

    fn version_of(&self, sandbox: &SandboxId, record: &VersionRecord) -> Version {
        Version {
            record: record.clone(),
            images_dir: record.process_image.map(|h| self.images_dir(sandbox, h)),
        }
    }
}

/// Checks versions of one manifest, each process image once.
struct Checker<'a> {
    inner: &'a Inner,
    sandbox: &'a SandboxId,
    manifest: &'a Manifest,
    depth: Depth,
    /// Results per holder.
    holders: HashMap<u64, Result<(), Defect>>,
}

// === impl Checker ===

impl<'a> Checker<'a> {
    fn new(inner: &'a Inner, sandbox: &'a SandboxId, manifest: &'a Manifest, depth: Depth) -> Self {
        Checker {
            inner,
            sandbox,
            manifest,
            depth,
            holders: HashMap::new(),
        }
    }

    /// Whether `record` (an intact line) can be restored: the process image
    /// it uses is named by an intact line and matches it.
    fn check(&mut self, record: &VersionRecord) -> Result<(), Defect> {
        let Some(holder) = record.process_image else {
            return Ok(());
        };
        if let Some(result) = self.holders.get(&holder) {
            return result.clone();
        }
        let result = match self.manifest.lookup(holder) {
            Lookup::Found(h) if h.holds_images() => {
                let dir = self.inner.images_dir(self.sandbox, holder);
                images::check(&dir, holder, &h.images, self.depth)
            }
            Lookup::Found(_) | Lookup::Unknown => Err(Defect::MissingDependency { holder }),
            Lookup::Bad { defect } => Err(defect.clone()),
        };
        self.holders.insert(holder, result.clone());
        result
    }
}
