//! A JSON client for HTTP/1.1 over a unix socket ([`UnixClient`]): crabd
//! calls shims with it, and [`Crabd`], the typed client of crabd's API that
//! crabctl and shims use, is built on it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::crabd::{ErrorBody, ErrorCode};

mod crabd;

pub use crabd::{Crabd, Progress};

/// What a call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens on the socket.
    #[error("cannot reach {what} at {}", socket.display())]
    Connect {
        /// Who should listen ("crabd", "the shim of s1").
        what: String,
        /// The socket.
        socket: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection broke or the answer was not HTTP.
    #[error("{what} at {} broke off the call", socket.display())]
    Transport {
        /// Who answered.
        what: String,
        /// The socket.
        socket: PathBuf,
        /// Why.
        #[source]
        source: hyper::Error,
    },
    /// The call took longer than its limit.
    #[error("{what} did not answer within {secs} s")]
    Timeout {
        /// Who was called.
        what: String,
        /// The limit.
        secs: u64,
    },
    /// The server refused the call.
    #[error("{message}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// What kind of refusal, as the server said.
        code: ErrorCode,
        /// The server's explanation.
        message: String,
    },
    /// A local file of the transfer could not be read or written.
    #[error("{}", path.display())]
    Local {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A streamed answer ended before the length the server announced.
    #[error("{what} broke off the transfer after {received} of {expected} bytes")]
    Truncated {
        /// Who answered.
        what: String,
        /// Bytes received.
        received: u64,
        /// Bytes announced.
        expected: u64,
    },
    /// The answer was not the JSON expected.
    #[error("{what} answered with unexpected content")]
    Decode {
        /// Who answered.
        what: String,
        /// Why it did not parse.
        #[source]
        source: serde_json::Error,
    },
}

/// A client of one unix socket.
#[derive(Debug, Clone)]
pub struct UnixClient {
    socket: PathBuf,
    what: String,
    timeout: Duration,
}

// === impl UnixClient ===

