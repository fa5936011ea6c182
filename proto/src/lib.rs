//! Protobuf and gRPC types for Nereid: the KServe v2 / Triton inference protocol and `ModelConfig`.

pub mod codec;

/// Everything generated from `grpc_service.proto` and `model_config.proto` (protobuf package `inference`).
pub mod inference {
    tonic::include_proto!("inference");
}

/// The standard gRPC health-checking protocol (`grpc.health.v1.Health`).
pub mod health {
    tonic::include_proto!("grpc.health.v1");
}

/// Encoded `google.protobuf.FileDescriptorSet` covering the `.proto` files, e.g. for
/// `prost_reflect::DescriptorPool::decode` to parse `config.pbtxt` text format.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/nereid_descriptor.bin"));
