//! The forward path's gRPC client: unary calls with encoded messages over HTTP/2 connections to
//! each worker (`--upstream-connections`, one by default), on `h2` directly.
//!
//! Why not tonic's `Channel` (which the control calls still use): hyper's HTTP/2 client waits
//! for a new stream to be *opened* — its HEADERS written and flushed — before it polls the
//! request body, so every forwarded request left the gateway in two writes (HEADERS, then
//! DATA). The worker then woke twice per request, and the gateway made an extra system call
//! and an extra task hop (tonic's buffer task) per request. Here the HEADERS and the DATA are
//! queued together and leave in one write.
//!
//! The connection is made on first use and again on the first call after it breaks (a call
//! made while the worker cannot be reached fails fast with a *connect* error, which the retry
//! policy knows was never sent). An idle connection is probed with HTTP/2 PINGs and closed when
//! the worker stops answering them, failing its open calls.
//!
//! When a connection breaks, h2 fails every open call alike, whether or not its request ever
//! left the gateway. The socket is watched ([`Observed`]) so that a call can tell two cases
//! apart where the worker provably never saw its request, and be retried (gRPC's "transparent
//! retry"): nothing was written to the socket after the request was queued, as the connection
//! ended (a worker killed with requests unread in its socket resets the connection, and the
//! write of a request queued after that fails), or the worker reset a connection on which it
//! never sent a byte (an HTTP/2 server writes its SETTINGS before it reads a request; a worker
//! killed while its kernel was still completing our connection accepted it in no process). A
//! worker that closed the connection cleanly (a FIN: it had read everything) is not caught this
//! way: a request queued before the gateway's event loop noticed is written into the closed
//! socket and fails as Broken. Nor is a connection the gateway itself gave up (keepalive): the
//! worker's kernel may hold the request for a process that reads it later.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use h2::client::SendRequest;
use http::HeaderMap;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How long a broken connection's task is given to end before its byte counters are read
/// (see [`Wire::unsent`]): one that takes longer proves nothing.
const TASK_END_WAIT: Duration = Duration::from_secs(1);

/// Said of a call that failed because the connection attempt it waited on failed.
const SHARED_FAILURE: &str = "a concurrent attempt to connect to the worker just failed";

/// Settings of a worker connection.
#[derive(Clone, Copy, Debug)]
pub struct ClientSettings {
    /// HTTP/2 receive windows (connection, per stream) for the worker's responses.
    pub connection_window: u32,
    pub stream_window: u32,
    /// A PING every `keepalive_interval`; no answer within `keepalive_timeout` closes the
    /// connection (a dead peer that sent no FIN/RST), failing its open calls.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// Time to establish the TCP connection and the HTTP/2 handshake (--connect-timeout-ms).
    pub connect_timeout: Duration,
}

/// One of a worker's forwarding connections (made lazily, remade after it breaks).
#[derive(Debug)]
pub struct H2Channel {
    address: String,
    authority: http::uri::Authority,
    settings: ClientSettings,
    current: Mutex<Option<Live>>,
    /// Held while connecting, so that calls arriving meanwhile wait for that one connection.
    connecting: tokio::sync::Mutex<()>,
    /// When the last connection attempt failed, and why: calls that waited on that attempt
    /// fail at once with it (and are retried elsewhere) instead of each trying again in turn.
    failed: Mutex<Option<(std::time::Instant, std::io::ErrorKind, String)>>,
}

#[derive(Debug)]
struct Live {
    send: SendRequest<Bytes>,
    wire: Arc<Wire>,
}

impl Drop for Live {
    fn drop(&mut self) {
        // The connection task ends once every handle is gone and its streams are done; marking it
        // closed makes sure no later call picks it up meanwhile.
        self.wire.closed.store(true, Ordering::Relaxed);
    }
}

/// What is known of one connection's socket.
#[derive(Debug, Default)]
struct Wire {
    /// No call may use it any more (it failed, or nobody drives it).
    closed: AtomicBool,
    /// Bytes the gateway has written to the socket.
    written: AtomicU64,
    /// Whether the worker has sent a byte on it.
    heard: AtomicBool,
    /// Cancelled when the connection task has ended: nothing more is written.
    ended: tokio_util::sync::CancellationToken,
}

impl Wire {
    fn written(&self) -> u64 {
        self.written.load(Ordering::Acquire)
    }

