//! Logging set-up shared by every binary: `--log-verbose` picks the starting level, `RUST_LOG`
//! narrows further, and Triton's logging extension (`GET`/`POST /v2/logging`, gRPC
//! `LogSettings`) changes what is logged while the process runs, through [`log_settings`].
//!
//! Triton's settings map onto levels: `log_error`, `log_warning` and `log_info` switch ERROR,
//! WARN and INFO events on or off, each on its own; `log_verbose_level` 1 adds DEBUG and 2 or
//! more TRACE. Logs go to standard output, or to the file named at start
//! ([`init_tracing_to`]), which cannot change afterwards; `log_format` is `default` or
//! `ISO8601` (timestamps are ISO 8601 either way).

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};

use tracing::Level;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::reload;
use tracing_subscriber::util::SubscriberInitExt;

use crate::Status;

/// What is logged now; changed at run time through [`LogSettings::apply`].
#[derive(Debug)]
pub struct LogSettings {
    info: AtomicBool,
    warning: AtomicBool,
    error: AtomicBool,
    verbose: AtomicU32,
}

static SETTINGS: LogSettings = LogSettings {
    info: AtomicBool::new(true),
    warning: AtomicBool::new(true),
    error: AtomicBool::new(true),
    verbose: AtomicU32::new(0),
};

/// The process's log settings.
pub fn log_settings() -> &'static LogSettings {
    &SETTINGS
}

/// One setting's value, as both protocols carry them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogValue {
    Bool(bool),
    Uint(u32),
    Str(String),
}

impl LogSettings {
    /// Whether an event of `level` is logged now.
    pub fn enabled(&self, level: &Level) -> bool {
        match *level {
            Level::ERROR => self.error.load(Relaxed),
            Level::WARN => self.warning.load(Relaxed),
            Level::INFO => self.info.load(Relaxed),
            Level::DEBUG => self.verbose.load(Relaxed) >= 1,
            _ => self.verbose.load(Relaxed) >= 2,
        }
    }

    /// Every setting, by Triton's names.
    pub fn current(&self) -> BTreeMap<&'static str, LogValue> {
        BTreeMap::from([
            ("log_file", LogValue::Str(log_file().to_string())),
            ("log_info", LogValue::Bool(self.info.load(Relaxed))),
            ("log_warning", LogValue::Bool(self.warning.load(Relaxed))),
            ("log_error", LogValue::Bool(self.error.load(Relaxed))),
            ("log_verbose_level", LogValue::Uint(self.verbose.load(Relaxed))),
            ("log_format", LogValue::Str("default".into())),
        ])
    }

    /// Checks every setting in `changes`, then applies them all (none when one is invalid).
    pub fn apply(&self, changes: &[(String, LogValue)]) -> Result<(), Status> {
        enum Change<'a> {
            Flag(&'a AtomicBool, bool),
            Verbose(u32),
            Nothing,
        }
        let mut planned = Vec::with_capacity(changes.len());
        for (key, value) in changes {
            let wrong = |want: &str| Status::invalid(format!("log setting '{key}' must be {want}, got {value:?}"));
            planned.push(match (key.as_str(), value) {
                ("log_info", LogValue::Bool(b)) => Change::Flag(&self.info, *b),
                ("log_warning", LogValue::Bool(b)) => Change::Flag(&self.warning, *b),
                ("log_error", LogValue::Bool(b)) => Change::Flag(&self.error, *b),
                ("log_info" | "log_warning" | "log_error", _) => return Err(wrong("a boolean")),
                ("log_verbose_level", LogValue::Uint(n)) => Change::Verbose(*n),
                ("log_verbose_level", _) => return Err(wrong("a non-negative integer")),
                ("log_file", LogValue::Str(path)) if path == log_file() => Change::Nothing,
                ("log_file", LogValue::Str(_)) => {
                    return Err(Status::invalid(match log_file() {
                        "" => "log setting 'log_file' must be empty: this process logs to standard output \
                               (a file is named at start, with --log-file)"
                            .to_string(),
                        now => format!("log setting 'log_file' is set at start (--log-file) and stays '{now}'"),
                    }));
                }
                ("log_format", LogValue::Str(f)) if f == "default" || f == "ISO8601" => Change::Nothing,
                ("log_file" | "log_format", _) => {
                    return Err(wrong("a string ('default' or 'ISO8601' for log_format)"));
                }
                (other, _) => {
                    return Err(Status::invalid(format!(
                        "unknown log setting '{other}' (settings: log_file, log_info, log_warning, log_error, \
                         log_verbose_level, log_format)"
                    )));
                }
            });
        }
        for change in planned {
            match change {
                Change::Flag(flag, on) => flag.store(on, Relaxed),
                Change::Verbose(n) => self.verbose.store(n, Relaxed),
                Change::Nothing => {}
            }
        }
        if let Some(reload) = MAX_LEVEL.get() {
            reload(self.max_level());
        }
        Ok(())
    }

    /// The most verbose level any setting lets through: what `tracing` may skip callsites
    /// above, at no cost (the per-level switches below it are checked per event).
    fn max_level(&self) -> LevelFilter {
        match self.verbose.load(Relaxed) {
            0 if self.info.load(Relaxed) => LevelFilter::INFO,
            0 if self.warning.load(Relaxed) => LevelFilter::WARN,
            0 if self.error.load(Relaxed) => LevelFilter::ERROR,
            0 => LevelFilter::OFF,
            1 => LevelFilter::DEBUG,
            _ => LevelFilter::TRACE,
        }
    }
}

