//! A sandbox's manifest file (`versions.log`): reading it, appending a line,
//! rewriting it whole.
//!
//! The file is a header line and then one line per version, in increasing
//! version order (the line format is drawn in `record.rs`). Line numbers
//! count from 1 (the header) and stay stable until the next compaction.
//! Bytes after the last LF are a torn line: an append that was cut short.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::record::{self, Decoded, Header, VersionRecord};
use super::{durable, Defect, SandboxId, StoreError};

/// A manifest as read.
#[derive(Debug, Clone)]
pub(crate) struct Manifest {
    /// The header, unless missing or corrupt.
    pub header: Option<Header>,
    /// The lines after the header.
    pub lines: Vec<Line>,
    /// The bytes after the last LF, if any.
    pub torn: Option<Torn>,
}

/// One complete line after the header.
#[derive(Debug, Clone)]
pub(crate) struct Line {
    /// Its number in the file, from 1.
    pub number: u64,
    /// Its bytes, without the LF.
    pub raw: Vec<u8>,
    /// What it holds.
    pub entry: Entry,
}

/// What a line holds.
#[derive(Debug, Clone)]
pub(crate) enum Entry {
    /// An intact version record.
    Version(VersionRecord),
    /// A line that is not an intact record of this sandbox.
    Bad(Defect),
}

/// A torn last line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Torn {
    /// The offset of its first byte.
    pub offset: u64,
    /// Its length.
    pub bytes: u64,
    /// The line number it would have had.
    pub number: u64,
}

/// Where a version number is in a manifest.
#[derive(Debug)]
pub(crate) enum Lookup<'a> {
    /// On an intact line.
    Found(&'a VersionRecord),
    /// Maybe on this bad line: it sits between the intact neighbours that
    /// bound the number.
    Bad { defect: &'a Defect },
    /// Nowhere.
    Unknown,
}

// === impl Manifest ===

impl Manifest {
    /// Reads the manifest at `path` of `sandbox`.
    pub(crate) fn read(path: &Path, sandbox: &SandboxId) -> Result<Manifest, StoreError> {
        let bytes = fs::read(path).map_err(StoreError::io("read manifest", path))?;
        Ok(Manifest::parse(&bytes, sandbox))
    }

    /// Parses manifest bytes.
    pub(crate) fn parse(bytes: &[u8], sandbox: &SandboxId) -> Manifest {
        let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let body = match complete {
            0 => &[][..],
            n => &bytes[..n - 1],
        };
        let mut header = None;
        let mut lines: Vec<Line> = Vec::new();
        let mut newest = 0;
        for (idx, raw) in body.split(|&b| b == b'\n').enumerate().filter(|_| complete > 0) {
            let number = idx as u64 + 1;
            let entry = match record::decode(raw) {
                Decoded::Header(h) if number == 1 && h.sandbox == *sandbox => {
                    header = Some(h);
                    continue;
                }
                Decoded::Header(h) if h.sandbox != *sandbox => Entry::Bad(Defect::NotOfSandbox {
                    line: number,
                    found: h.sandbox.to_string(),
                }),
                Decoded::Version(r) if r.sandbox != *sandbox => Entry::Bad(Defect::NotOfSandbox {
                    line: number,
                    found: r.sandbox.to_string(),
                }),
                // Invariant: intact versions are in increasing order; a line
                // that breaks it was not written by this store.
                Decoded::Version(r) if r.version <= newest => {
                    Entry::Bad(Defect::CorruptLine { line: number })
                }
                Decoded::Version(r) => {
                    newest = r.version;
                    Entry::Version(r)
                }
                Decoded::Header(_) | Decoded::Corrupt => Entry::Bad(Defect::CorruptLine { line: number }),
            };
            lines.push(Line {
                number,
                raw: raw.to_vec(),
                entry,
            });
        }
        let torn = (complete < bytes.len()).then(|| Torn {
            offset: complete as u64,
            bytes: (bytes.len() - complete) as u64,
            number: count_lines(&bytes[..complete]) as u64 + 1,
        });
        Manifest { header, lines, torn }
    }

    /// The intact version records, oldest first.
    pub(crate) fn records(&self) -> impl DoubleEndedIterator<Item = &VersionRecord> {
        self.lines.iter().filter_map(|l| match &l.entry {
            Entry::Version(r) => Some(r),
            Entry::Bad(_) => None,
        })
    }

    /// Where `version` is.
    pub(crate) fn lookup(&self, version: u64) -> Lookup<'_> {
        for (idx, line) in self.lines.iter().enumerate() {
            match &line.entry {
                Entry::Version(r) if r.version == version => return Lookup::Found(r),
                Entry::Version(_) => {}
                Entry::Bad(defect) => {
                    if self.bounds(idx).contains(&version) {
                        return Lookup::Bad { defect };
                    }
                }
            }
        }
        Lookup::Unknown
    }

    /// The version numbers the bad line at `idx` may hold: strictly between
    /// its intact neighbours', and below [`Manifest::next_version`].
    pub(crate) fn bounds(&self, idx: usize) -> std::ops::Range<u64> {
        let below = self.lines[..idx]
            .iter()
            .rev()
            .find_map(intact_version)
            .unwrap_or(0);
        let above = self.lines[idx + 1..].iter().find_map(intact_version);
        below + 1..above.unwrap_or_else(|| self.next_version())
    }

    /// Whether directory `images/<sandbox>/<n>` may be named by a line: an
    /// intact record uses it as its process image, or a bad line may.
    pub(crate) fn claims_images(&self, n: u64) -> bool {
        self.records().any(|r| r.process_image == Some(n))
            || self
                .lines
                .iter()
                .enumerate()
                .any(|(idx, l)| matches!(l.entry, Entry::Bad(_)) && self.bounds(idx).contains(&n))
    }

    /// The lowest number no line can hold.
    ///
    /// Invariant: this store gives out numbers one by one, so each bad line
    /// after the newest intact one holds at most one more.
    pub(crate) fn next_version(&self) -> u64 {
        let newest_intact = self
            .lines
            .iter()
            .rev()
            .position(|l| matches!(l.entry, Entry::Version(_)));
        let (intact, n_bad_after) = match newest_intact {
            Some(n_after) => (self.records().next_back().map_or(0, |r| r.version), n_after),
            None => (0, self.lines.len()),
        };
        let from_header = self.header.as_ref().map_or(1, |h| h.next_version);
        from_header.max(intact + 1 + n_bad_after as u64)
    }

    /// The newest line.
    pub(crate) fn last(&self) -> Option<&Line> {
        self.lines.last()
    }
}

