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

/// Checks a worker id or model name used as one key segment: non-empty, at most 255 bytes, no
/// `/`, no whitespace or control characters, not starting with `.` (`.` and `..`, and the hidden
/// folders a worker's repository scan skips: such a model could never load).
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if name.starts_with('.') {
        return Err(format!("{what} '{name}' starts with '.' (hidden in a model repository, or a path step)"));
    }
    if name.len() > 255 {
        // Cut on a character boundary: the name may hold multi-byte characters. 255: a file
        // name's limit (NAME_MAX), which a model's folder in a repository must keep to.
        let head: String = name.chars().take(32).collect();
        return Err(format!("{what} '{head}…' is longer than 255 bytes"));
    }
    if let Some(c) = name.chars().find(|c| *c == '/' || c.is_whitespace() || c.is_control() || is_invisible(*c)) {
        return Err(format!("{what} '{}' contains {c:?}, which a key segment cannot hold", name.escape_debug()));
    }
    Ok(())
}

/// Characters that print as nothing or reorder text (the zero-width space, bidirectional
/// embeddings, overrides and isolates, the byte order mark, the soft hyphen): a name holding
/// one looks like another name, or prints scrambled. The zero-width joiners and the
/// left-to-right / right-to-left marks stay allowed: Persian, Indic and emoji names need them.
fn is_invisible(c: char) -> bool {
    matches!(c, '\u{00AD}' | '\u{180E}' | '\u{200B}' | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{206F}' | '\u{FEFF}')
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

    /// Parses a key read from etcd; `None` when it is not under the prefix at all. A key the
    /// schema cannot use (see [`Keys::classify`]) is [`Key::Other`].
    pub fn parse(&self, key: &[u8]) -> Option<Key> {
        self.classify(key).map(|k| k.unwrap_or(Key::Other))
    }

    /// Parses a key read from etcd, telling apart a key under one of the schema's kinds that
    /// is malformed (`models/bad name`, `placement/w/m/01`, `workers/a/b`): readers reject and
    /// count those like invalid values, where [`Key::Other`] (election keys, kinds a later
    /// version may add) is ignored silently. `None` when the key is not under the prefix.
    pub fn classify(&self, key: &[u8]) -> Option<Result<Key, InvalidKey>> {
        let key = std::str::from_utf8(key).ok()?;
        let rest = key.strip_prefix(&self.prefix)?.strip_prefix('/')?;
        let parts: Vec<&str> = rest.split('/').collect();
        let (kind, shape) = match parts[0] {
            "workers" => ("worker", "workers/<id>"),
            "models" => ("model", "models/<model>"),
            "routes" => ("route", "routes/<model>"),
            "drain" => ("drain", "drain/<worker>"),
            "placement" => ("placement", "placement/<worker>/<model>/<version>"),
            "status" => ("status", "status/<worker>/<model>/<version>"),
            _ => return Some(Ok(Key::Other)),
        };
        let invalid = |reason: String| InvalidKey { kind, reason };
        let name = |what: &str, s: &str| check_name(what, s).map(|()| s.to_string()).map_err(invalid);
        let assignment = |w: &str, m: &str, v: &str| -> Result<(String, String, i64), InvalidKey> {
            Ok((name("worker id", w)?, name("model name", m)?, version(v).map_err(invalid)?))
        };
        Some(match parts.as_slice() {
            ["workers", id] => name("worker id", id).map(Key::Worker),
            ["models", m] => name("model name", m).map(Key::Model),
            ["routes", m] => name("model name", m).map(Key::Route),
            ["drain", w] => name("worker id", w).map(Key::Drain),
            ["placement", w, m, v] => {
                assignment(w, m, v).map(|(worker, model, version)| Key::Placement { worker, model, version })
            }
            ["status", w, m, v] => {
                assignment(w, m, v).map(|(worker, model, version)| Key::Status { worker, model, version })
            }
            _ => Err(invalid(format!("expected {shape}"))),
        })
    }
}

/// A key under one of the schema's kinds that the schema cannot use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidKey {
    /// Bounded label: the kind its first segment names ([`Key::kind`]'s names).
    pub kind: &'static str,
    pub reason: String,
}

