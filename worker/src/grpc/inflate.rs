//! Compressed gRPC messages (`grpc-encoding: gzip | deflate`) inflated off the event loop.
//!
//! tonic inflates a compressed message inline, in the task that decodes it: up to
//! `--max-request-bytes` (64 MiB by default) on a thread that serves every other connection —
//! the gateway has one such thread, and a 64 KiB gzip of zeros is 64 MiB. [`inflate_off_loop`]
//! rewrites such a request before tonic sees it: its body's compressed messages are inflated
//! here, on the blocking pool (beyond a small size), and passed on uncompressed, and the
//! `grpc-encoding` header is removed, so tonic decodes plain messages. Uncompressed messages
//! (the compressed flag is per message) pass through untouched, without a copy.
//!
//! The bounds tonic applies are kept, and answered with the codes a client acts on: a
//! compressed message, or one inflated, past the limit is RESOURCE_EXHAUSTED (inflating stops
//! there); data that does not inflate is INVALID_ARGUMENT. A request that goes away stops its
//! inflating. An encoding other than gzip and deflate (or a malformed message header) is left
//! to tonic, which refuses it as before.

use std::sync::atomic::AtomicBool;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http_body::Frame;
use tokio::task::JoinHandle;

use crate::http::{CancelOnDrop, Coding, OFFLOAD_INFLATE_BYTES, inflation_permit, read_bounded};

/// gRPC's message prefix: a compressed flag and a big-endian length.
const PREFIX: usize = 5;

/// `request` with its compressed messages inflated (to at most `limit` bytes each) as tonic
/// reads them, and its `grpc-encoding` removed; a request that is not gzip or deflate as it is.
pub fn inflate_off_loop(
    mut request: http::Request<tonic::body::Body>,
    limit: usize,
) -> http::Request<tonic::body::Body> {
    let coding = request.headers().get("grpc-encoding").and_then(|v| v.to_str().ok()).and_then(grpc_coding);
    let Some(coding) = coding else {
        return request;
    };
    request.headers_mut().remove("grpc-encoding");
    request.map(|body| tonic::body::Body::new(Inflating::new(body, coding, limit)))
}

/// The codings gRPC names `gzip` and `deflate` (the zlib format); names compare exactly, as
/// tonic's do.
fn grpc_coding(name: &str) -> Option<Coding> {
    match name {
        "gzip" => Some(Coding::Gzip),
        "deflate" => Some(Coding::Deflate),
        _ => None,
    }
}

/// A request body whose compressed messages come out inflated and flagged uncompressed.
struct Inflating {
    inner: tonic::body::Body,
    coding: Coding,
    limit: usize,
    /// Bytes received and not yet passed on: at most one message prefix and one compressed
    /// message (no more than `limit`), as tonic itself would hold.
    buf: BytesMut,
    /// Bytes of an uncompressed message still to pass through as they come.
    passthrough: usize,
    /// A message waiting for a place among the inflations running at once, then inflating
    /// on the blocking pool; dropping it stops the inflating.
    inflating: Option<futures::future::BoxFuture<'static, Result<Bytes, tonic::Status>>>,
    /// An inflated message waiting behind its prefix.
    queued: Option<Bytes>,
    /// A message header tonic will refuse (a flag other than 0 and 1): from there on every
    /// byte passes through, for tonic to answer.
    opaque: bool,
    /// The inner body ended (with these trailers, if any).
    ended: bool,
    trailers: Option<http::HeaderMap>,
    /// An error was returned: nothing more comes.
    failed: bool,
}

impl Inflating {
    fn new(inner: tonic::body::Body, coding: Coding, limit: usize) -> Self {
        Inflating {
            inner,
            coding,
            limit,
            buf: BytesMut::new(),
            passthrough: 0,
            inflating: None,
            queued: None,
            opaque: false,
            ended: false,
            trailers: None,
            failed: false,
        }
    }

