//! `nereidctl`'s etcd access: a handful of reads and writes, each bounded by [`ETCD_TIMEOUT`]
//! (the full read of the prefix is paged, and each page is bounded: a large fleet takes more
//! pages, not a longer call). A call that runs out of time or fails becomes
//! [`CtlError::Failed`] (exit 1), naming the endpoints, what was being done, and for writes
//! that it may or may not have been applied.

use std::future::Future;
use std::time::Duration;

use nereid_common::fleet::etcd_client::{self, Client, Compare, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};
use nereid_common::fleet::{self, CALL_TIMEOUT, FleetState, Keys, Rejected};

use super::CtlError;

/// Longest time any one etcd call may take.
pub const ETCD_TIMEOUT: Duration = Duration::from_secs(3);

/// A key as read: `(key, value, lease)`.
pub type RawKv = (Vec<u8>, Vec<u8>, i64);

pub struct Store {
    client: Client,
    pub keys: Keys,
    endpoints: String,
}

/// Whether a call changes anything (a failed write is reported as possibly applied).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Read,
    Write,
}

impl Store {
    pub async fn connect(endpoints: &[String], keys: Keys) -> Result<Store, CtlError> {
        let joined = endpoints.join(",");
        let client = bounded(&joined, "connect", Call::Read, nereid_common::fleet::connect(endpoints)).await?;
        Ok(Store { client, keys, endpoints: joined })
    }

    async fn call<T>(
        &self,
        what: &str,
        call: Call,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, CtlError> {
        bounded(&self.endpoints, what, call, fut).await
    }

    /// Every key under the prefix, in key order, as of one revision. Paged
    /// ([`fleet::get_prefix`]): one response holding the whole prefix would outgrow gRPC's
    /// message limit once the values under it add up to a few MiB.
    pub async fn read_all(&mut self) -> Result<Vec<RawKv>, CtlError> {
        let prefix = self.keys.all();
        let read = fleet::get_prefix(&self.client, &prefix).await;
        let read = classify(&self.endpoints, &format!("read {prefix}"), Call::Read, read)?;
        Ok(read.kvs.iter().map(|kv| (kv.key().to_vec(), kv.value().to_vec(), kv.lease())).collect())
    }

    /// The fleet under the prefix, with the values every reader rejects.
    pub async fn state(&mut self) -> Result<(FleetState, Vec<Rejected>), CtlError> {
        let kvs = self.read_all().await?;
        Ok(FleetState::from_kvs(&self.keys, kvs.iter().map(|(k, v, _)| (k.as_slice(), v.as_slice()))))
    }

    /// One key's value and modification revision.
    pub async fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, i64)>, CtlError> {
        let mut client = self.client.clone();
        let resp = self.call(&format!("read {key}"), Call::Read, client.get(key, None)).await?;
        Ok(resp.kvs().first().map(|kv| (kv.value().to_vec(), kv.mod_revision())))
    }

    /// Writes `key`; the value it replaced, if any.
    pub async fn put(&mut self, key: &str, value: &str) -> Result<Option<Vec<u8>>, CtlError> {
        let mut client = self.client.clone();
        let put = client.put(key, value, Some(PutOptions::new().with_prev_key()));
        let resp = self.call(&format!("write {key}"), Call::Write, put).await?;
        Ok(resp.prev_key().map(|kv| kv.value().to_vec()))
    }

    /// Writes `key` only if every comparison holds; whether it was written.
    pub async fn put_if(&mut self, when: Vec<Compare>, key: &str, value: &str) -> Result<bool, CtlError> {
        let mut client = self.client.clone();
        let txn = Txn::new().when(when).and_then([TxnOp::put(key, value, None)]);
        let resp = self.call(&format!("write {key}"), Call::Write, client.txn(txn)).await?;
        Ok(resp.succeeded())
    }

    /// The lease `key` is bound to (0: none), or `None` when the key does not exist.
    pub async fn lease_of(&mut self, key: &str) -> Result<Option<i64>, CtlError> {
        let mut client = self.client.clone();
        let resp = self.call(&format!("read {key}"), Call::Read, client.get(key, None)).await?;
        Ok(resp.kvs().first().map(|kv| kv.lease()))
    }

