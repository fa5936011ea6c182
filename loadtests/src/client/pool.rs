//! A fixed set of HTTP/1.1 connections to one server, all opened (TCP, and TLS where
//! configured) before the first request, so that connection setup stays out of measured
//! latency.
//!
//! A request takes a free connection, waiting in arrival order while all are busy (that wait
//! is client-side queueing and counts in the request's latency, as perf_analyzer's does), and
//! gives it back once its response has been read whole. A connection that breaks, or whose
//! request was abandoned mid-flight (a timeout: HTTP/1.1 can only end such a request by
//! closing the connection), is reopened by the next request that takes its slot. Nothing else
//! opens connections, so the server sees exactly as many as were asked for while none breaks.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use http::header::HOST;
use http::{HeaderValue, Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::codegen::Service;

use super::grpc::error_chain;
use super::tls::Connector;

/// Connections opened at the same time at start-up.
const OPEN_AT_ONCE: usize = 32;
/// Open files left for the rest of the process (metrics scrapes, shared memory, output files)
/// when the limit is raised for the connections.
const SPARE_FILES: u64 = 64;

/// The handle of one HTTP/1.1 connection; the connection closes when the last one is dropped.
pub type Sender = SendRequest<Full<Bytes>>;

/// `size` HTTP/1.1 connections to one origin.
pub struct Http1Pool {
    connector: Connector,
    /// `scheme://host:port`: what the connector dials.
    origin: Uri,
    /// `Host` of every request.
    host: HeaderValue,
    /// Free slots; `None` is one whose connection is to be reopened.
    free: Mutex<Vec<Option<Sender>>>,
    /// One permit per free slot; fair, so waiting requests are served in order.
    permits: Arc<Semaphore>,
    size: usize,
}

impl Http1Pool {
    /// Opens `size` connections to `origin` (at least one); fails with the first that cannot
    /// be opened.
    pub async fn open(connector: Connector, origin: Uri, size: usize) -> Result<Arc<Http1Pool>, String> {
        let size = size.max(1);
        let authority = origin.authority().ok_or_else(|| format!("'{origin}' has no host:port"))?;
        let host = HeaderValue::from_str(authority.as_str()).map_err(|e| format!("'{authority}': {e}"))?;
        let pool = Http1Pool {
            connector,
            origin,
            host,
            free: Mutex::new(Vec::with_capacity(size)),
            permits: Arc::new(Semaphore::new(size)),
            size,
        };
        let senders: Vec<Sender> =
            futures::stream::iter(0..size).map(|_| pool.connect()).buffer_unordered(OPEN_AT_ONCE).try_collect().await?;
        *pool.free.lock().unwrap_or_else(PoisonError::into_inner) = senders.into_iter().map(Some).collect();
        Ok(Arc::new(pool))
    }

    /// A free connection, waiting for one while all are busy.
    pub async fn acquire(self: &Arc<Self>) -> Lease {
        let permit = self.permits.clone().acquire_owned().await.expect("the pool's semaphore is never closed");
        let conn = self.free.lock().unwrap_or_else(PoisonError::into_inner).pop().expect("a free slot per permit");
        Lease { pool: self.clone(), conn, reusable: false, _permit: permit }
    }

    /// How many connections the pool holds: the most requests it can have at the server.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Sends `request` over a connection of its own, outside the pool, so that it does not
    /// queue behind the load (a liveness check while every pooled connection is busy or hung).
    /// Returns the connection's handle with the response: keep it until the body is read.
    pub async fn send_apart(&self, mut request: Request<Full<Bytes>>) -> Result<(Sender, Response<Incoming>), String> {
        request.headers_mut().insert(HOST, self.host.clone());
        let mut sender = self.connect().await?;
        sender.ready().await.map_err(|e| error_chain(&e))?;
        let response = sender.send_request(request).await.map_err(|e| error_chain(&e))?;
        Ok((sender, response))
    }

    /// Opens one connection: TCP (and TLS) through the connector, then the HTTP/1.1 client
    /// state, driven by a task of its own until the connection closes.
    async fn connect(&self) -> Result<Sender, String> {
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx)).await.map_err(|e| error_chain(&*e))?;
        let io = connector.call(self.origin.clone()).await.map_err(|e| error_chain(&*e))?;
        let (sender, connection) = http1::handshake(io).await.map_err(|e| error_chain(&e))?;
        tokio::spawn(async move {
            // Its end (the server closed it, or every handle was dropped) is seen by the
            // sender: `ready` fails and the slot reopens.
            let _ = connection.await;
        });
        Ok(sender)
    }
}