impl UnixClient {
    /// A client of `socket`, named `what` in errors, with calls limited to
    /// `timeout`.
    pub fn new(socket: impl AsRef<Path>, what: impl Into<String>, timeout: Duration) -> Self {
        UnixClient {
            socket: socket.as_ref().to_owned(),
            what: what.into(),
            timeout,
        }
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `GET path`, decoding the JSON answer.
    pub async fn get<R: DeserializeOwned>(&self, path: &str) -> Result<R, ClientError> {
        self.call(Method::GET, path, None::<&()>).await
    }

    /// `POST path` with a JSON body, decoding the JSON answer.
    pub async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, ClientError> {
        self.call(Method::POST, path, Some(body)).await
    }

    /// `GET path`, answering the body as text (a non-JSON answer).
    pub async fn get_text(&self, path: &str) -> Result<String, ClientError> {
        let work = async {
            let resp = self.send(bare_get(path)).await?;
            let body = self.ok_body(resp).await?;
            Ok(String::from_utf8_lossy(&body).into_owned())
        };
        self.limited(work).await
    }

    /// `DELETE path`, decoding the JSON answer.
    pub async fn delete<R: DeserializeOwned>(&self, path: &str) -> Result<R, ClientError> {
        self.call(Method::DELETE, path, None::<&()>).await
    }

    async fn call<B: Serialize, R: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<R, ClientError> {
        self.limited(self.call_once(method, path, body)).await
    }

    async fn call_once<B: Serialize, R: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<R, ClientError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).expect("API types always serialize"),
            None => Vec::new(),
        };
        let req = Request::builder()
            .method(method)
            .uri(format!("http://crab{path}"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(bytes)))
            .expect("a well-formed request");
        let resp = self.send(req).await?;
        let body = self.ok_body(resp).await?;
        serde_json::from_slice(&body).map_err(|source| ClientError::Decode {
            what: self.what.clone(),
            source,
        })
    }

    /// `GET path`, streaming the answer into `dst` (written as
    /// `dst.partial`, renamed when whole); `progress` sees the bytes so far
    /// and the total when the server said it.
    pub async fn download(
        &self,
        path: &str,
        dst: &Path,
        progress: &(dyn Fn(u64, Option<u64>) + Sync),
    ) -> Result<u64, ClientError> {
        use tokio::io::AsyncWriteExt;
        let req = Request::builder()
            .method(Method::GET)
            .uri(format!("http://crab{path}"))
            .body(Full::new(Bytes::new()))
            .expect("a well-formed request");
        let work = async {
            let resp = self.send(req).await?;
            if resp.status() != StatusCode::OK {
                self.ok_body(resp).await?;
                unreachable!("ok_body refuses every other status");
            }
            let total = resp
                .headers()
                .get(hyper::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            // `x.crab.partial`: beside the archive, never another file's name.
            let mut name = dst.file_name().unwrap_or_default().to_owned();
            name.push(".partial");
            let partial = dst.with_file_name(name);
            let local = |source| ClientError::Local {
                path: partial.clone(),
                source,
            };
            // An archive holds memory images and the spec's environment
            // (API keys): the downloader's alone.
            let mut file = tokio::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&partial)
                .await
                .map_err(local)?;
            let mut body = resp.into_body();
            // Whatever cuts the download short (crabd gone mid-answer, a
            // full disk, the timeout dropping this future) leaves no
            // partial file behind.
            let mut cleanup = RemoveOnDrop(Some(partial.clone()));
            let written = async {
                let mut n = 0u64;
                while let Some(frame) = body.frame().await {
                    let frame = frame.map_err(|source| self.transport(source))?;
                    if let Some(data) = frame.data_ref() {
                        file.write_all(data).await.map_err(local)?;
                        n += data.len() as u64;
                        progress(n, total);
                    }
                }
                if let Some(expected) = total.filter(|t| *t != n) {
                    return Err(ClientError::Truncated {
                        what: self.what.clone(),
                        received: n,
                        expected,
                    });
                }
                file.sync_all().await.map_err(local)?;
                tokio::fs::rename(&partial, dst).await.map_err(local)?;
                Ok(n)
            }
            .await;
            if written.is_ok() {
                cleanup.0 = None;
            }
            written
        };
        self.limited(work).await
    }

    /// `POST path` with the content of `src` as the body, decoding the JSON
    /// answer; `progress` sees the bytes sent so far and the total.
    pub async fn upload<R: DeserializeOwned>(
        &self,
        path: &str,
        src: &Path,
        progress: &(dyn Fn(u64, Option<u64>) + Sync),
    ) -> Result<R, ClientError> {
        use http_body_util::StreamBody;
        use tokio_stream::StreamExt;
        let local = |source| ClientError::Local {
            path: src.to_owned(),
            source,
        };
        let file = tokio::fs::File::open(src).await.map_err(local)?;
        let total = file.metadata().await.map_err(local)?.len();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let mut sent = 0u64;
        let stream = tokio_util::io::ReaderStream::new(file).map(move |chunk| {
            chunk.map(|b| {
                sent += b.len() as u64;
                let _ = tx.send(sent);
                hyper::body::Frame::data(b)
            })
        });
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("http://crab{path}"))
            .header(hyper::header::CONTENT_LENGTH, total)
            .header(hyper::header::CONTENT_TYPE, "application/x-tar")
            .body(StreamBody::new(stream))
            .expect("a well-formed request");
        let work = async {
            let call = async {
                let resp = self.send(req).await?;
                let body = self.ok_body(resp).await?;
                serde_json::from_slice(&body).map_err(|source| ClientError::Decode {
                    what: self.what.clone(),
                    source,
                })
            };
            tokio::pin!(call);
            loop {
                tokio::select! {
                    r = &mut call => return r,
                    Some(n) = rx.recv() => progress(n, Some(total)),
                }
            }
        };
        self.limited(work).await
    }

    /// `GET path`, handing each line of the streamed answer to `on_line`
    /// until the server ends it or `on_line` returns false. No time limit:
    /// a watch runs as long as its caller wants.
    pub async fn lines(&self, path: &str, mut on_line: impl FnMut(&str) -> bool) -> Result<(), ClientError> {
        let resp = self.send(bare_get(path)).await?;
        if resp.status() != StatusCode::OK {
            self.ok_body(resp).await?;
            unreachable!("ok_body refuses every other status");
        }
        let mut body = resp.into_body();
        let mut pending: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|source| self.transport(source))?;
            let Some(data) = frame.data_ref() else { continue };
            pending.extend_from_slice(data);
            while let Some(at) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=at).collect();
                if !on_line(String::from_utf8_lossy(&line[..at]).as_ref()) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    async fn limited<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        let secs = self.timeout.as_secs();
        match tokio::time::timeout(self.timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Timeout {
                what: self.what.clone(),
                secs,
            }),
        }
    }

    fn transport(&self, source: hyper::Error) -> ClientError {
        ClientError::Transport {
            what: self.what.clone(),
            socket: self.socket.clone(),
            source,
        }
    }

    async fn send<B>(&self, req: Request<B>) -> Result<hyper::Response<hyper::body::Incoming>, ClientError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| ClientError::Connect {
                what: self.what.clone(),
                socket: self.socket.clone(),
                source,
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| self.transport(e))?;
        // Ends with the connection, when this call is done.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        sender.send_request(req).await.map_err(|e| self.transport(e))
    }

    /// The whole body of a 200 answer, or the refusal the server explained.
    async fn ok_body(&self, resp: hyper::Response<hyper::body::Incoming>) -> Result<Bytes, ClientError> {
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| self.transport(e))?
            .to_bytes();
        if status != StatusCode::OK {
            let (code, message) = match serde_json::from_slice::<ErrorBody>(&body) {
                Ok(e) => (e.code, e.error),
                Err(_) => (
                    ErrorCode::Unknown,
                    format!(
                        "{} answered {status}: {}",
                        self.what,
                        String::from_utf8_lossy(&body)
                    ),
                ),
            };
            return Err(ClientError::Refused {
                status: status.as_u16(),
                code,
                message,
            });
        }
        Ok(body)
    }
}

/// `GET path` with no body.
fn bare_get(path: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::GET)
        .uri(format!("http://crab{path}"))
        .body(Full::new(Bytes::new()))
        .expect("a well-formed request")
}

/// Removes a file when dropped, unless disarmed (`.0 = None`).
struct RemoveOnDrop(Option<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}
