//! The last stage's answers straight to the coordinator (`Answers`): the coordinator of a term opens the stream
//! on the last stage of its plan, and a batch of that term is answered there, with only an acknowledgement
//! relayed back up the `Forward` streams to stage 1 (each stage waits for its downstream's reply to every batch;
//! stage 0 keeps it from the coordinator, which has the answer). A token then reaches the coordinator after one hop per stage plus one,
//! where the relay took two per stage; across hosts each hop is a network round, and on one host a thread
//! wake-up (20-50 µs on the development VMs).
//!
//! The route is a shortcut, never the only way: a batch whose term has no open route, or whose route is full or
//! closed, is answered up the `Forward` streams as before, so the coordinator sees every answer whatever happens
//! to the `Answers` stream.

use std::sync::{Arc, Mutex, PoisonError};

use strata_proto::pb;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::answer::Responses;

/// Answers buffered on the stream before batches go back to the relay.
const DEPTH: usize = 64;

/// The open route, if any: one coordinator (the one of the newest term) at a time.
#[derive(Clone, Default)]
pub(crate) struct DirectAnswers(Arc<Mutex<Option<Route>>>);

struct Route {
    term: u64,
    /// The route's only sender: dropping the route ends its stream once the buffered answers are read.
    tx: Responses,
    /// Cancelled when the route is dropped, so its shutdown watch ends with it.
    gone: CancellationToken,
}

impl DirectAnswers {
    /// Opens the route for the coordinator of `term` (its term already admitted), replacing an older route, whose
    /// stream ends once its buffered answers are read; returns the answers' receiving end. The route closes when
    /// `shutdown` is cancelled (the worker is stopping: answers go back to the relay, which its graceful shutdown
    /// waits for).
    pub(crate) fn open(
        &self,
        term: u64,
        shutdown: &CancellationToken,
    ) -> mpsc::Receiver<Result<pb::ForwardResponse, tonic::Status>> {
        let (tx, rx) = mpsc::channel(DEPTH);
        let gone = CancellationToken::new();
        self.replace(Some(Route { term, tx, gone: gone.clone() }));
        let route = self.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                // Stopping: no route stays open, whichever it is.
                () = shutdown.cancelled() => route.replace(None),
                () = gone.cancelled() => {}
            }
        });
        rx
    }

    /// Sends `resp`, the answer to a batch of `term`, down the open route; gives it back when there is none for
    /// that term or the route cannot take it now (full, or its coordinator gone), for the caller to relay.
    pub(crate) fn send(&self, term: u64, resp: pb::ForwardResponse) -> Result<(), pb::ForwardResponse> {
        let mut route = self.lock();
        let Some(open) = route.as_ref().filter(|r| r.term == term) else { return Err(resp) };
        let back = match open.tx.try_send(Ok(resp)) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::TrySendError::Full(back)) => back,
            Err(mpsc::error::TrySendError::Closed(back)) => {
                if let Some(r) = route.take() {
                    r.gone.cancel();
                }
                back
            }
        };
        match back {
            Ok(resp) => Err(resp),
            // Only answers are ever sent on a route.
            Err(_) => Ok(()),
        }
    }

    fn replace(&self, route: Option<Route>) {
        if let Some(old) = std::mem::replace(&mut *self.lock(), route) {
            old.gone.cancel();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Route>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
