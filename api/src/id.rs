//! Sandbox ids: the one name that reaches paths (manifests, transcripts,
//! snapshot stores) and URLs (`/v1/sandboxes/<id>`, `/s/<id>/…`), so it is
//! validated once, at the edge where it enters, and carried typed after.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A validated sandbox id: 1–76 ASCII letters, digits, `.`, `_` or `-`,
/// starting with a letter or a digit (so never `.`, `..`, a hidden name or
/// a flag), hence one safe path component.
///
/// 76 covers containerd ids (64 hex digits) with room for a prefix. An id
/// names exactly one sandbox: machines (shims, crabd) pass ids, never
/// prefixes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SandboxId(String);

/// What a person typed to name a sandbox: its whole id or a unique prefix
/// of one. crabd resolves it on the routes people use (`crabctl`); a
/// selector is never an id until crabd has resolved it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SandboxSelector(String);

/// A string that is not a valid [`SandboxId`].
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid sandbox id {id:?}: use 1-76 letters, digits, '.', '_' or '-', starting with a letter or digit"
)]
pub struct InvalidSandboxId {
    /// The id given.
    pub id: String,
}

/// A string that no [`SandboxSelector`] can be: it could match no
/// sandbox, since no valid id starts with it.
#[derive(Debug, thiserror::Error)]
#[error(
    "no sandbox matches {sel:?}: sandbox ids are 1-76 letters, digits, '.', '_' or '-', starting with a letter or digit"
)]
pub struct InvalidSelector {
    /// The text given.
    pub sel: String,
}

/// Longest id accepted; the same bound the shim puts on container ids.
const MAX_LEN: usize = 76;

fn well_formed(id: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let starts_ok = id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    starts_ok && id.len() <= MAX_LEN && id.chars().all(ok_char)
}

// === impl SandboxId ===

impl SandboxId {
    /// Validates `id`.
    ///
    /// # Errors
    /// [`InvalidSandboxId`] when `id` is empty, too long, or holds anything
    /// but ASCII letters, digits, `.`, `_`, `-`, or starts with `.`, `_`, `-`.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidSandboxId> {
        let id = id.into();
        if !well_formed(&id) {
            return Err(InvalidSandboxId { id });
        }
        Ok(Self(id))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for SandboxId {
    type Err = InvalidSandboxId;
    fn from_str(s: &str) -> Result<Self, InvalidSandboxId> {
        SandboxId::new(s)
    }
}

impl TryFrom<String> for SandboxId {
    type Error = InvalidSandboxId;
    fn try_from(s: String) -> Result<Self, InvalidSandboxId> {
        SandboxId::new(s)
    }
}

impl From<SandboxId> for String {
    fn from(id: SandboxId) -> String {
        id.0
    }
}

impl AsRef<str> for SandboxId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

// === impl SandboxSelector ===

/// The mark of an exact selector.
const EXACT: char = '=';

impl SandboxSelector {
    /// Validates `sel` by the id rule (a prefix of a valid id is one too).
    ///
    /// # Errors
    /// [`InvalidSelector`].
    pub fn new(sel: impl Into<String>) -> Result<Self, InvalidSelector> {
        let sel = sel.into();
        if !well_formed(sel.strip_prefix(EXACT).unwrap_or(&sel)) {
            return Err(InvalidSelector { sel });
        }
        Ok(Self(sel))
    }

    /// The selector of `id` and no other (written `=<id>`): what a program
    /// acting for one sandbox sends, so that a gone sandbox never resolves
    /// to another whose id it begins.
    pub fn exact(id: &SandboxId) -> Self {
        Self(format!("{EXACT}{id}"))
    }

    /// Whether `id` is the sandbox this selects, or one of its candidates.
    pub fn matches(&self, id: &SandboxId) -> bool {
        match self.0.strip_prefix(EXACT) {
            Some(exact) => id.as_str() == exact,
            None => id.as_str().starts_with(&self.0),
        }
    }

    /// Whether it is `id` exactly (an exact id wins over longer ones it
    /// is a prefix of).
    pub fn is_exactly(&self, id: &SandboxId) -> bool {
        id.as_str() == self.0.strip_prefix(EXACT).unwrap_or(&self.0)
    }

    /// The text typed.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for SandboxSelector {
    type Err = InvalidSelector;
    fn from_str(s: &str) -> Result<Self, InvalidSelector> {
        SandboxSelector::new(s)
    }
}

impl From<SandboxId> for SandboxSelector {
    fn from(id: SandboxId) -> Self {
        SandboxSelector(id.0)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn check(id: &str, valid: bool) {
        assert_eq!(SandboxId::new(id).is_ok(), valid, "{id:?}");
        assert_eq!(SandboxSelector::new(id).is_ok(), valid, "{id:?}");
    }

    #[test]
    fn an_exact_selector_matches_its_id_only() {
        let (a, ab) = (SandboxId::new("a").unwrap(), SandboxId::new("ab").unwrap());
        let exact = SandboxSelector::exact(&a);
        assert_eq!(exact.to_string(), "=a");
        assert_eq!(exact.to_string().parse::<SandboxSelector>().unwrap(), exact);
        assert!(exact.matches(&a) && exact.is_exactly(&a));
        assert!(!exact.matches(&ab));
        assert!(SandboxSelector::new("a").unwrap().matches(&ab));
        for bad in ["=", "==a", "=../a", "a="] {
            assert!(SandboxSelector::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ids() {
        for (id, valid) in [
            ("abc", true),
            ("a.b_c-9", true),
            ("crab-12.3_x", true),
            ("9", true),
            ("", false),
            (".", false),
            ("..", false),
            ("../etc", false),
            (".hidden", false),
            ("-x", false),
            ("_x", false),
            ("a/b", false),
            ("/abs", false),
            ("a%2fb", false),
            ("a b", false),
            ("a\0b", false),
            ("a\nb", false),
            ("é", false),
            (&"a".repeat(76), true),
            (&"a".repeat(77), false),
        ] {
            check(id, valid);
        }
    }

    #[test]
    fn ids_deserialize_only_when_valid() {
        assert_eq!(
            serde_json::from_str::<SandboxId>("\"s1\"").unwrap(),
            SandboxId::new("s1").unwrap()
        );
        assert!(serde_json::from_str::<SandboxId>("\"../etc\"").is_err());
    }

    #[test]
    fn a_selector_matches_by_prefix_and_knows_an_exact_id() {
        let sel = SandboxSelector::new("ab").unwrap();
        let abc = SandboxId::new("abc").unwrap();
        assert!(sel.matches(&abc) && !sel.is_exactly(&abc));
        assert!(SandboxSelector::from(abc.clone()).is_exactly(&abc));
        assert!(!SandboxSelector::new("b").unwrap().matches(&abc));
    }

    proptest! {
        #[test]
        fn valid_ids_never_hold_a_path_separator(s in "\\PC{0,80}") {
            if let Ok(id) = SandboxId::new(s.clone()) {
                prop_assert!(!id.as_str().contains('/') && !id.as_str().starts_with('.'));
                prop_assert_eq!(id.as_str(), s.as_str());
            }
        }
    }
}