/// The file the log goes to, when one was named at start.
static LOG_FILE: OnceLock<String> = OnceLock::new();

fn log_file() -> &'static str {
    LOG_FILE.get().map_or("", String::as_str)
}

/// Sets the subscriber's global level filter (which rebuilds `tracing`'s callsite cache).
static MAX_LEVEL: OnceLock<Box<dyn Fn(LevelFilter) + Send + Sync>> = OnceLock::new();

/// Installs the global `tracing` subscriber, starting at `verbose` (0 = info, 1 = debug, 2+ =
/// trace). `RUST_LOG`, when set, narrows what [`log_settings`] lets through. A second call
/// does nothing.
pub fn init_tracing(verbose: u8) {
    let _ = init_tracing_to(verbose, None);
}

/// [`init_tracing`], appending to `file` (created if missing) instead of standard output.
/// Fails only when the file cannot be opened.
pub fn init_tracing_to(verbose: u8, file: Option<&std::path::Path>) -> std::io::Result<()> {
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    let (writer, ansi) = match file {
        Some(path) => {
            let f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
            let _ = LOG_FILE.set(path.display().to_string());
            (BoxMakeWriter::new(std::sync::Arc::new(f)), false)
        }
        // Colours only on a terminal: a pod's log (kubectl logs) gets plain text.
        None => (
            BoxMakeWriter::new(std::io::stdout),
            std::io::IsTerminal::is_terminal(&std::io::stdout()) && std::env::var_os("NO_COLOR").is_none(),
        ),
    };
    SETTINGS.verbose.store(u32::from(verbose), Relaxed);
    // The global level filter keeps disabled levels free (callsites above it are skipped
    // statically, as with a fixed level); the per-event filter applies the single switches.
    let (level, handle) = reload::Layer::new(SETTINGS.max_level());
    let dynamic = tracing_subscriber::filter::filter_fn(|meta| SETTINGS.enabled(meta.level()));
    let env = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("trace"));
    let fmt = tracing_subscriber::fmt::layer().with_target(false).with_ansi(ansi).with_writer(writer);
    let installed = tracing_subscriber::registry()
        .with(level)
        .with(env)
        .with(tracing_subscriber::Layer::with_filter(fmt, dynamic))
        .try_init();
    if installed.is_ok() {
        let _ = MAX_LEVEL.set(Box::new(move |max| {
            let _ = handle.reload(max);
        }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings are process-wide: one test changes them and puts them back.
    #[test]
    fn settings_apply_all_or_nothing_and_map_to_levels() {
        let s = log_settings();
        assert_eq!(s.current()["log_info"], LogValue::Bool(true));
        assert!(s.enabled(&Level::INFO) && !s.enabled(&Level::DEBUG));

        let set = |k: &str, v: LogValue| (k.to_string(), v);
        s.apply(&[set("log_verbose_level", LogValue::Uint(2)), set("log_warning", LogValue::Bool(false))]).unwrap();
        assert!(s.enabled(&Level::TRACE) && s.enabled(&Level::DEBUG) && !s.enabled(&Level::WARN));
        assert!(s.enabled(&Level::ERROR) && s.enabled(&Level::INFO), "each level on its own");

        for (changes, needle) in [
            (vec![set("log_info", LogValue::Uint(1))], "'log_info' must be a boolean"),
            (vec![set("log_verbose_level", LogValue::Bool(true))], "must be a non-negative integer"),
            (vec![set("log_file", LogValue::Str("/tmp/x.log".into()))], "must be empty"),
            (vec![set("log_format", LogValue::Str("json".into()))], "'default' or 'ISO8601'"),
            (vec![set("log_colour", LogValue::Bool(true))], "unknown log setting 'log_colour'"),
            // The valid first change is not applied when the second is refused.
            (vec![set("log_error", LogValue::Bool(false)), set("nope", LogValue::Bool(true))], "unknown log setting"),
        ] {
            let e = s.apply(&changes).unwrap_err();
            assert!(e.message.contains(needle), "{needle}: {}", e.message);
        }
        assert!(s.enabled(&Level::ERROR), "nothing applied from a refused request");

        s.apply(&[
            set("log_verbose_level", LogValue::Uint(0)),
            set("log_warning", LogValue::Bool(true)),
            set("log_file", LogValue::Str(String::new())),
            set("log_format", LogValue::Str("ISO8601".into())),
        ])
        .unwrap();
        assert_eq!(s.current()["log_verbose_level"], LogValue::Uint(0));
        assert!(s.enabled(&Level::WARN) && !s.enabled(&Level::DEBUG));
    }
}