fn intact_version(line: &Line) -> Option<u64> {
    match &line.entry {
        Entry::Version(r) => Some(r.version),
        Entry::Bad(_) => None,
    }
}

fn count_lines(complete: &[u8]) -> usize {
    complete.iter().filter(|&&b| b == b'\n').count()
}

/// Appends `line` (LF included) to the manifest at `path` and fsyncs it.
///
/// On failure the file is cut back to its old length.
///
/// Invariant: a line is only appended after a LF (or to an empty file), so
/// a failed append whose cut-back failed too is never glued to the next
/// line; opening the store again cuts it off.
pub(crate) fn append(path: &Path, line: &[u8]) -> Result<(), StoreError> {
    let mut file = OpenOptions::new()
        .read(true)
        .append(true)
        .open(path)
        .map_err(StoreError::io("open manifest", path))?;
    let old_len = file
        .metadata()
        .map_err(StoreError::io("stat manifest", path))?
        .len();
    if old_len > 0 {
        let mut last = [0];
        file.read_exact_at(&mut last, old_len - 1)
            .map_err(StoreError::io("read manifest", path))?;
        if last != *b"\n" {
            return Err(StoreError::PartialLine {
                path: path.to_owned(),
            });
        }
    }
    let written = write_line(&mut file, line).and_then(|()| file.sync_all());
    if let Err(source) = written {
        if let Err(e) = file.set_len(old_len).and_then(|()| file.sync_all()) {
            tracing::error!(path = %path.display(), error = %e, "cannot cut a failed append off the manifest");
        }
        return Err(StoreError::Io {
            op: "append to manifest",
            path: path.to_owned(),
            source,
        });
    }
    super::crash_point("line-synced");
    Ok(())
}

/// Writes `line` in one `write_all`; tests stop half-way.
fn write_line(file: &mut fs::File, line: &[u8]) -> std::io::Result<()> {
    #[cfg(test)]
    if super::stops_at("line-half-written") {
        let (head, _) = line.split_at(line.len() / 2);
        file.write_all(head)?;
        super::crash_point("line-half-written");
    }
    file.write_all(line)
}

