//! The class of a turn: what its net, lasting effects need.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What a turn's net, lasting effects need (DESIGN.md, "class").
///
/// Ordered by cost: `Full` is `Fs` and `Proc` together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// Nothing: the version reuses the process image and the filesystem
    /// snapshot of the version it descends from.
    None,
    /// A new filesystem snapshot; the process image is reused.
    Fs,
    /// A new process image; the filesystem snapshot is reused.
    Proc,
    /// A new filesystem snapshot and a new process image.
    Full,
}

/// A string that names no [`Class`].
#[derive(Debug, thiserror::Error)]
#[error("invalid class {text:?}: one of none, fs, proc, full")]
pub struct InvalidClass {
    /// The text given.
    pub text: String,
}

// === impl Class ===

impl Class {
    /// Its name on the wire and in tables.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::None => "none",
            Class::Fs => "fs",
            Class::Proc => "proc",
            Class::Full => "full",
        }
    }

    /// The class of a turn that changed the filesystem (`fs`) and/or
    /// processes (`proc`).
    pub fn of(fs: bool, proc: bool) -> Class {
        match (fs, proc) {
            (false, false) => Class::None,
            (true, false) => Class::Fs,
            (false, true) => Class::Proc,
            (true, true) => Class::Full,
        }
    }

    /// Whether saving `self` also saves everything `other` needs.
    pub fn covers(self, other: Class) -> bool {
        (self.needs_fs() || !other.needs_fs()) && (self.needs_proc() || !other.needs_proc())
    }

    /// The smallest class that covers both `self` and `other` (two turns
    /// saved by one version).
    pub fn union(self, other: Class) -> Class {
        Class::of(
            self.needs_fs() || other.needs_fs(),
            self.needs_proc() || other.needs_proc(),
        )
    }

    /// Whether a version of this class takes a filesystem snapshot.
    pub fn needs_fs(self) -> bool {
        matches!(self, Class::Fs | Class::Full)
    }

    /// Whether a version of this class dumps the processes.
    pub fn needs_proc(self) -> bool {
        matches!(self, Class::Proc | Class::Full)
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Class {
    type Err = InvalidClass;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Class::None, Class::Fs, Class::Proc, Class::Full]
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| InvalidClass { text: s.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_union_covers_both_and_no_more() {
        let all = [Class::None, Class::Fs, Class::Proc, Class::Full];
        for a in all {
            for b in all {
                let u = a.union(b);
                assert!(u.covers(a) && u.covers(b), "{a} {b}");
                assert!(
                    all.iter()
                        .filter(|c| c.covers(a) && c.covers(b))
                        .all(|c| c.covers(u)),
                    "{a} {b}"
                );
            }
        }
        assert_eq!(Class::Fs.union(Class::Proc), Class::Full);
    }

    #[test]
    fn names_round_trip_as_text_and_json() {
        for class in [Class::None, Class::Fs, Class::Proc, Class::Full] {
            assert_eq!(class.as_str().parse::<Class>().unwrap(), class);
            let json = serde_json::to_string(&class).unwrap();
            assert_eq!(json, format!("\"{class}\""));
        }
        assert!("FULL".parse::<Class>().is_err());
    }
}