    /// Why a call whose request was queued when `written_before` bytes had been written, and
    /// that failed with `failure` (the connection's) before any answer, provably never reached
    /// the worker; `None` where it may have.
    ///
    /// h2 fails the streams before the connection task is done (a clean close still flushes
    /// what h2 had buffered): the counters are read once the task has ended — they are final
    /// then — and a task that does not end soon proves nothing.
    async fn unsent(&self, failure: &std::io::Error, written_before: u64) -> Option<&'static str> {
        if tokio::time::timeout(TASK_END_WAIT, self.ended.cancelled()).await.is_err() {
            return None;
        }
        if failure.kind() == std::io::ErrorKind::ConnectionReset && !self.heard.load(Ordering::Acquire) {
            Some("the worker reset a connection it never spoke on: no process read the request")
        } else if self.written() == written_before {
            Some("the connection failed before the request was written")
        } else {
            None
        }
    }
}

/// A worker connection's socket, counting what crosses it (see [`Wire`]).
struct Observed {
    io: TcpStream,
    wire: Arc<Wire>,
}

impl AsyncRead for Observed {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before && !self.wire.heard.load(Ordering::Relaxed) {
            self.wire.heard.store(true, Ordering::Release);
        }
        read
    }
}

impl Observed {
    fn count(&self, written: Poll<std::io::Result<usize>>) -> Poll<std::io::Result<usize>> {
        if let Poll::Ready(Ok(n)) = written {
            self.wire.written.fetch_add(n as u64, Ordering::Release);
        }
        written
    }
}

impl AsyncWrite for Observed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write(cx, buf);
        self.count(written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.count(written)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A failed call, by what it proves (the caller classifies the status it carries).
#[derive(Debug)]
pub enum CallError {
    /// Connecting failed, or the connection refused the new stream before anything was sent,
    /// or failed before the request could reach the worker (see [`Wire::unsent`]).
    Connect(std::io::Error),
    /// The connection or stream failed (h2 says whether the worker processed the stream).
    H2(h2::Error),
    /// The worker answered with a gRPC status other than OK (or a malformed answer).
    Status(tonic::Status),
}

/// Whether `status` is a call's failure to connect that only shared another call's failed
/// attempt (it waited on that attempt): one lost SYN with five calls waiting is one failure of
/// the worker, not six.
pub fn is_shared_connect_failure(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.to_string().ends_with(&format!("({SHARED_FAILURE})"))
        {
            return true;
        }
        source = e.source();
    }
    false
}

impl CallError {
    pub fn into_status(self) -> tonic::Status {
        match self {
            CallError::Connect(e) => tonic::Status::from_error(Box::new(tonic::ConnectError(Box::new(e)))),
            CallError::H2(e) => tonic::Status::from_error(Box::new(e)),
            CallError::Status(s) => s,
        }
    }
}

impl H2Channel {
    /// A channel to `address` (`host:port`); nothing is connected yet.
    pub fn new(address: &str, settings: ClientSettings) -> Result<H2Channel, http::uri::InvalidUri> {
        Ok(H2Channel {
            address: address.to_string(),
            authority: address.parse()?,
            settings,
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            failed: Mutex::new(None),
        })
    }

