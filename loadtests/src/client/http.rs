//! HTTP/1.1: `POST /v2/models/{m}[/versions/{v}]/infer` with JSON tensors or the binary-tensor
//! extension (`Inference-Header-Content-Length`), over a fixed set of keep-alive connections
//! opened up front ([`Http1Pool`]), which every call shares: control calls and inference alike.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{Map, Value, json};

use super::pool::{Http1Pool, ensure_open_files};
use super::shm::{ShmRequest, ShmSlice};
use super::tls::{ALPN_HTTP1, Connector};
use super::{CONTROL_TIMEOUT, ClientError, Target, bearer, unauthorized_hint};
use crate::measure::Failure;
use crate::workload::{Entry, InputTensor, ModelInfo, TensorSpec, json_data, json_unrepresentable};

/// Header carrying the JSON part's length in a binary-tensor request.
pub const INFERENCE_HEADER_CONTENT_LENGTH: &str = "inference-header-content-length";
/// Largest control-plane (metadata, config) response read.
const MAX_CONTROL_BYTES: usize = 4 << 20;

/// `target.connections` HTTP/1.1 connections to one server.
#[derive(Clone)]
pub struct HttpClient {
    url: String,
    binary: bool,
    pool: Arc<Http1Pool>,
    /// `Bearer <key>` of non-inference calls.
    auth: Option<HeaderValue>,
}

/// Which connection a control call takes.
#[derive(Clone, Copy)]
enum Via {
    /// One of the pooled connections (waiting for a free one, like any request).
    Pool,
    /// A connection of its own, closed after the call.
    Apart,
}

/// URI (origin-form) and headers of one prepared request.
#[derive(Clone, Debug)]
pub struct HttpParts {
    uri: Uri,
    headers: HeaderMap,
}

impl HttpClient {
    /// Opens the connections (TLS handshakes included) and checks `GET /v2/health/live`;
    /// `api_key` goes on every non-inference call.
    pub async fn connect(target: &Target, binary: bool, api_key: Option<&str>) -> Result<Self, ClientError> {
        let auth = api_key.map(bearer).transpose()?;
        let connector = match &target.tls {
            Some(tls) => tls.connector(ALPN_HTTP1),
            None => Connector::new(None),
        };
        let scheme = if target.tls.is_some() { "https" } else { "http" };
        let origin: Uri = format!("{scheme}://{}", target.url)
            .parse()
            .map_err(|e| ClientError::Invalid(format!("--url '{}': {e}", target.url)))?;
        ensure_open_files(target.connections).map_err(ClientError::Invalid)?;
        let pool = Http1Pool::open(connector, origin, target.connections)
            .await
            .map_err(|reason| ClientError::Unreachable { url: target.url.clone(), reason })?;
        let client = HttpClient { url: target.url.clone(), binary, pool, auth };
        let (status, _) = client.get("/v2/health/live").await?;
        if status != StatusCode::OK {
            return Err(ClientError::Unreachable {
                url: target.url.clone(),
                reason: format!("GET /v2/health/live answered HTTP {status}"),
            });
        }
        Ok(client)
    }

    pub fn lane(&self) -> HttpLane {
        HttpLane { pool: self.pool.clone() }
    }

    /// `GET /v2/health/live` over a connection of its own: asked while the load runs (is the
    /// server gone?), it must not wait behind requests queued for the pooled connections.
    pub async fn is_live(&self) -> bool {
        matches!(self.call_via(Method::GET, "/v2/health/live", Bytes::new(), Via::Apart).await, Ok((StatusCode::OK, _)))
    }

    /// The most requests this client can have at the server at once: one per connection.
    pub fn connections(&self) -> usize {
        self.pool.size()
    }

