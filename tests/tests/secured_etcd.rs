//! The `coordinator` and `stage-worker` binaries on a secured etcd: TLS with client certificates and a root user
//! with auth enabled, given to them the way the Helm chart does (env vars, the password in a file). They serve a
//! generation; `strata etcd enable-auth` (the chart's Job) finds auth on; a worker with a wrong password stops at
//! once, naming the problem.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_testkit::{EtcdSecurity, EtcdServer, workspace_bin};
use strata_tests::processes::{ProcessCluster, request};
use strata_tests::smollm2;

const PASSWORD: &str = "correct horse battery staple";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binaries_serve_a_generation_over_an_etcd_with_tls_and_auth() -> Result<()> {
    let security = EtcdSecurity { tls: true, root_password: Some(PASSWORD.into()) };
    let etcd = EtcdServer::start_secured("127.0.0.1", &security)?;
    let pki = etcd.pki().context("etcd without TLS")?.clone();
    let dir = tempfile::tempdir()?;
    let (password_file, wrong_file) = (dir.path().join("password"), dir.path().join("wrong"));
    std::fs::write(&password_file, format!("{PASSWORD}\n"))?;
    std::fs::write(&wrong_file, "guess")?;
    let path = |p: &std::path::Path| p.to_string_lossy().into_owned();
    let env = [
        ("STRATA_ETCD_CA", path(&pki.ca)),
        ("STRATA_ETCD_CERT", path(&pki.client_cert)),
        ("STRATA_ETCD_KEY", path(&pki.client_key)),
        ("STRATA_ETCD_USER", "root".into()),
        ("STRATA_ETCD_PASSWORD_FILE", path(&password_file)),
    ];
    let env = env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    let mut cluster = ProcessCluster::start_on_etcd(&smollm2(), 2, 1, etcd, env).await?;

    let url = cluster.coordinators.first().context("no coordinator")?.url.clone();
    let mut client = CoordinatorClient::connect(url).await?;
    let mut stream = client.generate(request(0, 4)).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(msg) = stream.message().await? {
        tokens.extend(msg.token_ids);
    }
    ensure!(tokens.len() == 4, "4 tokens asked for, got {tokens:?}\n{}", cluster.logs());
    // The records went into the secured etcd: root sees both workers there.
    let keys = cluster.etcd.etcdctl(&["get", "/strata/faults/", "--prefix", "--keys-only"])?;
    ensure!(keys.contains("w0") && keys.contains("w1"), "{keys}");
    // The chart's auth Job, run again as on an upgrade, finds auth on and the password right.
    let out = Command::new(workspace_bin("strata")?)
        .args(["etcd", "enable-auth", "--etcd", &cluster.etcd.endpoint()])
        .envs(cluster.env.iter().map(|(k, v)| (k, v)))
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && stdout.contains("already enabled"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Same settings but the wrong password: the worker exits within its connect window, saying why.
    for (key, value) in &mut cluster.env {
        if key == "STRATA_ETCD_PASSWORD_FILE" {
            *value = path(&wrong_file);
        }
    }
    cluster.add_worker("intruder")?;
    let (_, intruder) = cluster.workers.last_mut().context("no worker")?;
    let status = intruder.wait_exit(Duration::from_secs(10))?;
    let output = intruder.output();
    ensure!(!status.success() && output.contains("wrong etcd user or password"), "{status}: {output}");
    Ok(())
}
