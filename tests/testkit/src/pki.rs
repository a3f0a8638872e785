//! Throwaway certificate authorities and certificates for TLS tests (ring-backed rcgen, as the servers use ring).

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

/// A PEM certificate and its PEM private key.
#[derive(Debug, Clone)]
pub struct Pem {
    /// The certificate.
    pub cert: String,
    /// Its private key.
    pub key: String,
}

/// A certificate authority that signs [`Pem`] leaves.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// The CA's own certificate, what peers trust.
    pub cert: String,
}

impl Ca {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Result<Self> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key)?;
        Ok(Self { issuer: Issuer::new(params, key), cert: cert.pem() })
    }

    /// A certificate with common name `name` for `localhost`, `127.0.0.1` and `hosts`, good for serving and as a
    /// client certificate.
    pub fn leaf(&self, name: &str, hosts: &[&str]) -> Result<Pem> {
        let key = KeyPair::generate()?;
        let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        names.extend(hosts.iter().map(|h| (*h).to_owned()));
        names.dedup();
        let mut params = CertificateParams::new(names)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pem { cert: cert.pem(), key: key.serialize_pem() })
    }
}
