//! nereid-perf: load generation and measurement for KServe v2 servers (workers and gateway).
//!
//! The hot path, from `main`: [`cli::Args::into_config`] → [`driver::run`] (connect, prepare
//! each request once, then per load level: generate load, measure windows until stable,
//! scrape `/metrics`) → [`report`] (table, CSV, JSON) and [`html`] (the HTML report, drawn
//! with [`svg`]). Load shapes are in [`schedule`], `--binary-search` in [`search`], the
//! requests in [`workload`] (input data files in [`data_file`]) and [`client`], the numbers in [`measure`] and [`server_stats`].
//!
//! nereid-analyze (config sweeps with a Pareto frontier) lives in [`analyze`] and measures
//! each variant with the same [`driver`].

pub mod analyze;
pub mod cli;
pub mod client;
pub mod data_file;
pub mod driver;
pub mod error;
pub mod html;
pub mod measure;
pub mod report;
pub mod schedule;
pub mod search;
pub mod server_stats;
pub mod svg;
pub mod validation;
pub mod workload;

pub use driver::{RunConfig, RunReport, run};
pub use error::{PerfError, exit};