    fn fail(&mut self, status: tonic::Status) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        self.failed = true;
        self.inflating = None;
        Poll::Ready(Some(Err(status)))
    }

    /// Starts inflating the compressed message of `len` bytes at the front of `buf` (whole),
    /// inline when it is small enough that its inflated size stays small.
    fn start(&mut self, len: usize) -> Option<Result<Bytes, tonic::Status>> {
        self.buf.advance(PREFIX);
        let data = self.buf.split_to(len).freeze();
        let (coding, limit) = (self.coding, self.limit);
        if len <= OFFLOAD_INFLATE_BYTES {
            return Some(inflate_message(coding, &data, limit, &AtomicBool::new(false)));
        }
        self.inflating = Some(Box::pin(async move {
            let permit = inflation_permit().await;
            let gone = CancelOnDrop::default();
            let cancelled = gone.0.clone();
            let task: JoinHandle<_> = tokio::task::spawn_blocking(move || {
                let _permit = permit;
                inflate_message(coding, &data, limit, &cancelled)
            });
            task.await.unwrap_or_else(|e| Err(tonic::Status::internal(format!("inflating a message failed: {e}"))))
        }));
        None
    }

    /// The prefix of an uncompressed message of `len` bytes, its message queued behind it.
    fn emit(&mut self, message: Bytes) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let mut prefix = BytesMut::with_capacity(PREFIX);
        prefix.extend_from_slice(&[0]);
        // Fits: `inflate_message` never yields more than `limit`, which tonic's own limit (a
        // usize it compares a u32 length against) bounds the same way; a longer one is refused.
        let Ok(len) = u32::try_from(message.len()) else {
            return self.fail(tonic::Status::resource_exhausted(format!(
                "the inflated message of {} bytes is past the largest gRPC message",
                message.len()
            )));
        };
        prefix.extend_from_slice(&len.to_be_bytes());
        if !message.is_empty() {
            self.queued = Some(message);
        }
        Poll::Ready(Some(Ok(Frame::data(prefix.freeze()))))
    }
}

/// One message inflated to at most `limit` bytes, read as tonic reads it: gzip as one member
/// (what follows it ignored), deflate as the zlib format.
fn inflate_message(coding: Coding, data: &[u8], limit: usize, cancelled: &AtomicBool) -> Result<Bytes, tonic::Status> {
    use flate2::bufread::{GzDecoder, ZlibDecoder};
    let inflated = match coding {
        Coding::Gzip => read_bounded(GzDecoder::new(data), data.len(), limit, cancelled),
        Coding::Deflate => read_bounded(ZlibDecoder::new(data), data.len(), limit, cancelled),
    };
    match inflated {
        Ok(Some(message)) => Ok(Bytes::from(message)),
        Ok(None) => Err(tonic::Status::resource_exhausted(format!(
            "the {} message inflates past the limit of {limit} bytes",
            coding.name()
        ))),
        Err(e) => Err(tonic::Status::invalid_argument(format!("failed to inflate the {} message: {e}", coding.name()))),
    }
}

