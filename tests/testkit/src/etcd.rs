//! A throwaway single-member etcd per test: plaintext, or secured the way a production etcd is (TLS with client
//! certificates, a root user with auth enabled).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::free_port;
use crate::pki::Ca;

/// How to secure a test etcd.
#[derive(Debug, Clone, Default)]
pub struct EtcdSecurity {
    /// Serve TLS only, with certificates from a fresh CA, and require client certificates it signed.
    pub tls: bool,
    /// Add user `root` with this password and enable auth.
    pub root_password: Option<String>,
}

/// The PEM files of a TLS etcd, in its directory.
#[derive(Debug, Clone)]
pub struct EtcdPki {
    /// The CA that signs etcd's certificate and the client's.
    pub ca: PathBuf,
    /// A client certificate etcd accepts (common name `strata-client`, not a user: it grants no access).
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

/// A throwaway single-member etcd: its own data dir and ports, killed on drop.
pub struct EtcdServer {
    child: Option<Child>,
    host: String,
    port: u16,
    peer: u16,
    /// Plain HTTP `/health` (and `/metrics`), reachable without a certificate when clients need one.
    metrics: u16,
    pki: Option<EtcdPki>,
    root_password: Option<String>,
    dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts etcd on 127.0.0.1 and waits until `/health` says it is healthy.
    pub fn start() -> Result<Self> {
        Self::start_on("127.0.0.1")
    }

    /// Starts etcd serving clients on `host` (an address of this machine, e.g. a bridge that network namespaces
    /// reach it through) and waits until it is healthy.
    pub fn start_on(host: &str) -> Result<Self> {
        Self::start_secured(host, &EtcdSecurity::default())
    }

    /// Starts etcd on `host` secured as `security` says, and waits until it is healthy (and, with a root
    /// password, until auth is enabled).
    pub fn start_secured(host: &str, security: &EtcdSecurity) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let pki = if security.tls { Some(write_pki(&dir, host)?) } else { None };
        let mut server = Self {
            child: None,
            host: host.to_owned(),
            port: free_port()?,
            peer: free_port()?,
            metrics: free_port()?,
            pki,
            root_password: None,
            dir,
        };
        // A free port can be taken by another process before etcd binds it; etcd then exits, and other ports do.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match server.restart() {
                Ok(()) => break,
                Err(e) if attempts < 3 && server.exited() => {
                    eprintln!("etcd did not start ({e:#}); again on other ports");
                    server.port = free_port()?;
                    server.peer = free_port()?;
                    server.metrics = free_port()?;
                }
                Err(e) => return Err(e),
            }
        }
        if let Some(password) = &security.root_password {
            server.etcdctl(&["user", "add", &format!("root:{password}")])?;
            server.etcdctl(&["auth", "enable"])?;
            server.root_password = Some(password.clone());
        }
        Ok(server)
    }

    /// Whether the etcd process has exited.
    fn exited(&mut self) -> bool {
        self.child.as_mut().is_none_or(|c| !matches!(c.try_wait(), Ok(None)))
    }

    /// Kills etcd (simulating an outage); [`EtcdServer::restart`] brings it back with the same data.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// (Re)starts etcd on the same ports and data dir and waits until it is healthy.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let client = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer);
        let metrics_url = format!("http://{}:{}", self.host, self.metrics);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("etcd.log"))?;
        let mut cmd = Command::new("etcd");
        // A short heartbeat and election timeout make a single member ready in ~0.2 s.
        cmd.args(["--name", "test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            .args(["--listen-metrics-urls", &metrics_url])
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"]);
        if let Some(pki) = &self.pki {
            cmd.arg("--cert-file").arg(&pki.server_cert).arg("--key-file").arg(&pki.server_key);
            cmd.arg("--trusted-ca-file").arg(&pki.ca).arg("--client-cert-auth");
        }
        let child =
            cmd.stdout(Stdio::null()).stderr(log).spawn().context("spawning etcd (is etcd-server installed?)")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            // An etcd that could not bind a port exits; another test's etcd may hold that port and answer
            // `/health` on it (CI once saw a "healthy" etcd whose client port refused every connection): healthy
            // means this child still runs and its client port takes connections too.
            if self.exited() {
                break;
            }
            if self.healthy() && TcpStream::connect((self.host.as_str(), self.port)).is_ok() && !self.exited() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        let exited = self.exited();
        bail!(
            "etcd on port {} did not become healthy within 15 s or exited (exited: {exited}); its log ends:\n{}",
            self.port,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    /// Whether etcd answers its `/health` endpoint as healthy now.
    pub fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect((self.host.as_str(), self.metrics)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n").is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains(r#""health":"true""#)
    }

    /// Runs `etcdctl` against this etcd, with its client certificate and as root when secured; returns stdout.
    pub fn etcdctl(&self, args: &[&str]) -> Result<String> {
        let mut cmd = Command::new("etcdctl");
        cmd.arg("--endpoints").arg(self.endpoint());
        if let Some(pki) = &self.pki {
            cmd.arg("--cacert").arg(&pki.ca).arg("--cert").arg(&pki.client_cert).arg("--key").arg(&pki.client_key);
        }
        if let Some(password) = &self.root_password {
            cmd.arg(format!("--user=root:{password}"));
        }
        let out = cmd.args(args).output().context("running etcdctl")?;
        if !out.status.success() {
            bail!("etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Revokes every lease with `etcdctl` (what a lease expiry looks like to its holders); returns how many.
    pub fn revoke_all_leases(&self) -> Result<usize> {
        let list = self.etcdctl(&["lease", "list"])?;
        let ids: Vec<&str> = list.lines().skip(1).map(str::trim).filter(|l| !l.is_empty()).collect();
        for id in &ids {
            self.etcdctl(&["lease", "revoke", id])?;
        }
        Ok(ids.len())
    }

    /// The etcd process id, while it runs (to freeze it with SIGSTOP).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The client URL: `http://<host>:<port>`, or `https://` with TLS.
    pub fn endpoint(&self) -> String {
        let scheme = if self.pki.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.host, self.port)
    }

    /// The TLS files, when etcd serves TLS.
    pub fn pki(&self) -> Option<&EtcdPki> {
        self.pki.as_ref()
    }
}

/// A CA, etcd's certificate for `host` and a client certificate, written into `dir`.
fn write_pki(dir: &tempfile::TempDir, host: &str) -> Result<EtcdPki> {
    let ca = Ca::new("strata test etcd CA")?;
    let server = ca.leaf("etcd", &[host])?;
    let client = ca.leaf("strata-client", &[])?;
    let path = |name: &str| dir.path().join(name);
    let pki = EtcdPki {
        ca: path("ca.crt"),
        client_cert: path("client.crt"),
        client_key: path("client.key"),
        server_cert: path("server.crt"),
        server_key: path("server.key"),
    };
    for (file, pem) in [
        (&pki.ca, &ca.cert),
        (&pki.client_cert, &client.cert),
        (&pki.client_key, &client.key),
        (&pki.server_cert, &server.cert),
        (&pki.server_key, &server.key),
    ] {
        std::fs::write(file, pem).with_context(|| format!("writing {}", file.display()))?;
    }
    Ok(pki)
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}
