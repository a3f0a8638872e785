//! The worker's network runtime: one current-thread tokio runtime that serves the worker's gRPC connections and
//! dials the next stage. The executor thread drives it while it waits for a batch and while it computes a short
//! one (a decode step), so a batch goes from its socket to the compute and on to the next socket on one thread,
//! with no thread wake-up in between (each costs 20-50 µs on the development VMs, several per pipeline hop). A
//! helper thread drives it whenever no executor does (no stage loaded, or a long compute such as a prefill
//! chunk), so PINGs, `Status` and health checks wait at most one short compute.
//!
//! Which thread drives is decided by a count of the executor threads that want to: the helper drives while it is
//! 0 and hands the runtime over as soon as it is not (tokio lets one thread at a time run a current-thread
//! runtime's `block_on`; the others wait for it to be released).

use std::future::Future;
use std::sync::Arc;

use tokio::runtime::{Handle, Runtime};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::error::{Error, Result};

/// A cheap handle to the worker's network runtime; the helper thread stops when the last handle is dropped.
#[derive(Clone)]
pub struct IoRuntime {
    shared: Arc<Shared>,
    _alive: Arc<DropGuard>,
}

struct Shared {
    /// Always `Some` until dropped: taken out to be shut down without blocking, wherever the last handle goes.
    runtime: Option<Runtime>,
    handle: Handle,
    /// Executor threads driving the runtime or waiting to.
    drivers: watch::Sender<usize>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// One executor thread counted as a driver while this lives.
struct Claim<'a>(&'a watch::Sender<usize>);

impl<'a> Claim<'a> {
    fn new(drivers: &'a watch::Sender<usize>) -> Self {
        drivers.send_modify(|n| *n += 1);
        Claim(drivers)
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl IoRuntime {
    /// Starts the runtime and its helper thread, which drives it until every handle is gone (a server shutting
    /// down gracefully still needs it driven).
    pub fn start() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Executor(format!("cannot start the network runtime: {e}")))?;
        let handle = runtime.handle().clone();
        let shared = Arc::new(Shared { runtime: Some(runtime), handle, drivers: watch::Sender::new(0) });
        let stop = CancellationToken::new();
        let helper = shared.clone();
        let helper_stop = stop.clone();
        std::thread::Builder::new()
            .name("strata-io".into())
            .spawn(move || helper.help(&helper_stop))
            .map_err(|e| Error::Executor(format!("cannot start the network thread: {e}")))?;
        Ok(IoRuntime { shared, _alive: Arc::new(stop.drop_guard()) })
    }

    /// Spawns tasks and enters the runtime's context (to dial or bind on it).
    pub fn handle(&self) -> &Handle {
        &self.shared.handle
    }

    /// Runs `future` to completion on the calling thread, driving the runtime meanwhile (waiting first for
    /// whichever thread drives it now to let go). Not from inside an async context.
    pub fn drive<F: Future>(&self, future: F) -> F::Output {
        let _claim = Claim::new(&self.shared.drivers);
        self.shared.runtime().block_on(future)
    }
}

impl Shared {
    fn runtime(&self) -> &Runtime {
        // Only `Drop` takes it out.
        self.runtime.as_ref().expect("the network runtime exists until dropped")
    }

    /// The helper thread: drives the runtime whenever no executor does, until `shutdown` (every handle dropped).
    fn help(&self, shutdown: &CancellationToken) {
        let mut drivers = self.drivers.subscribe();
        while !shutdown.is_cancelled() {
            // Waiting without the runtime: an executor has it.
            let idle = self.handle.block_on(async {
                tokio::select! {
                    () = shutdown.cancelled() => false,
                    idle = drivers.wait_for(|n| *n == 0) => idle.is_ok(),
                }
            });
            if !idle {
                break;
            }
            let mut wanted = self.drivers.subscribe();
            self.runtime().block_on(async {
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    _ = wanted.wait_for(|n| *n > 0) => {}
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn tasks_run_whichever_thread_drives() -> anyhow::Result<()> {
        let io = IoRuntime::start()?;
        // The helper drives: a spawned task with a timer completes with no executor around.
        let (tx, rx) = std::sync::mpsc::channel();
        io.handle().spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let _ = tx.send(std::thread::current().name().map(str::to_owned));
        });
        let by = rx.recv_timeout(Duration::from_secs(10))?;
        assert_eq!(by.as_deref(), Some("strata-io"));
        // A driver takes over: its own future and the runtime's tasks run on its thread.
        let (tx, rx) = std::sync::mpsc::channel();
        let here = std::thread::current().name().map(str::to_owned);
        let ran_here = io.drive(async move {
            let task = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let _ = tx.send(std::thread::current().name().map(str::to_owned));
            });
            task.await.is_ok()
        });
        assert!(ran_here);
        assert_eq!(rx.recv_timeout(Duration::from_secs(10))?, here);
        // And hands back: the helper drives again.
        let (tx, rx) = std::sync::mpsc::channel();
        io.handle().spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let _ = tx.send(std::thread::current().name().map(str::to_owned));
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(10))?.as_deref(), Some("strata-io"));
        Ok(())
    }
}
