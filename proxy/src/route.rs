//! Route detection: which API a request speaks, which upstream serves it, and
//! whether it ends a turn. The first layer of a sandbox's request path.

use std::str::FromStr;
use std::task::{Context, Poll};

use http::{HeaderMap, Method, Request};
use serde::{Deserialize, Serialize};
use tower::{Layer, Service};

/// The API of a request, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// OpenAI Chat Completions, `POST /v1/chat/completions`.
    #[serde(rename = "openai_chat")]
    OpenAiChat,
    /// OpenAI Responses, `POST /v1/responses`.
    #[serde(rename = "openai_responses")]
    OpenAiResponses,
    /// Anthropic Messages, `POST /v1/messages`.
    AnthropicMessages,
    /// Anything else (model lists, token counting, embeddings, …).
    Other,
}

/// Which configured upstream serves a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// The OpenAI-compatible upstream.
    OpenAi,
    /// The Anthropic upstream.
    Anthropic,
}

/// What route detection decided about one request; put in its extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The API spoken.
    pub api: Api,
    /// The upstream to forward to.
    pub provider: Provider,
    /// Whether the request ends the sandbox's current turn.
    pub turn_end: bool,
}

/// One `METHOD /path` pattern counted as a turn end: an exact path, or a
/// prefix when it ends in `*` (`POST /v1/agents/*`). A trailing `/` of the
/// request path is ignored; the query never matters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePattern {
    method: Method,
    path: String,
    prefix: bool,
}

/// A [`RoutePattern`] string that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("invalid route pattern {pattern:?}: expected `METHOD /path` or `METHOD /prefix*`")]
pub struct InvalidRoutePattern {
    /// The pattern given.
    pub pattern: String,
}

/// The rule that tells turn ends from auxiliary requests.
#[derive(Debug, Clone)]
pub struct TurnEndRules {
    patterns: Vec<RoutePattern>,
    side_calls: bool,
}

/// Tower layer that classifies each request and inserts its [`Route`].
#[derive(Debug, Clone)]
pub struct RouteLayer {
    rules: TurnEndRules,
}

/// The service made by [`RouteLayer`].
#[derive(Debug, Clone)]
pub struct RouteService<S> {
    rules: TurnEndRules,
    inner: S,
}

// === impl RoutePattern ===

impl RoutePattern {
    fn matches(&self, method: &Method, path: &str) -> bool {
        if method != self.method {
            return false;
        }
        let path = normalize(path);
        if self.prefix {
            path.starts_with(&self.path)
        } else {
            path == self.path
        }
    }
}

impl FromStr for RoutePattern {
    type Err = InvalidRoutePattern;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || InvalidRoutePattern {
            pattern: s.to_owned(),
        };
        let (method, path) = s.trim().split_once(' ').ok_or_else(bad)?;
        let method = Method::from_bytes(method.as_bytes()).map_err(|_| bad())?;
        let path = path.trim();
        if !path.starts_with('/') || path.contains(char::is_whitespace) {
            return Err(bad());
        }
        let (path, prefix) = match path.strip_suffix('*') {
            Some(p) => (p.to_owned(), true),
            None => (normalize(path).to_owned(), false),
        };
        Ok(Self { method, path, prefix })
    }
}

impl<'de> Deserialize<'de> for RoutePattern {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

// === impl TurnEndRules ===

impl TurnEndRules {
    /// Rules from explicit patterns; every request on them ends a turn.
    pub fn new(patterns: Vec<RoutePattern>) -> Self {
        Self {
            patterns,
            side_calls: false,
        }
    }

    /// With `on`, a request on a turn-end route whose conversation is not
    /// the one the turns follow (a title, a summary, a sub-agent's first
    /// question) ends no turn (see the `side_call` module).
    pub fn with_side_calls(mut self, on: bool) -> Self {
        self.side_calls = on;
        self
    }

    /// Whether side calls are told from turn ends.
    pub fn side_calls(&self) -> bool {
        self.side_calls
    }

    /// The agent main loop of the three supported APIs:
    /// `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/messages`.
    pub fn main_loop() -> Self {
        let patterns = [
            "POST /v1/chat/completions",
            "POST /v1/responses",
            "POST /v1/messages",
        ]
        .into_iter()
        .map(|p| {
            // The literals above are valid patterns; the unit tests parse them.
            p.parse().unwrap_or_else(|_| unreachable!("built-in pattern {p}"))
        })
        .collect();
        Self::new(patterns)
    }

