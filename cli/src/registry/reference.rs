//! Image references as docker and containerd write them, with the
//! registry always named: `HOST[:PORT]/REPO[:TAG]` or `…/REPO@sha256:…`.

use std::fmt;

/// A parsed reference: where the artifact lives and which one it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// The registry's host and port (`127.0.0.1:5000`, `registry.example`).
    pub registry: String,
    /// The repository (`agents/web`).
    pub repository: String,
    /// The tag or the `sha256:` digest.
    pub target: Target,
}

/// Which manifest of a repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A tag (`v3`; `latest` when none is given).
    Tag(String),
    /// A manifest digest (`sha256:…`).
    Digest(String),
}

/// A reference that cannot be parsed, and why.
#[derive(Debug, thiserror::Error)]
#[error("invalid reference {reference:?}: {reason} (e.g. 127.0.0.1:5000/agents/web:v3)")]
pub struct InvalidReference {
    reference: String,
    reason: &'static str,
}

impl Reference {
    /// Parses `text`; the first component must name a registry (it has a
    /// `.` or a `:`, or is `localhost`): there is no default registry.
    pub fn parse(text: &str) -> Result<Reference, InvalidReference> {
        let bad = |reason| InvalidReference {
            reference: text.to_owned(),
            reason,
        };
        let (registry, rest) = text.split_once('/').ok_or_else(|| bad("no repository"))?;
        let registry_ok = !registry.is_empty()
            && (registry.contains('.') || registry.contains(':') || registry == "localhost")
            && registry
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b));
        if !registry_ok {
            return Err(bad("the first component must be a registry host"));
        }
        let (repository, target) = match rest.split_once('@') {
            Some((repo, digest)) => {
                let hex = digest
                    .strip_prefix("sha256:")
                    .ok_or_else(|| bad("only sha256 digests"))?;
                if hex.len() != 64
                    || !hex
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                {
                    return Err(bad("a digest is sha256: and 64 lower-case hex digits"));
                }
                (repo, Target::Digest(digest.to_owned()))
            }
            None => match rest.rsplit_once(':') {
                Some((repo, tag)) => {
                    let tag_ok = (1..=128).contains(&tag.len())
                        && tag
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
                        && !tag.starts_with(['.', '-']);
                    if !tag_ok {
                        return Err(bad("a tag is 1-128 letters, digits, '_', '.' or '-'"));
                    }
                    (repo, Target::Tag(tag.to_owned()))
                }
                None => (rest, Target::Tag("latest".to_owned())),
            },
        };
        // The distribution spec's grammar: lower-case components joined by
        // one separator, components joined by '/'.
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && c.starts_with(|ch: char| ch.is_ascii_alphanumeric())
                && c.ends_with(|ch: char| ch.is_ascii_alphanumeric())
        };
        if repository.len() > 255 || !repository.split('/').all(component_ok) {
            return Err(bad("a repository is lower-case letters, digits and separators"));
        }
        Ok(Reference {
            registry: registry.to_owned(),
            repository: repository.to_owned(),
            target,
        })
    }

    /// The registry's base URL: plain HTTP for a loopback registry (as
    /// docker allows without configuration), HTTPS for any other.
    pub fn base_url(&self) -> String {
        let host = self
            .registry
            .rsplit_once(':')
            .map_or(self.registry.as_str(), |(h, port)| {
                if port.bytes().all(|b| b.is_ascii_digit()) {
                    h
                } else {
                    self.registry.as_str()
                }
            });
        let ip = host.trim_start_matches('[').trim_end_matches(']');
        let loopback = host == "localhost" || ip.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
        let scheme = if loopback { "http" } else { "https" };
        format!("{scheme}://{}", self.registry)
    }

    /// The tag or digest, as a manifest URL names it.
    pub fn target(&self) -> &str {
        match &self.target {
            Target::Tag(t) | Target::Digest(t) => t,
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.target {
            Target::Tag(t) => write!(f, "{}/{}:{t}", self.registry, self.repository),
            Target::Digest(d) => write!(f, "{}/{}@{d}", self.registry, self.repository),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_name_their_registry_repository_and_target() {
        let r = Reference::parse("127.0.0.1:5000/agents/web:v3").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "agents/web");
        assert_eq!(r.target, Target::Tag("v3".into()));
        assert_eq!(r.base_url(), "http://127.0.0.1:5000");
        assert_eq!(r.to_string(), "127.0.0.1:5000/agents/web:v3");
        let r = Reference::parse("registry.example/web").unwrap();
        assert_eq!(r.target(), "latest");
        assert_eq!(r.base_url(), "https://registry.example");
        assert_eq!(
            Reference::parse("localhost/a").unwrap().base_url(),
            "http://localhost"
        );
        let digest = format!("sha256:{}", "ab".repeat(32));
        let r = Reference::parse(&format!("localhost:5000/a@{digest}")).unwrap();
        assert_eq!(r.target, Target::Digest(digest));
    }

    #[test]
    fn what_is_no_reference_is_refused_with_the_reason() {
        for bad in [
            "web:v3",
            "web/app",
            "/a",
            "localhost:5000/",
            "localhost:5000/Upper",
            "localhost:5000/a/../b",
            "localhost:5000/a//b",
            "localhost:5000/a:",
            "localhost:5000/a:-x",
            "localhost:5000/a:x/y",
            "localhost:5000/a@sha256:00",
            "localhost:5000/a@md5:00",
            "local host/a",
        ] {
            let e = Reference::parse(bad).expect_err(bad).to_string();
            assert!(e.contains("invalid reference"), "{bad}: {e}");
        }
    }
}