impl http_body::Body for Inflating {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        loop {
            if let Some(message) = this.queued.take() {
                return Poll::Ready(Some(Ok(Frame::data(message))));
            }
            if let Some(inflating) = this.inflating.as_mut() {
                let done = ready!(inflating.as_mut().poll(cx));
                this.inflating = None;
                return match done {
                    Ok(message) => this.emit(message),
                    Err(status) => this.fail(status),
                };
            }
            if !this.buf.is_empty() && (this.opaque || this.passthrough > 0) {
                let n = if this.opaque { this.buf.len() } else { this.passthrough.min(this.buf.len()) };
                this.passthrough -= n.min(this.passthrough);
                return Poll::Ready(Some(Ok(Frame::data(this.buf.split_to(n).freeze()))));
            }
            if !this.opaque && this.passthrough == 0 && this.buf.len() >= PREFIX {
                let len = u32::from_be_bytes([this.buf[1], this.buf[2], this.buf[3], this.buf[4]]) as usize;
                match this.buf[0] {
                    0 => {
                        this.passthrough = PREFIX + len;
                        continue;
                    }
                    1 if len > this.limit => {
                        return this.fail(tonic::Status::resource_exhausted(format!(
                            "the compressed message takes {len} bytes, past the limit of {} bytes",
                            this.limit
                        )));
                    }
                    1 if this.buf.len() >= PREFIX + len => match this.start(len) {
                        Some(Ok(message)) => return this.emit(message),
                        Some(Err(status)) => return this.fail(status),
                        None => continue,
                    },
                    1 => {}
                    _ => {
                        this.opaque = true;
                        continue;
                    }
                }
            }
            if this.ended {
                // What is left is a partial message: answered as tonic answers one.
                if !this.buf.is_empty() {
                    return this.fail(tonic::Status::internal(
                        "Unexpected EOF decoding stream: the body ended inside a message",
                    ));
                }
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            match ready!(std::pin::Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(mut data) => {
                        // An uncompressed message's bytes pass on as they came, uncopied.
                        if this.buf.is_empty() && this.passthrough > 0 {
                            let n = this.passthrough.min(data.len());
                            this.passthrough -= n;
                            let head = data.split_to(n);
                            this.buf.extend_from_slice(&data);
                            return Poll::Ready(Some(Ok(Frame::data(head))));
                        }
                        if this.buf.is_empty() && this.opaque {
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        this.buf.extend_from_slice(&data);
                    }
                    Err(frame) => {
                        this.trailers = frame.into_trailers().ok();
                        this.ended = true;
                    }
                },
                Some(Err(status)) => return this.fail(status),
                None => this.ended = true,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed
            || (self.ended
                && self.buf.is_empty()
                && self.queued.is_none()
                && self.inflating.is_none()
                && self.trailers.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::io::Write;

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    fn compress(coding: Coding, data: &[u8]) -> Vec<u8> {
        match coding {
            Coding::Gzip => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            Coding::Deflate => {
                let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
        }
    }

    /// A body that yields `bytes` in chunks of `chunk` bytes, then `trailers`.
    fn chunked(bytes: Vec<u8>, chunk: usize, trailers: Option<http::HeaderMap>) -> tonic::body::Body {
        let mut frames: Vec<Result<Frame<Bytes>, tonic::Status>> =
            bytes.chunks(chunk).map(|c| Ok(Frame::data(Bytes::copy_from_slice(c)))).collect();
        if let Some(t) = trailers {
            frames.push(Ok(Frame::trailers(t)));
        }
        tonic::body::Body::new(http_body_util::StreamBody::new(futures::stream::iter(frames)))
    }

    fn request(encoding: &str, body: tonic::body::Body) -> http::Request<tonic::body::Body> {
        http::Request::builder().header("grpc-encoding", encoding).body(body).unwrap()
    }

    async fn read_all(
        request: http::Request<tonic::body::Body>,
    ) -> Result<(Vec<u8>, Option<http::HeaderMap>), tonic::Status> {
        let collected = request.into_body().collect().await?;
        let trailers = collected.trailers().cloned();
        Ok((collected.to_bytes().to_vec(), trailers))
    }

    #[tokio::test]
    async fn compressed_messages_come_out_plain_whatever_the_chunking() {
        let small = b"a small message".to_vec();
        let large: Vec<u8> = (0..300_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        for coding in [Coding::Gzip, Coding::Deflate] {
            let mut wire = framed(1, &compress(coding, &small));
            wire.extend(framed(0, b"sent plain"));
            wire.extend(framed(1, &compress(coding, &large)));
            wire.extend(framed(1, &compress(coding, b"")));
            wire.extend(framed(0, b""));
            let mut expected = framed(0, &small);
            expected.extend(framed(0, b"sent plain"));
            expected.extend(framed(0, &large));
            expected.extend(framed(0, b""));
            expected.extend(framed(0, b""));
            let mut trailers = http::HeaderMap::new();
            trailers.insert("x-end", http::HeaderValue::from_static("1"));
            for chunk in [1, 3, 5, 7, 4096, wire.len()] {
                let request = inflate_off_loop(
                    request(
                        if coding == Coding::Gzip { "gzip" } else { "deflate" },
                        chunked(wire.clone(), chunk, Some(trailers.clone())),
                    ),
                    4 << 20,
                );
                assert!(request.headers().get("grpc-encoding").is_none(), "tonic must see plain messages");
                let (out, got_trailers) = read_all(request).await.unwrap();
                assert!(
                    out == expected,
                    "{coding:?}, chunks of {chunk}: {} bytes out, {} expected",
                    out.len(),
                    expected.len()
                );
                assert_eq!(got_trailers.as_ref(), Some(&trailers));
            }
        }
    }

    #[tokio::test]
    async fn other_encodings_are_left_to_tonic() {
        for encoding in ["identity", "zstd", "GZIP"] {
            let wire = framed(1, b"whatever");
            let request = inflate_off_loop(request(encoding, chunked(wire.clone(), 2, None)), 1 << 20);
            assert_eq!(request.headers()["grpc-encoding"], encoding);
            assert_eq!(read_all(request).await.unwrap().0, wire);
        }
        let plain = http::Request::new(chunked(framed(0, b"x"), 1, None));
        assert_eq!(read_all(inflate_off_loop(plain, 1 << 20)).await.unwrap().0, framed(0, b"x"));
    }

    #[tokio::test]
    async fn bounds_and_corrupt_data_are_refused_with_the_codes_clients_act_on() {
        // Inflates past the limit: refused, inflating stopped there.
        let bomb = framed(1, &compress(Coding::Gzip, &vec![0u8; 8 << 20]));
        let e = read_all(inflate_off_loop(request("gzip", chunked(bomb, 4096, None)), 1 << 20)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("limit of 1048576 bytes"), "{e:?}");
        // Small enough to inflate inline, still bounded.
        let small_bomb = framed(1, &compress(Coding::Deflate, &vec![0u8; 100_000]));
        let e =
            read_all(inflate_off_loop(request("deflate", chunked(small_bomb, 64, None)), 50_000)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        // A compressed message itself past the limit: refused from its prefix, never buffered.
        let mut prefix = vec![1];
        prefix.extend_from_slice(&(2u32 << 20).to_be_bytes());
        let e = read_all(inflate_off_loop(request("gzip", chunked(prefix, 5, None)), 1 << 20)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        // Not gzip at all, small and large.
        for junk in [vec![7u8; 100], vec![7u8; 100_000]] {
            let e = read_all(inflate_off_loop(request("gzip", chunked(framed(1, &junk), 999, None)), 1 << 20))
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains("failed to inflate the gzip message"), "{e:?}");
        }
        // A flag tonic refuses: passed on as it is, for tonic.
        let odd = framed(2, b"xyz");
        assert_eq!(
            read_all(inflate_off_loop(request("gzip", chunked(odd.clone(), 2, None)), 1 << 20)).await.unwrap().0,
            odd
        );
        // A message cut short by the end of the body, as tonic answers one.
        let cut = framed(1, &compress(Coding::Gzip, b"hello"))[..9].to_vec();
        let e = read_all(inflate_off_loop(request("gzip", chunked(cut, 4, None)), 1 << 20)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
        assert!(e.message().starts_with("Unexpected EOF"), "{e:?}");
        // As tonic: a gzip member's trailing bytes are ignored.
        let mut padded = compress(Coding::Gzip, b"hello");
        padded.extend_from_slice(b"\0\0\0");
        let out = read_all(inflate_off_loop(request("gzip", chunked(framed(1, &padded), 3, None)), 1 << 20)).await;
        assert_eq!(out.unwrap().0, framed(0, b"hello"));
    }

    /// Inflations on the blocking pool are a few at a time: with every place taken, a large
    /// message waits (no blocking task started), and inflates once one is given back.
    #[tokio::test(flavor = "current_thread")]
    async fn inflations_wait_for_a_place() {
        let taken: Vec<_> =
            futures::future::join_all((0..crate::http::inflation_permits()).map(|_| inflation_permit())).await;
        let wire = framed(1, &compress(Coding::Deflate, &vec![1u8; 4 << 20]));
        let mut body = inflate_off_loop(request("deflate", chunked(wire, 1 << 30, None)), 64 << 20).into_body();
        for _ in 0..3 {
            assert!(futures::poll!(std::pin::pin!(body.frame())).is_pending(), "no place: it must wait");
            tokio::task::yield_now().await;
        }
        drop(taken);
        let (out, _) = read_all(http::Request::new(body)).await.unwrap();
        assert_eq!(out.len(), PREFIX + (4 << 20));
    }

    /// The point of it all: a large message inflates on the blocking pool, so the thread
    /// reading the body is free meanwhile — on a single-threaded runtime, the first poll does
    /// not inflate (it returns pending) and another task runs before the message is out.
    #[tokio::test(flavor = "current_thread")]
    async fn large_messages_inflate_off_the_event_loop() {
        let wire = framed(1, &compress(Coding::Gzip, &vec![0u8; 16 << 20]));
        let mut body = inflate_off_loop(request("gzip", chunked(wire, 1 << 30, None)), 64 << 20).into_body();
        let first = futures::poll!(std::pin::pin!(body.frame()));
        assert!(first.is_pending(), "a 16 MiB message must not inflate on the event loop");
        let other = tokio::spawn(async { 42 });
        assert_eq!(other.await.unwrap(), 42, "the event loop serves others while it inflates");
        let (out, _) = read_all(http::Request::new(body)).await.unwrap();
        assert_eq!(out.len(), PREFIX + (16 << 20));
        assert!(out[PREFIX..].iter().all(|&b| b == 0));
    }
}
