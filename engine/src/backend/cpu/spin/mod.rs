//! The pool's other threads kept running between the parallel regions of a long forward pass.
//!
//! A pass runs a dozen parallel regions per layer (products, attention, the MLP's gate) with short serial steps
//! between them (norms, RoPE, regrouping the activations). An idle rayon worker goes to sleep after a few dozen
//! rounds of looking for work, and the next region wakes it with a system call and, on a VM, an interrupt to its
//! vCPU: `perf sched` counted ~420 such sleeps per 128-token prefill on the development VM. Over a prompt the other
//! threads instead take the pool's jobs as they come and spin between them, as llama.cpp's threads poll. Whether
//! short passes (decode) spin too is measured on the machine at hand (`choice`).

mod choice;

pub(super) use choice::{Choice, Mode};
use std::sync::atomic::{AtomicBool, Ordering};

/// Passes over at least this many tokens spin; below it, `Choice` decides.
pub(super) const MIN_TOKENS: usize = 32;

/// Pause instructions between two looks for work, so the looks do not hammer the other threads' queues.
const BACKOFF: usize = 64;

/// Runs `f` on the current thread of `pool` while every other thread of the pool runs the pool's jobs as they
/// come and spins between them, until `f` returns (or unwinds).
pub(super) fn while_running<R: Send>(pool: &rayon::ThreadPool, f: impl FnOnce() -> R + Send) -> R {
    pool.install(|| {
        let done = AtomicBool::new(false);
        let caller = rayon::current_thread_index();
        rayon::scope(|s| {
            // One spinner per other thread, as ordinary jobs: an idle thread steals one, and a thread that is busy
            // or blocked elsewhere (a second pass on the same pool, a thread waiting outside rayon) does not hold
            // the pass up, as a job broadcast to every thread would. The caller returns from one it picks up
            // itself: it runs `f`, and must not spin inside it.
            for _ in 1..rayon::current_num_threads() {
                s.spawn(|_| {
                    if rayon::current_thread_index() != caller {
                        spin(&done);
                    }
                });
            }
            // Set on unwinding too: the scope waits for the spinners before it passes a panic on.
            let _stop = Stop(&done);
            f()
        })
    })
}

/// Sets its flag when dropped.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

fn spin(done: &AtomicBool) {
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            for _ in 0..BACKOFF {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool")
    }

    #[test]
    fn parallel_work_inside_runs_and_returns() {
        let pool = pool(2);
        let sum = while_running(&pool, || (0..10_000u64).into_par_iter().map(|v| v * v).sum::<u64>());
        assert_eq!(sum, (0..10_000u64).map(|v| v * v).sum::<u64>());
        // Nested: a pass inside the pool (the executor's loop runs in it) spins the same way.
        let n = pool.install(|| while_running(&pool, || (0..100).into_par_iter().count()));
        assert_eq!(n, 100);
    }

    #[test]
    fn the_other_threads_take_the_work() {
        let pool = pool(2);
        let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
        while_running(&pool, || {
            (0..64).into_par_iter().for_each(|_| {
                std::thread::sleep(std::time::Duration::from_millis(1));
                seen.lock().expect("lock").insert(rayon::current_thread_index());
            })
        });
        assert_eq!(seen.into_inner().expect("lock").len(), 2, "both threads ran jobs");
    }

    #[test]
    fn a_panic_inside_stops_the_spinners_and_passes_on() {
        let pool = pool(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            while_running(&pool, || -> u32 { panic!("inside") })
        }));
        assert!(r.is_err());
        assert_eq!(pool.install(|| 7), 7, "the pool still runs work");
    }

    #[test]
    fn a_thread_blocked_elsewhere_does_not_hold_the_pass_up() {
        let pool = std::sync::Arc::new(pool(2));
        // One of the two threads waits outside rayon until the pass has returned.
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        pool.spawn(move || {
            let _ = blocked.recv();
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let p = std::sync::Arc::clone(&pool);
        std::thread::spawn(move || {
            let _ = tx.send(while_running(&p, || (0..1000u32).into_par_iter().sum::<u32>()));
        });
        let sum = rx.recv_timeout(std::time::Duration::from_secs(20));
        release.send(()).expect("release");
        assert_eq!(sum, Ok((0..1000u32).sum::<u32>()), "the pass returned while the other thread was blocked");
    }

    #[test]
    fn one_thread_returns() {
        assert_eq!(while_running(&pool(1), || 3), 3);
    }
}
