//! Shared vocabulary of Nereid: tensor data types, model configuration loading, and errors
//! rendered once to gRPC and HTTP status.

pub mod config;
pub mod dtype;
pub mod fleet;
pub mod limits;
pub mod status;
pub mod telemetry;
pub mod testing;

pub use dtype::DataType;
pub use status::{Code, Status};
