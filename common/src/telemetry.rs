//! Logging set-up shared by every binary: `--log-verbose` picks the starting level, `RUST_LOG`
//! narrows further, and Triton's logging extension (`GET`/`POST /v2/logging`, gRPC
//! `LogSettings`) changes what is logged while the process runs, through [`log_settings`].
//!
//! Triton's settings map onto levels: `log_error`, `log_warning` and `log_info` switch ERROR,
//! WARN and INFO events on or off, each on its own; `log_verbose_level` 1 adds DEBUG and 2 or
//! more TRACE. Logs go to standard output, or to the file named at start
//! ([`init_tracing_to`]), which cannot change afterwards.
//!
//! Lines look like tritonserver's in the worker ([`LogFormat`]: `default`, its glog-like
//! lines, or `ISO8601`; switchable at run time as `log_format`), with the event's fields after
//! the message as `key=value`; the gateway and the tools keep `tracing`'s own lines (their
//! `default`).

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering::Relaxed};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
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
    /// A [`LogFormat`], as `u8`.
    format: AtomicU8,
    /// The format `log_format: "default"` names here: the one the process started with, unless
    /// that was ISO8601 (then tritonserver's `default`).
    default_format: AtomicU8,
}

static SETTINGS: LogSettings = LogSettings {
    info: AtomicBool::new(true),
    warning: AtomicBool::new(true),
    error: AtomicBool::new(true),
    verbose: AtomicU32::new(0),
    format: AtomicU8::new(LogFormat::Tracing as u8),
    default_format: AtomicU8::new(LogFormat::Tracing as u8),
};

/// How a log line looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum LogFormat {
    /// `tracing`'s own: `2026-11-24T02:31:44.123456Z  INFO message key=value`.
    Tracing = 0,
    /// tritonserver's `default`: `I1124 02:31:44.123456 4242 fleet.rs:611] message key=value`
    /// (level E, W or I — verbose lines are I, as in Triton —, month and day, UTC time, process
    /// id, source file and line).
    Default = 1,
    /// tritonserver's `ISO8601`: `2026-11-24T02:31:44Z I 4242 fleet.rs:611] message key=value`.
    Iso8601 = 2,
}

