//! A certificate authority made for a test: the cluster's CA, the certificate every node uses, client certificates
//! with names of their own, and a stranger (another CA's certificate with the same names), all written to files as
//! the Helm chart mounts them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use strata_proto::TlsFiles;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// A certificate and its key, as PEM.
pub struct Pem {
    /// The certificate.
    pub cert: String,
    /// Its private key.
    pub key: String,
}

/// The cluster's CA and the one certificate every node uses, plus a stranger.
pub struct Pki {
    dir: tempfile::TempDir,
    issuer: Issuer<'static, KeyPair>,
    /// The CA's certificate.
    pub ca: String,
    /// Every node's certificate (`localhost`, `127.0.0.1`; server and client).
    pub node: Pem,
    /// Another CA.
    pub stranger_ca: String,
    /// A certificate from the other CA with the node's names.
    pub stranger: Pem,
}

fn new_ca(name: &str) -> Result<(Issuer<'static, KeyPair>, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key)?;
    Ok((Issuer::new(params, key), cert.pem()))
}

/// A certificate for `localhost` and `127.0.0.1`, good for serving and as a client certificate, as every node's is.
fn leaf(issuer: &Issuer<'static, KeyPair>) -> Result<Pem> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
    params.distinguished_name.push(DnType::CommonName, "strata node");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, issuer)?;
    Ok(Pem { cert: cert.pem(), key: key.serialize_pem() })
}

impl Pki {
    /// A new CA with the node certificate in `ca.crt`, `tls.crt` and `tls.key`.
    pub fn new() -> Result<Self> {
        let (issuer, ca) = new_ca("strata test CA")?;
        let (stranger_issuer, stranger_ca) = new_ca("someone else's CA")?;
        let node = leaf(&issuer)?;
        let pki = Pki { dir: tempfile::tempdir()?, issuer, ca, node, stranger_ca, stranger: leaf(&stranger_issuer)? };
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

    /// A client-only certificate from the CA whose subject common name is `name`, also written to `<name>.crt` and
    /// `<name>.key`.
    pub fn client(&self, name: &str) -> Result<Pem> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let pem = Pem { cert: params.signed_by(&key, &self.issuer)?.pem(), key: key.serialize_pem() };
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
