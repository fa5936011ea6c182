//! KServe v2 clients for the generator: gRPC (`raw_input_contents`) and HTTP (JSON tensors or
//! the binary-tensor extension), with `authorization: Bearer <key>`, connections opened once
//! and reused, and optional TLS ([`tls`]).
//!
//! Every call carries `authorization: Bearer <key>` when there is a key: inference requests
//! the key of their workload entry, every other call (health, metadata, config, shared-memory
//! registration) the run's default key given to [`Client::connect_with_key`]. A server that
//! answers a non-inference call with HTTP 401/403 (gRPC `UNAUTHENTICATED`/`PERMISSION_DENIED`)
//! fails it as [`ClientError::Unauthorized`].
//!
//! Request bodies are encoded once per workload entry ([`Client::prepare`]); each send clones
//! a `Bytes` handle. Responses are checked for status and drained but not decoded, so the
//! generator's own CPU stays small next to the server's. gRPC requests multiplex over a few
//! HTTP/2 channels; HTTP/1.1 requests share exactly [`Target::connections`] connections, all
//! opened (TLS handshake included) before the first request: a request waits for a free one,
//! and that wait counts in its latency.
//!
//! A request that gets no answer within the request timeout fails as
//! [`Failure::Timeout`]; one whose connection cannot be made or breaks fails as
//! [`Failure::Connection`]; status codes are kept as they came.

mod grpc;
mod http;
mod pool;
pub mod shm;
pub mod tls;

use std::time::Duration;

use bytes::Bytes;

use crate::measure::Failure;
use crate::workload::{Entry, InputTensor, ModelInfo};

pub use self::grpc::GrpcClient;
pub(crate) use self::grpc::error_chain;
pub use self::http::HttpClient;
pub use self::tls::{Tls, TlsSettings};

/// Time allowed to open one connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Attempts to reach the server at start-up before giving up.
pub const CONNECT_ATTEMPTS: u32 = 3;
/// Pause between start-up attempts.
pub const CONNECT_BACKOFF: Duration = Duration::from_millis(500);
/// Time allowed for a metadata or health call.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// Wire protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    Grpc,
    /// KServe v2 REST; `binary` selects the binary-tensor extension for inputs and outputs.
    Http {
        binary: bool,
    },
}

/// Where and how to send.
#[derive(Clone, Debug)]
pub struct Target {
    pub protocol: Protocol,
    /// `host:port`.
    pub url: String,
    /// HTTP/2 channels for gRPC; for HTTP, the HTTP/1.1 connections, all opened up front and
    /// the most requests in flight at once.
    pub connections: usize,
    /// TLS (gRPC over TLS, HTTPS); `None` for plain TCP.
    pub tls: Option<Tls>,
}

/// The client could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("model '{model}' is not available on {url}: {reason}")]
    Model { model: String, url: String, reason: String },
    /// The server refused a call for want of a (valid) API key.
    #[error("{url} refused the request: {reason}")]
    Unauthorized { url: String, reason: String },
    #[error("{0}")]
    Invalid(String),
}

/// Why a server refused a call with 401/403 (gRPC `UNAUTHENTICATED`/`PERMISSION_DENIED`),
/// given whether a key was sent.
fn unauthorized_hint(key_sent: bool) -> &'static str {
    if key_sent { "the API key was refused" } else { "no API key was sent; give one with --api-key" }
}

/// `Bearer <key>` as a header value.
fn bearer(key: &str) -> Result<::http::HeaderValue, ClientError> {
    ::http::HeaderValue::try_from(format!("Bearer {key}"))
        .map_err(|_| ClientError::Invalid("the API key is not a valid header value".into()))
}

/// One entry's request, encoded once for the target's protocol, headers included. Cloning
/// shares the body.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub series: usize,
    pub batch_size: u32,
    pub body: Bytes,
    wire: Wire,
}

#[derive(Clone, Debug)]
enum Wire {
    Grpc(grpc::GrpcParts),
    Http(http::HttpParts),
}

