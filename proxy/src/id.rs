//! Sandbox ids: the one name that reaches paths (transcript files) and URLs
//! (`/s/<sandbox>/…`), so it is validated once, here.

use std::fmt;

/// A validated sandbox id: 1–76 ASCII letters, digits, `.`, `_` or `-`,
/// starting with a letter or a digit (so never `.`, `..` or a hidden name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxId(String);

/// A string that is not a valid [`SandboxId`].
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid sandbox id {id:?}: use 1-76 letters, digits, '.', '_' or '-', starting with a letter or digit"
)]
pub struct InvalidSandboxId {
    /// The id given.
    pub id: String,
}

/// Longest id accepted; the same bound the shim puts on container ids.
const MAX_LEN: usize = 76;

impl SandboxId {
    /// Validates `id`.
    ///
    /// # Errors
    /// [`InvalidSandboxId`] when `id` is empty, too long, or holds anything
    /// but ASCII letters, digits, `.`, `_`, `-`, or starts with `.`, `_`, `-`.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidSandboxId> {
        let id = id.into();
        let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        let starts_ok = id.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
        if !starts_ok || id.len() > MAX_LEN || !id.chars().all(ok_char) {
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn check(id: &str, valid: bool) {
        assert_eq!(SandboxId::new(id).is_ok(), valid, "{id:?}");
    }

    #[test]
    fn ids() {
        for (id, valid) in [
            ("abc", true),
            ("a.b_c-9", true),
            ("9", true),
            ("", false),
            (".", false),
            ("..", false),
            (".hidden", false),
            ("-x", false),
            ("a/b", false),
            ("a%2fb", false),
            ("a b", false),
            ("é", false),
            (&"a".repeat(76), true),
            (&"a".repeat(77), false),
        ] {
            check(id, valid);
        }
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