    /// Classifies a request by method, path and headers.
    pub fn classify(&self, method: &Method, path: &str, headers: &HeaderMap) -> Route {
        let norm = normalize(path);
        let api = match norm {
            "/v1/chat/completions" => Api::OpenAiChat,
            "/v1/responses" => Api::OpenAiResponses,
            "/v1/messages" => Api::AnthropicMessages,
            _ => Api::Other,
        };
        // Anthropic's SDKs send `anthropic-version` on every request; the
        // Messages paths are Anthropic's whatever the headers say.
        let anthropic = norm == "/v1/messages"
            || norm.starts_with("/v1/messages/")
            || headers.contains_key("anthropic-version");
        let provider = if anthropic {
            Provider::Anthropic
        } else {
            Provider::OpenAi
        };
        let turn_end = self.patterns.iter().any(|p| p.matches(method, path));
        Route {
            api,
            provider,
            turn_end,
        }
    }
}

/// The path without one trailing `/` (the root stays `/`).
fn normalize(path: &str) -> &str {
    match path.strip_suffix('/') {
        Some(p) if !p.is_empty() => p,
        _ => path,
    }
}

// === impl RouteLayer ===

impl RouteLayer {
    /// A layer classifying with `rules`.
    pub fn new(rules: TurnEndRules) -> Self {
        Self { rules }
    }
}

impl<S> Layer<S> for RouteLayer {
    type Service = RouteService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RouteService {
            rules: self.rules.clone(),
            inner,
        }
    }
}

impl<S, B> Service<Request<B>> for RouteService<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let route = self.rules.classify(req.method(), req.uri().path(), req.headers());
        req.extensions_mut().insert(route);
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn check(
        rules: &TurnEndRules,
        method: &str,
        path: &str,
        anthropic_header: bool,
        expected: (Api, Provider, bool),
    ) {
        let mut headers = HeaderMap::new();
        if anthropic_header {
            headers.insert("anthropic-version", http::HeaderValue::from_static("2023-06-01"));
        }
        let method = Method::from_bytes(method.as_bytes()).expect("test method");
        let route = rules.classify(&method, path, &headers);
        assert_eq!(
            (route.api, route.provider, route.turn_end),
            expected,
            "{method} {path}"
        );
    }

    #[test]
    fn main_loop_rules() {
        use Api::*;
        use Provider::*;
        let rules = TurnEndRules::main_loop();
        for (method, path, hdr, expected) in [
            ("POST", "/v1/chat/completions", false, (OpenAiChat, OpenAi, true)),
            ("POST", "/v1/chat/completions/", false, (OpenAiChat, OpenAi, true)),
            ("POST", "/v1/responses", false, (OpenAiResponses, OpenAi, true)),
            ("POST", "/v1/messages", true, (AnthropicMessages, Anthropic, true)),
            (
                "POST",
                "/v1/messages",
                false,
                (AnthropicMessages, Anthropic, true),
            ),
            (
                "POST",
                "/v1/messages/count_tokens",
                true,
                (Other, Anthropic, false),
            ),
            (
                "POST",
                "/v1/messages/count_tokens",
                false,
                (Other, Anthropic, false),
            ),
            ("GET", "/v1/models", false, (Other, OpenAi, false)),
            ("GET", "/v1/models", true, (Other, Anthropic, false)),
            ("POST", "/v1/embeddings", false, (Other, OpenAi, false)),
            ("GET", "/v1/chat/completions", false, (OpenAiChat, OpenAi, false)),
            ("GET", "/v1/responses/resp_123", false, (Other, OpenAi, false)),
            ("POST", "/v1/messagesx", false, (Other, OpenAi, false)),
            ("POST", "/", false, (Other, OpenAi, false)),
        ] {
            check(&rules, method, path, hdr, expected);
        }
    }

    #[test]
    fn configured_rules() {
        let rules = TurnEndRules::new(vec![
            "POST /v1/agents/*".parse().expect("pattern"),
            "PUT /turn".parse().expect("pattern"),
        ]);
        check(
            &rules,
            "POST",
            "/v1/agents/a/run",
            false,
            (Api::Other, Provider::OpenAi, true),
        );
        check(
            &rules,
            "PUT",
            "/turn/",
            false,
            (Api::Other, Provider::OpenAi, true),
        );
        check(
            &rules,
            "POST",
            "/v1/chat/completions",
            false,
            (Api::OpenAiChat, Provider::OpenAi, false),
        );
        for bad in ["", "POST", "POST v1", "POST /a b", "BAD METHOD /x"] {
            assert!(bad.parse::<RoutePattern>().is_err(), "{bad:?}");
        }
    }

    proptest! {
        /// Only the three exact main-loop paths (POST, one optional trailing
        /// slash) end a turn; nothing else does, whatever the path.
        #[test]
        fn turn_end_iff_main_loop_path(
            method in prop::sample::select(vec!["GET", "POST", "PUT", "DELETE"]),
            path in "(/[a-z0-9_.%-]{0,12}){0,4}/?",
            hdr in any::<bool>(),
        ) {
            let rules = TurnEndRules::main_loop();
            let mut headers = HeaderMap::new();
            if hdr {
                headers.insert("anthropic-version", http::HeaderValue::from_static("2023-06-01"));
            }
            let m = Method::from_bytes(method.as_bytes()).expect("method");
            let route = rules.classify(&m, &path, &headers);
            let main = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]
                .iter()
                .any(|p| path == *p || path == format!("{p}/"));
            prop_assert_eq!(route.turn_end, method == "POST" && main);
            prop_assert_eq!(route.api == Api::Other, !main);
        }
    }
}
