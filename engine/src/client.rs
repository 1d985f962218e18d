//! A JSON client for HTTP/1.1 over a unix socket: crabctl and shims call
//! crabd with it, crabd calls shims.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::ErrorBody;

/// What a call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens on the socket.
    #[error("cannot reach {what} at {}: {source}", socket.display())]
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
    #[error("{what} at {} broke off the call: {source}", socket.display())]
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
        /// The server's explanation.
        message: String,
    },
    /// The answer was not the JSON expected.
    #[error("{what} answered with unexpected content: {source}")]
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
        let secs = self.timeout.as_secs();
        match tokio::time::timeout(self.timeout, self.call_once(method, path, body)).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Timeout {
                what: self.what.clone(),
                secs,
            }),
        }
    }

    async fn call_once<B: Serialize, R: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<R, ClientError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| ClientError::Connect {
                what: self.what.clone(),
                socket: self.socket.clone(),
                source,
            })?;
        let transport = |source| ClientError::Transport {
            what: self.what.clone(),
            socket: self.socket.clone(),
            source,
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(transport)?;
        // Ends with the connection, when this call is done.
        tokio::spawn(conn);
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
        let resp = sender.send_request(req).await.map_err(transport)?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(transport)?.to_bytes();
        if status != StatusCode::OK {
            let message = serde_json::from_slice::<ErrorBody>(&body)
                .map(|e| e.error)
                .unwrap_or_else(|_| {
                    format!(
                        "{} answered {status}: {}",
                        self.what,
                        String::from_utf8_lossy(&body)
                    )
                });
            return Err(ClientError::Refused {
                status: status.as_u16(),
                message,
            });
        }
        serde_json::from_slice(&body).map_err(|source| ClientError::Decode {
            what: self.what.clone(),
            source,
        })
    }
}
