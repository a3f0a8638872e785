//! Coordinators come and go under load, with real processes (etcd, three stage workers, a leader and a standby
//! coordinator): SIGTERM lets the leader's in-flight streams finish before it exits, and the standby takes over; a
//! leader killed with SIGKILL leaves its streams a retryable `UNAVAILABLE`, and the standby serves new requests
//! within 15 s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use strata_proto::pb::coordinator_client::CoordinatorClient;
use strata_tests::processes::{ProcessCluster, load, request, signal};
use strata_tests::smollm2;
use tokio::sync::Notify;

/// Generates through `url` until it works (or `within` passes); returns how long that took.
async fn first_success(url: &str, within: Duration) -> Result<Duration> {
    let started = Instant::now();
    let mut last = None;
    while started.elapsed() < within {
        if let Ok(mut client) = CoordinatorClient::connect(url.to_owned()).await {
            match client.generate(request(0, 4)).await {
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    let mut n = 0;
                    let done = loop {
                        match stream.message().await {
                            Ok(Some(m)) => n += m.token_ids.len(),
                            Ok(None) => break n == 4,
                            Err(e) => {
                                last = Some(e);
                                break false;
                            }
                        }
                    };
                    if done {
                        return Ok(started.elapsed());
                    }
                }
                Err(e) => last = Some(e),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("no request served through {url} within {within:?}; last error {last:?}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_streams_finish_then_the_standby_takes_over() -> Result<()> {
    let mut cluster = ProcessCluster::start(&smollm2(), 3, 1).await?;
    cluster.add_coordinator(&["--min-stages=3"])?;
    let leader = cluster.leader().await?;
    let (url, standby) = (cluster.coordinators[leader].url.clone(), cluster.coordinators[1 - leader].url.clone());
    let baseline = load(url.clone(), 24, Arc::new(Notify::new())).await?;
    let producing = Arc::new(Notify::new());
    let run = tokio::spawn(load(url.clone(), 24, producing.clone()));
    tokio::time::timeout(Duration::from_secs(60), producing.notified()).await.context("streams never started")?;
    signal(&cluster.coordinators[leader].process, "-TERM")?;
    let results = run.await??;
    for (i, (got, want)) in results.iter().zip(&baseline).enumerate() {
        let got = got.as_ref().map_err(|e| anyhow::anyhow!("stream {i} failed on SIGTERM: {e}\n{}", cluster.logs()))?;
        let want = want.as_ref().map_err(|e| anyhow::anyhow!("baseline {i}: {e}"))?;
        ensure!(got.tokens == want.tokens, "stream {i}: tokens differ");
    }
    let status = cluster.coordinators[leader].process.wait_exit(Duration::from_secs(40))?;
    ensure!(status.success(), "the leader exited with {status}\n{}", cluster.logs());
    let took = first_success(&standby, Duration::from_secs(15)).await.with_context(|| cluster.logs())?;
    eprintln!("the standby served {took:?} after the leader's streams finished");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_leaves_retryable_errors_and_the_standby_serves_within_15_s() -> Result<()> {
    let mut cluster = ProcessCluster::start(&smollm2(), 3, 1).await?;
    cluster.add_coordinator(&["--min-stages=3"])?;
    let leader = cluster.leader().await?;
    let (url, standby) = (cluster.coordinators[leader].url.clone(), cluster.coordinators[1 - leader].url.clone());
    let producing = Arc::new(Notify::new());
    let run = tokio::spawn(load(url.clone(), 48, producing.clone()));
    tokio::time::timeout(Duration::from_secs(60), producing.notified()).await.context("streams never started")?;
    signal(&cluster.coordinators[leader].process, "-KILL")?;
    let killed = Instant::now();
    for (i, r) in run.await??.into_iter().enumerate() {
        // Cut off mid-stream: the caller must be told to retry, not that its request was bad.
        if let Err(e) = r {
            ensure!(matches!(e.code(), tonic::Code::Unavailable | tonic::Code::Unknown), "stream {i}: {e}");
        }
    }
    let took = first_success(&standby, Duration::from_secs(15)).await.with_context(|| cluster.logs())?;
    eprintln!("the standby served {:?} after the leader was killed", killed.elapsed());
    ensure!(took < Duration::from_secs(15), "{took:?}");
    Ok(())
}
