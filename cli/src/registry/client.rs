//! The few calls of the OCI distribution API that moving a version needs:
//! whether a blob is there, a blob's upload (streamed from a file, in one
//! PUT), a manifest's upload, and their downloads (streamed to a file,
//! checked against their digests and sizes as they arrive).
//!
//! No credentials: a registry that asks for them is refused, saying so.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Method, Request, Response, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio_stream::StreamExt;

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
    /// The registry asks for credentials.
    #[error(
        "{url}: the registry asks for credentials ({challenge}); crabctl push and pull speak only to \
         registries open to them (e.g. one on this host's loopback)"
    )]
    Unauthorized {
        /// The URL.
        url: String,
        /// Its `WWW-Authenticate`.
        challenge: String,
    },
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
}

impl Registry {
    /// A client for `reference`'s repository.
    pub fn new(reference: &Reference) -> Result<Registry, RegistryError> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(Duration::from_secs(10)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
            .map_err(RegistryError::Tls)?
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Registry {
            client: Client::builder(TokioExecutor::new()).build(https),
            base: reference.base_url(),
            repository: reference.repository.clone(),
        })
    }

    fn url(&self, tail: &str) -> String {
        format!("{}/v2/{}/{tail}", self.base, self.repository)
    }

    async fn send(&self, req: Request<Body>) -> Result<Response<hyper::body::Incoming>, RegistryError> {
        let url = req.uri().to_string();
        // A blob's upload is answered once all of it is sent: no limit.
        let upload = req.method() == Method::PUT && url.contains("/blobs/uploads/");
        let call = self.client.request(req);
        let resp = match upload {
            true => call.await,
            false => tokio::time::timeout(STALL, call)
                .await
                .map_err(|_| RegistryError::Invalid {
                    what: url.clone(),
                    reason: format!("the registry did not answer in {} s", STALL.as_secs()),
                })?,
        }
        .map_err(|source| RegistryError::Connect {
            url: url.clone(),
            source,
        })?;
        if resp.status() == StatusCode::UNAUTHORIZED {
            let challenge = resp
                .headers()
                .get(hyper::header::WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("no challenge")
                .to_owned();
            return Err(RegistryError::Unauthorized { url, challenge });
        }
        Ok(resp)
    }

    /// Whether blob `digest` is in the repository already.
    pub async fn has_blob(&self, digest: &str) -> Result<bool, RegistryError> {
        let url = self.url(&format!("blobs/{digest}"));
        let resp = self.send(request(Method::HEAD, &url, empty())).await?;
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
        let resp = self.send(request(Method::POST, &url, empty())).await?;
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
        let resp = self.send(req).await?;
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
        let mut req = request(Method::PUT, &url, full(bytes));
        req.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            media_type.parse().expect("a media type is a header value"),
        );
        let resp = self.send(req).await?;
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
        let mut req = request(Method::GET, &url, empty());
        req.headers_mut().insert(
            hyper::header::ACCEPT,
            media_type.parse().expect("a media type is a header value"),
        );
        let resp = self.send(req).await?;
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
        let mut resp = self.send(request(Method::GET, &url, empty())).await?;
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
            resp = self.send(request(Method::GET, &url, empty())).await?;
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

fn full(bytes: Vec<u8>) -> Body {
    BodyExt::boxed(Full::new(Bytes::from(bytes)).map_err(|never| match never {}))
}

/// A status error with the start of the answer (the registry's reason).
async fn status_error(what: String, resp: Response<hyper::body::Incoming>) -> RegistryError {
    let status = resp.status();
    let body = match tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect()).await {
        Ok(Ok(b)) => {
            let bytes = b.to_bytes();
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
                .trim()
                .to_owned()
        }
        _ => String::new(),
    };
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
