//! Retrying a generation whose connection or stream failed: which errors are worth retrying, when to stop, how
//! long to wait between attempts, and how a re-sent deterministic request resumes a stream the caller has already
//! seen part of. Shared by `strata client generate` and the load of `strata chaos`; no I/O here.

use std::fmt;
use std::time::Duration;

use strata_membership::Backoff;

/// First delay between attempts; it doubles up to [`MAX_DELAY`].
pub const BASE_DELAY: Duration = Duration::from_millis(100);
/// Longest delay between attempts: a standby coordinator takes over within one lease TTL (5 s), so a longer
/// pause would only add latency.
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// When to stop retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryBudget {
    /// Retries in a row without progress (a new token resets the count).
    pub retries: u32,
    /// Give up once no new token arrived for this long.
    pub retry_timeout: Duration,
    /// Before the first token, keep retrying regardless of `retries` for this long from the start (the cluster
    /// may still be loading or switching plans).
    pub wait: Duration,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Wait this long, then re-send the whole request (to the next coordinator URL).
    Retry(Duration),
    /// Stop and report the failure with this reason.
    GiveUp(String),
}

/// The retry state of one request: a capped exponential backoff and the count of retries since the last
/// progress.
#[derive(Debug, Clone)]
pub struct Retrier {
    budget: RetryBudget,
    backoff: Backoff,
    retries_in_a_row: u32,
}

impl Retrier {
    /// A fresh state for one request.
    pub fn new(budget: RetryBudget) -> Self {
        Self { budget, backoff: Backoff::new(BASE_DELAY, MAX_DELAY), retries_in_a_row: 0 }
    }

    /// New tokens reached the caller: the budget starts again.
    pub fn progressed(&mut self) {
        self.retries_in_a_row = 0;
        self.backoff.reset();
    }

    /// Decides after a failure. `retryable`: the error is UNAVAILABLE or a transport error. `delivered`: tokens
    /// the caller already has. `deterministic`: greedy, or seeded, so a re-sent request yields the same tokens.
    /// `since_start` / `since_progress`: time since the request began / since its last new token (or the start).
    pub fn decide(
        &mut self,
        retryable: bool,
        delivered: usize,
        deterministic: bool,
        since_start: Duration,
        since_progress: Duration,
    ) -> Decision {
        if !retryable {
            return Decision::GiveUp("the error is not one a retry can fix".into());
        }
        if delivered > 0 && !deterministic {
            return Decision::GiveUp(format!(
                "the stream broke after {delivered} token(s) and the request is not deterministic (temperature > 0 \
                 without a seed), so a retry would not continue the same text; pass --seed to make it resumable"
            ));
        }
        let waiting_for_cluster = delivered == 0 && since_start < self.budget.wait;
        if !waiting_for_cluster {
            if self.retries_in_a_row >= self.budget.retries {
                return Decision::GiveUp(format!("gave up after {} retries", self.retries_in_a_row));
            }
            if since_progress >= self.budget.retry_timeout {
                return Decision::GiveUp(format!(
                    "gave up: no new token for {:.1} s (retry timeout {:.1} s)",
                    since_progress.as_secs_f64(),
                    self.budget.retry_timeout.as_secs_f64()
                ));
            }
        }
        self.retries_in_a_row += 1;
        Decision::Retry(self.backoff.next_delay())
    }
}

/// A retried stream's output differs from what the caller already has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// What is compared ("token", "byte of text").
    pub what: &'static str,
    /// Position of the first difference.
    pub at: usize,
    /// What the caller already has there.
    pub delivered: String,
    /// What the retried stream gave.
    pub retried: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the retried request diverged from the output already delivered: {} {} was {} before, {} now",
            self.what, self.at, self.delivered, self.retried
        )
    }
}

impl std::error::Error for Mismatch {}

/// What the caller already has of one request, and where a re-sent request's stream is within it: the first
/// `delivered` items of a new attempt are checked against it and skipped, the rest are new.
#[derive(Debug, Clone)]
pub struct Resume<T> {
    what: &'static str,
    delivered: Vec<T>,
    /// How far the current attempt has got (≤ delivered.len() while replaying).
    position: usize,
}

impl<T: PartialEq + Clone + fmt::Debug> Resume<T> {
    /// Nothing delivered yet; `what` names an item in mismatch messages.
    pub fn new(what: &'static str) -> Self {
        Self { what, delivered: Vec::new(), position: 0 }
    }

    /// Everything delivered so far.
    pub fn delivered(&self) -> &[T] {
        &self.delivered
    }

    /// A new attempt starts from the beginning of the output.
    pub fn restart(&mut self) {
        self.position = 0;
    }

    /// Takes the next items of the current attempt: those already delivered must be equal and are skipped; the
    /// returned ones are new (and now count as delivered).
    pub fn feed(&mut self, items: &[T]) -> Result<&[T], Mismatch> {
        let replay = (self.delivered.len() - self.position).min(items.len());
        for (i, item) in items[..replay].iter().enumerate() {
            let at = self.position + i;
            if self.delivered[at] != *item {
                return Err(Mismatch {
                    what: self.what,
                    at,
                    delivered: format!("{:?}", self.delivered[at]),
                    retried: format!("{item:?}"),
                });
            }
        }
        // New items exist only once the replay has caught up, so the position ends at the delivered length.
        let start = self.delivered.len();
        self.delivered.extend_from_slice(&items[replay..]);
        self.position += items.len();
        Ok(&self.delivered[start..])
    }
}

/// [`Resume`] for text: compares bytes, hands back the new text.
#[derive(Debug, Clone)]
pub struct TextResume(Resume<u8>);

impl Default for TextResume {
    fn default() -> Self {
        Self(Resume::new("byte of text"))
    }
}

