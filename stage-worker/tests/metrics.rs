//! `--metrics-listen`: two chained workers run real micro-batches, and each one's `GET /metrics` counts them
//! (batches, compute time, bytes in and out) and shows what it holds (KV blocks, weights, layers).

mod common;

use std::io::{Read, Write};

use anyhow::{Context, Result, ensure};
use common::{Stream, interleaved, stage_config, stop_all};
use strata_stage_worker::Worker;
use strata_testkit::free_port;

/// `GET /metrics` over a plain HTTP/1.1 connection.
fn scrape(addr: &str) -> Result<String> {
    let mut conn = std::net::TcpStream::connect(addr)?;
    write!(conn, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    conn.read_to_string(&mut text)?;
    ensure!(text.starts_with("HTTP/1.1 200"), "{text}");
    ensure!(text.contains("application/openmetrics-text"), "{text}");
    Ok(text)
}

/// The value of the sample `name` (exactly, labels included) in `text`.
fn value(text: &str, name: &str) -> Result<f64> {
    let line = text.lines().find(|l| l.split_once(' ').is_some_and(|(n, _)| n == name)).context(name.to_owned())?;
    Ok(line.rsplit(' ').next().context("no value")?.parse()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_worker_exports_what_it_computed_and_holds() -> Result<()> {
    let model = common::tiny_model()?;
    let addrs = [format!("127.0.0.1:{}", free_port()?), format!("127.0.0.1:{}", free_port()?)];
    let last = Worker::start(
        strata_stage_worker::WorkerConfig {
            metrics_listen: Some(addrs[1].clone()),
            ..stage_config(model.path(), 1, 2..4, None)
        },
        "127.0.0.1:0",
    )
    .await?;
    let first = Worker::start(
        strata_stage_worker::WorkerConfig {
            metrics_listen: Some(addrs[0].clone()),
            ..stage_config(model.path(), 0, 0..2, Some(last.local_addr().to_string()))
        },
        "127.0.0.1:0",
    )
    .await?;
    let mut stream = Stream::open(&first).await?;
    let (got, rounds) = interleaved(4).run_stream(&mut stream).await?;
    ensure!(!got.is_empty() && !rounds.is_empty());
    drop(stream);

    for (addr, name) in addrs.iter().zip(["first", "last"]) {
        let text = scrape(addr)?;
        let batches = value(&text, "strata_worker_batches_total")?;
        ensure!(batches >= rounds.len() as f64, "{name}: {batches} batches for {} rounds\n{text}", rounds.len());
        ensure!(value(&text, "strata_worker_batch_compute_seconds_count")? == batches, "{name}\n{text}");
        ensure!(value(&text, "strata_worker_received_bytes_total")? > 0.0, "{name}\n{text}");
        ensure!(value(&text, "strata_worker_sent_bytes_total")? > 0.0, "{name}\n{text}");
        // stage_config: 64 blocks of 4 tokens, two of the tiny model's four layers.
        ensure!(value(&text, "strata_worker_kv_blocks_total")? == 64.0, "{name}\n{text}");
        ensure!(value(&text, "strata_worker_kv_capacity_tokens")? == 256.0, "{name}\n{text}");
        ensure!(value(&text, "strata_worker_layers")? == 2.0, "{name}\n{text}");
        ensure!(value(&text, "strata_worker_weight_bytes")? > 0.0, "{name}\n{text}");
        ensure!(value(&text, "strata_worker_resident_bytes")? > 0.0, "{name}\n{text}");
        ensure!(value(&text, "strata_worker_queue_depth")? == 0.0, "{name}\n{text}");
    }
    stop_all(vec![first, last]).await
}
