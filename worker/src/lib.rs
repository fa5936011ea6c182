//! nereid-worker: serves a Triton-style model repository through ONNX Runtime, with dynamic
//! batching and instance groups, over KServe v2 HTTP and gRPC, with Triton-named metrics.
//!
//! Request path: `http` / `grpc` front end → [`server::Server::infer`] →
//! [`repository::Repository`] (model + version lookup) → [`validate`] (against the config) →
//! [`scheduler`] (dynamic batcher task) → [`backend`] instance thread (ONNX Runtime) → reply.
//! An [`ensemble`] runs its steps as such requests to its composing models.

pub mod backend;
pub mod cache;
pub mod classify;
pub mod cli;
pub mod cpu;
pub mod ensemble;
pub mod fleet;
pub mod gpu;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod repository;
pub mod restrict;
pub mod scheduler;
pub mod server;
pub mod shm;
pub mod tensor;
pub mod validate;
