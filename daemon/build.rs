//! Compiles the peer protocol (gRPC, tonic) with protox: no system `protoc`. The local
//! protocol lives in `shardcache-proto`, which clients use without any gRPC dependency.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from("../proto/proto");
    let file = root.join("shardcache/peer/v1/peer.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
