//! A TLS listener for the HTTP API, served by axum like a `TcpListener`. One task accepts TCP connections (setting
//! TCP_NODELAY) and runs each handshake in a task of its own under [`HANDSHAKE_TIMEOUT`], so a slow or broken client
//! never holds up the others; finished streams reach axum through a bounded queue.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;

/// How long a client may take to complete its TLS handshake before it is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; past this the accept loop waits (each is bounded by the timeout), so a flood of
/// connections that never finish cannot grow memory without limit.
const MAX_HANDSHAKES: usize = 256;
/// Finished handshakes waiting for axum to take them.
const READY_QUEUE: usize = 64;

/// A TLS connection and its peer's address.
type Accepted = (TlsStream<TcpStream>, SocketAddr);

/// Accepts TLS connections on a bound TCP listener (see the module docs).
pub struct TlsListener {
    ready: mpsc::Receiver<Accepted>,
    local_addr: SocketAddr,
    acceptor: JoinHandle<()>,
}

impl TlsListener {
    /// Starts accepting on `listener` with `config`; stops when this is dropped.
    pub fn new(listener: TcpListener, config: Arc<ServerConfig>) -> io::Result<Self> {
        let local_addr = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_QUEUE);
        let acceptor = tokio::spawn(accept_loop(listener, TlsAcceptor::from(config), tx));
        Ok(TlsListener { ready, local_addr, acceptor })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        // Closes the TCP listener; handshakes in flight end on their own when their result cannot be delivered.
        self.acceptor.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> Accepted {
        match self.ready.recv().await {
            Some(accepted) => accepted,
            // The accept loop only returns once this receiver is gone, so this is not reached while it lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local_addr)
    }
}

async fn accept_loop(listener: TcpListener, acceptor: TlsAcceptor, ready: mpsc::Sender<Accepted>) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let permit = tokio::select! {
            () = ready.closed() => return,
            permit = handshakes.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return, // never closed
            },
        };
        let (tcp, peer) = tokio::select! {
            () = ready.closed() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
        };
        // Token chunks are small writes; Nagle would hold them back.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let (acceptor, ready) = (acceptor.clone(), ready.clone());
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
            drop(permit);
            match handshake {
                Ok(Ok(tls)) => {
                    let _ = ready.send((tls, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out after {HANDSHAKE_TIMEOUT:?}"),
            }
        });
    }
}

/// Errors of one connection (reset before it was accepted) are nothing to wait for; others (out of file
/// descriptors) would spin the loop, so it pauses, as axum's own listener does.
async fn accept_failed(e: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(e.kind(), ConnectionAborted | ConnectionRefused | ConnectionReset) {
        return;
    }
    tracing::error!(error = %e, "accepting an HTTPS connection failed; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
