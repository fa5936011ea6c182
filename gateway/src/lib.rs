//! nereid-gateway: one KServe v2 endpoint (HTTP + gRPC) in front of a fleet of nereid-workers.
//!
//! Request path, from [`app::run`]: ingress ([`grpc`] / [`http`]) → [`ingress::Ingress::infer`]
//! → the tower stack assembled in [`stack::infer_stack`]: [`metrics`] → [`admission`] →
//! [`deadline`] → [`retry`] → [`balance`] (reads the [`routing`] table) → [`forward`] (pooled
//! channel of an [`upstream`]). Model metadata / config / statistics go through [`control`].
//! The routing table is published by [`membership`] (etcd watch, or a static list polled) and
//! never waited on by requests. With etcd, the leader-elected [`placement`] controller assigns
//! declared models to workers.

pub mod admission;
pub mod app;
pub mod balance;
pub mod call;
pub mod cli;
pub mod config;
pub mod control;
pub mod ctl;
pub mod deadline;
pub mod error;
pub mod forward;
pub mod grpc;
pub mod http;
pub mod ingress;
pub mod membership;
pub mod metrics;
pub mod outlier;
pub mod placement;
pub mod retry;
pub mod routing;
pub mod stack;
pub mod upstream;
pub mod wire;