    pub async fn model_info(&self, model: &str, version: Option<&str>) -> Result<ModelInfo, ClientError> {
        let base = model_path(model, version);
        let fail = |status: StatusCode, body: &[u8]| ClientError::Model {
            model: model.to_string(),
            url: self.url.clone(),
            reason: format!("HTTP {status}: {}", String::from_utf8_lossy(body).trim()),
        };
        let (status, body) = self.get(&base).await?;
        if status != StatusCode::OK {
            return Err(fail(status, &body));
        }
        let bad_json = |what: &str, e: String| ClientError::Model {
            model: model.to_string(),
            url: self.url.clone(),
            reason: format!("{what} is not valid KServe v2 JSON: {e}"),
        };
        let meta: Value = serde_json::from_slice(&body).map_err(|e| bad_json("model metadata", e.to_string()))?;
        let tensors = |key: &str| -> Result<Vec<TensorSpec>, ClientError> {
            let list = meta.get(key).and_then(Value::as_array).cloned().unwrap_or_default();
            list.iter()
                .map(|t| {
                    let name = t.get("name").and_then(Value::as_str);
                    let datatype = t.get("datatype").and_then(Value::as_str);
                    let shape: Option<Vec<i64>> =
                        t.get("shape").and_then(Value::as_array).map(|s| s.iter().filter_map(Value::as_i64).collect());
                    match (name, datatype, shape) {
                        (Some(n), Some(d), Some(s)) => Ok(TensorSpec { name: n.into(), datatype: d.into(), shape: s }),
                        _ => Err(bad_json("model metadata", format!("{key} entry {t} lacks name, datatype or shape"))),
                    }
                })
                .collect()
        };
        let inputs = tensors("inputs")?;
        let outputs = tensors("outputs")?;
        let (status, body) = self.get(&format!("{base}/config")).await?;
        if status != StatusCode::OK {
            return Err(fail(status, &body));
        }
        let config: Value = serde_json::from_slice(&body).map_err(|e| bad_json("model config", e.to_string()))?;
        // proto3 JSON may render int32 as a number or a string.
        let max_batch_size = match config.get("max_batch_size") {
            Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
            Some(Value::String(s)) => s.parse().unwrap_or(0),
            _ => 0,
        };
        Ok(ModelInfo {
            name: meta.get("name").and_then(Value::as_str).unwrap_or(model).to_string(),
            versions: meta
                .get("versions")
                .and_then(Value::as_array)
                .map(|v| v.iter().filter_map(Value::as_str).map(String::from).collect())
                .unwrap_or_default(),
            max_batch_size: max_batch_size.min(u32::MAX as u64) as u32,
            inputs,
            outputs,
        })
    }

    /// Encodes an infer request body and builds its headers.
    pub fn encode(
        &self,
        entry: &Entry,
        inputs: &[InputTensor],
        shm: Option<&ShmRequest>,
    ) -> Result<(Bytes, HttpParts), ClientError> {
        let uri: Uri = infer_path(&entry.model, entry.version.as_deref())
            .parse()
            .map_err(|e| ClientError::Invalid(format!("model '{}' does not fit in a URL: {e}", entry.model)))?;
        if !self.binary && shm.is_none() {
            for i in inputs {
                if let Some(why) = json_unrepresentable(i.datatype, &i.data) {
                    return Err(ClientError::Invalid(format!(
                        "input '{}': {why}; send it with --http-binary or over gRPC",
                        i.name
                    )));
                }
            }
        }
        let mut headers = HeaderMap::new();
        if let Some(k) = &entry.api_key {
            headers.insert(AUTHORIZATION, bearer(k)?);
        }
        let (body, header_len) = encode(entry, inputs, self.binary, shm);
        match header_len {
            Some(n) => {
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
                headers.insert(INFERENCE_HEADER_CONTENT_LENGTH, HeaderValue::from(n));
            }
            None => {
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            }
        }
        Ok((body, HttpParts { uri, headers }))
    }

    /// `POST /v2/systemsharedmemory/region/{name}/register`.
    pub async fn register_system_shm(&self, name: &str, key: &str, byte_size: u64) -> Result<(), ClientError> {
        let body = json!({ "key": key, "offset": 0, "byte_size": byte_size }).to_string();
        let path = format!("/v2/systemsharedmemory/region/{}/register", name);
        self.expect_ok(Method::POST, &path, Bytes::from(body), "registering shared memory").await
    }

    /// `POST /v2/systemsharedmemory/region/{name}/unregister`.
    pub async fn unregister_system_shm(&self, name: &str) -> Result<(), ClientError> {
        let path = format!("/v2/systemsharedmemory/region/{}/unregister", name);
        self.expect_ok(Method::POST, &path, Bytes::new(), "unregistering shared memory").await
    }

    async fn expect_ok(&self, method: Method, path: &str, body: Bytes, what: &str) -> Result<(), ClientError> {
        let (status, body) = self.call(method, path, body).await?;
        if status != StatusCode::OK {
            return Err(ClientError::Invalid(format!(
                "{what} on {}: HTTP {status}: {}",
                self.url,
                String::from_utf8_lossy(&body).trim()
            )));
        }
        Ok(())
    }

