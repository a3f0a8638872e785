//! What a chaos scenario measured, computed from the stream records alone (no I/O, unit-tested): completions and
//! failures, streams identical to the undisturbed baseline, the time from the fault to each stream's next token,
//! throughput before and after the fault; the table, and the host facts (CPU model and flags, commit).

use std::fmt::Write as _;

use serde::Serialize;

use super::load::{Api, StreamRecord};

/// Seconds before the fault that the "before" throughput covers.
pub const BEFORE_WINDOW_S: f64 = 5.0;

/// How a stream compares with its baseline.
#[derive(Debug, Clone, PartialEq)]
pub enum Compare {
    /// Complete and equal.
    Identical,
    /// Incomplete (it failed), but what arrived matches the baseline so far.
    Prefix,
    /// Some token differs, or it ended at another length.
    Changed(String),
}

/// Compares `run` with `base`: token ids over gRPC, text over HTTP.
pub fn compare(base: &StreamRecord, run: &StreamRecord) -> Compare {
    fn cmp<T: PartialEq + std::fmt::Debug>(base: &[T], run: &[T], complete: bool, what: &str) -> Compare {
        if let Some(at) = base.iter().zip(run).position(|(a, b)| a != b) {
            return Compare::Changed(format!("{what} {at} is {:?}, was {:?}", run[at], base[at]));
        }
        match (complete, run.len() == base.len()) {
            (true, true) => Compare::Identical,
            (false, _) if run.len() <= base.len() => Compare::Prefix,
            _ => Compare::Changed(format!("{} {what}s, the baseline had {}", run.len(), base.len())),
        }
    }
    match run.api {
        Some(Api::Http) => cmp(base.text.as_bytes(), run.text.as_bytes(), run.completed(), "text byte"),
        _ => cmp(&base.token_ids, &run.token_ids, run.completed(), "token"),
    }
}

/// One wave of requests summarised.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Wave {
    /// Requests sent.
    pub sent: usize,
    /// Requests that finished normally.
    pub completed: usize,
    /// Requests that ended with an error.
    pub failed: usize,
    /// The first error of each API (gRPC, then HTTP), as `stream N (api): message`.
    pub first_errors: Vec<String>,
    /// Streams equal to the baseline.
    pub identical: usize,
    /// Streams that differ from the baseline.
    pub changed: usize,
    /// The first difference, as `stream N (api): ...`.
    pub first_change: Option<String>,
    /// Retries made across the streams.
    pub retries: u32,
}

impl Wave {
    /// Compares every stream of `run` with the same stream of `baseline`.
    pub fn of(baseline: &[StreamRecord], run: &[StreamRecord]) -> Self {
        let mut w = Wave { sent: run.len(), ..Wave::default() };
        let mut first_error: [Option<String>; 2] = [None, None];
        for r in run {
            let who = format!("stream {} ({})", r.index, api_name(r.api));
            w.retries += r.retries;
            if r.completed() {
                w.completed += 1;
            } else {
                w.failed += 1;
                let slot = &mut first_error[usize::from(r.api == Some(Api::Http))];
                slot.get_or_insert_with(|| format!("{who}: {}", r.error.as_deref().unwrap_or("no finish reason")));
            }
            match baseline.get(r.index).map(|b| compare(b, r)) {
                Some(Compare::Identical) => w.identical += 1,
                Some(Compare::Prefix) => {}
                Some(Compare::Changed(why)) => {
                    w.changed += 1;
                    w.first_change.get_or_insert(format!("{who}: {why}"));
                }
                None => {
                    w.changed += 1;
                    w.first_change.get_or_insert(format!("{who}: no baseline stream"));
                }
            }
        }
        w.first_errors = first_error.into_iter().flatten().collect();
        w
    }

    /// Every request completed with the baseline's tokens.
    pub fn clean(&self) -> bool {
        self.failed == 0 && self.changed == 0 && self.identical == self.sent
    }
}

fn api_name(api: Option<Api>) -> &'static str {
    match api {
        Some(Api::Grpc) => "grpc",
        Some(Api::Http) => "http",
        None => "?",
    }
}

/// Timing around the fault.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FaultTiming {
    /// Seconds from the load's start to the fault.
    pub fault_at_s: f64,
    /// p50 over streams of the time from the fault to their next token, in ms.
    pub next_token_ms_p50: Option<f64>,
    /// The longest of those.
    pub next_token_ms_max: Option<f64>,
    /// Streams still running at the fault that got no token after it.
    pub no_token_after_fault: usize,
    /// Tokens per second over the (up to) 5 s before the fault.
    pub tokens_per_s_before: f64,
    /// Tokens per second from the fault to the last stream's end.
    pub tokens_per_s_after: f64,
}

