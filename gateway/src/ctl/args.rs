//! `nereidctl`'s command line, parsed once by clap. Every value is checked here, before etcd is
//! touched, and a refused value is reported with its flag (clap exits 2).

use clap::{Parser, Subcommand, ValueEnum};
use nereid_common::fleet::keys::check_name;
use nereid_common::fleet::records::{self, MAX_MEMORY_MB, MAX_REPLICAS};
use nereid_common::fleet::{DEFAULT_PREFIX, Keys};

/// Default `--etcd-endpoints`.
pub const DEFAULT_ENDPOINTS: &str = "http://127.0.0.1:2379";

const GLOBAL: &str = "Global options";

/// nereidctl: inspect and steer a Nereid fleet through etcd (models, placement, routes, drains).
///
/// Every write is validated before it is sent. Exit status: 0 done; 1 etcd unreachable or
/// failing; 2 invalid input or a request the fleet's state refuses (nothing written).
#[derive(Debug, Parser)]
#[command(name = "nereidctl", version, about, long_about)]
pub struct Cli {
    /// etcd endpoints (comma-separated http://host:port).
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL,
        env = "NEREID_ETCD_ENDPOINTS",
        default_value = DEFAULT_ENDPOINTS,
        value_name = "URLS",
        value_parser = endpoints
    )]
    pub etcd_endpoints: Endpoints,

    /// Prefix of every Nereid key in etcd.
    #[arg(long, global = true, help_heading = GLOBAL, default_value = DEFAULT_PREFIX, value_name = "PREFIX", value_parser = prefix)]
    pub etcd_prefix: Keys,

    /// Output format.
    #[arg(long, global = true, help_heading = GLOBAL, value_enum, default_value_t = Output::Table)]
    pub output: Output,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    Table,
    /// One JSON document for scripts.
    Json,
}