    async fn get(&self, path: &str) -> Result<(StatusCode, Bytes), ClientError> {
        self.call(Method::GET, path, Bytes::new()).await
    }

    /// One non-inference call, with the run's key; 401 and 403 fail as
    /// [`ClientError::Unauthorized`].
    async fn call(&self, method: Method, path: &str, body: Bytes) -> Result<(StatusCode, Bytes), ClientError> {
        self.call_via(method, path, body, Via::Pool).await
    }

    async fn call_via(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        via: Via,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let unreachable = |reason: String| ClientError::Unreachable { url: self.url.clone(), reason };
        let uri: Uri =
            path.parse().map_err(|e| ClientError::Invalid(format!("'{}{path}' is not a valid URL: {e}", self.url)))?;
        let mut request = Request::builder().method(method.clone()).uri(uri);
        if !body.is_empty() {
            request = request.header(CONTENT_TYPE, "application/json");
        }
        if let Some(auth) = &self.auth {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let request = request.body(Full::new(body)).map_err(|e| ClientError::Invalid(e.to_string()))?;
        let fetch = async {
            let read = |resp: Response<Incoming>| async move {
                let status = resp.status();
                let body = http_body_util::Limited::new(resp.into_body(), MAX_CONTROL_BYTES)
                    .collect()
                    .await
                    .map_err(|e| unreachable(format!("reading {path}: {e}")))?
                    .to_bytes();
                Ok::<_, ClientError>((status, body))
            };
            match via {
                Via::Pool => {
                    let mut lease = self.pool.acquire().await;
                    let resp = lease.send(request).await.map_err(unreachable)?;
                    let answer = read(resp).await?;
                    lease.done();
                    Ok(answer)
                }
                Via::Apart => {
                    let (_connection, resp) = self.pool.send_apart(request).await.map_err(unreachable)?;
                    read(resp).await
                }
            }
        };
        let (status, body) = tokio::time::timeout(CONTROL_TIMEOUT, fetch)
            .await
            .map_err(|_| unreachable(format!("{path} did not answer within {CONTROL_TIMEOUT:?}")))??;
        if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return Err(ClientError::Unauthorized {
                url: self.url.clone(),
                reason: format!("{method} {path} answered HTTP {status}; {}", unauthorized_hint(self.auth.is_some())),
            });
        }
        Ok((status, body))
    }
}

/// One sender's handle on the connections.
pub struct HttpLane {
    pool: Arc<Http1Pool>,
}

impl HttpLane {
    pub async fn send(&mut self, body: &Bytes, parts: &HttpParts) -> Result<(), Failure> {
        let mut lease = self.pool.acquire().await;
        let resp = lease.send(request(body, parts)).await.map_err(|_| Failure::Connection)?;
        let status = resp.status();
        // Drain the body so the connection can take the next request; frames are dropped unread.
        let mut body = resp.into_body();
        while let Some(frame) = body.frame().await {
            frame.map_err(|_| Failure::Connection)?;
        }
        lease.done();
        if status == StatusCode::OK { Ok(()) } else { Err(Failure::Http(status.as_u16())) }
    }

    /// Sends one request and returns its whole response body (JSON, or with binary tensors the
    /// JSON header followed by the output bytes), for checks; the load path never decodes.
    pub async fn fetch(&mut self, body: &Bytes, parts: &HttpParts) -> Result<Bytes, Failure> {
        let mut lease = self.pool.acquire().await;
        let resp = lease.send(request(body, parts)).await.map_err(|_| Failure::Connection)?;
        let status = resp.status();
        let body = resp.into_body().collect().await.map_err(|_| Failure::Connection)?.to_bytes();
        lease.done();
        if status == StatusCode::OK { Ok(body) } else { Err(Failure::Http(status.as_u16())) }
    }
}

/// A prepared inference request.
fn request(body: &Bytes, parts: &HttpParts) -> Request<Full<Bytes>> {
    let mut request = Request::new(Full::new(body.clone()));
    *request.method_mut() = Method::POST;
    *request.uri_mut() = parts.uri.clone();
    *request.headers_mut() = parts.headers.clone();
    request
}

fn model_path(model: &str, version: Option<&str>) -> String {
    match version {
        Some(v) => format!("/v2/models/{model}/versions/{v}"),
        None => format!("/v2/models/{model}"),
    }
}

pub fn infer_path(model: &str, version: Option<&str>) -> String {
    format!("{}/infer", model_path(model, version))
}

