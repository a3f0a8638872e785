//! Test helpers: a real etcd per test on free ports, and a tiny model on disk.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use strata_coordinator::EtcdRegistry;
use strata_coordinator::membership::{NodeRecord, NodeState};
use strata_engine::tensor::DType;
use strata_engine::testing::{TinySpec, random_weights, tiny_config, write_hf};
use strata_proto::{NodeId, PlanEpoch};

/// A throwaway single-member etcd: its own data dir and ports, killed on drop.
pub struct EtcdServer {
    child: Option<Child>,
    port: u16,
    peer: u16,
    dir: tempfile::TempDir,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdServer {
    /// Starts etcd and waits until `/health` says it is healthy.
    pub fn start() -> anyhow::Result<Self> {
        let mut server = Self { child: None, port: free_port()?, peer: free_port()?, dir: tempfile::tempdir()? };
        server.restart()?;
        Ok(server)
    }

    /// Kills etcd (simulating an outage); [`EtcdServer::restart`] brings it back with the same data.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// (Re)starts etcd on the same ports and data dir and waits until it is healthy.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let client = format!("http://127.0.0.1:{}", self.port);
        let peer_url = format!("http://127.0.0.1:{}", self.peer);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("etcd.log"))?;
        let child = Command::new("etcd")
            .args(["--name", "test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning etcd (is etcd-server installed?)")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if self.healthy() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("etcd on port {} did not become healthy", self.port)
    }

    fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n").is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains(r#""health":"true""#)
    }

    /// The client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A registry for `cluster` on this server.
    pub async fn registry(&self, cluster: &str) -> anyhow::Result<EtcdRegistry> {
        Ok(EtcdRegistry::connect(&[self.endpoint()], cluster, Duration::from_secs(5)).await?)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
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

/// Polls `check` until it returns `Some` or `timeout` passes.
pub async fn eventually<T, F, Fut>(timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("condition not met within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A node record for registry tests: 1 GiB, 10 ms per layer, nothing loaded yet.
pub fn node(id: &str, state: NodeState) -> NodeRecord {
    NodeRecord {
        node_id: NodeId::new(id),
        address: format!("{id}.local:7000"),
        device: "cpu".into(),
        memory_bytes: 1 << 30,
        layer_seconds: 0.01,
        state,
        plan_epoch_loaded: PlanEpoch(0),
    }
}
