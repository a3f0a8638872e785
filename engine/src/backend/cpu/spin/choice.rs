//! Whether a short pass (decode) spins: measured on the machine at hand, from the passes' own times.
//!
//! Spinning the pool's threads through a decode step saved 8-13 % on one Intel Xeon VM and cost 7-10 % on an AMD
//! EPYC and another Xeon (docs/performance.md): it depends on the CPU, its hypervisor and what else runs there, so
//! no fixed rule holds. Each size of pass (a power-of-two bucket of tokens) therefore runs a short trial of passes
//! alternately spinning and sleeping, compares their times per token pair by pair, keeps the faster mode, and runs
//! the trial again after a while, as the machine's load may have changed. Pure: the backend times the passes.

use std::time::Duration;

use super::MIN_TOKENS;

/// Buckets of pass sizes: 1, 2-3, 4-7, 8-15 and 16-31 tokens (longer passes always spin).
const BUCKETS: usize = MIN_TOKENS.ilog2() as usize;
/// Passes of a bucket not measured first: the first passes fault in KV pages and warm caches.
const WARMUP: u32 = 4;
/// Alternated pairs a trial compares.
const PAIRS: usize = 12;
/// Passes of a bucket run in the chosen mode before the next trial.
const KEEP: u32 = 2048;
/// Spinning is kept only when it is at least this much faster: it takes the other threads' cores for the whole
/// step, which other processes on the host could have used, and two modes within noise are a tie.
const SPIN_MUST_SAVE: f64 = 0.02;

/// How the pool's other threads wait between a pass's parallel regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// They sleep (rayon's own idling) and are woken for each region.
    Sleep,
    /// They spin, taking each region's jobs as they come (`while_running`).
    Spin,
}

/// The choice of every bucket.
#[derive(Debug, Default)]
pub(crate) struct Choice {
    buckets: [Bucket; BUCKETS],
}

impl Choice {
    /// The mode for a pass over `tokens` tokens (fewer than `MIN_TOKENS`).
    pub(crate) fn mode(&mut self, tokens: usize) -> Mode {
        self.buckets[bucket(tokens)].mode()
    }

    /// Records that a pass over `tokens` tokens ran `mode` for `took`.
    pub(crate) fn record(&mut self, tokens: usize, mode: Mode, took: Duration) {
        let b = bucket(tokens);
        if let Some((chosen, median)) = self.buckets[b].record(mode, took.as_secs_f64() / tokens.max(1) as f64) {
            let (from, to) = (1 << b, if b + 1 == BUCKETS { MIN_TOKENS - 1 } else { (2 << b) - 1 });
            tracing::debug!(from, to, ?chosen, median, "passes of from..=to tokens timed spinning over sleeping");
        }
    }
}

fn bucket(tokens: usize) -> usize {
    (tokens.max(1).ilog2() as usize).min(BUCKETS - 1)
}

#[derive(Debug)]
enum Bucket {
    /// Passes left before the trial starts.
    Warmup(u32),
    Trial(Trial),
    /// The mode kept, and the passes left before the next trial.
    Chosen(Mode, u32),
}

impl Default for Bucket {
    fn default() -> Self {
        Bucket::Warmup(WARMUP)
    }
}

#[derive(Debug, Default)]
struct Trial {
    /// Seconds per token spinning over seconds per token sleeping, of each pair so far.
    ratios: Vec<f64>,
    /// The first pass of the pair under way: its mode and seconds per token. The next pass runs the other mode;
    /// a pair starts spinning.
    first: Option<(Mode, f64)>,
}

impl Bucket {
    fn mode(&self) -> Mode {
        match self {
            // Warmup sleeps, as every short pass did before the trials.
            Bucket::Warmup(_) => Mode::Sleep,
            Bucket::Trial(Trial { first: Some((Mode::Spin, _)), .. }) => Mode::Sleep,
            Bucket::Trial(_) => Mode::Spin,
            Bucket::Chosen(mode, _) => *mode,
        }
    }

    /// Records a pass; returns the mode a trial it ends chose, and its median ratio.
    fn record(&mut self, mode: Mode, per_token: f64) -> Option<(Mode, f64)> {
        match self {
            Bucket::Warmup(0) | Bucket::Chosen(_, 0) => {
                *self = Bucket::Trial(Trial::default());
            }
            Bucket::Warmup(left) | Bucket::Chosen(_, left) => *left -= 1,
            Bucket::Trial(t) => {
                // Passes that ran concurrently may record out of turn: a pair is two consecutive records of
                // different modes, and the next pass runs the mode the pair lacks.
                match t.first.take() {
                    Some((other, first)) if other != mode => {
                        let (spin, sleep) = if mode == Mode::Spin { (per_token, first) } else { (first, per_token) };
                        if sleep > 0.0 {
                            t.ratios.push(spin / sleep);
                        }
                    }
                    _ => t.first = Some((mode, per_token)),
                }
                if t.ratios.len() >= PAIRS {
                    let (chosen, median) = decide(&mut t.ratios);
                    *self = Bucket::Chosen(chosen, KEEP);
                    return Some((chosen, median));
                }
            }
        }
        None
    }
}