/// One slot of the pool, held from [`Http1Pool::acquire`] until dropped. The connection goes
/// back for reuse only when [`Lease::done`] said its response was read whole; otherwise the
/// slot goes back empty and its connection is dropped (closed).
pub struct Lease {
    pool: Arc<Http1Pool>,
    conn: Option<Sender>,
    reusable: bool,
    // Released after `drop` has put the slot back.
    _permit: OwnedSemaphorePermit,
}

impl Lease {
    /// Sends `request` (origin-form URI; `Host` is added) and returns the response head, its
    /// body unread. Reopens the slot's connection first when it is gone.
    pub async fn send(&mut self, mut request: Request<Full<Bytes>>) -> Result<Response<Incoming>, String> {
        self.reusable = false;
        request.headers_mut().insert(HOST, self.pool.host.clone());
        let mut retried = false;
        loop {
            let mut sender = match self.conn.take() {
                Some(mut s) => match s.ready().await {
                    Ok(()) => s,
                    Err(_) => self.pool.connect().await?,
                },
                None => self.pool.connect().await?,
            };
            let result = sender.try_send_request(request).await;
            // Kept while the body is read: dropping the last handle would close the connection.
            self.conn = Some(sender);
            match result {
                Ok(response) => return Ok(response),
                Err(mut e) => match e.take_message() {
                    // The connection closed before taking the request (e.g. the server's
                    // keep-alive timeout ran out just now): none of it reached the server, so
                    // it goes again, once, on a new connection.
                    Some(again) if !retried => {
                        retried = true;
                        request = again;
                        self.conn = None;
                    }
                    _ => return Err(error_chain(e.error())),
                },
            }
        }
    }

    /// The last response was read whole: the connection can take the next request.
    pub fn done(&mut self) {
        self.reusable = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let conn = if self.reusable { self.conn.take() } else { None };
        self.pool.free.lock().unwrap_or_else(PoisonError::into_inner).push(conn);
    }
}

/// Raises the soft limit on open files (to at most the hard limit) when `connections` would
/// not fit under it; fails, saying what to do, when even the hard limit is too low.
pub fn ensure_open_files(connections: usize) -> Result<(), String> {
    let need = connections as u64 + SPARE_FILES;
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into a live struct of its type.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || limit.rlim_cur >= need {
        return Ok(());
    }
    let raised = libc::rlimit { rlim_cur: need.min(limit.rlim_max), rlim_max: limit.rlim_max };
    // SAFETY: setrlimit reads a live struct of its type; only the soft limit changes, within
    // the hard one.
    let now =
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 { raised.rlim_cur } else { limit.rlim_cur };
    if now < need {
        return Err(format!(
            "{connections} connections need about {need} open files, but the limit is {now} (ulimit -n); \
             lower --connections or raise the limit"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> (u64, u64) {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        (limit.rlim_cur, limit.rlim_max)
    }

    #[test]
    fn the_open_files_limit_is_raised_for_the_connections_or_refused_clearly() {
        let (_, hard) = limits();
        if hard == libc::RLIM_INFINITY || hard > 1 << 40 || hard <= SPARE_FILES + 1 {
            eprintln!("SKIPPED: no usable finite hard limit on open files ({hard})");
            return;
        }
        // Fits under the hard limit: the soft one is raised to make room.
        let fits = (hard - SPARE_FILES) as usize;
        ensure_open_files(fits).unwrap();
        assert_eq!(limits().0, hard);
        let e = ensure_open_files(hard as usize).unwrap_err();
        assert!(e.contains(&format!("limit is {hard}")) && e.contains("lower --connections"), "{e}");
    }
}
