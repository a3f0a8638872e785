//! Generates the `strata.v1` messages, clients and servers, and the encoded file descriptor set that the
//! reflection service serves.

use std::{env, path::PathBuf};

const PROTOS: &[&str] = &["strata/v1/common.proto", "strata/v1/coordinator.proto", "strata/v1/stage.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("strata_descriptor.bin"))
        // Hidden states are the bulk of every message: decode them as `Bytes` to avoid a copy.
        .bytes(".strata.v1.HiddenStates.data")
        .compile_protos(PROTOS, &["."])?;
    Ok(())
}
