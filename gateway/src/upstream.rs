//! One worker as the gateway sees it: its pooled gRPC channel, the requests this gateway has
//! outstanding on it (the balancer's load figure) and its outlier-ejection state.
//!
//! The channel is one lazily connected HTTP/2 connection, multiplexing every call — never a
//! connection per request. When the connection breaks, tonic reconnects on the next call; a
//! call made while the worker cannot be reached fails fast with a *connect* error, which the
//! retry policy knows was never sent. An [`Upstream`] lives as long as the worker is a member:
//! membership hands the same `Arc` to every routing table, so load and ejection state survive
//! table swaps.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};

use crate::config::OutlierConfig;
use crate::outlier::{Outcome, OutlierDetector};

/// A worker's identity: its gRPC address as configured (unique among members).
pub type UpstreamId = Arc<str>;

/// Time to establish the TCP connection to a worker.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// HTTP/2 PINGs on idle connections find dead peers that sent no FIN/RST.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 receive windows (connection, per stream) for responses from workers.
pub const HTTP2_CONNECTION_WINDOW: u32 = 64 << 20;
pub const HTTP2_STREAM_WINDOW: u32 = 8 << 20;

#[derive(Debug)]
pub struct Upstream {
    pub id: UpstreamId,
    channel: Channel,
    outstanding: AtomicU64,
    outlier: Mutex<OutlierDetector>,
}

impl Upstream {
    /// A member at gRPC address `address` (`host:port`). Nothing is connected yet.
    pub fn new(address: &str, outlier: OutlierConfig) -> Result<Upstream, tonic::transport::Error> {
        let channel = Endpoint::from_shared(format!("http://{address}"))?
            .tcp_nodelay(true)
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            // Large fixed windows, as the worker's server uses: one connection carries every
            // client's requests, and small adaptive windows let bursts trip h2's flood guard.
            .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
            .initial_stream_window_size(HTTP2_STREAM_WINDOW)
            .connect_lazy();
        Ok(Upstream {
            id: Arc::from(address),
            channel,
            outstanding: AtomicU64::new(0),
            outlier: Mutex::new(OutlierDetector::new(outlier)),
        })
    }

    /// The shared channel (cloning it shares the connection).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// Requests this gateway has in flight on the worker.
    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Relaxed)
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
    pub fn record(&self, outcome: Outcome, now: Instant) -> bool {
        let ejected = self.outlier.lock().unwrap_or_else(|e| e.into_inner()).record(outcome, now);
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