    /// The current connection's handle and what is known of it, unless it is marked closed.
    fn live(&self) -> Option<(SendRequest<Bytes>, Arc<Wire>)> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        match current.as_ref() {
            Some(live) if !live.wire.closed.load(Ordering::Relaxed) => Some((live.send.clone(), live.wire.clone())),
            Some(_) => {
                *current = None;
                None
            }
            None => None,
        }
    }

    /// The live connection, or a new one; `on_connect` hears of each attempt this call makes
    /// (`true`: connected).
    async fn sender(&self, on_connect: &(dyn Fn(bool) + Sync)) -> Result<(SendRequest<Bytes>, Arc<Wire>), CallError> {
        if let Some(live) = self.live() {
            return Ok(live);
        }
        let waiting_since = std::time::Instant::now();
        let _connecting = self.connecting.lock().await;
        if let Some(live) = self.live() {
            return Ok(live);
        }
        if let Some((at, kind, reason)) = self.failed.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
            && *at >= waiting_since
        {
            return Err(CallError::Connect(std::io::Error::new(*kind, format!("{reason} ({SHARED_FAILURE})"))));
        }
        let attempt = tokio::time::timeout(self.settings.connect_timeout, self.connect()).await.unwrap_or_else(|_| {
            let limit = self.settings.connect_timeout.as_millis();
            let e = format!("no connection within {limit} ms (--connect-timeout-ms)");
            Err(CallError::Connect(std::io::Error::new(std::io::ErrorKind::TimedOut, e)))
        });
        on_connect(attempt.is_ok());
        let (send, wire) = match attempt {
            Ok(live) => live,
            Err(CallError::Connect(e)) => {
                *self.failed.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((std::time::Instant::now(), e.kind(), e.to_string()));
                return Err(CallError::Connect(e));
            }
            Err(e) => return Err(e),
        };
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(Live { send: send.clone(), wire: wire.clone() });
        Ok((send, wire))
    }

    async fn connect(&self) -> Result<(SendRequest<Bytes>, Arc<Wire>), CallError> {
        let tcp = TcpStream::connect(&self.address).await.map_err(CallError::Connect)?;
        tcp.set_nodelay(true).map_err(CallError::Connect)?;
        let wire = Arc::new(Wire::default());
        let tcp = Observed { io: tcp, wire: wire.clone() };
        let (send, mut connection) = h2::client::Builder::new()
            .initial_window_size(self.settings.stream_window)
            .initial_connection_window_size(self.settings.connection_window)
            .enable_push(false)
            .handshake::<_, Bytes>(tcp)
            .await
            .map_err(|e| CallError::Connect(std::io::Error::other(e)))?;
        let mut ping = connection.ping_pong();
        let address = self.address.clone();
        let done = wire.clone();
        let (interval, timeout) = (self.settings.keepalive_interval, self.settings.keepalive_timeout);
        tokio::spawn(async move {
            let keepalive = async {
                let Some(ping) = ping.as_mut() else { return std::future::pending().await };
                loop {
                    tokio::time::sleep(interval).await;
                    match tokio::time::timeout(timeout, ping.ping(h2::Ping::opaque())).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return format!("keepalive PING failed: {e}"),
                        Err(_) => return format!("no PING answer within {timeout:?}"),
                    }
                }
            };
            tokio::select! {
                result = &mut connection => match result {
                    Ok(()) => tracing::debug!(worker = %address, "worker connection closed"),
                    Err(e) => tracing::debug!(worker = %address, "worker connection failed: {e}"),
                },
                reason = keepalive => tracing::warn!(worker = %address, "closing the worker connection: {reason}"),
            }
            // Marked before the connection is dropped (which fails its open streams), so that no
            // new call queues a stream on a connection nobody drives any more.
            done.closed.store(true, Ordering::Relaxed);
            drop(connection);
            done.ended.cancel();
        });
        Ok((send, wire))
    }

    /// One unary call: `message` (an encoded protobuf) to `path`, with `timeout` sent as
    /// `grpc-timeout` (the caller enforces it). Returns the response headers and the encoded
    /// response message. `on_connect` hears of each connection attempt the call makes.
    pub async fn unary(
        &self,
        path: &'static str,
        message: Bytes,
        timeout: Duration,
        on_connect: &(dyn Fn(bool) + Sync),
    ) -> Result<(HeaderMap, Bytes), CallError> {
        self.unary_parts(path, [message, Bytes::new()], timeout, on_connect).await
    }

    /// [`Self::unary`] with a message sent as two parts, one after the other, neither copied:
    /// e.g. an encoded message and a field appended to it (a later occurrence of a protobuf
    /// field overrides an earlier one).
    pub async fn unary_parts(
        &self,
        path: &'static str,
        parts: [Bytes; 2],
        timeout: Duration,
        on_connect: &(dyn Fn(bool) + Sync),
    ) -> Result<(HeaderMap, Bytes), CallError> {
        // A connection that closed a moment ago may not be marked yet: one that refuses the
        // new stream is retired and the call goes to a fresh one (nothing was sent on it).
        let (send, mut wire) = self.sender(on_connect).await?;
        let mut send = match send.ready().await {
            Ok(send) => send,
            Err(_) => {
                wire.closed.store(true, Ordering::Relaxed);
                let (send, fresh) = self.sender(on_connect).await?;
                wire = fresh;
                send.ready().await.map_err(|e| broken(e, true, &wire))?
            }
        };
        // Read before the request is queued: the connection task may write it at once.
        let written_before = wire.written();
        // Made field by field: no header name or URI is parsed per call.
        let mut request = http::Request::new(());
        *request.method_mut() = http::Method::POST;
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(http::uri::Scheme::HTTP);
        uri.authority = Some(self.authority.clone());
        uri.path_and_query = Some(http::uri::PathAndQuery::from_static(path));
        *request.uri_mut() = http::Uri::from_parts(uri).expect("scheme, authority and a path make a valid URI");
        let headers = request.headers_mut();
        headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
        headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        headers.insert(GRPC_TIMEOUT, grpc_timeout_value(timeout));
        // Before the stream opens: a message h2 cannot carry is refused without the worker seeing
        // a stream opened and cancelled.
        let prefix = grpc_prefix(parts.iter().map(Bytes::len).sum()).map_err(CallError::Status)?;
        let (response, mut body) = send.send_request(request, false).map_err(|e| broken(e, true, &wire))?;
        // Queued behind the HEADERS: all leave in the connection's next write.
        body.send_data(prefix, false).map_err(|e| broken(e, true, &wire))?;
        let [first, second] = parts;
        if second.is_empty() {
            body.send_data(first, true).map_err(|e| broken(e, true, &wire))?;
        } else {
            body.send_data(first, false).map_err(|e| broken(e, true, &wire))?;
            body.send_data(second, true).map_err(|e| broken(e, true, &wire))?;
        }

        let response = match response.await {
            Ok(response) => response,
            Err(e) => {
                let unsent = match e.get_io() {
                    Some(io) => wire.unsent(io, written_before).await.map(|why| (io.kind(), why)),
                    None => None,
                };
                return Err(match unsent {
                    Some((kind, why)) => {
                        wire.closed.store(true, Ordering::Relaxed);
                        CallError::Connect(std::io::Error::new(kind, format!("{e} ({why})")))
                    }
                    None => broken(e, false, &wire),
                });
            }
        };
        let (parts, mut stream) = response.into_parts();
        if parts.status != http::StatusCode::OK {
            // A grpc-status, where a proxy left one, says more than the HTTP status.
            let status = tonic::Status::from_header_map(&parts.headers)
                .filter(|s| s.code() != tonic::Code::Ok)
                .unwrap_or_else(|| status_from_http(parts.status));
            return Err(CallError::Status(status));
        }
        // Trailers-only: an error (or an empty OK, which a unary call must not give).
        if let Some(status) = tonic::Status::from_header_map(&parts.headers) {
            return Err(CallError::Status(if status.code() == tonic::Code::Ok {
                tonic::Status::internal("worker answered OK without a response message")
            } else {
                status
            }));
        }
        let mut chunks: Vec<Bytes> = Vec::with_capacity(1);
        while let Some(chunk) = stream.data().await {
            let chunk = chunk.map_err(|e| broken(e, false, &wire))?;
            let _ = stream.flow_control().release_capacity(chunk.len());
            chunks.push(chunk);
        }
        let trailers = stream.trailers().await.map_err(|e| broken(e, false, &wire))?;
        match trailers.as_ref().and_then(tonic::Status::from_header_map) {
            Some(status) if status.code() == tonic::Code::Ok => {}
            Some(status) => return Err(CallError::Status(status)),
            None => return Err(CallError::Status(tonic::Status::internal("worker response has no grpc-status"))),
        }
        let message = unframe(chunks).map_err(CallError::Status)?;
        Ok((parts.headers, message))
    }
}

