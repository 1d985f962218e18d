//! Sandbox ids as the store accepts them.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::StoreError;

/// A sandbox id: 1–76 letters, digits, `.`, `_`, `-`, starting with a letter
/// or digit, so it is one safe path component (no `/`, `..` or hidden name);
/// the rule is `crab_proxy::SandboxId`'s.
///
/// 76 covers containerd ids (64 hex digits) with room for a prefix.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SandboxId(String);

// === impl SandboxId ===

impl SandboxId {
    /// Validates `id`.
    ///
    /// # Errors
    /// [`StoreError::InvalidSandboxId`].
    pub fn new(id: &str) -> Result<Self, StoreError> {
        // One rule for every sandbox id in Crab: the proxy's.
        crab_proxy::SandboxId::new(id)
            .map(|valid| SandboxId(valid.as_str().to_owned()))
            .map_err(|e| StoreError::InvalidSandboxId { id: e.id })
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for SandboxId {
    type Error = StoreError;
    fn try_from(s: String) -> Result<Self, StoreError> {
        SandboxId::new(&s)
    }
}

impl From<SandboxId> for String {
    fn from(id: SandboxId) -> String {
        id.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(id: &str, valid: bool) {
        assert_eq!(SandboxId::new(id).is_ok(), valid, "{id:?}");
    }

    #[test]
    fn ids() {
        check("s1", true);
        check("crab-12.3_x", true);
        check(&"a".repeat(76), true);
        check(&"a".repeat(77), false);
        check("", false);
        check(".", false);
        check("..", false);
        check("../etc", false);
        check("a/b", false);
        check("/abs", false);
        check(".hidden", false);
        check("-flag", false);
        check("_x", false);
        check("a\0b", false);
        check("a b", false);
        check("a\nb", false);
        check("é", false);
    }
}
