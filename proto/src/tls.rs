//! TLS for strata's gRPC servers and clients, from PEM files. The Helm chart mounts a Secret and names its files in
//! `STRATA_TLS_CERT`, `STRATA_TLS_KEY` and `STRATA_TLS_CA`. With a CA, peers verify each other (mutual TLS): servers
//! require a client certificate signed by it and clients trust only it; without one, clients trust the public web
//! PKI roots and servers take any client.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::error::{ProtoError, Result};

/// Where the PEM files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This node's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA that signs every peer's certificate (enables mutual TLS).
    pub ca: Option<PathBuf>,
}

impl TlsFiles {
    /// Reads `STRATA_TLS_CERT`, `STRATA_TLS_KEY` and `STRATA_TLS_CA`; `None` when none is set. A CA without a
    /// certificate and key, or one of those two without the other, is an error.
    pub fn from_env() -> Result<Option<Self>> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        Self::from_parts(var("STRATA_TLS_CERT"), var("STRATA_TLS_KEY"), var("STRATA_TLS_CA"))
    }

    /// Builds the file set from its optional parts (flags or env); `None` when none is given.
    pub fn from_parts(cert: Option<PathBuf>, key: Option<PathBuf>, ca: Option<PathBuf>) -> Result<Option<Self>> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), ca) => Ok(Some(Self { cert, key, ca })),
            _ => {
                Err(ProtoError::Tls("TLS needs both a certificate and a key (STRATA_TLS_CERT, STRATA_TLS_KEY)".into()))
            }
        }
    }

    /// Reads and checks the files.
    pub fn load(&self) -> Result<Tls> {
        let cert = read_pem(&self.cert, "CERTIFICATE")?;
        let key = read_pem(&self.key, "PRIVATE KEY")?;
        let ca = self.ca.as_deref().map(|p| read_pem(p, "CERTIFICATE")).transpose()?;
        Ok(Tls { identity: Identity::from_pem(cert, key), ca: ca.map(Certificate::from_pem) })
    }
}

fn read_pem(path: &Path, kind: &str) -> Result<Vec<u8>> {
    let pem = std::fs::read(path).map_err(|e| ProtoError::Tls(format!("reading {}: {e}", path.display())))?;
    // "PRIVATE KEY" also matches "RSA PRIVATE KEY" and "EC PRIVATE KEY" headers.
    if !String::from_utf8_lossy(&pem).contains(&format!("{kind}-----")) {
        return Err(ProtoError::Tls(format!("{} holds no PEM {kind}", path.display())));
    }
    Ok(pem)
}

/// Loaded TLS material, cheap to clone into every server and client.
#[derive(Debug, Clone)]
pub struct Tls {
    identity: Identity,
    ca: Option<Certificate>,
}

impl Tls {
    /// The server side: this node's identity, and with a CA, a required client certificate signed by it.
    pub fn server_config(&self) -> ServerTlsConfig {
        let config = ServerTlsConfig::new().identity(self.identity.clone());
        match &self.ca {
            Some(ca) => config.client_ca_root(ca.clone()),
            None => config,
        }
    }

    /// The client side for a server at `host`: trust the CA (or the web PKI roots without one) and present this
    /// node's certificate.
    pub fn client_config(&self, host: &str) -> ClientTlsConfig {
        let config = ClientTlsConfig::new().domain_name(host).identity(self.identity.clone());
        match &self.ca {
            Some(ca) => config.ca_certificate(ca.clone()),
            None => config.with_webpki_roots(),
        }
    }
}

/// The host part of `host:port` or a URL (`https://host:port/...`, `[v6]:port`), for certificate name checks.
pub fn host_of(address: &str) -> &str {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_must_come_in_pairs() -> Result<()> {
        assert_eq!(TlsFiles::from_parts(None, None, None)?, None);
        let both = TlsFiles::from_parts(Some("c".into()), Some("k".into()), None)?;
        assert_eq!(both.map(|f| f.cert), Some(PathBuf::from("c")));
        assert!(TlsFiles::from_parts(Some("c".into()), None, None).is_err());
        assert!(TlsFiles::from_parts(None, None, Some("ca".into())).is_err());
        Ok(())
    }

    #[test]
    fn missing_and_non_pem_files_are_named() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("strata-tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| ProtoError::Tls(e.to_string()))?;
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a pem").map_err(|e| ProtoError::Tls(e.to_string()))?;
        let files = TlsFiles { cert: junk.clone(), key: junk.clone(), ca: None };
        let err = files.load().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("junk.pem") && err.contains("CERTIFICATE"), "{err}");
        let files = TlsFiles { cert: dir.join("nope.pem"), key: junk, ca: None };
        let err = files.load().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("nope.pem"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn hosts_are_taken_from_addresses_and_urls() {
        assert_eq!(host_of("stage-0.svc:7000"), "stage-0.svc");
        assert_eq!(host_of("https://coord.example:50051/x"), "coord.example");
        assert_eq!(host_of("[::1]:7000"), "::1");
        assert_eq!(host_of("localhost"), "localhost");
    }
}
