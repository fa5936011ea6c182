//! nereid-perf: load generation and measurement for KServe v2 servers (workers and gateway).
//!
//! The hot path, from `main`: [`cli::Args::into_config`] → [`driver::run`] (connect, prepare
//! each request once, then per load level: generate load, measure windows until stable,
//! scrape `/metrics`) → [`report`] (table, CSV, JSON). Load shapes are in [`schedule`], the
//! requests in [`workload`] and [`client`], the numbers in [`measure`] and [`server_stats`].

pub mod cli;
pub mod client;
pub mod driver;
pub mod error;
pub mod measure;
pub mod report;
pub mod schedule;
pub mod server_stats;
pub mod workload;

pub use driver::{RunConfig, RunReport, run};
pub use error::{PerfError, exit};