    /// Writes `key` bound to `lease` (it goes when the lease does) only if every comparison
    /// holds; whether it was written.
    pub async fn put_leased_if(
        &mut self,
        when: Vec<Compare>,
        key: &str,
        value: &str,
        lease: i64,
    ) -> Result<bool, CtlError> {
        let mut client = self.client.clone();
        let txn = Txn::new().when(when).and_then([TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)))]);
        let resp = self.call(&format!("write {key}"), Call::Write, client.txn(txn)).await?;
        Ok(resp.succeeded())
    }

    /// The keys under `prefix` (names only, in key order).
    pub async fn keys_under(&mut self, prefix: &str) -> Result<Vec<String>, CtlError> {
        let mut client = self.client.clone();
        let get = client.get(prefix, Some(GetOptions::new().with_prefix().with_keys_only()));
        let resp = self.call(&format!("read {prefix}"), Call::Read, get).await?;
        Ok(resp.kvs().iter().map(|kv| String::from_utf8_lossy(kv.key()).into_owned()).collect())
    }

    /// Deletes `key` only if every comparison holds; the value it had when it was deleted
    /// (`None`: not deleted).
    pub async fn delete_if(&mut self, when: Vec<Compare>, key: &str) -> Result<Option<Vec<u8>>, CtlError> {
        let mut client = self.client.clone();
        let delete = TxnOp::delete(key, Some(DeleteOptions::new().with_prev_key()));
        let txn = Txn::new().when(when).and_then([delete]);
        let resp = self.call(&format!("delete {key}"), Call::Write, client.txn(txn)).await?;
        if !resp.succeeded() {
            return Ok(None);
        }
        let deleted = resp.op_responses().into_iter().find_map(|op| match op {
            etcd_client::TxnOpResponse::Delete(d) => d.prev_kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        Ok(Some(deleted.unwrap_or_default()))
    }

    /// Deletes `key`; the value it held, or `None` if there was none.
    pub async fn delete(&mut self, key: &str) -> Result<Option<Vec<u8>>, CtlError> {
        let mut client = self.client.clone();
        let delete = client.delete(key, Some(DeleteOptions::new().with_prev_key()));
        let resp = self.call(&format!("delete {key}"), Call::Write, delete).await?;
        Ok(resp.prev_kvs().first().map(|kv| kv.value().to_vec()))
    }
}

async fn bounded<T>(
    endpoints: &str,
    what: &str,
    call: Call,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, CtlError> {
    match tokio::time::timeout(ETCD_TIMEOUT, fut).await {
        Ok(result) => classify(endpoints, what, call, result),
        Err(_) => Err(no_answer(endpoints, what, call, ETCD_TIMEOUT)),
    }
}

/// An etcd call's result as `nereidctl` reports it.
fn classify<T>(endpoints: &str, what: &str, call: Call, result: Result<T, etcd_client::Error>) -> Result<T, CtlError> {
    let maybe = if call == Call::Write { " (it may or may not have been applied)" } else { "" };
    match result {
        Ok(v) => Ok(v),
        Err(e) if unreachable(&e) => Err(CtlError::Failed(format!(
            "cannot reach etcd at {endpoints} ({what}): {}; is it running and reachable?",
            root_cause(&e)
        ))),
        // A page of a paged read that ran out of its time (fleet::get_prefix bounds each page).
        Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::DeadlineExceeded => {
            Err(no_answer(endpoints, what, call, CALL_TIMEOUT))
        }
        Err(e) => Err(CtlError::Failed(format!("etcd at {endpoints}: {what} failed{maybe}: {e}"))),
    }
}

fn no_answer(endpoints: &str, what: &str, call: Call, within: Duration) -> CtlError {
    let maybe = if call == Call::Write { " (it may or may not have been applied)" } else { "" };
    CtlError::Failed(format!(
        "etcd at {endpoints} did not answer within {}s ({what}){maybe}; is it running and reachable?",
        within.as_secs()
    ))
}

/// The client could not connect (refused, no route, DNS): nothing reached etcd.
fn unreachable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(s) => s.code() == tonic::Code::Unavailable,
        _ => false,
    }
}

/// The root cause's message (e.g. "Connection refused (os error 111)").
fn root_cause(e: &etcd_client::Error) -> String {
    let mut cause: &(dyn std::error::Error + 'static) = match e {
        etcd_client::Error::GRpcStatus(s) => s,
        etcd_client::Error::TransportError(t) => t,
        other => other,
    };
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(r: Result<(), CtlError>) -> String {
        match r {
            Err(CtlError::Failed(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_page_out_of_time_reads_as_no_answer() {
        let status = |s| Err::<(), _>(etcd_client::Error::GRpcStatus(s));
        let m = failed(classify("http://e:1", "read /n/", Call::Read, status(tonic::Status::deadline_exceeded("x"))));
        assert!(m.contains("did not answer within 3s (read /n/)"), "{m}");
        let m = failed(classify("http://e:1", "write k", Call::Write, status(tonic::Status::internal("boom"))));
        assert!(m.contains("write k failed (it may or may not have been applied)"), "{m}");
        let m = failed(classify("http://e:1", "read /n/", Call::Read, status(tonic::Status::unavailable("down"))));
        assert!(m.starts_with("cannot reach etcd at http://e:1"), "{m}");
    }
}