/// An h2 error on a call made on the connection `wire`; `before_sending`: the request cannot
/// have reached the worker whole (its last DATA frame was not queued). A connection-level
/// failure marks that connection — not a newer one — closed.
fn broken(e: h2::Error, before_sending: bool, wire: &Wire) -> CallError {
    if e.is_io() || e.is_go_away() {
        wire.closed.store(true, Ordering::Relaxed);
    }
    if before_sending { CallError::Connect(std::io::Error::other(e)) } else { CallError::H2(e) }
}

const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// [`grpc_timeout`] as a header value.
fn grpc_timeout_value(timeout: Duration) -> http::HeaderValue {
    http::HeaderValue::try_from(grpc_timeout(timeout)).expect("digits and a unit letter make a valid header value")
}

/// `grpc-timeout`: at most 8 digits, in the finest unit that holds the value.
pub fn grpc_timeout(timeout: Duration) -> String {
    let micros = timeout.as_micros();
    let millis = timeout.as_millis();
    let seconds = u128::from(timeout.as_secs());
    match () {
        _ if micros < 100_000_000 => format!("{micros}u"),
        _ if millis < 100_000_000 => format!("{millis}m"),
        _ if seconds < 100_000_000 => format!("{seconds}S"),
        _ => format!("{}M", (seconds / 60).min(99_999_999)),
    }
}

/// The 5-byte gRPC message prefix: not compressed, big-endian length.
fn grpc_prefix(len: usize) -> Result<Bytes, tonic::Status> {
    // h2 refuses a DATA payload of 2^31 bytes or more.
    let len = u32::try_from(len)
        .ok()
        .filter(|&l| l <= i32::MAX as u32)
        // Not RESOURCE_EXHAUSTED: that reads as overload, which clients retry.
        .ok_or_else(|| tonic::Status::invalid_argument("a request message over 2 GiB cannot be forwarded"))?;
    let mut prefix = BytesMut::with_capacity(5);
    prefix.extend_from_slice(&[0]);
    prefix.extend_from_slice(&len.to_be_bytes());
    Ok(prefix.freeze())
}

