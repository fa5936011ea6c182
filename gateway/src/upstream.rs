//! One worker as the gateway sees it: its pooled gRPC channel, the requests this gateway has
//! outstanding on it (the balancer's load figure) and its outlier-ejection state.
//!
//! Inference goes over lazily connected HTTP/2 connections ([`H2Channel`]) — one per I/O thread
//! by default, `--upstream-connections` in all, calls taking them in turn — multiplexing, never a
//! connection per request; each is remade on the first call after it breaks,
//! and a call made while the worker cannot be reached fails fast with a *connect* error, which
//! the retry policy knows was never sent. Control calls (metadata, config, statistics, health
//! polls) use a separate tonic channel, also lazy: they are rare, and keep tonic's generated
//! clients. An [`Upstream`] lives as long as the worker is a member:
//! membership hands the same `Arc` to every routing table, so load and ejection state survive
//! table swaps.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};

use crate::config::OutlierConfig;
use crate::forward::client::{ClientSettings, H2Channel};
use crate::outlier::{Outcome, OutlierDetector};

/// A worker's identity: its gRPC address as configured (unique among members).
pub type UpstreamId = Arc<str>;

/// HTTP/2 PINGs on idle connections find dead peers that sent no FIN/RST.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 receive windows (connection, per stream) for responses from workers.
pub const HTTP2_CONNECTION_WINDOW: u32 = 64 << 20;
pub const HTTP2_STREAM_WINDOW: u32 = 8 << 20;

/// How the gateway treats each worker: outlier ejection, and how many inference connections.
#[derive(Clone, Copy, Debug)]
pub struct UpstreamOptions {
    pub outlier: OutlierConfig,
    /// Inference connections (at least one is made).
    pub connections: usize,
    /// Time to connect (TCP and the HTTP/2 handshake), for inference and control channels.
    pub connect_timeout: Duration,
}

impl From<OutlierConfig> for UpstreamOptions {
    fn from(outlier: OutlierConfig) -> Self {
        let connect_timeout = Duration::from_millis(crate::config::DEFAULT_CONNECT_TIMEOUT_MS);
        UpstreamOptions { outlier, connections: 1, connect_timeout }
    }
}

#[derive(Debug)]
pub struct Upstream {
    pub id: UpstreamId,
    channel: Channel,
    /// The inference connections, taken in turn.
    infer: Vec<H2Channel>,
    next_lane: AtomicUsize,
    outstanding: AtomicU64,
    /// The queue the worker last reported in-band (its `nereid-queue` response header), and
    /// when (milliseconds since `created`); a report older than [`QUEUE_REPORT_TTL`] counts 0.
    reported_queue: AtomicU64,
    reported_at_ms: AtomicU64,
    created: Instant,
    outlier: Mutex<OutlierDetector>,
}

/// How long a worker's queue report is believed: a worker that gets no traffic sends no
/// reports, and its last (possibly high) figure must not keep it unpicked forever.
pub const QUEUE_REPORT_TTL: Duration = Duration::from_secs(1);

impl Upstream {
    /// A member at gRPC address `address` (`host:port`). Nothing is connected yet.
    pub fn new(
        address: &str,
        options: impl Into<UpstreamOptions>,
    ) -> Result<Upstream, Box<dyn std::error::Error + Send + Sync>> {
        let UpstreamOptions { outlier, connections, connect_timeout } = options.into();
        let channel = Endpoint::from_shared(format!("http://{address}"))?
            .tcp_nodelay(true)
            .connect_timeout(connect_timeout)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            // Large fixed windows, as the worker's server uses: one connection carries every
            // client's requests, and small adaptive windows let bursts trip h2's flood guard.
            .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
            .initial_stream_window_size(HTTP2_STREAM_WINDOW)
            .connect_lazy();
        let settings = ClientSettings {
            connection_window: HTTP2_CONNECTION_WINDOW,
            stream_window: HTTP2_STREAM_WINDOW,
            keepalive_interval: KEEPALIVE_INTERVAL,
            keepalive_timeout: KEEPALIVE_TIMEOUT,
            connect_timeout,
        };
        let infer = (0..connections.max(1)).map(|_| H2Channel::new(address, settings)).collect::<Result<_, _>>()?;
        Ok(Upstream {
            id: Arc::from(address),
            channel,
            infer,
            next_lane: AtomicUsize::new(0),
            outstanding: AtomicU64::new(0),
            reported_queue: AtomicU64::new(0),
            reported_at_ms: AtomicU64::new(0),
            created: Instant::now(),
            outlier: Mutex::new(OutlierDetector::new(outlier)),
        })
    }

    /// The shared control channel (cloning it shares the connection).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// The inference connection the next call takes (they are taken in turn).
    pub fn infer_channel(&self) -> &H2Channel {
        match self.infer.len() {
            1 => &self.infer[0],
            n => &self.infer[self.next_lane.fetch_add(1, Ordering::Relaxed) % n],
        }
    }

    /// Requests this gateway has in flight on the worker.
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Records the queue length the worker reported on a response.
    pub fn report_queue(&self, queue: u64) {
        self.reported_queue.store(queue, Ordering::Relaxed);
        let ms = self.created.elapsed().as_millis() as u64;
        self.reported_at_ms.store(ms.max(1), Ordering::Relaxed);
    }

    /// The worker's last reported queue, when recent enough to believe (else 0).
    pub fn reported_queue(&self, now: Instant) -> u64 {
        let at = self.reported_at_ms.load(Ordering::Relaxed);
        let now_ms = now.saturating_duration_since(self.created).as_millis() as u64;
        if at == 0 || now_ms.saturating_sub(at) > QUEUE_REPORT_TTL.as_millis() as u64 {
            return 0;
        }
        self.reported_queue.load(Ordering::Relaxed)
    }

    /// The balancer's load figure: this gateway's requests in flight on the worker plus the
    /// worker's recently reported queue.
    pub fn load(&self, now: Instant) -> u64 {
        self.outstanding().saturating_add(self.reported_queue(now))
    }

    /// Counts a request as outstanding until the guard is dropped.
    pub fn start_request(self: &Arc<Self>) -> OutstandingGuard {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        OutstandingGuard(self.clone())
    }

    pub fn is_ejected(&self, now: Instant) -> bool {
        self.outlier.lock().unwrap_or_else(|e| e.into_inner()).is_ejected(now)
    }

    /// Feeds a request's outcome to outlier detection; `true` when it ejected the worker.
    pub fn record(&self, outcome: Outcome, started: Instant, now: Instant) -> bool {
        let ejected = self.outlier.lock().unwrap_or_else(|e| e.into_inner()).record(outcome, started, now);
        if ejected {
            tracing::warn!(worker = %self.id, "worker ejected after consecutive failures");
        }
        ejected
    }
}

/// Decrements the outstanding count of its worker when dropped (completed or cancelled).
pub struct OutstandingGuard(Arc<Upstream>);

impl Drop for OutstandingGuard {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}
