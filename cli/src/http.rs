//! A minimal HTTP/1.1 client on hyper (which tonic already brings) for the chaos load and the cluster benchmark:
//! `POST /v1/completions` with `"stream": true` read as server-sent events one at a time, and plain `GET`s for
//! health checks and metrics. One connection per request; dropping a stream closes it, as a client that goes
//! away would. Plaintext only.

use std::net::{SocketAddr, ToSocketAddrs};

use anyhow::{Context, Result, bail};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// The socket address of `url` (`http://host:port`, or just `host:port`).
pub fn addr_of(url: &str) -> Result<SocketAddr> {
    let rest = url.trim().trim_end_matches('/');
    if rest.starts_with("https://") {
        bail!("{url}: this client speaks plaintext HTTP only");
    }
    let host_port = rest.strip_prefix("http://").unwrap_or(rest);
    host_port
        .to_socket_addrs()
        .with_context(|| format!("HTTP address {url:?}"))?
        .next()
        .with_context(|| format!("{url:?} resolves to no address"))
}

/// A response body read as server-sent events; dropping it closes the connection.
pub struct EventStream {
    /// The status code.
    pub status: u16,
    body: Incoming,
    buf: Vec<u8>,
    connection: JoinHandle<()>,
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

impl EventStream {
    /// The next event's `data` (its data lines joined), or `None` once the body ends.
    pub async fn next_data(&mut self) -> Result<Option<String>> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buf.drain(..end + 2).collect();
                let text = String::from_utf8(block).context("an event is not UTF-8")?;
                let data: Vec<&str> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue; // a comment or keep-alive
                }
                return Ok(Some(data.join("\n")));
            }
            match self.body.frame().await {
                None => {
                    if self.buf.iter().any(|b| !b.is_ascii_whitespace()) {
                        bail!("the body ended inside an event: {:?}", String::from_utf8_lossy(&self.buf));
                    }
                    return Ok(None);
                }
                Some(frame) => {
                    if let Ok(data) = frame.context("reading the event stream")?.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// The rest of the body as text (for an error response).
    pub async fn rest(mut self) -> String {
        let mut out = std::mem::take(&mut self.buf);
        while let Some(Ok(frame)) = self.body.frame().await {
            if let Ok(d) = frame.into_data() {
                out.extend_from_slice(&d);
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

async fn send(addr: SocketAddr, req: Request<Full<Bytes>>) -> Result<(u16, Incoming, JoinHandle<()>)> {
    let stream = TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let connection = tokio::spawn(async move {
        let _ = conn.await;
    });
    let response = sender.send_request(req).await.with_context(|| format!("HTTP request to {addr}"))?;
    let status = response.status().as_u16();
    Ok((status, response.into_body(), connection))
}

/// `POST path` with a JSON body, the response read as events.
pub async fn post_events(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Result<EventStream> {
    let req = Request::post(path)
        .header(HOST, addr.to_string())
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let (status, body, connection) = send(addr, req).await?;
    Ok(EventStream { status, body, buf: Vec::new(), connection })
}

/// `GET path`: the status line's code and the body, as `"<code> <body>"`.
pub async fn get(addr: SocketAddr, path: &str) -> Result<String> {
    let req = Request::get(path).header(HOST, addr.to_string()).body(Full::new(Bytes::new()))?;
    let (status, body, connection) = send(addr, req).await?;
    let bytes = body.collect().await.map(|b| b.to_bytes());
    connection.abort();
    Ok(format!("{status} {}", String::from_utf8_lossy(&bytes.unwrap_or_default())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_bare_addresses_are_accepted() -> Result<()> {
        assert_eq!(addr_of("http://127.0.0.1:8080/")?, "127.0.0.1:8080".parse()?);
        assert_eq!(addr_of("127.0.0.1:9")?, "127.0.0.1:9".parse()?);
        assert!(addr_of("https://127.0.0.1:8080").is_err());
        Ok(())
    }
}