/// Checked `--etcd-endpoints`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoints(pub Vec<String>);

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List workers: state, address, capacity, labels, and each model version's status.
    Workers,
    /// List declared models and, per version, how many workers hold it READY of the replicas wanted.
    Models,
    /// Declare or remove a model (the placement controller then loads or unloads it).
    #[command(subcommand)]
    Model(ModelCommand),
    /// Show the placement controller's assignments, grouped by worker, with their status.
    Placement,
    /// Set, show or clear a model's traffic split across versions.
    #[command(subcommand)]
    Routes(RoutesCommand),
    /// Drain a worker: the gateway stops routing to it and its models are placed elsewhere.
    Drain {
        /// Worker id (as `nereidctl workers` lists it).
        #[arg(value_name = "WORKER", value_parser = worker_id)]
        worker: String,
        /// Why (shown by `nereidctl workers`).
        #[arg(long, value_name = "TEXT", value_parser = reason)]
        reason: Option<String>,
        /// Write the drain even if no such worker is registered (e.g. to cordon one before it starts).
        #[arg(long, conflicts_with = "until_exit")]
        force: bool,
        /// Bind the drain to the worker's current registration (its etcd lease), so that it
        /// goes away when the worker exits: for a preStop hook, where the pod's worker id is
        /// never reused. Without it the drain stays until `undrain`, across restarts.
        #[arg(long)]
        until_exit: bool,
        /// Then wait up to SECS for the placement controller to move every model off the worker
        /// (its placements gone once a replacement is READY elsewhere); exit 1, naming what is
        /// left, if it has not by then. 0: do not wait.
        #[arg(long, value_name = "SECS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=3600))]
        wait_secs: u64,
    },
    /// Undo `drain`: the worker takes traffic and placements again.
    Undrain {
        /// Worker id.
        #[arg(value_name = "WORKER", value_parser = worker_id)]
        worker: String,
        /// Remove the drain even when it is a worker's own way out (`drain --until-exit`, bound
        /// to its lease, e.g. written by its pod's preStop hook): the worker takes traffic
        /// and placements again while it waits to be stopped.
        #[arg(long)]
        force: bool,
    },
    /// Print every key and value under the prefix, marking values that fail validation.
    Get,
}

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Declare (or redeclare) a model: which versions to serve and on how many workers each.
    Declare {
        /// Model name, as in the workers' model repositories.
        #[arg(value_name = "NAME", value_parser = model_name)]
        name: String,
        /// Versions to serve, comma-separated (e.g. 1,2).
        #[arg(long, value_name = "LIST", value_parser = versions)]
        versions: Versions,
        /// Workers each version is placed on.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=MAX_REPLICAS as i64))]
        replicas: u32,
        /// Memory one loaded version needs on a worker, in MiB (0: not counted).
        #[arg(long, default_value_t = 0, value_name = "MIB", value_parser = clap::value_parser!(u64).range(0..=MAX_MEMORY_MB))]
        memory_mb: u64,
        /// Cost class of the model's requests (stored for the gateway's cost-class routing;
        /// not used by the gateway yet).
        #[arg(long, value_name = "CLASS", value_parser = cost_class)]
        cost_class: Option<String>,
        /// Only workers with this label (KEY=VALUE, as given by the worker's --label); repeat
        /// for several, all required. E.g. --selector device=gpu.
        #[arg(long = "selector", value_name = "KEY=VALUE", value_parser = selector)]
        selector: Vec<(String, String)>,
    },
    /// Undeclare a model: it is unloaded from every worker.
    Remove {
        /// Model name.
        #[arg(value_name = "NAME", value_parser = model_name)]
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum RoutesCommand {
    /// Store a model's version weights (routes/<m>), checked against its declared versions,
    /// for splitting traffic between versions. This gateway does not apply them yet: a request
    /// naming no version goes to the newest READY one (the old one during a roll-over).
    Set {
        /// A declared model.
        #[arg(value_name = "MODEL", value_parser = model_name)]
        model: String,
        /// VERSION=WEIGHT; repeat per version (relative weights; unlisted versions get no traffic).
        #[arg(long = "weight", required = true, value_name = "VERSION=WEIGHT", value_parser = weight)]
        weights: Vec<(i64, u32)>,
        /// Request header whose value keeps a client on one version (e.g. x-nereid-route-key).
        #[arg(long, value_name = "HEADER", value_parser = header_name)]
        sticky_key: Option<String>,
    },
    /// Show the routes of one model, or of all.
    Show {
        /// Only this model.
        #[arg(value_name = "MODEL", value_parser = model_name)]
        model: Option<String>,
    },
    /// Remove a model's routes.
    Clear {
        /// Model name.
        #[arg(value_name = "MODEL", value_parser = model_name)]
        model: String,
    },
}

fn endpoints(value: &str) -> Result<Endpoints, String> {
    nereid_common::fleet::parse_endpoints(value).map(Endpoints)
}

fn prefix(value: &str) -> Result<Keys, String> {
    Keys::new(value)
}

fn model_name(value: &str) -> Result<String, String> {
    check_name("model name", value).map(|()| value.to_string())
}

fn worker_id(value: &str) -> Result<String, String> {
    check_name("worker id", value).map(|()| value.to_string())
}

fn cost_class(value: &str) -> Result<String, String> {
    check_name("cost class", value).map(|()| value.to_string())
}

fn reason(value: &str) -> Result<String, String> {
    nereid_common::fleet::records::check_reason(value).map(|()| value.to_string())
}

/// Parses one `--selector KEY=VALUE`, checked as workers check their `--label`s
/// ([`records::check_label`]): a selector no worker label could match is refused.
pub fn selector(value: &str) -> Result<(String, String), String> {
    let Some((k, v)) = value.split_once('=').map(|(k, v)| (k.trim(), v.trim())).filter(|(k, _)| !k.is_empty()) else {
        return Err(format!("'{value}': expected KEY=VALUE with a non-empty key"));
    };
    records::check_label(k, v).map_err(|e| format!("'{value}': {e}"))?;
    Ok((k.to_string(), v.to_string()))
}

/// Checked `--versions`: positive integers, each once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versions(pub Vec<i64>);

/// Parses `--versions 1,2` (spaces around commas allowed).
pub fn versions(value: &str) -> Result<Versions, String> {
    let mut out = Vec::new();
    for part in value.split(',').map(str::trim) {
        if part.is_empty() {
            return Err("expected comma-separated version numbers, e.g. 1,2".into());
        }
        let v: i64 = part.parse().map_err(|_| format!("'{part}' is not a version number"))?;
        if v < 1 {
            return Err(format!("version {v} is not a positive integer"));
        }
        if out.contains(&v) {
            return Err(format!("version {v} is listed twice"));
        }
        out.push(v);
    }
    Ok(Versions(out))
}

/// Parses `--weight VERSION=WEIGHT` (e.g. `2=10`).
pub fn weight(value: &str) -> Result<(i64, u32), String> {
    let (version, weight) =
        value.split_once('=').ok_or_else(|| format!("'{value}' is not VERSION=WEIGHT (e.g. 1=90)"))?;
    let version: i64 = match version.trim().parse() {
        Ok(v) if v >= 1 => v,
        _ => return Err(format!("'{}' is not a version number (a positive integer)", version.trim())),
    };
    let weight: u32 = weight
        .trim()
        .parse()
        .map_err(|_| format!("weight '{}' of version {version} is not a non-negative integer", weight.trim()))?;
    Ok((version, weight))
}

/// Checks `--sticky-key` is an HTTP header name; header names are case-insensitive, so it is
/// stored lowercase.
pub fn header_name(value: &str) -> Result<String, String> {
    let name = value.to_ascii_lowercase();
    http::HeaderName::from_bytes(name.as_bytes())
        .map(|h| h.as_str().to_string())
        .map_err(|_| format!("'{value}' is not an HTTP header name"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("nereidctl").chain(args.iter().copied()))
    }

    #[test]
    fn versions_are_positive_and_distinct() {
        assert_eq!(versions("1").unwrap(), Versions(vec![1]));
        assert_eq!(versions("3, 1,2").unwrap(), Versions(vec![3, 1, 2]));
        assert!(versions("").unwrap_err().contains("comma-separated"));
        assert!(versions("1,").unwrap_err().contains("comma-separated"));
        assert!(versions("1,x").unwrap_err().contains("'x'"));
        assert!(versions("0").unwrap_err().contains("version 0"));
        assert!(versions("-2").unwrap_err().contains("version -2"));
        assert!(versions("1,2,1").unwrap_err().contains("twice"));
    }

    #[test]
    fn weights_are_version_equals_weight() {
        assert_eq!(weight("1=90").unwrap(), (1, 90));
        assert_eq!(weight(" 2 = 0 ").unwrap(), (2, 0));
        assert!(weight("1").unwrap_err().contains("VERSION=WEIGHT"));
        assert!(weight("x=1").unwrap_err().contains("'x'"));
        assert!(weight("0=1").unwrap_err().contains("'0'"));
        assert!(weight("1=-5").unwrap_err().contains("weight '-5'"));
        assert!(weight("1=").unwrap_err().contains("weight ''"));
    }

    #[test]
    fn sticky_keys_are_header_names() {
        assert_eq!(header_name("X-Nereid-Route-Key").unwrap(), "x-nereid-route-key");
        assert!(header_name("bad header").is_err());
        assert!(header_name("").is_err());
    }

    #[test]
    fn parses_subcommands_and_global_flags_anywhere() {
        let cli = parse(&["models", "--output", "json", "--etcd-endpoints", "http://a:1,http://b:2"]).unwrap();
        assert!(matches!(cli.command, Command::Models));
        assert_eq!(cli.output, Output::Json);
        assert_eq!(cli.etcd_endpoints.0, vec!["http://a:1", "http://b:2"]);
        assert_eq!(cli.etcd_prefix.prefix(), DEFAULT_PREFIX);

        let cli = parse(&[
            "--etcd-prefix",
            "/x/",
            "routes",
            "set",
            "m",
            "--weight",
            "1=90",
            "--weight",
            "2=10",
            "--sticky-key",
            "X-User",
        ])
        .unwrap();
        assert_eq!(cli.etcd_prefix.prefix(), "/x");
        match cli.command {
            Command::Routes(RoutesCommand::Set { model, weights, sticky_key }) => {
                assert_eq!(model, "m");
                assert_eq!(weights, vec![(1, 90), (2, 10)]);
                assert_eq!(sticky_key.as_deref(), Some("x-user"));
            }
            other => panic!("{other:?}"),
        }
        let cli =
            parse(&["model", "declare", "m", "--versions", "1,2", "--replicas", "2", "--memory-mb", "64"]).unwrap();
        match cli.command {
            Command::Model(ModelCommand::Declare { name, versions, replicas, memory_mb, cost_class, selector }) => {
                assert_eq!(
                    (name.as_str(), versions.0, replicas, memory_mb, cost_class),
                    ("m", vec![1, 2], 2, 64, None)
                );
                assert!(selector.is_empty());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn selectors_are_key_equals_value() {
        assert_eq!(selector("device=gpu").unwrap(), ("device".to_string(), "gpu".to_string()));
        assert_eq!(selector("zone=").unwrap(), ("zone".to_string(), String::new()));
        assert!(selector("=gpu").unwrap_err().contains("non-empty key"));
        assert!(selector("gpu").is_err());
        assert!(selector("dev ice=gpu").unwrap_err().contains("space or control"));
        assert!(selector("device=g\tpu").unwrap_err().contains("space or control"));
        assert!(selector(&format!("k={}", "v".repeat(64))).unwrap_err().contains("longer than 63"));
    }

    #[test]
    fn invalid_input_names_the_flag() {
        let err = |args: &[&str]| {
            let e = parse(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            (e.kind(), e.to_string())
        };
        let (_, msg) = err(&["model", "declare", "m", "--versions", "1,x", "--replicas", "1"]);
        assert!(msg.contains("--versions") && msg.contains("'x'"), "{msg}");
        let (_, msg) = err(&["model", "declare", "m", "--versions", "1", "--replicas", "0"]);
        assert!(msg.contains("--replicas") && msg.contains("1..=1024"), "{msg}");
        let (_, msg) = err(&["model", "declare", "a/b", "--versions", "1", "--replicas", "1"]);
        assert!(msg.contains("model name 'a/b'"), "{msg}");
        let (_, msg) = err(&["routes", "set", "m", "--weight", "1:90"]);
        assert!(msg.contains("--weight"), "{msg}");
        let (kind, _) = err(&["routes", "set", "m"]);
        assert_eq!(kind, ErrorKind::MissingRequiredArgument);
        let (_, msg) = err(&["workers", "--etcd-endpoints", "127.0.0.1:2379"]);
        assert!(msg.contains("--etcd-endpoints") && msg.contains("http://host:port"), "{msg}");
        let (_, msg) = err(&["workers", "--etcd-prefix", "nereid"]);
        assert!(msg.contains("must start with '/'"), "{msg}");
        let (_, msg) = err(&["workers", "--output", "yaml"]);
        assert!(msg.contains("--output"), "{msg}");
        let (kind, _) = err(&["frobnicate"]);
        assert_eq!(kind, ErrorKind::InvalidSubcommand);
        let (_, msg) = err(&["drain", "w1", "--reason", &"x".repeat(5000)]);
        assert!(msg.contains("--reason"), "{msg}");
        let (_, msg) = err(&["drain", "w1", "--reason", "line\n\u{1b}[31mred"]);
        assert!(msg.contains("--reason") && msg.contains("control character"), "{msg}");
        let (_, msg) =
            err(&["model", "declare", "m", "--versions", "1", "--replicas", "1", "--memory-mb", "99999999999"]);
        assert!(msg.contains("--memory-mb"), "{msg}");
    }
}