/// A connected client. Cheap to clone; clones share connections.
#[derive(Clone)]
pub enum Client {
    Grpc(GrpcClient),
    Http(HttpClient),
}

/// A per-task handle for sending: each closed-loop worker owns one.
pub enum Lane {
    Grpc(grpc::GrpcLane),
    Http(http::HttpLane),
}

impl Client {
    /// Connects and checks the server answers, retrying [`CONNECT_ATTEMPTS`] times; sends no
    /// key on non-inference calls ([`Client::connect_with_key`] does).
    pub async fn connect(target: &Target) -> Result<Client, ClientError> {
        Self::connect_with_key(target, None).await
    }

    /// [`Client::connect`], sending `authorization: Bearer <api_key>` on every non-inference
    /// call (health, metadata, config, shared memory); inference requests carry their entry's
    /// key ([`Client::prepare`]). A refused key is not retried.
    pub async fn connect_with_key(target: &Target, api_key: Option<&str>) -> Result<Client, ClientError> {
        let mut last = String::new();
        for attempt in 0..CONNECT_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(CONNECT_BACKOFF).await;
            }
            let result = match target.protocol {
                Protocol::Grpc => GrpcClient::connect(target, api_key).await.map(Client::Grpc),
                Protocol::Http { binary } => HttpClient::connect(target, binary, api_key).await.map(Client::Http),
            };
            match result {
                Ok(client) => return Ok(client),
                Err(ClientError::Unreachable { reason, .. }) => last = reason,
                Err(other) => return Err(other),
            }
        }
        Err(ClientError::Unreachable {
            url: target.url.clone(),
            reason: format!("{last} (after {CONNECT_ATTEMPTS} attempts)"),
        })
    }

    /// The model's inputs, outputs and max batch size, from `ModelMetadata` and `ModelConfig`.
    pub async fn model_info(&self, model: &str, version: Option<&str>) -> Result<ModelInfo, ClientError> {
        match self {
            Client::Grpc(c) => c.model_info(model, version).await,
            Client::Http(c) => c.model_info(model, version).await,
        }
    }

    /// Encodes `entry`'s request with `inputs` (or, with `shm`, naming their shared-memory
    /// slices), once. Fails only on an API key that cannot be a header value.
    pub fn prepare(
        &self,
        entry: &Entry,
        inputs: &[InputTensor],
        series: usize,
        shm: Option<&shm::ShmRequest>,
    ) -> Result<Prepared, ClientError> {
        let (body, wire) = match self {
            Client::Grpc(_) => (grpc::encode(entry, inputs, shm), Wire::Grpc(grpc::GrpcParts::new(entry)?)),
            Client::Http(c) => {
                let (body, parts) = c.encode(entry, inputs, shm)?;
                (body, Wire::Http(parts))
            }
        };
        Ok(Prepared { series, batch_size: entry.batch_size, body, wire })
    }

    /// Registers a system shared-memory region (offset 0) with the server.
    pub async fn register_system_shm(&self, name: &str, key: &str, byte_size: u64) -> Result<(), ClientError> {
        match self {
            Client::Grpc(c) => c.register_system_shm(name, key, byte_size).await,
            Client::Http(c) => c.register_system_shm(name, key, byte_size).await,
        }
    }

    /// Unregisters a system shared-memory region.
    pub async fn unregister_system_shm(&self, name: &str) -> Result<(), ClientError> {
        match self {
            Client::Grpc(c) => c.unregister_system_shm(name).await,
            Client::Http(c) => c.unregister_system_shm(name).await,
        }
    }

    /// A sending handle for the `index`-th concurrent sender (spreads senders over channels).
    pub fn lane(&self, index: usize) -> Lane {
        match self {
            Client::Grpc(c) => Lane::Grpc(c.lane(index)),
            Client::Http(c) => Lane::Http(c.lane()),
        }
    }

    /// Whether the server still answers its liveness check (bounded by [`CONTROL_TIMEOUT`]).
    /// The most requests this client can have at the server at once: HTTP/1.1 carries one
    /// per connection; `None` for gRPC, which multiplexes streams on each channel.
    pub fn max_in_flight(&self) -> Option<usize> {
        match self {
            Client::Grpc(_) => None,
            Client::Http(c) => Some(c.connections()),
        }
    }

    pub async fn is_live(&self) -> bool {
        let check = async {
            match self {
                Client::Grpc(c) => c.is_live().await,
                Client::Http(c) => c.is_live().await,
            }
        };
        tokio::time::timeout(CONTROL_TIMEOUT, check).await.unwrap_or(false)
    }
}

