//! The etcd key schema under one prefix, built and parsed in one place.

/// Keys under a validated prefix (no trailing slash).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

/// A parsed key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Key {
    Worker(String),
    Model(String),
    Placement {
        worker: String,
        model: String,
        version: i64,
    },
    Status {
        worker: String,
        model: String,
        version: i64,
    },
    Route(String),
    Drain(String),
    /// Under the prefix but not part of the schema (election keys, a future kind, a typo).
    Other,
}

impl Key {
    /// A short bounded label for metrics (`worker`, `status`, …).
    pub fn kind(&self) -> &'static str {
        match self {
            Key::Worker(_) => "worker",
            Key::Model(_) => "model",
            Key::Placement { .. } => "placement",
            Key::Status { .. } => "status",
            Key::Route(_) => "route",
            Key::Drain(_) => "drain",
            Key::Other => "other",
        }
    }
}

/// Checks a worker id or model name used as one key segment: non-empty, at most 256 bytes, no
/// `/`, no whitespace or control characters.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if name.len() > 256 {
        // Cut on a character boundary: the name may hold multi-byte characters.
        let head: String = name.chars().take(32).collect();
        return Err(format!("{what} '{head}…' is longer than 256 bytes"));
    }
    if let Some(c) = name.chars().find(|c| *c == '/' || c.is_whitespace() || c.is_control()) {
        return Err(format!("{what} '{name}' contains {c:?}, which a key segment cannot hold"));
    }
    Ok(())
}

