//! Generates Rust code for the inference protocol and the model config schema.

use std::path::PathBuf;
use std::process::Command;

const PROTOS: &[&str] = &["src/grpc_service.proto", "src/model_config.proto", "src/health.proto"];

fn protoc_available() -> bool {
    let protoc = std::env::var_os("PROTOC").unwrap_or_else(|| "protoc".into());
    Command::new(protoc).arg("--version").output().map(|o| o.status.success()).unwrap_or(false)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    println!("cargo:rerun-if-env-changed=PROTOC");

    if !protoc_available() {
        return Err("nereid-proto: `protoc` (the protobuf compiler) was not found on PATH \
                    (nor via $PROTOC). Run scripts/setup.sh, or install it with \
                    `apt-get install -y protobuf-compiler`."
            .into());
    }

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .generate_default_stubs(true)
        // prost's codec, with inference requests' entry counts checked before decoding.
        .codec_path("crate::codec::CheckedCodec")
        // Tensor payloads as `Bytes`: decoded as slices of the received message buffer instead
        // of one allocation and copy each, and moved into responses without copying. A slice
        // is aligned only as the message laid it out: users check before viewing it as
        // elements (the worker copies a misaligned one into its batch buffer).
        .bytes(".inference.ModelInferRequest.raw_input_contents")
        .bytes(".inference.ModelInferResponse.raw_output_contents")
        .file_descriptor_set_path(out_dir.join("nereid_descriptor.bin"))
        .compile_protos(PROTOS, &["src"])?;
    Ok(())
}
