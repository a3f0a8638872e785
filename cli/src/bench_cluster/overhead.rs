//! The median of a hop, from the coordinator's `strata_pipeline_overhead_seconds` histogram (each micro-batch's
//! round trip minus its stages' compute), scraped from `GET /metrics` just before and after a run: the run's own
//! batches are the difference. A median, unlike the means of the step table, is not moved by the few steps that
//! a busy machine stalls for a millisecond.

use std::net::SocketAddr;

use anyhow::{Result, bail};

const BUCKET: &str = "strata_pipeline_overhead_seconds_bucket{le=\"";

/// A histogram's cumulative counts by upper bound (seconds, ascending; the last is `+Inf`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Buckets(Vec<(f64, f64)>);

/// The overhead histogram of the coordinator whose HTTP API is at `http`.
pub(super) async fn scrape(http: SocketAddr) -> Result<Buckets> {
    let reply = crate::http::get(http, "/metrics").await?;
    match reply.strip_prefix("200 ") {
        Some(text) => parse(text),
        None => bail!("GET /metrics on {http}: {}", reply.chars().take(200).collect::<String>()),
    }
}

/// The overhead histogram's buckets in an OpenMetrics text.
fn parse(text: &str) -> Result<Buckets> {
    let mut buckets = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(BUCKET) else { continue };
        let Some((le, count)) = rest.split_once("\"} ") else { bail!("metrics line {line:?}") };
        let le = if le == "+Inf" { f64::INFINITY } else { le.parse()? };
        buckets.push((le, count.trim().parse()?));
    }
    if buckets.is_empty() {
        bail!("the coordinator exports no strata_pipeline_overhead_seconds histogram");
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(Buckets(buckets))
}

impl Buckets {
    /// What was observed between `before` and this scrape.
    pub(super) fn since(&self, before: &Buckets) -> Buckets {
        let earlier = |le: f64| before.0.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
        Buckets(self.0.iter().map(|&(le, n)| (le, n - earlier(le))).collect())
    }

    /// The median, interpolated linearly inside its bucket as Prometheus' `histogram_quantile` does; `None`
    /// without observations.
    pub(super) fn median(&self) -> Option<f64> {
        let total = self.0.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = total / 2.0;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, n) in &self.0 {
            if n >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                return Some(lower + (le - lower) * (rank - below) / (n - below));
            }
            (lower, below) = (le, n);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = "# HELP strata_pipeline_overhead_seconds Micro-batch round trip\n\
        # TYPE strata_pipeline_overhead_seconds histogram\n\
        strata_pipeline_overhead_seconds_sum 0.5\n\
        strata_pipeline_overhead_seconds_count 10\n\
        strata_pipeline_overhead_seconds_bucket{le=\"0.0001\"} 2\n\
        strata_pipeline_overhead_seconds_bucket{le=\"0.0002\"} 8\n\
        strata_pipeline_overhead_seconds_bucket{le=\"+Inf\"} 10\n\
        strata_batch_duration_seconds_bucket{le=\"0.0001\"} 7\n\
        # EOF\n";

    #[test]
    fn the_median_interpolates_inside_its_bucket() -> Result<()> {
        let b = parse(SCRAPE)?;
        assert_eq!(b.0.len(), 3);
        // Rank 5 of 10 lies 3 of the 6 observations into 100..200 µs.
        let median = b.median().expect("observations");
        assert!((median - 150e-6).abs() < 1e-12, "{median}");
        Ok(())
    }

    #[test]
    fn a_run_is_the_difference_of_two_scrapes() -> Result<()> {
        let before = parse(SCRAPE)?;
        let after = Buckets(vec![(0.0001, 12.0), (0.0002, 8.0 + 10.0), (f64::INFINITY, 30.0)]);
        let run = after.since(&before);
        assert_eq!(run, Buckets(vec![(0.0001, 10.0), (0.0002, 10.0), (f64::INFINITY, 20.0)]));
        // Rank 10 of 20 is the last observation of the first bucket.
        assert_eq!(run.median(), Some(0.0001));
        assert_eq!(before.since(&before).median(), None);
        Ok(())
    }

    #[test]
    fn a_median_past_the_last_bound_is_that_bound_and_a_missing_histogram_is_an_error() -> Result<()> {
        let b = Buckets(vec![(0.0001, 1.0), (f64::INFINITY, 5.0)]);
        assert_eq!(b.median(), Some(0.0001));
        assert!(parse("strata_batch_tokens_bucket{le=\"1\"} 3\n").is_err());
        assert!(parse("strata_pipeline_overhead_seconds_bucket{le=\"x\"} 3\n").is_err());
        Ok(())
    }
}
