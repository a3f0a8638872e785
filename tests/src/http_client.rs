//! A small HTTP/1.1 client for the coordinator's HTTP API, one connection per request, built on hyper (which
//! tonic already brings) so the tests need no client crate; HTTPS through tokio-rustls (`post_https`). Streams read
//! server-sent events one at a time, and dropping a stream closes its connection, as a client that goes away would.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::rustls::pki_types::ServerName;

/// How long any one request (or one streamed event) may take.
const BUDGET: Duration = Duration::from_secs(60);

/// A whole response.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// The `content-type` header.
    pub content_type: String,
    /// The body.
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body).with_context(|| {
            format!("status {}: body is not JSON: {}", self.status, String::from_utf8_lossy(&self.body))
        })
    }
}

/// A response whose body is read as server-sent events; dropping it closes the connection.
pub struct EventStream {
    /// The status code.
    pub status: u16,
    /// The `content-type` header.
    pub content_type: String,
    body: Incoming,
    buf: Vec<u8>,
    connection: JoinHandle<()>,
}

impl Drop for EventStream {
    fn drop(&mut self) {
        // Aborting the task drops the socket: the server sees the client go away.
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
            let frame = tokio::time::timeout(BUDGET, self.body.frame()).await.context("no event in time")?;
            match frame {
                None => {
                    if self.buf.iter().any(|b| !b.is_ascii_whitespace()) {
                        bail!("the body ended inside an event: {:?}", String::from_utf8_lossy(&self.buf));
                    }
                    return Ok(None);
                }
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// Every remaining event's data.
    pub async fn collect(mut self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        while let Some(d) = self.next_data().await? {
            out.push(d);
        }
        Ok(out)
    }
}

/// How to reach an HTTPS server: the client config (the roots it trusts) and the name the server's certificate must
/// carry.
#[derive(Clone)]
pub struct Https {
    /// The rustls client config.
    pub config: Arc<ClientConfig>,
    /// The server name checked against the certificate (`localhost`, `127.0.0.1`).
    pub server_name: String,
}

/// An HTTP/1.1 connection over `io`, driven by a task of its own.
async fn http1<Io>(io: Io) -> Result<(SendRequest<Full<Bytes>>, JoinHandle<()>)>
where
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    let connection = tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok((sender, connection))
}

/// A response whose body is still to be read: status, content type, body, and the connection's task.
type Sent = (u16, String, Incoming, JoinHandle<()>);

async fn send(
    addr: SocketAddr,
    https: Option<&Https>,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Result<Sent> {
    let stream = TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
    let (mut sender, connection) = match https {
        None => http1(stream).await?,
        Some(https) => {
            let name = ServerName::try_from(https.server_name.clone())?;
            let handshake = TlsConnector::from(https.config.clone()).connect(name, stream);
            http1(tokio::time::timeout(BUDGET, handshake).await.context("no TLS handshake in time")??).await?
        }
    };
    let mut req = Request::builder().method(method).uri(path).header(HOST, addr.to_string());
    if body.is_some() {
        req = req.header(CONTENT_TYPE, "application/json");
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
    let resp = tokio::time::timeout(BUDGET, sender.send_request(req)).await.context("no response in time")??;
    let content_type = resp.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    Ok((resp.status().as_u16(), content_type, resp.into_body(), connection))
}

/// Reads the whole body of a response, then closes its connection.
async fn whole(sent: Sent) -> Result<Reply> {
    let (status, content_type, body, connection) = sent;
    let body = tokio::time::timeout(BUDGET, body.collect()).await.context("body not read in time")??.to_bytes();
    connection.abort();
    Ok(Reply { status, content_type, body: body.to_vec() })
}

/// `GET path`.
pub async fn get(addr: SocketAddr, path: &str) -> Result<Reply> {
    whole(send(addr, None, Method::GET, path, &[], None).await?).await
}

/// `GET /metrics`: every sample, keyed by its name with labels (`strata_requests_finished_total{reason="length"}`),
/// after checking that the reply is OpenMetrics.
pub async fn scrape(addr: SocketAddr) -> Result<HashMap<String, f64>> {
    let reply = get(addr, "/metrics").await?;
    ensure!(reply.status == 200, "status {}", reply.status);
    ensure!(reply.content_type.starts_with("application/openmetrics-text"), "content type {}", reply.content_type);
    let text = String::from_utf8(reply.body)?;
    ensure!(text.trim_end().ends_with("# EOF"), "not OpenMetrics: {text}");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.rsplit_once(' ').with_context(|| format!("sample line {l:?}"))?;
            Ok((key.to_owned(), value.parse::<f64>().with_context(|| format!("sample line {l:?}"))?))
        })
        .collect()
}

/// `POST path` with `body` as JSON.
pub async fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Result<Reply> {
    post_raw(addr, path, serde_json::to_vec(body)?).await
}

/// `POST path` with these exact bytes (labelled JSON).
pub async fn post_raw(addr: SocketAddr, path: &str, body: Vec<u8>) -> Result<Reply> {
    whole(send(addr, None, Method::POST, path, &[], Some(body)).await?).await
}

/// `method path` with extra `headers` and, if given, `body` (labelled JSON).
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Result<Reply> {
    whole(send(addr, None, Method::from_bytes(method.as_bytes())?, path, headers, body).await?).await
}

/// `POST path` with `body` as JSON, over TLS.
pub async fn post_https(addr: SocketAddr, https: &Https, path: &str, body: &serde_json::Value) -> Result<Reply> {
    whole(send(addr, Some(https), Method::POST, path, &[], Some(serde_json::to_vec(body)?)).await?).await
}

/// `POST path` with `body` as JSON, reading the answer as server-sent events.
pub async fn post_stream(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Result<EventStream> {
    let (status, content_type, body, connection) =
        send(addr, None, Method::POST, path, &[], Some(serde_json::to_vec(body)?)).await?;
    Ok(EventStream { status, content_type, body, buf: Vec::new(), connection })
}
