//! HTTP/2 keepalive for strata's long-lived gRPC connections. A peer that hangs without closing its socket (a
//! stopped process, a dead host behind a NAT) leaves a stream silent forever; a PING every `interval` that is not
//! acknowledged within `timeout` closes the connection, so its streams fail with `UNAVAILABLE` instead.

use std::time::Duration;

use tonic::transport::{Endpoint, Server};

/// Keepalive settings for one side of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Time between PINGs.
    pub interval: Duration,
    /// How long a PING may go unacknowledged before the connection is closed.
    pub timeout: Duration,
}

impl Keepalive {
    /// Default PING interval of every strata binary, in milliseconds (flags take milliseconds).
    pub const DEFAULT_INTERVAL_MS: u64 = 1000;
    /// Default PING timeout of every strata binary, in milliseconds.
    pub const DEFAULT_TIMEOUT_MS: u64 = 2000;
    /// The defaults: a hung peer is detected within about 3 s.
    pub const DEFAULT: Keepalive = Keepalive {
        interval: Duration::from_millis(Self::DEFAULT_INTERVAL_MS),
        timeout: Duration::from_millis(Self::DEFAULT_TIMEOUT_MS),
    };

    /// Settings from milliseconds, as flags give them; `None` if either is 0.
    pub fn from_millis(interval_ms: u64, timeout_ms: u64) -> Option<Self> {
        (interval_ms > 0 && timeout_ms > 0).then(|| Keepalive {
            interval: Duration::from_millis(interval_ms),
            timeout: Duration::from_millis(timeout_ms),
        })
    }

    /// A client endpoint that pings its server, idle or not.
    pub fn endpoint(self, endpoint: Endpoint) -> Endpoint {
        endpoint.http2_keep_alive_interval(self.interval).keep_alive_timeout(self.timeout).keep_alive_while_idle(true)
    }

    /// A server that pings its clients.
    pub fn server<L>(self, server: Server<L>) -> Server<L> {
        server.http2_keepalive_interval(Some(self.interval)).http2_keepalive_timeout(Some(self.timeout))
    }
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_must_be_positive() {
        let defaults = Keepalive::from_millis(Keepalive::DEFAULT_INTERVAL_MS, Keepalive::DEFAULT_TIMEOUT_MS);
        assert_eq!(defaults, Some(Keepalive::DEFAULT));
        assert_eq!(Keepalive::from_millis(0, 2000), None);
        assert_eq!(Keepalive::from_millis(1000, 0), None);
    }
}