impl Keys {
    /// `prefix` must start with `/`; a trailing `/` is dropped.
    pub fn new(prefix: &str) -> Result<Keys, String> {
        let trimmed = prefix.trim_end_matches('/');
        if !prefix.starts_with('/') {
            return Err(format!("etcd prefix '{prefix}' must start with '/'"));
        }
        if trimmed.split('/').skip(1).any(str::is_empty) || trimmed.chars().any(|c| c.is_whitespace()) {
            return Err(format!("etcd prefix '{prefix}' has an empty segment or whitespace"));
        }
        Ok(Keys { prefix: trimmed.to_string() })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Everything Nereid stores: `<prefix>/`.
    pub fn all(&self) -> String {
        format!("{}/", self.prefix)
    }

    pub fn workers(&self) -> String {
        format!("{}/workers/", self.prefix)
    }

    pub fn worker(&self, id: &str) -> String {
        format!("{}/workers/{id}", self.prefix)
    }

    pub fn models(&self) -> String {
        format!("{}/models/", self.prefix)
    }

    pub fn model(&self, name: &str) -> String {
        format!("{}/models/{name}", self.prefix)
    }

    pub fn placements(&self) -> String {
        format!("{}/placement/", self.prefix)
    }

    /// One worker's placement prefix (what its placement agent watches).
    pub fn placement_of(&self, worker: &str) -> String {
        format!("{}/placement/{worker}/", self.prefix)
    }

    pub fn placement(&self, worker: &str, model: &str, version: i64) -> String {
        format!("{}/placement/{worker}/{model}/{version}", self.prefix)
    }

    pub fn statuses(&self) -> String {
        format!("{}/status/", self.prefix)
    }

    pub fn status(&self, worker: &str, model: &str, version: i64) -> String {
        format!("{}/status/{worker}/{model}/{version}", self.prefix)
    }

    pub fn routes(&self) -> String {
        format!("{}/routes/", self.prefix)
    }

    pub fn route(&self, model: &str) -> String {
        format!("{}/routes/{model}", self.prefix)
    }

    pub fn drains(&self) -> String {
        format!("{}/drain/", self.prefix)
    }

    pub fn drain(&self, worker: &str) -> String {
        format!("{}/drain/{worker}", self.prefix)
    }

    /// The placement controller's election name.
    pub fn placement_election(&self) -> String {
        format!("{}/leader/placement", self.prefix)
    }

    /// Parses a key read from etcd; `None` when it is not under the prefix at all.
    pub fn parse(&self, key: &[u8]) -> Option<Key> {
        let key = std::str::from_utf8(key).ok()?;
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix('/')?;
        let parts: Vec<&str> = rest.split('/').collect();
        let version = |s: &str| s.parse::<i64>().ok().filter(|v| *v >= 1);
        let name = |s: &str| check_name("name", s).is_ok();
        Some(match parts.as_slice() {
            ["workers", id] if name(id) => Key::Worker(id.to_string()),
            ["models", m] if name(m) => Key::Model(m.to_string()),
            ["routes", m] if name(m) => Key::Route(m.to_string()),
            ["drain", w] if name(w) => Key::Drain(w.to_string()),
            ["placement", w, m, v] if name(w) && name(m) && version(v).is_some() => {
                Key::Placement { worker: w.to_string(), model: m.to_string(), version: version(v).unwrap_or(1) }
            }
            ["status", w, m, v] if name(w) && name(m) && version(v).is_some() => {
                Key::Status { worker: w.to_string(), model: m.to_string(), version: version(v).unwrap_or(1) }
            }
            _ => Key::Other,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_and_parse_round_trip() {
        let k = Keys::new("/nereid/v1/").unwrap();
        assert_eq!(k.prefix(), "/nereid/v1");
        assert_eq!(k.worker("w-1"), "/nereid/v1/workers/w-1");
        assert_eq!(k.placement("w", "m", 3), "/nereid/v1/placement/w/m/3");
        assert_eq!(k.parse(k.worker("w-1").as_bytes()), Some(Key::Worker("w-1".into())));
        assert_eq!(k.parse(k.model("m").as_bytes()), Some(Key::Model("m".into())));
        assert_eq!(
            k.parse(k.placement("w", "m", 3).as_bytes()),
            Some(Key::Placement { worker: "w".into(), model: "m".into(), version: 3 })
        );
        assert_eq!(
            k.parse(k.status("w", "m", 2).as_bytes()),
            Some(Key::Status { worker: "w".into(), model: "m".into(), version: 2 })
        );
        assert_eq!(k.parse(k.route("m").as_bytes()), Some(Key::Route("m".into())));
        assert_eq!(k.parse(k.drain("w").as_bytes()), Some(Key::Drain("w".into())));
        assert_eq!(k.parse(b"/nereid/v1/status/w/m/0"), Some(Key::Other));
        assert_eq!(k.parse(b"/nereid/v1/status/w/m/x"), Some(Key::Other));
        assert_eq!(k.parse(b"/nereid/v1/leader/placement/123"), Some(Key::Other));
        assert_eq!(k.parse(b"/nereid/v10/workers/w"), None);
        assert_eq!(k.parse(b"/other/workers/w"), None);
        assert_eq!(k.parse(&[0xff, 0xfe]), None);
    }

    #[test]
    fn prefixes_and_names_are_checked() {
        assert!(Keys::new("nereid").is_err());
        assert!(Keys::new("/a//b").is_err());
        assert!(Keys::new("/a b").is_err());
        assert!(Keys::new("/").is_ok());
        assert!(check_name("model", "resnet-50.v2").is_ok());
        assert!(check_name("model", "").is_err());
        assert!(check_name("model", "a/b").unwrap_err().contains("'/'"));
        assert!(check_name("model", "a b").is_err());
        assert!(check_name("model", &"x".repeat(300)).is_err());
        // Over-long names with multi-byte characters (byte 32 falls inside '€') are refused, not
        // a panic: every etcd key read goes through here.
        let euros = "€".repeat(100);
        assert!(check_name("model", &euros).unwrap_err().contains(&"€".repeat(32)));
        let k = Keys::new("/nereid/v1/").unwrap();
        assert_eq!(k.parse(k.model(&euros).as_bytes()), Some(Key::Other));
    }
}
