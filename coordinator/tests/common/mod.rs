//! Test helpers: a real etcd per test on free ports, and a tiny model on disk.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use strata_engine::tensor::DType;
use strata_engine::testing::{TinySpec, random_weights, tiny_config, write_hf};
use strata_membership::{EtcdOptions, EtcdRegistry, NodeRecord, NodeState};
use strata_proto::{NodeId, PlanEpoch};

pub use strata_testkit::EtcdServer;

/// A registry for `cluster` on `server`.
pub async fn registry(server: &EtcdServer, cluster: &str) -> anyhow::Result<EtcdRegistry> {
    Ok(EtcdRegistry::connect(&EtcdOptions::new(vec![server.endpoint()]), cluster, Duration::from_secs(5)).await?)
}

/// Writes a tiny random Llama (f32 safetensors) with `layers` layers into `dir` and returns its path.
pub fn tiny_model(dir: &Path, layers: usize) -> anyhow::Result<PathBuf> {
    let mut config = tiny_config();
    config.num_layers = layers;
    let spec = TinySpec { config, dtype: DType::F32, seed: 7 };
    let path = dir.join("tiny-llama");
    write_hf(&path, &spec, &random_weights(&spec))?;
    Ok(path)
}

/// A node record for registry tests: 1 GiB, 10 ms per layer, nothing loaded yet.
pub fn node(id: &str, state: NodeState) -> NodeRecord {
    NodeRecord {
        node_id: NodeId::new(id),
        address: format!("{id}.local:7000"),
        device: "cpu".into(),
        memory_bytes: 1 << 30,
        layer_seconds: 0.01,
        offload_layer_seconds: 0.0,
        head_seconds: 0.0,
        state,
        plan_epoch_loaded: PlanEpoch(0),
        load_failed_epoch: PlanEpoch(0),
    }
}