/// Measures the streams of `run` around a fault at `fault_at_s`.
pub fn timing(run: &[StreamRecord], fault_at_s: f64) -> FaultTiming {
    let mut gaps = Vec::new();
    let mut silent = 0;
    for r in run.iter().filter(|r| r.ended_s >= fault_at_s) {
        match r.arrivals_s.iter().find(|&&t| t >= fault_at_s) {
            Some(t) => gaps.push((t - fault_at_s) * 1e3),
            None => silent += 1,
        }
    }
    let window = BEFORE_WINDOW_S.min(fault_at_s);
    let arrivals = || run.iter().flat_map(|r| r.arrivals_s.iter().copied());
    let before = arrivals().filter(|&t| t < fault_at_s && t >= fault_at_s - window).count();
    let end = run.iter().map(|r| r.ended_s).fold(fault_at_s, f64::max);
    let after = arrivals().filter(|&t| t >= fault_at_s).count();
    let rate = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    FaultTiming {
        fault_at_s,
        next_token_ms_p50: crate::stats::percentile(&mut gaps.clone(), 0.5),
        next_token_ms_max: gaps.iter().copied().reduce(f64::max),
        no_token_after_fault: silent,
        tokens_per_s_before: rate(before, window),
        tokens_per_s_after: rate(after, end - fault_at_s),
    }
}

/// Everything one scenario measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScenarioReport {
    /// The scenario's name.
    pub scenario: String,
    /// What was done, and when.
    pub fault: String,
    /// The undisturbed run compared with itself: did the baseline complete?
    pub baseline: Wave,
    /// The run with the fault, compared with the baseline.
    pub run: Wave,
    /// Timing around the fault.
    pub timing: FaultTiming,
    /// The same requests once the fault is over, compared with the baseline (`None`: not run).
    pub after: Option<Wave>,
    /// Plan epochs seen during the run (first → last).
    pub plan: String,
    /// Anything else worth knowing (setup problems, the drain's outcome, ...).
    pub notes: Vec<String>,
    /// Every stream's record: baseline, run, after.
    pub streams: Streams,
    /// No failed request and no changed token, in the run and after it.
    pub passed: bool,
}

/// The raw stream records of a scenario.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Streams {
    /// The undisturbed run.
    pub baseline: Vec<StreamRecord>,
    /// The run with the fault.
    pub run: Vec<StreamRecord>,
    /// The run after the fault.
    pub after: Vec<StreamRecord>,
}

