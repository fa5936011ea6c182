//! Reading and following a prefix without tonic's default 4 MiB message limit in the way.
//!
//! A single unpaginated `Get` of the whole prefix is one gRPC message: once the fleet's keys
//! (or junk someone wrote under the prefix) add up to more than the client's decode limit, the
//! read fails every time, and a gateway never builds a table and `nereidctl` never answers.
//! [`get_prefix`] reads in pages of at most [`PageLimits::keys`] keys, each page pinned to the
//! first page's revision so the result is one consistent snapshot, and decodes messages up to
//! [`MAX_MESSAGE_BYTES`]; a page that is still too large (a few huge values) is re-read in
//! halves. [`watch`] opens a watch with the same decode limit: a watch resuming after an outage
//! receives the missed events batched, and one batch can be as large as a page.

use std::time::Duration;

use etcd_client::{Client, GetOptions, KeyValue, WatchOptions, WatchStream};

use super::CALL_TIMEOUT;
use super::history::ClusterMark;

/// Largest gRPC message a Nereid reader decodes from etcd (reads and watches). Large enough for
/// a page of [`PageLimits::keys`] ordinary records many times over, and for the handful of
/// values at etcd's own request-size limit (1.5 MiB by default) that one watch response may
/// carry; small enough that a runaway prefix cannot make one message exhaust memory.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Keys per page of [`get_prefix`]: Nereid's records are a few hundred bytes, so a page is
/// well under a megabyte, and etcd never holds one read's whole result in one response.
pub const PAGE_KEYS: i64 = 500;

/// How many times a read whose pinned revision was compacted between two pages starts over.
const COMPACTED_RETRIES: usize = 3;

/// Limits of one paged read (the defaults are what production uses; tests make them small).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLimits {
    /// Most keys per page (at least 1).
    pub keys: i64,
    /// Largest response decoded; a page over it is re-read in halves.
    pub message_bytes: usize,
}

impl Default for PageLimits {
    fn default() -> Self {
        PageLimits { keys: PAGE_KEYS, message_bytes: MAX_MESSAGE_BYTES }
    }
}

/// Everything under a prefix as of one revision.
#[derive(Debug)]
pub struct PrefixRead {
    /// In key order.
    pub kvs: Vec<KeyValue>,
    /// The first page's header: `mark.revision` is the revision every page was read at, the
    /// one to watch from (+1).
    pub mark: ClusterMark,
}

/// Reads every key under `prefix` as of one revision, in pages, with [`PageLimits::default`].
/// Each page is bounded by [`CALL_TIMEOUT`] (not the whole read: a large fleet takes more pages,
/// not longer pages); a page that runs out of time is a `DeadlineExceeded` gRPC status.
pub async fn get_prefix(client: &Client, prefix: &str) -> Result<PrefixRead, etcd_client::Error> {
    get_prefix_with(client, prefix, PageLimits::default()).await
}

/// [`get_prefix`] with explicit limits.
pub async fn get_prefix_with(
    client: &Client,
    prefix: &str,
    limits: PageLimits,
) -> Result<PrefixRead, etcd_client::Error> {
    let mut attempt = 1;
    loop {
        match read_pages(client, prefix, limits).await {
            // The first page's revision was compacted before a later page was read: start over
            // at the current revision (a first page reads the current revision: it cannot hit
            // this).
            Err(e) if is_compacted(&e) && attempt < COMPACTED_RETRIES => attempt += 1,
            other => return other,
        }
    }
}

async fn read_pages(client: &Client, prefix: &str, limits: PageLimits) -> Result<PrefixRead, etcd_client::Error> {
    let mut kv = client.kv_client().max_decoding_message_size(limits.message_bytes);
    let end = prefix_end(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    let mut limit = limits.keys.max(1);
    let mut kvs = Vec::new();
    let mut mark: Option<ClusterMark> = None;
    // Ends: every answered page either moves `from` past at least one key (of finitely many at
    // the pinned revision) or ends the read, and a page too large to decode halves `limit` (for
    // the rest of this read: large values tend to sit together), which stops at 1 (then the
    // error is returned).
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(limit);
        if let Some(m) = &mark {
            options = options.with_revision(m.revision);
        }
        let answer = tokio::time::timeout(CALL_TIMEOUT, kv.get(from.clone(), Some(options))).await;
        let mut resp = match answer {
            Err(_) => return Err(deadline_exceeded(CALL_TIMEOUT)),
            Ok(Err(e)) if is_too_large(&e) && limit > 1 => {
                limit = (limit / 2).max(1);
                continue;
            }
            Ok(result) => result?,
        };
        if mark.is_none() {
            mark = Some(ClusterMark::of(resp.header()));
        }
        let page = resp.take_kvs();
        let more = resp.more();
        let Some(last) = page.last() else { break };
        from = last.key().to_vec();
        from.push(0); // the smallest key after `last`
        kvs.extend(page);
        if !more {
            break;
        }
    }
    Ok(PrefixRead { kvs, mark: mark.unwrap_or_default() })
}

/// Opens a watch whose responses may be up to [`MAX_MESSAGE_BYTES`]: a watch that resumes
/// after an outage receives the events it missed batched into few responses, and with a few
/// large values one batch outgrows tonic's default 4 MiB — the watch would then fail on every
/// resume, forever.
pub async fn watch(
    client: &Client,
    key: impl Into<Vec<u8>>,
    options: WatchOptions,
) -> Result<WatchStream, etcd_client::Error> {
    client.watch_client().max_decoding_message_size(MAX_MESSAGE_BYTES).watch(key, Some(options)).await
}

/// The end of the range of keys starting with `prefix` (etcd's convention: the prefix with its
/// last byte below 0xff incremented; `\0`, "to the end of the keyspace", when there is none).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|b| *b < 0xff) {
        Some(i) => {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        }
        None => vec![0],
    }
}

fn deadline_exceeded(after: Duration) -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::deadline_exceeded(format!("no answer within {after:?}")))
}

/// The client refused to decode a response over its message limit (tonic's `OutOfRange`,
/// which etcd also uses for compaction: told apart by the message).
fn is_too_large(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::OutOfRange && s.message().contains("message length too large"))
}

/// etcd's "mvcc: required revision has been compacted".
fn is_compacted(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::OutOfRange && s.message().contains("compacted"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/nereid/v1/"), b"/nereid/v10".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn errors_are_told_apart() {
        let status = |code, msg: &str| etcd_client::Error::GRpcStatus(tonic::Status::new(code, msg));
        let too_large = status(
            tonic::Code::OutOfRange,
            "Error, decoded message length too large: found 4917187 bytes, the limit is: 4194304 bytes",
        );
        let compacted = status(tonic::Code::OutOfRange, "etcdserver: mvcc: required revision has been compacted");
        assert!(is_too_large(&too_large) && !is_compacted(&too_large));
        assert!(is_compacted(&compacted) && !is_too_large(&compacted));
        assert!(!is_too_large(&status(tonic::Code::Unavailable, "message length too large")));
        assert!(deadline_exceeded(CALL_TIMEOUT).to_string().contains("no answer within 3s"));
    }
}