/// Spin when the median pair has it faster by `SPIN_MUST_SAVE`: a median, as a pass now and then waits on
/// something else (a page fault, another process) whichever mode it runs.
fn decide(ratios: &mut [f64]) -> (Mode, f64) {
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    let median = if n % 2 == 1 { ratios[n / 2] } else { (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0 };
    (if median <= 1.0 - SPIN_MUST_SAVE { Mode::Spin } else { Mode::Sleep }, median)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `passes` passes of `tokens` tokens, each taking what `time` says for its mode, and returns the modes.
    fn run(c: &mut Choice, tokens: usize, passes: usize, time: impl Fn(Mode, usize) -> f64) -> Vec<Mode> {
        (0..passes)
            .map(|i| {
                let mode = c.mode(tokens);
                c.record(tokens, mode, Duration::from_secs_f64(time(mode, i) * tokens as f64));
                mode
            })
            .collect()
    }

    fn millis(spin: f64, sleep: f64) -> impl Fn(Mode, usize) -> f64 {
        move |mode, _| if mode == Mode::Spin { spin } else { sleep } / 1e3
    }

    const TRIAL_ENDS: usize = WARMUP as usize + 1 + 2 * PAIRS;

    #[test]
    fn warms_up_asleep_then_alternates() {
        let mut c = Choice::default();
        let modes = run(&mut c, 1, TRIAL_ENDS, millis(1.0, 1.0));
        assert!(modes[..=WARMUP as usize].iter().all(|m| *m == Mode::Sleep), "{modes:?}");
        for pair in modes[WARMUP as usize + 1..].chunks(2) {
            assert_eq!(pair, [Mode::Spin, Mode::Sleep], "{modes:?}");
        }
    }

    #[test]
    fn keeps_spinning_where_it_is_faster_and_sleeping_where_not() {
        let mut c = Choice::default();
        run(&mut c, 8, TRIAL_ENDS, millis(0.9, 1.0));
        assert!(run(&mut c, 8, 100, millis(0.9, 1.0)).iter().all(|m| *m == Mode::Spin));
        let mut c = Choice::default();
        run(&mut c, 8, TRIAL_ENDS, millis(1.1, 1.0));
        assert!(run(&mut c, 8, 100, millis(1.1, 1.0)).iter().all(|m| *m == Mode::Sleep));
    }

    #[test]
    fn a_tie_sleeps() {
        let mut c = Choice::default();
        run(&mut c, 1, TRIAL_ENDS, millis(0.99, 1.0));
        assert_eq!(c.mode(1), Mode::Sleep);
    }

    #[test]
    fn a_few_slow_passes_do_not_decide() {
        let mut c = Choice::default();
        // Spinning is 10 % faster, but every fifth pass waits 20 ms on something else.
        run(&mut c, 2, TRIAL_ENDS, |mode, i| if i % 5 == 0 { 20e-3 } else { millis(0.9, 1.0)(mode, i) });
        assert_eq!(c.mode(2), Mode::Spin);
    }

    #[test]
    fn each_size_of_pass_chooses_for_itself() {
        let mut c = Choice::default();
        run(&mut c, 1, TRIAL_ENDS, millis(0.8, 1.0));
        run(&mut c, 16, TRIAL_ENDS, millis(1.2, 1.0));
        assert_eq!((c.mode(1), c.mode(31), c.mode(5)), (Mode::Spin, Mode::Sleep, Mode::Sleep));
        // 5 tokens are still warming up.
    }

    #[test]
    fn the_trial_runs_again_and_follows_a_change() {
        let mut c = Choice::default();
        run(&mut c, 4, TRIAL_ENDS, millis(0.8, 1.0));
        run(&mut c, 4, KEEP as usize, millis(0.8, 1.0));
        // The machine got busy: spinning now costs.
        run(&mut c, 4, 1 + 2 * PAIRS, millis(1.3, 1.0));
        assert_eq!(c.mode(4), Mode::Sleep);
    }

    #[test]
    fn passes_recorded_out_of_turn_still_pair_up() {
        let mut c = Choice::default();
        run(&mut c, 1, WARMUP as usize + 1, millis(1.0, 1.0));
        // Two spinning passes finish before a sleeping one: the second starts the pair again.
        for mode in [Mode::Spin, Mode::Spin] {
            c.record(1, mode, Duration::from_micros(800));
        }
        assert_eq!(c.mode(1), Mode::Sleep, "the pair lacks a sleeping pass");
        for _ in 0..PAIRS {
            c.record(1, Mode::Sleep, Duration::from_micros(1000));
            c.record(1, Mode::Spin, Duration::from_micros(800));
        }
        assert_eq!(c.mode(1), Mode::Spin);
    }
}