impl TextResume {
    /// The text delivered so far.
    pub fn delivered(&self) -> String {
        String::from_utf8_lossy(self.0.delivered()).into_owned()
    }

    /// A new attempt starts from the beginning.
    pub fn restart(&mut self) {
        self.0.restart();
    }

    /// The part of `delta` not delivered yet; an error if the overlap differs.
    pub fn feed(&mut self, delta: &str) -> Result<String, Mismatch> {
        // The skipped part ends where the delivered text ended, itself a whole UTF-8 string equal to the replayed
        // bytes, so the remainder starts on a character boundary.
        self.0.feed(delta.as_bytes()).map(|b| String::from_utf8_lossy(b).into_owned())
    }
}

/// Whether a request yields the same tokens when re-sent: greedy (temperature 0) or seeded.
pub fn deterministic(temperature: f32, seed: Option<u64>) -> bool {
    temperature <= 0.0 || seed.is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(retries: u32) -> RetryBudget {
        RetryBudget { retries, retry_timeout: Duration::from_secs(30), wait: Duration::ZERO }
    }

    fn delays(r: &mut Retrier, n: usize) -> Vec<Decision> {
        (0..n).map(|_| r.decide(true, 0, true, Duration::from_secs(1), Duration::from_secs(1))).collect()
    }

    #[test]
    fn backoff_doubles_to_a_cap_then_gives_up_after_the_retries() {
        let mut r = Retrier::new(budget(7));
        let ms = |m| Decision::Retry(Duration::from_millis(m));
        let got = delays(&mut r, 8);
        assert_eq!(got[..7], [ms(100), ms(200), ms(400), ms(800), ms(1600), ms(2000), ms(2000)]);
        assert!(matches!(&got[7], Decision::GiveUp(m) if m.contains("7 retries")), "{:?}", got[7]);
    }

    #[test]
    fn progress_resets_the_count_and_the_delay() {
        let mut r = Retrier::new(budget(2));
        assert_eq!(delays(&mut r, 2), [Decision::Retry(BASE_DELAY), Decision::Retry(BASE_DELAY * 2)]);
        r.progressed();
        let again = delays(&mut r, 3);
        assert_eq!(again[..2], [Decision::Retry(BASE_DELAY), Decision::Retry(BASE_DELAY * 2)]);
        assert!(matches!(&again[2], Decision::GiveUp(m) if m.contains("2 retries")), "{:?}", again[2]);
    }

    #[test]
    fn what_is_never_retried() {
        let mut r = Retrier::new(budget(5));
        let d = r.decide(false, 0, true, Duration::ZERO, Duration::ZERO);
        assert!(matches!(d, Decision::GiveUp(_)));
        let d = r.decide(true, 3, false, Duration::ZERO, Duration::ZERO);
        assert!(matches!(&d, Decision::GiveUp(m) if m.contains("after 3 token(s)") && m.contains("--seed")), "{d:?}");
        // Nothing delivered yet: a non-deterministic request can simply start again.
        assert!(matches!(r.decide(true, 0, false, Duration::ZERO, Duration::ZERO), Decision::Retry(_)));
        let d = r.decide(true, 1, true, Duration::ZERO, Duration::from_secs(31));
        assert!(matches!(&d, Decision::GiveUp(m) if m.contains("no new token for 31.0 s")), "{d:?}");
    }

    #[test]
    fn before_the_first_token_wait_outlasts_the_retry_count() {
        let mut r = Retrier::new(RetryBudget { wait: Duration::from_secs(60), ..budget(1) });
        for _ in 0..10 {
            let d = r.decide(true, 0, true, Duration::from_secs(5), Duration::from_secs(45));
            assert!(matches!(d, Decision::Retry(_)), "{d:?}");
        }
        let d = r.decide(true, 0, true, Duration::from_secs(61), Duration::from_secs(1));
        assert!(matches!(d, Decision::GiveUp(_)), "{d:?}");
    }

    #[test]
    fn a_resumed_stream_skips_what_was_delivered_and_passes_the_rest() -> Result<(), Mismatch> {
        let mut r = Resume::new("token");
        assert_eq!(r.feed(&[1, 2])?, [1, 2]);
        assert_eq!(r.feed(&[3])?, [3]);
        r.restart();
        // Re-sent: the first three come back in other chunk sizes and are skipped; 4 and 5 are new.
        assert_eq!(r.feed(&[1])?, [] as [u32; 0]);
        assert_eq!(r.feed(&[2, 3, 4])?, [4]);
        assert_eq!(r.feed(&[5])?, [5]);
        assert_eq!(r.delivered(), [1, 2, 3, 4, 5]);
        r.restart();
        let err = r.feed(&[1, 9]).err();
        assert_eq!(
            err,
            Some(Mismatch { what: "token", at: 1, delivered: "2".into(), retried: "9".into() }),
            "a different token is an error naming it"
        );
        Ok(())
    }

    #[test]
    fn text_resumes_on_character_boundaries() -> Result<(), Mismatch> {
        let mut t = TextResume::default();
        assert_eq!(t.feed(" Paris, the")?, " Paris, the");
        t.restart();
        assert_eq!(t.feed(" Par")?, "");
        assert_eq!(t.feed("is, the cité")?, " cité");
        assert_eq!(t.delivered(), " Paris, the cité");
        t.restart();
        let err = t.feed(" Lyon").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("byte of text 1"), "{err}");
        Ok(())
    }

    #[test]
    fn greedy_or_seeded_is_deterministic() {
        assert!(deterministic(0.0, None));
        assert!(deterministic(0.8, Some(3)));
        assert!(!deterministic(0.8, None));
    }
}