impl ScenarioReport {
    /// Sets `passed` from the waves (an incomplete baseline fails the scenario: nothing to compare with).
    pub fn judge(&mut self) {
        self.passed = self.baseline.failed == 0
            && self.baseline.sent > 0
            && self.run.clean()
            && self.after.as_ref().is_none_or(Wave::clean)
            && !self.notes.iter().any(|n| n.starts_with("FAILED"));
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

/// The markdown table of `reports`, then each scenario's first error and first change.
pub fn table(reports: &[ScenarioReport]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| scenario | completed/sent | failed | identical | retries | fault→next token p50 / max ms | no token after fault | tok/s before | tok/s after | plan epochs | after fault | result |"
    );
    let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|");
    for r in reports {
        let after = r
            .after
            .as_ref()
            .map_or_else(|| "-".into(), |w| format!("{}/{} ok, {} identical", w.completed, w.sent, w.identical));
        let _ = writeln!(
            t,
            "| {} | {}/{} | {} | {}/{} | {} | {} / {} | {} | {:.1} | {:.1} | {} | {} | {} |",
            r.scenario,
            r.run.completed,
            r.run.sent,
            r.run.failed,
            r.run.identical,
            r.run.sent,
            r.run.retries,
            ms(r.timing.next_token_ms_p50),
            ms(r.timing.next_token_ms_max),
            r.timing.no_token_after_fault,
            r.timing.tokens_per_s_before,
            r.timing.tokens_per_s_after,
            r.plan,
            after,
            if r.passed { "PASS" } else { "FAIL" }
        );
    }
    for r in reports {
        let _ = writeln!(t, "\n{}: {}", r.scenario, r.fault);
        let after = r.after.as_ref();
        let lines = (r.baseline.first_errors.iter().map(|e| format!("baseline error: {e}")))
            .chain(r.run.first_errors.iter().map(|e| format!("first error: {e}")))
            .chain(r.run.first_change.iter().map(|e| format!("first changed stream: {e}")))
            .chain(
                after.into_iter().flat_map(|w| &w.first_errors).map(|e| format!("after the fault, first error: {e}")),
            )
            .chain(after.and_then(|w| w.first_change.as_ref()).map(|e| format!("after the fault, changed: {e}")))
            .chain(r.notes.iter().cloned());
        for line in lines {
            let _ = writeln!(t, "  - {line}");
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpc(index: usize, ids: &[u32], arrivals: &[f64], error: Option<&str>) -> StreamRecord {
        StreamRecord {
            index,
            api: Some(Api::Grpc),
            token_ids: ids.to_vec(),
            arrivals_s: arrivals.to_vec(),
            finish: error.is_none().then(|| "length".into()),
            error: error.map(Into::into),
            ended_s: arrivals.last().copied().unwrap_or(0.0),
            ..StreamRecord::default()
        }
    }

    fn http(index: usize, text: &str, error: Option<&str>) -> StreamRecord {
        StreamRecord {
            index,
            api: Some(Api::Http),
            text: text.into(),
            finish: error.is_none().then(|| "length".into()),
            error: error.map(Into::into),
            ..StreamRecord::default()
        }
    }

    #[test]
    fn streams_are_identical_a_matching_prefix_or_changed() {
        let base = grpc(0, &[1, 2, 3], &[], None);
        assert_eq!(compare(&base, &grpc(0, &[1, 2, 3], &[], None)), Compare::Identical);
        assert_eq!(compare(&base, &grpc(0, &[1, 2], &[], Some("gRPC UNAVAILABLE"))), Compare::Prefix);
        assert_eq!(compare(&base, &grpc(0, &[1, 5, 3], &[], None)), Compare::Changed("token 1 is 5, was 2".into()));
        assert!(matches!(compare(&base, &grpc(0, &[1, 2], &[], None)), Compare::Changed(m) if m.contains("2 tokens")));
        let base = http(1, " Paris", None);
        assert_eq!(compare(&base, &http(1, " Paris", None)), Compare::Identical);
        assert!(matches!(compare(&base, &http(1, " Pari", Some("cut"))), Compare::Prefix));
        assert!(matches!(compare(&base, &http(1, " Lyon.", None)), Compare::Changed(_)));
    }

    #[test]
    fn a_wave_counts_failures_and_changes_with_the_first_of_each() {
        let base = vec![grpc(0, &[1, 2], &[], None), http(1, "ab", None), grpc(2, &[7, 8], &[], None)];
        let run = vec![
            grpc(0, &[1, 2], &[], None),
            http(1, "a", Some("HTTP 503")),
            grpc(2, &[7, 9], &[], None),
            http(3, "", Some("HTTP 500")),
            grpc(4, &[], &[], Some("gRPC UNAVAILABLE")),
        ];
        let w = Wave::of(&base, &run);
        assert_eq!(
            (w.sent, w.completed, w.failed, w.identical, w.changed),
            (5, 2, 3, 1, 3),
            "3 and 4 have no baseline"
        );
        assert_eq!(w.first_errors, ["stream 4 (grpc): gRPC UNAVAILABLE", "stream 1 (http): HTTP 503"]);
        assert_eq!(w.first_change.as_deref(), Some("stream 2 (grpc): token 1 is 9, was 8"));
        assert!(!w.clean());
        assert!(Wave::of(&base, &base).clean());
    }

    #[test]
    fn timing_measures_the_gap_after_the_fault_and_both_throughputs() {
        // Fault at 6 s. Stream 0: next token 0.1 s later; stream 1: 0.4 s; stream 2: nothing after the fault.
        let run = vec![
            grpc(0, &[], &[0.5, 2.0, 4.0, 6.1, 7.0], None),
            grpc(1, &[], &[1.5, 5.0, 6.4], None),
            StreamRecord { ended_s: 9.0, ..grpc(2, &[], &[3.0], Some("timed out")) },
            grpc(3, &[], &[0.2, 0.3], None), // ended before the fault: not counted
        ];
        let t = timing(&run, 6.0);
        assert_eq!(t.next_token_ms_p50.map(f64::round), Some(100.0));
        assert_eq!(t.next_token_ms_max.map(f64::round), Some(400.0));
        assert_eq!(t.no_token_after_fault, 1);
        // Before: arrivals in [1, 6): 2.0, 4.0, 1.5, 5.0, 3.0 = 5 over 5 s; after: 3 over 9 - 6 = 3 s.
        assert!((t.tokens_per_s_before - 1.0).abs() < 1e-9, "{t:?}");
        assert!((t.tokens_per_s_after - 1.0).abs() < 1e-9, "{t:?}");
        // A fault 2 s in measures "before" over those 2 s.
        let t = timing(&run, 2.0);
        assert!((t.tokens_per_s_before - 2.0).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn a_scenario_passes_only_when_every_wave_is_clean() {
        let base = vec![grpc(0, &[1], &[], None)];
        let mut r = ScenarioReport {
            baseline: Wave::of(&base, &base),
            run: Wave::of(&base, &base),
            after: Some(Wave::of(&base, &base)),
            ..ScenarioReport::default()
        };
        r.judge();
        assert!(r.passed);
        r.after = Some(Wave::of(&base, &[grpc(0, &[], &[], Some("gRPC UNAVAILABLE"))]));
        r.judge();
        assert!(!r.passed);
        let t = table(&[r]);
        assert!(t.contains("| FAIL |") && t.contains("after the fault, first error: stream 0 (grpc)"), "{t}");
    }
}
