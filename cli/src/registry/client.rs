//! The few calls of the OCI distribution API that moving a version needs:
//! whether a blob is there, a blob's upload (streamed from a file, in one
//! PUT), a manifest's upload, and their downloads (streamed to a file,
//! checked against their digests and sizes as they arrive).
//!
//! A registry that answers 401 is answered as its challenge asks
//! ([`super::auth`]): with the user's credentials (Basic), or with a token
//! from the service it names (Bearer), once per request; the answer is
//! then sent with every later request to the registry itself (its scheme,
//! host and port; an upload or a blob elsewhere gets none). Credentials
//! never go over plain HTTP but between loopback addresses.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, Limited, StreamBody};
use hyper::body::Frame;
use hyper::header::HeaderValue;
use hyper::{Method, Request, Response, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio_stream::StreamExt;

use super::auth::{self, Challenge, Credentials};
use super::reference::Reference;

/// A request or answer body.
type Body = BoxBody<Bytes, std::io::Error>;

/// The most a manifest may weigh (read into memory).
pub const MAX_MANIFEST: usize = 4 << 20;
/// Redirects followed for a blob (a registry on object storage sends one).
const MAX_REDIRECTS: usize = 3;
/// The longest a registry may send nothing in the middle of an answer.
const STALL: Duration = Duration::from_secs(60);

/// What went wrong talking to a registry.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry could not be reached.
    #[error("{url}: {source}")]
    Connect {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// The registry asks for credentials that crabctl does not have, or
    /// refused those it sent.
    #[error("{url}: {reason} ({challenge}); {fix}")]
    Unauthorized {
        /// The URL.
        url: String,
        /// What happened.
        reason: String,
        /// Its `WWW-Authenticate`.
        challenge: String,
        /// What the user can do.
        fix: String,
    },
    /// The credentials could not be read.
    #[error(transparent)]
    Credentials(#[from] super::auth::AuthError),
    /// The registry answered with an unexpected status.
    #[error("{what}: the registry answered {status}: {body}")]
    Status {
        /// What was asked.
        what: String,
        /// The status.
        status: StatusCode,
        /// The start of its answer.
        body: String,
    },
    /// What arrived is not what was named.
    #[error("{what}: {reason}")]
    Invalid {
        /// What was fetched.
        what: String,
        /// How it differs.
        reason: String,
    },
    /// A local file.
    #[error("{context}: {source}")]
    Io {
        /// What was done.
        context: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// No TLS configuration could be made.
    #[error("TLS: {0}")]
    Tls(#[source] rustls::Error),
}

/// One repository of one registry.
pub struct Registry {
    client: Client<HttpsConnector<HttpConnector>, Body>,
    base: String,
    repository: String,
    /// What `--authfile` (or docker's config) holds for the registry,
    /// once looked up: at the first challenge, unless a file was named (a
    /// credential helper may prompt, or not be installed where the
    /// registry asks for nothing).
    credentials: OnceLock<Option<Credentials>>,
    /// The registry's name, as credentials are kept under it.
    registry: String,
    /// Where credentials were looked for, for messages.
    auth_file: Option<PathBuf>,
    /// The `Authorization` the registry last accepted, sent with every
    /// request.
    authorization: Mutex<Option<HeaderValue>>,
}

impl Registry {
    /// A client for `reference`'s repository, with the credentials
    /// `authfile` (or docker's config) holds for its registry.
    ///
    /// # Errors
    /// A named `authfile` cannot be read (it must exist), or no TLS
    /// configuration could be made.
    pub fn new(reference: &Reference, authfile: Option<&Path>) -> Result<Registry, RegistryError> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(Duration::from_secs(10)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
            .map_err(RegistryError::Tls)?
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let auth_file = auth::auth_file(authfile);
        let credentials = OnceLock::new();
        if let Some(file) = authfile {
            let _ = credentials.set(auth::lookup(file, &reference.registry, true)?);
        }
        Ok(Registry {
            client: Client::builder(TokioExecutor::new()).build(https),
            base: reference.base_url(),
            repository: reference.repository.clone(),
            credentials,
            registry: reference.registry.clone(),
            auth_file,
            authorization: Mutex::new(None),
        })
    }

    /// The credentials for the registry, looked up the first time (off
    /// the runtime's thread: a credential helper may take its time).
    async fn credentials(&self) -> Result<Option<&Credentials>, RegistryError> {
        if let Some(found) = self.credentials.get() {
            return Ok(found.as_ref());
        }
        let found = match self.auth_file.clone() {
            Some(file) => {
                let registry = self.registry.clone();
                tokio::task::spawn_blocking(move || auth::lookup(&file, &registry, false))
                    .await
                    .map_err(|e| RegistryError::Invalid {
                        what: "the credentials' lookup".to_owned(),
                        reason: e.to_string(),
                    })??
            }
            None => None,
        };
        Ok(self.credentials.get_or_init(|| found).as_ref())
    }

    fn url(&self, tail: &str) -> String {
        format!("{}/v2/{}/{tail}", self.base, self.repository)
    }

    /// Sends the request `build` makes; on a 401 answers the challenge and
    /// sends it again, once.
    async fn send(
        &self,
        build: impl Fn() -> Request<Body>,
    ) -> Result<Response<hyper::body::Incoming>, RegistryError> {
        let resp = self.send_once(build()).await?;
        if resp.status() != StatusCode::UNAUTHORIZED {
            return Ok(resp);
        }
        let url = build().uri().to_string();
        let authorization = self.answer(&url, &resp).await?;
        *self.authorization.lock().expect("not poisoned") = Some(authorization);
        let resp = self.send_once(build()).await?;
        if resp.status() == StatusCode::UNAUTHORIZED {
            return Err(self.refused(url, &resp, "the registry refused the credentials it asked for"));
        }
        Ok(resp)
    }

    /// Sends `req` with the `Authorization` accepted so far; a 401 is the
    /// caller's to answer.
    async fn send_once(
        &self,
        mut req: Request<Body>,
    ) -> Result<Response<hyper::body::Incoming>, RegistryError> {
        // Only to the registry itself: an upload's Location may name
        // another host (its storage), which gets none of the credentials.
        if self.is_registry(&req.uri().to_string()) {
            if let Some(value) = self.authorization.lock().expect("not poisoned").clone() {
                req.headers_mut().insert(hyper::header::AUTHORIZATION, value);
            }
        }
        self.call(req).await
    }

    /// Whether `url` is on the registry's own scheme, host and port.
    fn is_registry(&self, url: &str) -> bool {
        url.strip_prefix(self.base.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/') || rest.starts_with('?'))
    }

    /// Sends `req` as it is (to the registry, or where it redirected).
    async fn call(&self, req: Request<Body>) -> Result<Response<hyper::body::Incoming>, RegistryError> {
        let url = req.uri().to_string();
        // A blob's upload is answered once all of it is sent: no limit.
        let upload = req.method() == Method::PUT && url.contains("/blobs/uploads/");
        let call = self.client.request(req);
        match upload {
            true => call.await,
            false => tokio::time::timeout(STALL, call)
                .await
                .map_err(|_| RegistryError::Invalid {
                    what: url.clone(),
                    reason: format!("the registry did not answer in {} s", STALL.as_secs()),
                })?,
        }
        .map_err(|source| RegistryError::Connect { url, source })
    }

    /// The `Authorization` that answers the 401 `resp` to `url`.
    async fn answer(
        &self,
        url: &str,
        resp: &Response<hyper::body::Incoming>,
    ) -> Result<HeaderValue, RegistryError> {
        let challenge = resp
            .headers()
            .get(hyper::header::WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .and_then(Challenge::parse);
        let Some(challenge) = challenge else {
            return Err(self.refused(
                url.to_owned(),
                resp,
                "the registry asks for credentials it does not name",
            ));
        };
        let value = match challenge.scheme.as_str() {
            "basic" => match self.credentials().await? {
                Some(c) if self.may_send_secrets(url) => c.basic(),
                Some(_) => return Err(self.refused(url.to_owned(), resp, "credentials go over HTTPS only")),
                None => return Err(self.refused(url.to_owned(), resp, "the registry asks for credentials")),
            },
            "bearer" => format!("Bearer {}", self.token(url, &challenge, resp).await?),
            _ => {
                return Err(self.refused(
                    url.to_owned(),
                    resp,
                    "the registry asks for an authentication crabctl does not speak",
                ))
            }
        };
        let mut value = HeaderValue::from_str(&value).map_err(|_| RegistryError::Invalid {
            what: url.to_owned(),
            reason: "credentials that are no header value".to_owned(),
        })?;
        value.set_sensitive(true);
        Ok(value)
    }

    /// A token from the service `challenge` names, for its scope, asked
    /// with the user's credentials when there are any.
    async fn token(
        &self,
        url: &str,
        challenge: &Challenge,
        resp: &Response<hyper::body::Incoming>,
    ) -> Result<String, RegistryError> {
        let Some(realm) = challenge.params.get("realm") else {
            return Err(self.refused(url.to_owned(), resp, "the registry names no token service"));
        };
        // The token service is asked with the user's password: over HTTPS,
        // or on the loopback when the registry is a loopback one too (a
        // remote registry never sends crabctl to this host's services).
        if !realm.starts_with("https://")
            && (self.base.starts_with("https://") || !self.may_send_secrets(realm))
        {
            return Err(self.refused(
                url.to_owned(),
                resp,
                &format!("its token service {realm} is not HTTPS"),
            ));
        }
        let mut query = Vec::new();
        for name in ["service", "scope"] {
            if let Some(v) = challenge.params.get(name) {
                query.push(format!("{name}={}", auth::query_escape(v)));
            }
        }
        let credentials = self.credentials().await?;
        if let Some(c) = credentials {
            query.push(format!("account={}", auth::query_escape(c.username())));
        }
        let sep = if realm.contains('?') { '&' } else { '?' };
        let token_url = format!("{realm}{sep}{}", query.join("&"));
        let mut req = request(Method::GET, &token_url, empty());
        if let Some(c) = credentials {
            let mut basic = HeaderValue::from_str(&c.basic()).map_err(|_| RegistryError::Invalid {
                what: token_url.clone(),
                reason: "credentials that are no header value".to_owned(),
            })?;
            basic.set_sensitive(true);
            req.headers_mut().insert(hyper::header::AUTHORIZATION, basic);
        }
        let what = format!("the token service {realm}");
        let answer = tokio::time::timeout(STALL, self.client.request(req))
            .await
            .map_err(|_| RegistryError::Invalid {
                what: what.clone(),
                reason: format!("no answer in {} s", STALL.as_secs()),
            })?
            .map_err(|source| RegistryError::Connect {
                url: realm.clone(),
                source,
            })?;
        match answer.status() {
            StatusCode::OK => {}
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                let reason = match credentials {
                    Some(_) => format!("{what} refused the credentials ({})", answer.status()),
                    None => format!("{what} asks for credentials ({})", answer.status()),
                };
                return Err(self.refused(url.to_owned(), resp, &reason));
            }
            _ => return Err(status_error(what, answer).await),
        }
        let body = tokio::time::timeout(STALL, Limited::new(answer.into_body(), MAX_MANIFEST).collect())
            .await
            .map_err(|_| RegistryError::Invalid {
                what: what.clone(),
                reason: format!("its answer did not end in {} s", STALL.as_secs()),
            })?
            .map_err(|e| RegistryError::Invalid {
                what: what.clone(),
                reason: e.to_string(),
            })?
            .to_bytes();
        serde_json::from_slice::<auth::TokenAnswer>(&body)
            .ok()
            .and_then(auth::TokenAnswer::token)
            .ok_or_else(|| RegistryError::Invalid {
                what,
                reason: "an answer with no token".to_owned(),
            })
    }

    /// Whether credentials may be sent to `url`: over HTTPS, or to a
    /// loopback address.
    fn may_send_secrets(&self, url: &str) -> bool {
        let Ok(uri) = url.parse::<hyper::Uri>() else {
            return false;
        };
        match uri.scheme_str() {
            Some("https") => true,
            Some("http") => uri.host().is_some_and(|h| {
                let h = h.trim_start_matches('[').trim_end_matches(']');
                h == "localhost" || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
            }),
            _ => false,
        }
    }

    /// The error of a 401 (`resp`) to `url` that crabctl cannot answer.
    fn refused(&self, url: String, resp: &Response<hyper::body::Incoming>, reason: &str) -> RegistryError {
        let challenge = resp
            .headers()
            .get(hyper::header::WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("no challenge")
            .to_owned();
        let login = format!(
            "log in (`docker login {}`) or name a file that holds credentials for it with --authfile",
            self.host()
        );
        let fix = match (self.credentials.get(), &self.auth_file) {
            (Some(Some(c)), _) => format!("check the credentials in {}", c.source),
            (Some(None), Some(file)) => format!("{login} ({} holds none)", file.display()),
            (None, Some(file)) => format!("{login} ({} was not read yet)", file.display()),
            (_, None) => login,
        };
        RegistryError::Unauthorized {
            url,
            reason: reason.to_owned(),
            challenge,
            fix,
        }
    }

    /// The registry's `host[:port]`.
    fn host(&self) -> &str {
        self.base
            .trim_start_matches("https://")
            .trim_start_matches("http://")
    }

    /// Whether blob `digest` is in the repository already.
    pub async fn has_blob(&self, digest: &str) -> Result<bool, RegistryError> {
        let url = self.url(&format!("blobs/{digest}"));
        let resp = self.send(|| request(Method::HEAD, &url, empty())).await?;
        match resp.status() {
            StatusCode::OK => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            _ => Err(status_error(format!("HEAD {url}"), resp).await),
        }
    }

    /// Uploads `file` (`size` bytes) as blob `digest`: one POST to open the
    /// upload, one PUT with the whole content.
    pub async fn put_blob(&self, digest: &str, file: &Path, size: u64) -> Result<(), RegistryError> {
        let url = self.url("blobs/uploads/");
        let resp = self.send(|| request(Method::POST, &url, empty())).await?;
        if resp.status() != StatusCode::ACCEPTED {
            return Err(status_error(format!("POST {url}"), resp).await);
        }
        let location = resp
            .headers()
            .get(hyper::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| RegistryError::Invalid {
                what: format!("POST {url}"),
                reason: "the upload has no Location".to_owned(),
            })?;
        let mut upload = self.absolute(location);
        if !self.same_scheme(&upload) {
            return Err(RegistryError::Invalid {
                what: format!("POST {url}"),
                reason: format!("an upload to {upload}, not over the registry's own scheme"),
            });
        }
        upload.push(if upload.contains('?') { '&' } else { '?' });
        upload.push_str(&format!("digest={digest}"));
        let f = tokio::fs::File::open(file).await.map_err(io(file))?;
        let stream = tokio_util::io::ReaderStream::new(f).map(|chunk| chunk.map(Frame::data));
        let mut req = request(Method::PUT, &upload, BodyExt::boxed(StreamBody::new(stream)));
        let headers = req.headers_mut();
        headers.insert(hyper::header::CONTENT_LENGTH, size.into());
        headers.insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/octet-stream"),
        );
        // Sent once: its body is a stream. The upload's POST has answered
        // the registry's challenge for this scope already.
        let resp = self.send_once(req).await?;
        if resp.status() == StatusCode::UNAUTHORIZED {
            return Err(self.refused(upload, &resp, "the registry refused the credentials it asked for"));
        }
        if resp.status() != StatusCode::CREATED {
            return Err(status_error(format!("PUT blob {digest}"), resp).await);
        }
        Ok(())
    }

    /// Uploads manifest `bytes` of `media_type` as `target` (a tag);
    /// answers its digest.
    pub async fn put_manifest(
        &self,
        target: &str,
        bytes: Vec<u8>,
        media_type: &str,
    ) -> Result<String, RegistryError> {
        let url = self.url(&format!("manifests/{target}"));
        let digest = sha256(&bytes);
        let bytes = Bytes::from(bytes);
        let resp = self
            .send(|| {
                let mut req = request(Method::PUT, &url, full(bytes.clone()));
                req.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    media_type.parse().expect("a media type is a header value"),
                );
                req
            })
            .await?;
        if resp.status() != StatusCode::CREATED {
            return Err(status_error(format!("PUT {url}"), resp).await);
        }
        Ok(digest)
    }

    /// Downloads manifest `target` (a tag or a digest) of `media_type`;
    /// answers its bytes and digest. A digest target must match.
    pub async fn get_manifest(
        &self,
        target: &str,
        media_type: &str,
    ) -> Result<(Vec<u8>, String), RegistryError> {
        let url = self.url(&format!("manifests/{target}"));
        let resp = self
            .send(|| {
                let mut req = request(Method::GET, &url, empty());
                req.headers_mut().insert(
                    hyper::header::ACCEPT,
                    media_type.parse().expect("a media type is a header value"),
                );
                req
            })
            .await?;
        if resp.status() != StatusCode::OK {
            return Err(status_error(format!("GET {url}"), resp).await);
        }
        let mut body = resp.into_body();
        let mut bytes = Vec::new();
        while let Some(frame) = next_frame(&mut body, &url).await? {
            let frame = frame.map_err(|e| RegistryError::Invalid {
                what: format!("GET {url}"),
                reason: e.to_string(),
            })?;
            if let Some(data) = frame.data_ref() {
                if bytes.len() + data.len() > MAX_MANIFEST {
                    return Err(RegistryError::Invalid {
                        what: format!("GET {url}"),
                        reason: format!("a manifest of more than {MAX_MANIFEST} bytes"),
                    });
                }
                bytes.extend_from_slice(data);
            }
        }
        let digest = sha256(&bytes);
        if target.starts_with("sha256:") && digest != target {
            return Err(RegistryError::Invalid {
                what: format!("GET {url}"),
                reason: format!("its content is {digest}"),
            });
        }
        Ok((bytes, digest))
    }

    /// Downloads blob `digest` of `size` bytes into a new file `to`,
    /// refusing more bytes than named and any content but `digest`'s.
    pub async fn get_blob(&self, digest: &str, size: u64, to: &Path) -> Result<(), RegistryError> {
        let what = format!("blob {digest}");
        let mut url = self.url(&format!("blobs/{digest}"));
        let mut resp = self.send(|| request(Method::GET, &url, empty())).await?;
        for _ in 0..MAX_REDIRECTS {
            if !resp.status().is_redirection() {
                break;
            }
            let Some(next) = resp
                .headers()
                .get(hyper::header::LOCATION)
                .and_then(|v| v.to_str().ok())
            else {
                break;
            };
            let next = self.absolute(next);
            // Object storage is HTTPS; a registry spoken to over HTTPS never
            // sends the blob's bytes over plain HTTP.
            if !self.same_scheme(&next) {
                return Err(RegistryError::Invalid {
                    what,
                    reason: format!("a redirect to {next}, which is not HTTPS"),
                });
            }
            url = next;
            // Object storage is another host: it gets none of the
            // registry's credentials.
            resp = self.call(request(Method::GET, &url, empty())).await?;
        }
        if resp.status() != StatusCode::OK {
            return Err(status_error(format!("GET {url}"), resp).await);
        }
        let mut out = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(to)
            .await
            .map_err(io(to))?;
        let mut body = resp.into_body();
        let (mut hasher, mut got) = (Sha256::new(), 0u64);
        while let Some(frame) = next_frame(&mut body, &what).await? {
            let frame = frame.map_err(|e| RegistryError::Invalid {
                what: what.clone(),
                reason: e.to_string(),
            })?;
            if let Some(data) = frame.data_ref() {
                got += data.len() as u64;
                if got > size {
                    return Err(RegistryError::Invalid {
                        what,
                        reason: format!("more than the {size} bytes its manifest names"),
                    });
                }
                hasher.update(data);
                out.write_all(data).await.map_err(io(to))?;
            }
        }
        out.flush().await.map_err(io(to))?;
        let content = format!("sha256:{}", hex(&hasher.finalize()));
        if got != size || content != digest {
            return Err(RegistryError::Invalid {
                what,
                reason: format!("{got} bytes of {content} arrived, not {size} of {digest}"),
            });
        }
        Ok(())
    }

    /// Whether `url` keeps to the registry's scheme (HTTPS for any registry
    /// but a loopback one; a loopback one only to itself over HTTP).
    fn same_scheme(&self, url: &str) -> bool {
        match self.base.strip_prefix("http://") {
            Some(_) => url.starts_with("https://") || url.starts_with(&format!("{}/", self.base)),
            None => url.starts_with("https://"),
        }
    }

    /// `location` made absolute against the registry.
    fn absolute(&self, location: &str) -> String {
        if location.starts_with("http://") || location.starts_with("https://") {
            location.to_owned()
        } else {
            format!("{}/{}", self.base, location.trim_start_matches('/'))
        }
    }
}

/// The next frame of `body` (of `what`), unless the registry stalls.
async fn next_frame(
    body: &mut hyper::body::Incoming,
    what: &str,
) -> Result<Option<Result<Frame<Bytes>, hyper::Error>>, RegistryError> {
    tokio::time::timeout(STALL, body.frame())
        .await
        .map_err(|_| RegistryError::Invalid {
            what: what.to_owned(),
            reason: format!("the registry sent nothing for {} s", STALL.as_secs()),
        })
}

fn request(method: Method, url: &str, body: Body) -> Request<Body> {
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = url.parse().unwrap_or_default();
    req
}

fn empty() -> Body {
    BodyExt::boxed(Empty::new().map_err(|never| match never {}))
}

fn full(bytes: Bytes) -> Body {
    BodyExt::boxed(Full::new(bytes).map_err(|never| match never {}))
}

/// A status error with the start of the answer (the registry's reason).
async fn status_error(what: String, resp: Response<hyper::body::Incoming>) -> RegistryError {
    const SHOWN: usize = 300;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut start = Vec::new();
    // The start is all that is shown: the rest is not read.
    let read = async {
        while start.len() < SHOWN {
            match body.frame().await {
                Some(Ok(frame)) => start.extend_from_slice(frame.data_ref().map_or(&[][..], |d| &d[..])),
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
    let body = String::from_utf8_lossy(&start[..start.len().min(SHOWN)])
        .trim()
        .to_owned();
    RegistryError::Status { what, status, body }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> RegistryError + '_ {
    move |source| RegistryError::Io {
        context: path.display().to_string(),
        source,
    }
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_looked_up_at_the_first_challenge_unless_a_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        // A helper that is not installed (a config copied from elsewhere).
        std::fs::write(&config, r#"{"credsStore":"crab-test-missing"}"#).unwrap();
        let reference = Reference::parse("127.0.0.1:5000/agents/a:v1").unwrap();
        let mut r = Registry::new(&reference, None).unwrap();
        r.auth_file = Some(config.clone());
        assert!(r.credentials.get().is_none(), "nothing asked before a challenge");
        let lookup = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(r.credentials())
            .err();
        let Some(e) = lookup else {
            panic!("the helper cannot run")
        };
        let e = e.to_string();
        assert!(e.contains("docker-credential-crab-test-missing"), "{e}");
        // Named, the file is read at once.
        let e = Registry::new(&reference, Some(&config))
            .err()
            .expect("named")
            .to_string();
        assert!(e.contains("docker-credential-crab-test-missing"), "{e}");
    }
}
