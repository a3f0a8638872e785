//! A parallel region's tasks, claimed one at a time, in order, by whichever of the pool's threads is free.
//!
//! Why not a rayon parallel iterator: its adaptive splitting runs runs of tasks (a quarter of them, on two threads)
//! as one sequential leaf that an idle thread cannot take from, and a thread that finishes before the others waits
//! in rayon's join, which puts it to sleep after a few dozen rounds and needs a system call and, on a VM, an
//! interrupt to wake it. Profiled on a 128-token prefill (2 threads), the two threads ended the products ~100 µs
//! apart on average and the region returned ~40 µs after its last task. Here every thread takes the next task as
//! it frees up, so the threads end at most one task apart, and the caller spins for the others' last tasks.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Runs `f` on every task, each exactly once, on the current thread and the current pool's other threads.
/// `f` must not wait for work of the caller's (the caller spins until the tasks that others claimed are done).
pub(super) fn for_each<T: Sync>(tasks: &[T], f: impl Fn(&T) + Sync) {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let work = || {
        loop {
            let Some(task) = tasks.get(next.fetch_add(1, Ordering::Relaxed)) else { return };
            // Counted on unwinding too, so a panicking task does not leave the caller spinning.
            let _done = Done(&done);
            f(task);
        }
    };
    let helpers = rayon::current_num_threads().min(tasks.len()).saturating_sub(1);
    rayon::scope(|s| {
        // Helpers as ordinary jobs: a thread busy elsewhere leaves its job to the others (or to the caller, which
        // runs it at the scope's end with nothing left to claim).
        for _ in 0..helpers {
            s.spawn(|_| work());
        }
        work();
        // Every task is claimed; those still running are on threads that took them and will finish them.
        while done.load(Ordering::Acquire) < tasks.len() {
            std::hint::spin_loop();
        }
    });
}

/// Counts a finished (or unwound) task when dropped.
struct Done<'a>(&'a AtomicUsize);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool")
    }

    #[test]
    fn every_task_runs_once() {
        for threads in [1, 2, 3] {
            for n in [0, 1, 2, 7, 100] {
                let tasks: Vec<usize> = (0..n).collect();
                let seen = Mutex::new(vec![0u32; n]);
                pool(threads).install(|| for_each(&tasks, |&i| seen.lock().expect("lock")[i] += 1));
                assert!(seen.into_inner().expect("lock").iter().all(|&c| c == 1), "{threads} threads, {n} tasks");
            }
        }
    }

    #[test]
    fn the_other_threads_take_tasks() {
        let tasks: Vec<usize> = (0..64).collect();
        let threads = Mutex::new(std::collections::BTreeSet::new());
        pool(2).install(|| {
            for_each(&tasks, |_| {
                std::thread::sleep(std::time::Duration::from_millis(1));
                threads.lock().expect("lock").insert(rayon::current_thread_index());
            })
        });
        assert_eq!(threads.into_inner().expect("lock").len(), 2, "both threads ran tasks");
    }

    #[test]
    fn a_panicking_task_passes_on_and_the_pool_still_runs() {
        let pool = pool(2);
        let tasks: Vec<usize> = (0..16).collect();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                for_each(&tasks, |&i| {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    assert!(i != 9, "task 9");
                })
            })
        }));
        assert!(r.is_err());
        assert_eq!(pool.install(|| 7), 7);
    }
}