/// A version segment: a positive integer written the one way [`Keys::placement`] writes it.
/// "01" or "+1" would otherwise parse as 1 and alias version 1's key: deleting
/// `placement/w/m/01` would read as removing `placement/w/m/1`'s assignment while that key
/// still exists.
fn version(segment: &str) -> Result<i64, String> {
    match segment.parse::<i64>() {
        Ok(v) if v >= 1 && v.to_string() == segment => Ok(v),
        _ => Err(format!("version '{segment}' is not a positive integer written in canonical form")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_print_as_another_are_refused() {
        for name in ["a\u{200B}b", "\u{FEFF}m", "m\u{202E}gnp", "soft\u{00AD}hyphen"] {
            let e = check_name("model", name).unwrap_err();
            assert!(e.contains("which a key segment cannot hold"), "{e}");
            assert!(!e.contains('\u{202E}'), "the name is shown escaped: {e}");
        }
        assert_eq!(check_name("model", "résumé-v2_模型"), Ok(()));
        // Joiners and direction marks that real names need.
        assert_eq!(check_name("model", "می\u{200C}خواهم"), Ok(()));
        assert_eq!(check_name("model", "👩\u{200D}💻"), Ok(()));
    }

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
        assert_eq!(k.parse(b"/nereid/v1/placement/w/m/01"), Some(Key::Other));
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
        for hidden in [".", "..", ".cache"] {
            assert!(check_name("model", hidden).unwrap_err().contains("starts with '.'"), "{hidden}");
        }
        assert!(check_name("model", &"x".repeat(300)).is_err());
        // Over-long names with multi-byte characters (byte 32 falls inside '€') are refused, not
        // a panic: every etcd key read goes through here.
        let euros = "€".repeat(100);
        assert!(check_name("model", &euros).unwrap_err().contains(&"€".repeat(32)));
        let k = Keys::new("/nereid/v1/").unwrap();
        assert_eq!(k.parse(k.model(&euros).as_bytes()), Some(Key::Other));
    }

    #[test]
    fn versions_are_canonical() {
        let k = Keys::new("/n").unwrap();
        let placement = |v: &str| k.classify(format!("/n/placement/w0/mlp_fp32/{v}").as_bytes());
        assert_eq!(
            placement("1"),
            Some(Ok(Key::Placement { worker: "w0".into(), model: "mlp_fp32".into(), version: 1 }))
        );
        assert!(matches!(placement("12"), Some(Ok(Key::Placement { version: 12, .. }))));
        // Each would alias another key's version (or none): never an assignment.
        for bad in ["01", "+1", "0", "-1", "1.0", " 1", "1 ", "", "x", "99999999999999999999"] {
            let got = placement(bad);
            let Some(Err(e)) = &got else { panic!("{bad:?} parsed as {got:?}") };
            assert_eq!(e.kind, "placement");
            assert!(e.reason.contains("canonical form"), "{bad:?}: {e:?}");
            assert_eq!(k.parse(format!("/n/placement/w0/mlp_fp32/{bad}").as_bytes()), Some(Key::Other));
        }
        assert!(matches!(k.classify(b"/n/status/w/m/007"), Some(Err(InvalidKey { kind: "status", .. }))));
    }

    #[test]
    fn malformed_keys_of_known_kinds_are_told_from_other_keys() {
        let k = Keys::new("/n").unwrap();
        let invalid = |key: &str| match k.classify(key.as_bytes()) {
            Some(Err(e)) => (e.kind, e.reason),
            other => panic!("{key}: {other:?}"),
        };
        let (kind, reason) = invalid("/n/models/bad name");
        assert_eq!(kind, "model");
        assert!(reason.contains("model name 'bad name'"), "{reason}");
        assert_eq!(invalid("/n/workers/").0, "worker");
        assert!(invalid("/n/workers/a/b").1.contains("expected workers/<id>"));
        assert!(invalid("/n/workers").1.contains("expected workers/<id>"));
        assert_eq!(invalid("/n/routes/a\tb").0, "route");
        assert_eq!(invalid("/n/drain/x/y").0, "drain");
        assert_eq!(invalid("/n/placement/w/m").0, "placement");
        assert!(invalid("/n/status/w/bad name/1").1.contains("model name"));
        // Not the schema's kinds: ignored, not rejected.
        for other in ["/n/leader/placement/694d", "/n/filler", "/n/model/typo-of-a-kind", "/n/"] {
            assert_eq!(k.classify(other.as_bytes()), Some(Ok(Key::Other)), "{other}");
        }
        assert_eq!(k.classify(b"/other/models/m"), None);
    }
}