/// The one gRPC message of a unary response, from the DATA chunks as received (without a copy
/// when it arrived in one chunk).
pub fn unframe(chunks: Vec<Bytes>) -> Result<Bytes, tonic::Status> {
    let mut body = if chunks.len() == 1 {
        chunks.into_iter().next().expect("one chunk")
    } else {
        let mut all = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
        for c in chunks {
            all.extend_from_slice(&c);
        }
        all.freeze()
    };
    if body.len() < 5 {
        return Err(tonic::Status::internal("worker response message is truncated"));
    }
    let compressed = body[0];
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if compressed != 0 {
        return Err(tonic::Status::internal("worker sent a compressed response, which was not asked for"));
    }
    body.advance(5);
    if body.len() != len {
        return Err(tonic::Status::internal(format!(
            "worker response framing: message of {len} bytes announced, {} received",
            body.len()
        )));
    }
    Ok(body)
}

/// The gRPC status for a non-200 HTTP answer without a grpc-status (the gRPC-over-HTTP/2
/// mapping), except 502 and 504: those come from an intermediary that may have forwarded the
/// request before failing, so they are not proof that the worker did not run it, and map to
/// UNKNOWN, which is never retried, rather than UNAVAILABLE, which is.
fn status_from_http(status: http::StatusCode) -> tonic::Status {
    let code = match status.as_u16() {
        400 => tonic::Code::Internal,
        401 => tonic::Code::Unauthenticated,
        403 => tonic::Code::PermissionDenied,
        404 => tonic::Code::Unimplemented,
        429 | 503 => tonic::Code::Unavailable,
        _ => tonic::Code::Unknown,
    };
    tonic::Status::new(code, format!("worker answered HTTP {status}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_fit_eight_digits() {
        assert_eq!(grpc_timeout(Duration::from_millis(995)), "995000u");
        assert_eq!(grpc_timeout(Duration::from_secs(99)), "99000000u");
        assert_eq!(grpc_timeout(Duration::from_secs(100)), "100000m");
        // Past 8 digits of milliseconds (27.8 h), seconds; past those (3.2 years), minutes.
        assert_eq!(grpc_timeout(Duration::from_secs(10_000_000)), "10000000S");
        assert_eq!(grpc_timeout(Duration::from_secs(200_000_000)), "3333333M");
        assert_eq!(grpc_timeout(Duration::from_secs(u64::MAX)), "99999999M");
    }

    #[test]
    fn messages_h2_cannot_carry_are_refused_before_sending() {
        assert_eq!(&grpc_prefix(5).unwrap()[..], &[0, 0, 0, 0, 5]);
        assert!(grpc_prefix(i32::MAX as usize).is_ok());
        let e = grpc_prefix(i32::MAX as usize + 1).unwrap_err();
        // Not RESOURCE_EXHAUSTED, which clients read as overload and retry.
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn responses_are_unframed_whole_or_refused() {
        assert_eq!(unframe(vec![framed(b"abc")]).unwrap(), Bytes::from_static(b"abc"));
        let f = framed(b"hello");
        let split = vec![f.slice(..3), f.slice(3..7), f.slice(7..)];
        assert_eq!(unframe(split).unwrap(), Bytes::from_static(b"hello"));
        assert!(unframe(vec![Bytes::from_static(&[0, 0, 0])]).unwrap_err().message().contains("truncated"));
        let short = framed(b"hello").slice(..8);
        assert!(unframe(vec![short]).unwrap_err().message().contains("5 bytes announced, 3 received"));
        let mut compressed = framed(b"x").to_vec();
        compressed[0] = 1;
        assert!(unframe(vec![Bytes::from(compressed)]).unwrap_err().message().contains("compressed"));
    }

    #[test]
    fn http_failures_map_to_grpc_codes() {
        assert_eq!(status_from_http(http::StatusCode::SERVICE_UNAVAILABLE).code(), tonic::Code::Unavailable);
        assert_eq!(status_from_http(http::StatusCode::TOO_MANY_REQUESTS).code(), tonic::Code::Unavailable);
        // Possibly forwarded and run before the intermediary failed: not retryable.
        for maybe_run in [http::StatusCode::BAD_GATEWAY, http::StatusCode::GATEWAY_TIMEOUT] {
            let status = status_from_http(maybe_run);
            assert_eq!(status.code(), tonic::Code::Unknown);
            assert!(!crate::forward::FailureKind::classify(&status).safe_to_retry());
        }
        assert_eq!(status_from_http(http::StatusCode::NOT_FOUND).code(), tonic::Code::Unimplemented);
        assert_eq!(status_from_http(http::StatusCode::IM_A_TEAPOT).code(), tonic::Code::Unknown);
    }

    #[test]
    fn connect_errors_are_classified_as_never_sent() {
        let refused = CallError::Connect(std::io::ErrorKind::ConnectionRefused.into()).into_status();
        assert_eq!(crate::forward::FailureKind::classify(&refused), crate::forward::FailureKind::NotSent);
        let reset = CallError::H2(h2::Error::from(h2::Reason::INTERNAL_ERROR)).into_status();
        assert_eq!(crate::forward::FailureKind::classify(&reset), crate::forward::FailureKind::Broken);
    }

    #[tokio::test]
    async fn an_unreachable_worker_fails_fast_with_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        drop(listener);
        let channel = H2Channel::new(&address, settings()).unwrap();
        let e = channel.unary("/x/y", Bytes::new(), Duration::from_secs(1), &|_| {}).await.unwrap_err();
        assert!(matches!(e, CallError::Connect(_)), "{e:?}");
    }

    /// A worker host that went silent, on loopback: a listener with a backlog of one that
    /// never accepts, its queue filled by one connection, so the kernel drops further SYNs and
    /// connecting hangs until the connect timeout. Its address, and what keeps it so.
    fn silent_host() -> (String, (tokio::net::TcpListener, std::net::TcpStream)) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let address = listener.local_addr().unwrap();
        let filler = std::net::TcpStream::connect(address).unwrap();
        (address.to_string(), (listener, filler))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_waiting_on_a_failed_connect_share_its_failure() {
        let (address, _host) = silent_host();
        let channel = H2Channel::new(&address, settings()).unwrap();
        let attempts = std::sync::atomic::AtomicUsize::new(0);
        let count = |ok: bool| {
            assert!(!ok);
            attempts.fetch_add(1, Ordering::SeqCst);
        };
        let calls = (0..4).map(|_| channel.unary("/s/m", Bytes::from_static(b"x"), Duration::from_secs(30), &count));
        let results = tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(calls))
            .await
            .expect("connect attempts are bounded by the connect timeout");
        let mut shared = 0;
        for result in results {
            let Err(CallError::Connect(e)) = result else { panic!("{result:?}") };
            let was_shared = e.to_string().contains(SHARED_FAILURE);
            shared += usize::from(was_shared);
            // Told apart once it is a status too (only the attempt counts against the worker).
            let status = CallError::Connect(e).into_status();
            assert_eq!(is_shared_connect_failure(&status), was_shared, "{status:?}");
        }
        // One call made the attempt; the others waited on it and got its failure, instead of
        // each trying (and waiting the connect timeout) in turn.
        assert_eq!(shared, 3);
        assert_eq!(attempts.load(Ordering::SeqCst), 1, "one connection attempt for the four calls");
    }

    #[tokio::test]
    async fn the_connect_timeout_is_the_configured_one() {
        let (address, _host) = silent_host();
        let quick = ClientSettings { connect_timeout: Duration::from_millis(50), ..settings() };
        let channel = H2Channel::new(&address, quick).unwrap();
        let result = tokio::time::timeout(
            Duration::from_secs(20),
            channel.unary("/s/m", Bytes::from_static(b"x"), Duration::from_secs(30), &|_| {}),
        )
        .await
        .expect("the attempt ends at the connect timeout");
        let Err(CallError::Connect(e)) = result else { panic!("{result:?}") };
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("within 50 ms (--connect-timeout-ms)"), "{e}");
    }

    fn settings() -> ClientSettings {
        ClientSettings {
            connection_window: 1 << 20,
            stream_window: 1 << 20,
            keepalive_interval: Duration::from_millis(100),
            keepalive_timeout: Duration::from_millis(200),
            connect_timeout: Duration::from_secs(1),
        }
    }

    fn framed(payload: &[u8]) -> Bytes {
        let mut b = grpc_prefix(payload.len()).unwrap().to_vec();
        b.extend_from_slice(payload);
        Bytes::from(b)
    }

    /// How the test server treats each connection it accepts.
    #[derive(Clone, Copy, PartialEq)]
    enum Behaviour {
        /// Echoes the message reversed, with a `nereid-queue: 7` header; a message "fail" gets
        /// a trailers-only INVALID_ARGUMENT with `nereid-queue: 9`; "bye" closes the connection
        /// without answering.
        Serve,
        /// Completes the handshake, then never reads again (a hung peer).
        Hang,
    }

    /// A minimal HTTP/2 gRPC server on loopback; returns its address and how many connections
    /// it accepted.
    async fn server(behaviour: Behaviour) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut conn = h2::server::handshake(socket).await.unwrap();
                    if behaviour == Behaviour::Hang {
                        std::future::pending::<()>().await;
                    }
                    let (close_tx, mut close_rx) = tokio::sync::mpsc::channel::<()>(1);
                    loop {
                        let next = tokio::select! {
                            next = conn.accept() => next,
                            _ = close_rx.recv() => return,
                        };
                        let Some(Ok((request, respond))) = next else { return };
                        tokio::spawn(answer(request, respond, close_tx.clone()));
                    }
                });
            }
        });
        (address, accepted)
    }

    async fn answer(
        request: http::Request<h2::RecvStream>,
        mut respond: h2::server::SendResponse<Bytes>,
        close: tokio::sync::mpsc::Sender<()>,
    ) {
        assert_eq!(request.headers()["content-type"], "application/grpc");
        assert!(request.headers()["grpc-timeout"].to_str().unwrap().ends_with('u'));
        let mut body = request.into_body();
        let mut chunks = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.unwrap();
            let _ = body.flow_control().release_capacity(chunk.len());
            chunks.push(chunk);
        }
        let message = unframe(chunks).unwrap();
        if &message[..] == b"bye" {
            let _ = close.send(()).await;
            return;
        }
        let response = http::Response::builder().status(200).header("content-type", "application/grpc");
        if &message[..] == b"fail" {
            let response =
                response.header("grpc-status", "3").header("grpc-message", "bad%20input").header("nereid-queue", "9");
            let _ = respond.send_response(response.body(()).unwrap(), true);
            return;
        }
        let response = response.header("nereid-queue", "7").body(()).unwrap();
        let mut send = respond.send_response(response, false).unwrap();
        let reply: Vec<u8> = message.iter().rev().copied().collect();
        send.send_data(framed(&reply), false).unwrap();
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        send.send_trailers(trailers).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unary_calls_share_one_connection_and_reconnect_after_it_closes() {
        let (address, accepted) = server(Behaviour::Serve).await;
        let channel = H2Channel::new(&address, settings()).unwrap();
        let calls =
            (0..8).map(|i| channel.unary("/s/m", Bytes::from(format!("abc{i}")), Duration::from_secs(5), &|_| {}));
        for (i, result) in futures::future::join_all(calls).await.into_iter().enumerate() {
            let (headers, message) = result.unwrap();
            assert_eq!(message, Bytes::from(format!("{i}cba")));
            assert_eq!(headers["nereid-queue"], "7");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for every call");

        // A gRPC error status comes back as the worker's answer, message decoded.
        let e = channel.unary("/s/m", Bytes::from_static(b"fail"), Duration::from_secs(5), &|_| {}).await.unwrap_err();
        let CallError::Status(status) = e else { panic!("{e:?}") };
        assert_eq!((status.code(), status.message()), (tonic::Code::InvalidArgument, "bad input"));

        // The server drops the connection mid-call: that call fails as a broken connection...
        let e = channel.unary("/s/m", Bytes::from_static(b"bye"), Duration::from_secs(5), &|_| {}).await.unwrap_err();
        assert!(matches!(e, CallError::H2(_)), "{e:?}");
        // ...and, once the channel has seen the connection end (the reset stream may arrive
        // before the end of the connection), the next call connects again.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while channel.live().is_some() {
            assert!(std::time::Instant::now() < deadline, "the closed connection was never noticed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (_, message) =
            channel.unary("/s/m", Bytes::from_static(b"xy"), Duration::from_secs(5), &|_| {}).await.unwrap();
        assert_eq!(message, Bytes::from_static(b"yx"));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);

        // The worker's queue report is taken from its answers, errors included.
        let upstream = crate::upstream::Upstream::new(&address, crate::config::OutlierConfig::default()).unwrap();
        let call = crate::forward::unary_bytes(
            &upstream,
            "/s/m",
            [Bytes::from_static(b"abc"), Bytes::new()],
            Duration::from_secs(5),
            &|_| {},
        );
        assert_eq!(call.await.unwrap(), Bytes::from_static(b"cba"));
        assert_eq!(upstream.reported_queue(std::time::Instant::now()), 7);
        let call = crate::forward::unary_bytes(
            &upstream,
            "/s/m",
            [Bytes::from_static(b"fail"), Bytes::new()],
            Duration::from_secs(5),
            &|_| {},
        );
        assert_eq!(call.await.unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(upstream.reported_queue(std::time::Instant::now()), 9, "an error's report counts too");
    }

    #[tokio::test]
    async fn large_messages_cross_many_frames_and_windows_both_ways() {
        // 3 MiB each way over 1 MiB windows: the call completes only if both sides release
        // flow-control capacity as they read, and the answer is reassembled from many frames.
        let (address, _) = server(Behaviour::Serve).await;
        let channel = H2Channel::new(&address, settings()).unwrap();
        let message: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
        let (_, answer) = tokio::time::timeout(
            Duration::from_secs(30),
            channel.unary("/s/m", Bytes::from(message.clone()), Duration::from_secs(30), &|_| {}),
        )
        .await
        .expect("no flow-control stall")
        .unwrap();
        let reversed: Vec<u8> = message.into_iter().rev().collect();
        assert!(answer == reversed, "the answer differs from the reversed message");
    }

    #[tokio::test]
    async fn a_call_on_a_connection_the_worker_never_spoke_on_is_known_never_sent() {
        // The kernel completes the connection, but no HTTP/2 server ever answers on it: it is
        // read, then reset (a worker killed while its listener's backlog held our connection).
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            socket.set_zero_linger().unwrap(); // closing resets it
            // All of the request, up to its last DATA frame's payload, reaches the socket.
            let mut received = Vec::new();
            let mut buf = vec![0u8; 1 << 16];
            while !received.ends_with(b"abc") {
                match tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await {
                    Ok(n) if n > 0 => received.extend_from_slice(&buf[..n]),
                    _ => panic!("the request never arrived whole"),
                }
            }
        });
        let channel = H2Channel::new(&address, settings()).unwrap();
        let e = channel.unary("/s/m", Bytes::from_static(b"abc"), Duration::from_secs(5), &|_| {}).await.unwrap_err();
        let CallError::Connect(e) = e else { panic!("{e:?}") };
        assert!(e.to_string().contains("never spoke on"), "{e}");
        let status = CallError::Connect(e).into_status();
        assert_eq!(crate::forward::FailureKind::classify(&status), crate::forward::FailureKind::NotSent);

        // Silent but never reset: the gateway gives the connection up (no PING answer), while
        // the worker's kernel holds the request for a process that may still read it — so the
        // call may have run.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (read_tx, read_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 1 << 16];
            let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await;
            let _ = read_tx.send(());
            std::future::pending::<()>().await;
        });
        let channel = H2Channel::new(&address, settings()).unwrap();
        let call = channel.unary("/s/m", Bytes::from_static(b"abc"), Duration::from_secs(60), &|_| {});
        let e = tokio::time::timeout(Duration::from_secs(20), call).await.expect("keepalive ends it").unwrap_err();
        assert!(matches!(e, CallError::H2(_)), "{e:?}");
        read_rx.await.expect("the request reached the silent peer");
    }

    #[test]
    fn a_call_queued_on_a_connection_that_died_unnoticed_is_known_never_sent() {
        // The worker, in a thread of its own: answers one call, then resets the connection when
        // told (as a killed worker's kernel does where requests wait unread) — while the
        // client's runtime, and so its connection task, is not running.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (close_tx, close_rx) = std::sync::mpsc::channel::<()>();
        let (closed_tx, closed_rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let (socket, _) = listener.accept().await.unwrap();
                socket.set_zero_linger().unwrap(); // closing resets it
                let mut conn = h2::server::handshake(socket).await.unwrap();
                let (request, respond) = conn.accept().await.unwrap().unwrap();
                let (close, _open) = tokio::sync::mpsc::channel(1);
                tokio::spawn(answer(request, respond, close));
                let told = tokio::task::spawn_blocking(move || close_rx.recv());
                tokio::select! {
                    _ = told => {}
                    next = conn.accept() => panic!("the connection went on: {:?}", next.map(|r| r.map(|_| ()))),
                }
                drop(conn);
            });
            closed_tx.send(()).unwrap();
        });
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            // No keepalive PING may be pending: it would be written before the failure is read.
            let quiet = ClientSettings { keepalive_interval: Duration::from_secs(600), ..settings() };
            let channel = H2Channel::new(&address, quiet).unwrap();
            let (_, message) =
                channel.unary("/s/m", Bytes::from_static(b"abc"), Duration::from_secs(5), &|_| {}).await.unwrap();
            assert_eq!(message, Bytes::from_static(b"cba"));
            close_tx.send(()).unwrap();
            // Blocks this runtime on purpose: the closed connection stays unnoticed.
            closed_rx.recv().unwrap();
            let e =
                channel.unary("/s/m", Bytes::from_static(b"xyz"), Duration::from_secs(5), &|_| {}).await.unwrap_err();
            let CallError::Connect(e) = e else { panic!("{e:?}") };
            assert!(e.to_string().contains("before the request was written"), "{e}");
            // The next call connects again (and finds nobody).
            let e = channel.unary("/s/m", Bytes::from_static(b"x"), Duration::from_secs(5), &|_| {}).await.unwrap_err();
            assert!(matches!(e, CallError::Connect(_)), "{e:?}");
        });
        worker.join().unwrap();
    }

    #[tokio::test]
    async fn a_peer_that_stops_answering_pings_fails_its_calls() {
        let (address, accepted) = server(Behaviour::Hang).await;
        let channel = H2Channel::new(&address, settings()).unwrap();
        // Without keepalive this call would wait out its 60 s; the unanswered PING ends it.
        let call = channel.unary("/s/m", Bytes::from_static(b"abc"), Duration::from_secs(60), &|_| {});
        let e = tokio::time::timeout(Duration::from_secs(20), call).await.expect("keepalive closes the connection");
        assert!(matches!(e, Err(CallError::H2(_))), "{e:?}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }
}