impl LogFormat {
    /// tritonserver's name for it (`--log-format`, the `log_format` setting).
    pub fn name(self) -> &'static str {
        match self {
            LogFormat::Tracing | LogFormat::Default => "default",
            LogFormat::Iso8601 => "ISO8601",
        }
    }

    /// The format tritonserver calls `name`.
    pub fn from_name(name: &str) -> Option<LogFormat> {
        match name {
            "default" => Some(LogFormat::Default),
            "ISO8601" => Some(LogFormat::Iso8601),
            _ => None,
        }
    }

    fn load(cell: &AtomicU8) -> LogFormat {
        match cell.load(Relaxed) {
            1 => LogFormat::Default,
            2 => LogFormat::Iso8601,
            _ => LogFormat::Tracing,
        }
    }
}

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
            ("log_format", LogValue::Str(LogFormat::load(&self.format).name().into())),
        ])
    }

    /// Checks every setting in `changes`, then applies them all (none when one is invalid).
    pub fn apply(&self, changes: &[(String, LogValue)]) -> Result<(), Status> {
        enum Change<'a> {
            Flag(&'a AtomicBool, bool),
            Verbose(u32),
            Format(LogFormat),
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
                ("log_format", LogValue::Str(f)) if LogFormat::from_name(f).is_some() => {
                    Change::Format(LogFormat::from_name(f).expect("checked"))
                }
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
                Change::Format(LogFormat::Default) => self.format.store(self.default_format.load(Relaxed), Relaxed),
                Change::Format(f) => self.format.store(f as u8, Relaxed),
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
/// trace), with `tracing`'s own lines. `RUST_LOG`, when set, narrows what [`log_settings`]
/// lets through. A second call does nothing.
pub fn init_tracing(verbose: u8) {
    let _ = init_tracing_to(verbose, LogFormat::Tracing, None);
}

/// [`init_tracing`] with lines in `format`, appending to `file` (created if missing) instead
/// of standard output. Fails only when the file cannot be opened.
pub fn init_tracing_to(verbose: u8, format: LogFormat, file: Option<&std::path::Path>) -> std::io::Result<()> {
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
    let fmt =
        tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(writer).event_format(Lines::new(&SETTINGS.format));
    let installed = tracing_subscriber::registry()
        .with(level)
        .with(env)
        .with(tracing_subscriber::Layer::with_filter(fmt, dynamic))
        .try_init();
    if installed.is_ok() {
        // Only the call that installed the subscriber says how its lines look.
        SETTINGS.format.store(format as u8, Relaxed);
        let default = if format == LogFormat::Iso8601 { LogFormat::Default } else { format };
        SETTINGS.default_format.store(default as u8, Relaxed);
        let _ = MAX_LEVEL.set(Box::new(move |max| {
            let _ = handle.reload(max);
        }));
    }
    Ok(())
}

/// Formats each event as its [`LogFormat`] (read per event: `log_format` changes at run time).
struct Lines {
    format: &'static AtomicU8,
    tracing: tracing_subscriber::fmt::format::Format,
    pid: u32,
}

impl Lines {
    fn new(format: &'static AtomicU8) -> Lines {
        Lines { format, tracing: tracing_subscriber::fmt::format().with_target(false), pid: std::process::id() }
    }
}

impl<S, N> FormatEvent<S, N> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let format = LogFormat::load(self.format);
        if format == LogFormat::Tracing {
            return self.tracing.format_event(ctx, writer, event);
        }
        let meta = event.metadata();
        let (letter, colour) = match *meta.level() {
            Level::ERROR => ('E', "31"),
            Level::WARN => ('W', "33"),
            _ => ('I', "32"),
        };
        let level =
            if writer.has_ansi_escapes() { format!("\x1b[{colour}m{letter}\x1b[0m") } else { letter.to_string() };
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let t = civil_time(now.as_secs());
        let file = meta.file().map_or("?", |f| f.rsplit(['/', '\\']).next().unwrap_or(f));
        let (pid, line) = (self.pid, meta.line().unwrap_or(0));
        if format == LogFormat::Iso8601 {
            write!(
                writer,
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z {level} ",
                t.year, t.month, t.day, t.hour, t.minute, t.second
            )?;
        } else {
            let micros = now.subsec_micros();
            write!(
                writer,
                "{level}{:02}{:02} {:02}:{:02}:{:02}.{micros:06} ",
                t.month, t.day, t.hour, t.minute, t.second
            )?;
        }
        write!(writer, "{pid} {file}:{line}] ")?;
        ctx.format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// A UTC date and time of day.
#[derive(Debug, PartialEq, Eq)]
struct CivilTime {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
}

/// The UTC date and time `secs` seconds after the Unix epoch (proleptic Gregorian calendar:
/// days counted in 400-year eras from 0000-03-01).
fn civil_time(secs: u64) -> CivilTime {
    let days = (secs / 86_400) as i64 + 719_468;
    let of_day = (secs % 86_400) as u32;
    let era = days.div_euclid(146_097);
    let day_of_era = days.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153; // March = 0
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    CivilTime { year, month, day, hour: of_day / 3_600, minute: of_day % 3_600 / 60, second: of_day % 60 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_time_counts_leap_years() {
        let at = |secs| {
            let t = civil_time(secs);
            format!("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}", t.year, t.month, t.day, t.hour, t.minute, t.second)
        };
        assert_eq!(at(0), "1970-01-01T00:00:00");
        assert_eq!(at(951_782_400 + 3_661), "2000-02-29T01:01:01");
        assert_eq!(at(951_868_800), "2000-03-01T00:00:00");
        assert_eq!(at(4_107_542_399), "2100-02-28T23:59:59");
        assert_eq!(at(4_107_542_400), "2100-03-01T00:00:00", "2100 is no leap year");
        assert_eq!(at(1_795_998_704), "2026-11-30T00:31:44");
    }

    /// Lines in each format, switched between events as `log_format` does.
    #[test]
    fn lines_look_like_tritonservers() {
        static FORMAT: AtomicU8 = AtomicU8::new(LogFormat::Default as u8);
        let buffer = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let sink = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .event_format(Lines::new(&FORMAT))
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(model = "m", version = 3, "model ready");
            FORMAT.store(LogFormat::Iso8601 as u8, Relaxed);
            tracing::warn!("reload failed");
            FORMAT.store(LogFormat::Tracing as u8, Relaxed);
            tracing::error!("boom");
        });
        let text = String::from_utf8(buffer.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        let pid = std::process::id();
        // I1124 02:31:44.123456 4242 telemetry.rs:NNN] model ready model="m" version=3
        let (head, rest) = lines[0].split_once(&format!(" {pid} telemetry.rs:")).expect(lines[0]);
        let b = head.as_bytes();
        assert!(head.len() == 21 && b[0] == b'I' && b[5] == b' ' && b[14] == b'.', "{head}");
        assert!(head[1..5].bytes().chain(head[15..].bytes()).all(|c| c.is_ascii_digit()), "{head}");
        let (line, message) = rest.split_once("] ").unwrap();
        assert!(line.parse::<u32>().is_ok(), "{rest}");
        assert_eq!(message, "model ready model=\"m\" version=3");
        // 2026-11-24T02:31:44Z W 4242 telemetry.rs:NNN] reload failed
        let (head, rest) = lines[1].split_once(&format!(" W {pid} telemetry.rs:")).expect(lines[1]);
        assert!(head.len() == 20 && head.as_bytes()[10] == b'T' && head.ends_with('Z'), "{head}");
        assert!(rest.ends_with("] reload failed"), "{rest}");
        // tracing's own: a full timestamp, the level spelled out.
        assert!(lines[2].contains("ERROR") && lines[2].ends_with("boom"), "{}", lines[2]);
    }

    /// A writer appending to a shared buffer.
    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

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
        assert_eq!(LogFormat::load(&s.format), LogFormat::Iso8601);
        // This process started with tracing's own lines (as the gateway does): "default" names
        // them, not tritonserver's.
        s.apply(&[set("log_format", LogValue::Str("default".into()))]).unwrap();
        assert_eq!(LogFormat::load(&s.format), LogFormat::Tracing);
        assert_eq!(s.current()["log_format"], LogValue::Str("default".into()));
    }
}