/// The request body; with `binary`, the JSON header length too (inputs follow it as raw bytes
/// and outputs are asked for in binary). With `shm`, tensors are named by their shared-memory
/// slices instead: no data in the body, every output requested into its slot.
pub fn encode(entry: &Entry, inputs: &[InputTensor], binary: bool, shm: Option<&ShmRequest>) -> (Bytes, Option<usize>) {
    let binary = binary && shm.is_none();
    let mut parameters = Map::new();
    if let Some(p) = entry.priority {
        parameters.insert("priority".into(), json!(p));
    }
    if let Some(t) = entry.timeout_us {
        parameters.insert("timeout".into(), json!(t));
    }
    if binary {
        parameters.insert("binary_data_output".into(), json!(true));
    }
    let slice_parameters = |s: &ShmSlice| json!({ "shared_memory_region": s.region, "shared_memory_offset": s.offset, "shared_memory_byte_size": s.byte_size });
    let tensors: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(k, i)| {
            let mut t = json!({ "name": i.name, "shape": i.shape, "datatype": i.datatype.wire_name() });
            if let Some(slice) = shm.and_then(|s| s.inputs.get(k)) {
                t["parameters"] = slice_parameters(slice);
            } else if binary {
                t["parameters"] = json!({ "binary_data_size": i.data.len() });
            } else {
                t["data"] = json_data(i.datatype, &i.data);
            }
            t
        })
        .collect();
    let mut header = json!({ "inputs": tensors });
    if let Some(shm) = shm {
        let outputs: Vec<Value> =
            shm.outputs.iter().map(|(name, s)| json!({ "name": name, "parameters": slice_parameters(s) })).collect();
        header["outputs"] = Value::Array(outputs);
    }
    if !parameters.is_empty() {
        header["parameters"] = Value::Object(parameters);
    }
    let mut body = serde_json::to_vec(&header).unwrap_or_default();
    if !binary {
        return (Bytes::from(body), None);
    }
    let header_len = body.len();
    for i in inputs {
        body.extend_from_slice(&i.data);
    }
    (Bytes::from(body), Some(header_len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_common::DataType;

    fn inputs() -> Vec<InputTensor> {
        vec![InputTensor {
            name: "X".into(),
            datatype: DataType::Fp32,
            shape: vec![1, 2],
            data: [1.0f32, 2.0].iter().flat_map(|f| f.to_le_bytes()).collect(),
        }]
    }

    #[test]
    fn json_bodies_carry_data_and_parameters() {
        let mut e = Entry::for_model("m");
        e.priority = Some(2);
        let (body, len) = encode(&e, &inputs(), false, None);
        assert_eq!(len, None);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["inputs"][0]["data"], json!([1.0, 2.0]));
        assert_eq!(v["parameters"]["priority"], json!(2));
        assert_eq!(infer_path("m", Some("3")), "/v2/models/m/versions/3/infer");
    }

    #[test]
    fn shared_memory_bodies_name_slices_instead_of_data() {
        let slice = |offset| ShmSlice { region: "r".into(), offset, byte_size: 8 };
        let shm = ShmRequest { inputs: vec![slice(64)], outputs: vec![("Y".into(), slice(0))] };
        // Binary is moot: nothing goes in the body.
        let (body, len) = encode(&Entry::for_model("m"), &inputs(), true, Some(&shm));
        assert_eq!(len, None);
        let v: Value = serde_json::from_slice(&body).unwrap();
        let expect =
            |offset: u64| json!({"shared_memory_region":"r","shared_memory_offset":offset,"shared_memory_byte_size":8});
        assert_eq!(v["inputs"][0]["parameters"], expect(64));
        assert!(v["inputs"][0].get("data").is_none());
        assert_eq!(v["outputs"], json!([{"name":"Y","parameters": expect(0)}]));
        assert!(v.get("parameters").is_none());
    }

    #[test]
    fn binary_bodies_put_tensors_after_the_header() {
        let (body, len) = encode(&Entry::for_model("m"), &inputs(), true, None);
        let n = len.unwrap();
        let v: Value = serde_json::from_slice(&body[..n]).unwrap();
        assert_eq!(v["inputs"][0]["parameters"]["binary_data_size"], json!(8));
        assert_eq!(v["parameters"]["binary_data_output"], json!(true));
        assert_eq!(&body[n..], &inputs()[0].data[..]);
    }
}
