//! Compiles the `.proto` files with protox (pure Rust), so building needs no system `protoc`.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from("proto");
    let files = [
        root.join("shardcache/local/v1/local.proto"),
        root.join("shardcache/store/v1/journal.proto"),
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&root])?;
    prost_build::Config::new()
        // Status and verify replies are printed as JSON by the CLI.
        .type_attribute(".shardcache.local.v1", "#[derive(serde::Serialize)]")
        // Enum fields as their names, not numbers (`crate::json`).
        .field_attribute(
            ".shardcache.local.v1.FallbackCount.reason",
            "#[serde(serialize_with = \"crate::json::fallback_reason\")]",
        )
        .field_attribute(
            ".shardcache.local.v1.Refused.reason",
            "#[serde(serialize_with = \"crate::json::reason\")]",
        )
        .field_attribute(
            ".shardcache.local.v1.ErrorReply.code",
            "#[serde(serialize_with = \"crate::json::error_code\")]",
        )
        .compile_fds(fds)?;
    Ok(())
}
