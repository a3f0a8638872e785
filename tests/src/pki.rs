//! The cluster PKI of the TLS tests, on the testkit's throwaway [`Ca`]: the cluster's CA, the certificate every node
//! uses, client certificates with names of their own, and a stranger (another CA's certificate with the node's
//! names), written to files as the Helm chart mounts them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use strata_proto::TlsFiles;
pub use strata_testkit::pki::{Ca, Pem};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// The cluster's CA and the one certificate every node uses, plus a stranger.
pub struct Pki {
    dir: tempfile::TempDir,
    issuer: Ca,
    /// The CA's certificate.
    pub ca: String,
    /// Every node's certificate (common name `strata node`; `localhost`, `127.0.0.1`; server and client).
    pub node: Pem,
    /// Another CA.
    pub stranger_ca: String,
    /// A certificate from the other CA with the node's names.
    pub stranger: Pem,
}

impl Pki {
    /// A new CA with the node certificate in `ca.crt`, `tls.crt` and `tls.key`.
    pub fn new() -> Result<Self> {
        let (issuer, stranger_issuer) = (Ca::new("strata test CA")?, Ca::new("someone else's CA")?);
        let pki = Pki {
            dir: tempfile::tempdir()?,
            node: issuer.leaf("strata node", &[])?,
            ca: issuer.cert.clone(),
            stranger: stranger_issuer.leaf("strata node", &[])?,
            stranger_ca: stranger_issuer.cert,
            issuer,
        };
        std::fs::write(pki.path("ca.crt"), &pki.ca)?;
        std::fs::write(pki.path("tls.crt"), &pki.node.cert)?;
        std::fs::write(pki.path("tls.key"), &pki.node.key)?;
        Ok(pki)
    }

    /// A file in the PKI's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The node's files as the Helm chart mounts them: mutual TLS.
    pub fn files(&self) -> TlsFiles {
        TlsFiles { cert: self.path("tls.crt"), key: self.path("tls.key"), ca: Some(self.path("ca.crt")) }
    }

    /// A certificate from the CA with common name `name`, also written to `<name>.crt` and `<name>.key`.
    pub fn client(&self, name: &str) -> Result<Pem> {
        let pem = self.issuer.leaf(name, &[])?;
        std::fs::write(self.path(&format!("{name}.crt")), &pem.cert)?;
        std::fs::write(self.path(&format!("{name}.key")), &pem.key)?;
        Ok(pem)
    }
}

/// A gRPC endpoint at `addr` over TLS, trusting `ca` and presenting `identity` if any.
pub fn tls_endpoint(addr: SocketAddr, ca: &str, identity: Option<&Pem>) -> Result<Endpoint> {
    let mut config = ClientTlsConfig::new().domain_name("127.0.0.1").ca_certificate(Certificate::from_pem(ca));
    if let Some(id) = identity {
        config = config.identity(Identity::from_pem(&id.cert, &id.key));
    }
    Ok(Endpoint::from_shared(format!("https://{addr}"))?.connect_timeout(Duration::from_secs(5)).tls_config(config)?)
}
