//! The shutdown signal every strata binary stops on: SIGINT (Ctrl-C) or SIGTERM (what Kubernetes and Docker send).

use tokio_util::sync::CancellationToken;

/// Completes on the first SIGINT or SIGTERM. A signal that cannot be listened for is logged and never fires; the
/// other one still does.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutting down");
}

/// A token cancelled on the first SIGINT or SIGTERM (the listener is spawned on the current Tokio runtime).
pub fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let on_signal = token.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        on_signal.cancel();
    });
    token
}