/// Cuts a torn line off the manifest at `path`.
pub(crate) fn cut_torn(path: &Path, torn: Torn) -> Result<(), StoreError> {
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(StoreError::io("open manifest", path))?;
    file.set_len(torn.offset)
        .and_then(|()| file.sync_all())
        .map_err(StoreError::io("cut torn line off", path))
}

/// Writes a new manifest of `header` and `lines` over `path`, atomically.
pub(crate) fn rewrite<'a>(
    path: &Path,
    header: &Header,
    lines: impl IntoIterator<Item = &'a Line>,
) -> Result<(), StoreError> {
    let mut bytes = record::encode_header(header)?;
    for line in lines {
        bytes.extend_from_slice(&line.raw);
        bytes.push(b'\n');
    }
    durable::replace_file(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::record::{Class, VersionRecord};

    /// Builds a manifest from `spec` words: `h<n>` a header with next
    /// version n, `v<n>` version n holding its own images, `u<n>:<h>`
    /// version n using h's images, `x` a corrupt line, `t` a torn tail.
    fn build(spec: &str) -> Vec<u8> {
        let s1 = SandboxId::new("s1").unwrap();
        let record = |version: u64, holder: u64| VersionRecord {
            sandbox: s1.clone(),
            version,
            created_unix_ms: 0,
            turn: None,
            branch: 0,
            class: Class::Proc,
            parent: None,
            process_image: Some(holder),
            fs_snapshot: None,
            transcript_turns: 0,
            images: Vec::new(),
        };
        let mut bytes = Vec::new();
        for word in spec.split_whitespace() {
            let (kind, arg) = word.split_at(1);
            match kind {
                "h" => bytes.extend(
                    record::encode_header(&Header {
                        sandbox: s1.clone(),
                        next_version: arg.parse().unwrap(),
                    })
                    .unwrap(),
                ),
                "v" => {
                    let v = arg.parse().unwrap();
                    bytes.extend(record::encode_version(&record(v, v)).unwrap());
                }
                "u" => {
                    let (v, h) = arg.split_once(':').unwrap();
                    bytes.extend(
                        record::encode_version(&record(v.parse().unwrap(), h.parse().unwrap())).unwrap(),
                    );
                }
                "x" => bytes.extend(b"0123 not a line\n"),
                "t" => bytes.extend(b"abc"),
                _ => panic!("bad spec word {word:?}"),
            }
        }
        bytes
    }

    /// Checks the next version, where versions 1..=9 are found (`f`, `b`
    /// for a bad line, `-` for nowhere), which images directories 1..=9 are
    /// claimed, and the torn tail's line number.
    fn check(spec: &str, next: u64, found: &str, claimed: &str, torn: Option<u64>) {
        let m = Manifest::parse(&build(spec), &SandboxId::new("s1").unwrap());
        let got_found: String = (1..=9)
            .map(|v| match m.lookup(v) {
                Lookup::Found(_) => 'f',
                Lookup::Bad { .. } => 'b',
                Lookup::Unknown => '-',
            })
            .collect();
        let got_claimed: String = (1..=9)
            .map(|n| if m.claims_images(n) { 'c' } else { '-' })
            .collect();
        assert_eq!(m.next_version(), next, "next, {spec:?}");
        assert_eq!(got_found, found, "found, {spec:?}");
        assert_eq!(got_claimed, claimed, "claimed, {spec:?}");
        assert_eq!(m.torn.map(|t| t.number), torn, "torn, {spec:?}");
    }

    #[test]
    fn manifests() {
        check("", 1, "---------", "---------", None);
        check("t", 1, "---------", "---------", Some(1));
        check("h1", 1, "---------", "---------", None);
        check("h1 v1 u2:1 v3", 4, "fff------", "c-c------", None);
        check("h1 v1 u2:1 v3 t", 4, "fff------", "c-c------", Some(5));
        // Bad lines hold the numbers between their intact neighbours, and
        // each trailing one holds one more.
        check("h1 v1 x v3", 4, "fbf------", "ccc------", None);
        check("h1 v1 x x", 4, "fbb------", "ccc------", None);
        check("h1 x v2", 3, "bf-------", "cc-------", None);
        // The header keeps the high mark after the newest were removed.
        check("h7 v1 v3", 7, "f-f------", "c-c------", None);
        check("h7 v1 x", 7, "fbbbbb---", "cccccc---", None);
        // Out of order and misplaced headers are bad lines.
        check("h1 v2 v2", 4, "-fb------", "-cc------", None);
        check("h1 v1 h5", 3, "fb-------", "cc-------", None);
    }
}