impl Lane {
    /// Sends one request and waits for its whole response, at most `timeout`.
    pub async fn send(&mut self, req: &Prepared, timeout: Duration) -> Result<(), Failure> {
        let call = async {
            match (self, &req.wire) {
                (Lane::Grpc(l), Wire::Grpc(parts)) => l.send(&req.body, parts).await,
                (Lane::Http(l), Wire::Http(parts)) => l.send(&req.body, parts).await,
                // A request prepared for another protocol: a bug, reported as a client error.
                _ => Err(Failure::Connection),
            }
        };
        tokio::time::timeout(timeout, call).await.unwrap_or(Err(Failure::Timeout))
    }

    /// Sends one request and returns its raw response body (the gRPC message frames, or the HTTP
    /// body), at most `timeout`. For checking what a server answers to
    /// the prepared requests; measurement uses [`Lane::send`], which decodes nothing.
    pub async fn fetch(&mut self, req: &Prepared, timeout: Duration) -> Result<Bytes, Failure> {
        let call = async {
            match (self, &req.wire) {
                (Lane::Grpc(l), Wire::Grpc(parts)) => l.fetch(&req.body, parts).await,
                (Lane::Http(l), Wire::Http(parts)) => l.fetch(&req.body, parts).await,
                _ => Err(Failure::Connection),
            }
        };
        tokio::time::timeout(timeout, call).await.unwrap_or(Err(Failure::Timeout))
    }
}

/// `host:port` from `host:port`, `http://host:port[/]`, for plain-HTTP addresses (a bare
/// `--metrics-url host:port`); refuses `https://` (TLS URLs go through [`split_url`]) and
/// anything else with a path.
pub fn normalize_url(url: &str) -> Result<String, String> {
    match split_url(url)? {
        (_, true) => Err(format!("'{url}': TLS (https://) is not supported here; use a plain host:port")),
        (host_port, false) => Ok(host_port),
    }
}

/// `(host:port, https)` from `host:port`, `http://host:port[/]` or `https://host:port[/]`;
/// refuses other schemes and anything with a path.
pub fn split_url(url: &str) -> Result<(String, bool), String> {
    let (rest, https) = if let Some(r) = url.strip_prefix("http://") {
        (r, false)
    } else if let Some(r) = url.strip_prefix("https://") {
        (r, true)
    } else if url.contains("://") {
        return Err(format!("'{url}': expected host:port"));
    } else {
        (url, false)
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') {
        return Err(format!("'{url}': expected host:port"));
    }
    let uri: ::http::Uri =
        format!("http://{rest}").parse().map_err(|e| format!("'{url}': expected host:port ({e})"))?;
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("'{url}': expected host:port"));
    }
    Ok((rest.to_string(), https))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_host_port() {
        assert_eq!(normalize_url("localhost:8001").unwrap(), "localhost:8001");
        assert_eq!(normalize_url("http://127.0.0.1:8000/").unwrap(), "127.0.0.1:8000");
        assert!(normalize_url("https://x:1").unwrap_err().contains("TLS"));
        assert!(normalize_url("x:1/v2").is_err());
        assert!(normalize_url("").is_err());
        assert!(normalize_url("grpc://x:1").is_err());
        assert_eq!(split_url("https://h:443/").unwrap(), ("h:443".to_string(), true));
        assert_eq!(split_url("h:1").unwrap(), ("h:1".to_string(), false));
        assert!(split_url("https://h:1/x").is_err());
    }
}
