//! tritonserver's endpoint restrictions: `--http-restricted-api` and
//! `--grpc-restricted-protocol`, each `APIS:KEY=VALUE` and repeatable. A request to an API of a
//! restricted group must carry the group's header with its value — `KEY` over HTTP,
//! `triton-grpc-protocol-KEY` over gRPC — or is refused before any handler runs (HTTP 403;
//! gRPC UNAVAILABLE, as tritonserver answers). So an operator can give one credential to
//! inference clients and another to those allowed to load models or change logging.
//!
//! The APIs, by tritonserver's names: `health`, `metadata`, `inference`, `shared-memory`,
//! `model-config`, `model-repository`, `statistics`, `trace`, `logging`. An API may be in one
//! group only. `/metrics` (its own port) is not an API here.

use std::collections::BTreeMap;

use http::{HeaderMap, HeaderName, HeaderValue, Method};

/// An API group member, by tritonserver's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Api {
    Health,
    Metadata,
    Inference,
    SharedMemory,
    ModelConfig,
    ModelRepository,
    Statistics,
    Trace,
    Logging,
}

impl Api {
    const ALL: [Api; 9] = [
        Api::Health,
        Api::Metadata,
        Api::Inference,
        Api::SharedMemory,
        Api::ModelConfig,
        Api::ModelRepository,
        Api::Statistics,
        Api::Trace,
        Api::Logging,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Api::Health => "health",
            Api::Metadata => "metadata",
            Api::Inference => "inference",
            Api::SharedMemory => "shared-memory",
            Api::ModelConfig => "model-config",
            Api::ModelRepository => "model-repository",
            Api::Statistics => "statistics",
            Api::Trace => "trace",
            Api::Logging => "logging",
        }
    }

    fn from_name(name: &str) -> Option<Api> {
        Api::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The API an HTTP request is for (`None`: none of them, e.g. an unknown path).
    pub fn of_http(method: &Method, path: &str) -> Option<Api> {
        let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
        match segments.as_slice() {
            // GET, and HEAD, which the router answers as GET.
            ["v2"] if method != Method::POST => Some(Api::Metadata),
            ["v2", "health", "live" | "ready"] => Some(Api::Health),
            ["v2", "models", "stats"] => Some(Api::Statistics),
            ["v2", "repository", ..] => Some(Api::ModelRepository),
            ["v2", "systemsharedmemory" | "cudasharedmemory", ..] => Some(Api::SharedMemory),
            ["v2", "trace", ..] => Some(Api::Trace),
            ["v2", "logging"] => Some(Api::Logging),
            ["v2", "models", _model, rest @ ..] => {
                let rest = match rest {
                    ["versions", _version, rest @ ..] => rest,
                    rest => rest,
                };
                match rest {
                    [] => Some(Api::Metadata),
                    ["ready"] => Some(Api::Health),
                    ["infer" | "generate" | "generate_stream"] => Some(Api::Inference),
                    ["config"] => Some(Api::ModelConfig),
                    ["stats"] => Some(Api::Statistics),
                    ["trace", ..] => Some(Api::Trace),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// The API a gRPC call is for, from its path (`/inference.GRPCInferenceService/ModelInfer`).
    pub fn of_grpc(path: &str) -> Option<Api> {
        let (service, method) = path.strip_prefix('/')?.split_once('/')?;
        // The standard `grpc.health.v1.Health` is never restricted: Kubernetes' gRPC probes
        // (and grpc_health_probe) cannot send a header; it tells no more than `/v2/health`.
        if service != "inference.GRPCInferenceService" {
            return None;
        }
        Some(match method {
            "ServerLive" | "ServerReady" | "ModelReady" => Api::Health,
            "ServerMetadata" | "ModelMetadata" => Api::Metadata,
            "ModelInfer" | "ModelStreamInfer" => Api::Inference,
            "ModelConfig" => Api::ModelConfig,
            "ModelStatistics" => Api::Statistics,
            "RepositoryIndex" | "RepositoryModelLoad" | "RepositoryModelUnload" => Api::ModelRepository,
            "TraceSetting" => Api::Trace,
            "LogSettings" => Api::Logging,
            m if m.starts_with("SystemSharedMemory") || m.starts_with("CudaSharedMemory") => Api::SharedMemory,
            _ => return None,
        })
    }
}

/// The header a restricted API requires, and the value it must carry.
#[derive(Clone, Debug)]
struct Rule {
    header: HeaderName,
    value: HeaderValue,
}

/// The restrictions of one protocol (HTTP or gRPC).
#[derive(Clone, Debug, Default)]
pub struct Restrictions {
    rules: BTreeMap<Api, Rule>,
    /// "API" (HTTP) or "protocol" (gRPC), as tritonserver words its refusals.
    noun: &'static str,
}

impl Restrictions {
    /// `--http-restricted-api` groups.
    pub fn http(groups: &[String]) -> Result<Restrictions, String> {
        Restrictions::parse("--http-restricted-api", groups, "", "API")
    }

    /// `--grpc-restricted-protocol` groups: the header is `triton-grpc-protocol-KEY`.
    pub fn grpc(groups: &[String]) -> Result<Restrictions, String> {
        Restrictions::parse("--grpc-restricted-protocol", groups, "triton-grpc-protocol-", "protocol")
    }

    fn parse(flag: &str, groups: &[String], prefix: &str, noun: &'static str) -> Result<Restrictions, String> {
        let mut rules = BTreeMap::new();
        for group in groups {
            let malformed = || format!("{flag} '{group}': expected API[,API...]:KEY=VALUE");
            let (apis, setting) = group.split_once(':').ok_or_else(malformed)?;
            let (key, value) = setting.split_once('=').ok_or_else(malformed)?;
            let header = HeaderName::from_bytes(format!("{prefix}{}", key.trim()).as_bytes())
                .ok()
                .filter(|_| !key.trim().is_empty())
                .ok_or_else(|| format!("{flag} '{group}': '{key}' is not a header name"))?;
            // Trimmed as header values arrive (hyper drops surrounding whitespace).
            let value = HeaderValue::from_str(value.trim())
                .map_err(|_| format!("{flag} '{group}': the value is not a valid header value"))?;
            for name in apis.split(',').map(str::trim) {
                let api = Api::from_name(name).ok_or_else(|| {
                    let known: Vec<&str> = Api::ALL.iter().map(|a| a.name()).collect();
                    format!("{flag} '{group}': unknown API '{name}' (known: {})", known.join(", "))
                })?;
                let rule = Rule { header: header.clone(), value: value.clone() };
                if rules.insert(api, rule).is_some() {
                    return Err(format!("{flag}: '{name}' is in more than one group (each API may be in one only)"));
                }
            }
        }
        Ok(Restrictions { rules, noun })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Why a request for `api` with `headers` is refused; `None` when it may go on.
    pub fn refusal(&self, api: Option<Api>, headers: &HeaderMap) -> Option<String> {
        let rule = self.rules.get(&api?)?;
        let given = headers.get(&rule.header);
        if given.is_some_and(|v| same(v.as_bytes(), rule.value.as_bytes())) {
            return None;
        }
        Some(format!("This {} is restricted, expecting header '{}'", self.noun, rule.header))
    }
}

/// Equality that takes as long whatever the first difference (the value is a credential).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(g: &[&str]) -> Vec<String> {
        g.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn every_worker_endpoint_belongs_to_its_api() {
        let get = |p| Api::of_http(&Method::GET, p);
        let post = |p| Api::of_http(&Method::POST, p);
        assert_eq!(get("/v2"), Some(Api::Metadata));
        assert_eq!(Api::of_http(&Method::HEAD, "/v2"), Some(Api::Metadata));
        assert_eq!(get("/v2/health/ready"), Some(Api::Health));
        assert_eq!(get("/v2/models/m/ready"), Some(Api::Health));
        assert_eq!(get("/v2/models/m/versions/2/ready"), Some(Api::Health));
        assert_eq!(get("/v2/models/m"), Some(Api::Metadata));
        assert_eq!(get("/v2/models/m/versions/2"), Some(Api::Metadata));
        assert_eq!(post("/v2/models/m/infer"), Some(Api::Inference));
        assert_eq!(post("/v2/models/m/versions/2/infer"), Some(Api::Inference));
        assert_eq!(get("/v2/models/m/config"), Some(Api::ModelConfig));
        assert_eq!(get("/v2/models/stats"), Some(Api::Statistics));
        assert_eq!(get("/v2/models/m/versions/1/stats"), Some(Api::Statistics));
        assert_eq!(post("/v2/repository/index"), Some(Api::ModelRepository));
        assert_eq!(post("/v2/repository/models/m/load"), Some(Api::ModelRepository));
        assert_eq!(post("/v2/systemsharedmemory/region/r/register"), Some(Api::SharedMemory));
        assert_eq!(get("/v2/cudasharedmemory/status"), Some(Api::SharedMemory));
        assert_eq!(post("/v2/logging"), Some(Api::Logging));
        assert_eq!(get("/v2/nothing/here"), None);

        let grpc = |m: &str| Api::of_grpc(&format!("/inference.GRPCInferenceService/{m}"));
        assert_eq!(grpc("ModelInfer"), Some(Api::Inference));
        assert_eq!(grpc("ModelStreamInfer"), Some(Api::Inference));
        assert_eq!(grpc("ServerReady"), Some(Api::Health));
        assert_eq!(grpc("RepositoryModelLoad"), Some(Api::ModelRepository));
        assert_eq!(grpc("SystemSharedMemoryRegister"), Some(Api::SharedMemory));
        assert_eq!(grpc("LogSettings"), Some(Api::Logging));
        assert_eq!(grpc("Unheard"), None);
        assert_eq!(Api::of_grpc("/other.Service/ModelInfer"), None);
        // Kubernetes' gRPC probes send no header: the standard health check stays open.
        assert_eq!(Api::of_grpc("/grpc.health.v1.Health/Check"), None);
    }

    #[test]
    fn a_restricted_api_needs_its_header_with_its_value() {
        let r = Restrictions::grpc(&groups(&["model-repository,logging:admin-key=s3cret", "inference:k=v"])).unwrap();
        let mut headers = HeaderMap::new();
        let refusal = r.refusal(Some(Api::ModelRepository), &headers).expect("no header");
        assert_eq!(refusal, "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'");
        headers.insert("triton-grpc-protocol-admin-key", HeaderValue::from_static("wrong"));
        assert!(r.refusal(Some(Api::Logging), &headers).is_some(), "wrong value");
        headers.insert("triton-grpc-protocol-admin-key", HeaderValue::from_static("s3cret"));
        assert!(r.refusal(Some(Api::Logging), &headers).is_none());
        assert!(r.refusal(Some(Api::Inference), &headers).is_some(), "another group's key");
        assert!(r.refusal(Some(Api::Health), &HeaderMap::new()).is_none(), "unrestricted");
        assert!(r.refusal(None, &HeaderMap::new()).is_none());

        let r = Restrictions::http(&groups(&["inference:Token= abc "])).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("token", HeaderValue::from_static("abc"));
        assert!(r.refusal(Some(Api::Inference), &headers).is_none(), "header names are case-insensitive");
        assert_eq!(
            r.refusal(Some(Api::Inference), &HeaderMap::new()).unwrap(),
            "This API is restricted, expecting header 'token'"
        );
    }

    #[test]
    fn malformed_groups_are_refused_naming_the_flag() {
        for (bad, needle) in [
            ("inference", "expected API"),
            ("inference:novalue", "expected API"),
            ("inferense:k=v", "unknown API 'inferense'"),
            ("inference:=v", "not a header name"),
            ("inference:bad key=v", "not a header name"),
            ("inference:k=bad\nvalue", "not a valid header value"),
        ] {
            let e = Restrictions::http(&groups(&[bad])).unwrap_err();
            assert!(e.starts_with("--http-restricted-api") && e.contains(needle), "{bad}: {e}");
        }
        let e = Restrictions::grpc(&groups(&["health,metadata:a=1", "health:b=2"])).unwrap_err();
        assert!(e.contains("'health' is in more than one group"), "{e}");
    }
}
