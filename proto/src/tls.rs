//! TLS for strata's gRPC servers and clients and the coordinator's HTTP API, from PEM files; the one place that
//! reads them. The Helm chart mounts a Secret and names its files in `STRATA_TLS_CERT`, `STRATA_TLS_KEY` and
//! `STRATA_TLS_CA`. With a CA, gRPC peers verify each other (mutual TLS): servers require a client certificate
//! signed by it and clients trust only it; without one, clients trust the public web PKI roots and servers take any
//! client. The HTTP API never asks for a client certificate.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

use crate::error::{ProtoError, Result};

/// Where the PEM files are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// This node's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA that signs every peer's certificate (enables mutual TLS).
    #[serde(default)]
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
            (cert, key, _) => {
                let missing = match (cert, key) {
                    (Some(_), None) => "a certificate but no key",
                    (None, Some(_)) => "a key but no certificate",
                    _ => "a CA but no certificate and key",
                };
                Err(ProtoError::Tls(format!(
                    "{missing} given: TLS needs both --tls-cert (STRATA_TLS_CERT) and --tls-key (STRATA_TLS_KEY)"
                )))
            }
        }
    }

    /// Reads and checks the files: each must hold what it is named for, and the key must belong to the certificate.
    /// Errors name the file.
    pub fn load(&self) -> Result<Tls> {
        let cert = read_pem(&self.cert, "CERTIFICATE")?;
        let key = read_pem(&self.key, "PRIVATE KEY")?;
        let chain = certificates(&self.cert, &cert)?;
        let key_der = PrivateKeyDer::from_pem_slice(&key)
            .map_err(|e| ProtoError::Tls(format!("{}: no usable PEM PRIVATE KEY: {e}", self.key.display())))?;
        let ca = match self.ca.as_deref() {
            Some(path) => {
                let pem = read_pem(path, "CERTIFICATE")?;
                certificates(path, &pem)?;
                Some(Certificate::from_pem(pem))
            }
            None => None,
        };
        let https = https_server_config(chain, key_der)
            .map_err(|e| ProtoError::Tls(format!("{} with {}: {e}", self.cert.display(), self.key.display())))?;
        Ok(Tls { identity: Identity::from_pem(cert, key), ca, https })
    }
}

/// The `--tls-cert`, `--tls-key` and `--tls-ca` flags (env `STRATA_TLS_CERT`, `STRATA_TLS_KEY`, `STRATA_TLS_CA`, as
/// the Helm chart sets them), shared by every binary.
#[cfg(feature = "clap")]
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsArgs {
    /// PEM certificate chain this process serves TLS with and presents as a TLS client (needs --tls-key).
    #[arg(long, env = "STRATA_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "STRATA_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: gRPC peers must present a certificate it signed, and servers' certificates must chain to it
    /// (mutual TLS; the HTTP API never asks clients for one). Without it the web PKI roots are trusted.
    #[arg(long, env = "STRATA_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

#[cfg(feature = "clap")]
impl TlsArgs {
    /// The files named, `None` when none is; a key without a certificate (or the reverse, or a CA alone) is an error.
    pub fn files(&self) -> Result<Option<TlsFiles>> {
        TlsFiles::from_parts(self.tls_cert.clone(), self.tls_key.clone(), self.tls_ca.clone())
    }
}

/// Reads the PEM file at `path`, which must hold a `kind` block (`CERTIFICATE`, `PRIVATE KEY`); errors name the file.
/// Also what the etcd client's TLS files are read with.
pub fn read_pem(path: &Path, kind: &str) -> Result<Vec<u8>> {
    let pem = std::fs::read(path).map_err(|e| ProtoError::Tls(format!("reading {}: {e}", path.display())))?;
    // "PRIVATE KEY" also matches "RSA PRIVATE KEY" and "EC PRIVATE KEY" headers.
    if !String::from_utf8_lossy(&pem).contains(&format!("{kind}-----")) {
        return Err(ProtoError::Tls(format!("{} holds no PEM {kind}", path.display())));
    }
    Ok(pem)
}

/// Every certificate in `pem` (read from `path`), at least one.
fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let bad = |e: &dyn std::fmt::Display| ProtoError::Tls(format!("{}: bad PEM CERTIFICATE: {e}", path.display()));
    let certs = CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>().map_err(|e| bad(&e))?;
    if certs.is_empty() {
        return Err(bad(&"none found"));
    }
    Ok(certs)
}

/// The HTTP API's server side: this node's certificate, no client certificate asked for (users' HTTP clients have
/// none), HTTP/1.1 offered in ALPN. ring, the provider tonic uses too.
fn https_server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Loaded TLS material, cheap to clone into every server and client.
#[derive(Clone)]
pub struct Tls {
    identity: Identity,
    ca: Option<Certificate>,
    https: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for Tls {
    // tonic's `Identity` prints its private key; never let a log line do that.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("mutual", &self.ca.is_some()).finish_non_exhaustive()
    }
}

impl Tls {
    /// The gRPC server side: this node's identity, and with a CA, a required client certificate signed by it.
    pub fn server_config(&self) -> ServerTlsConfig {
        let config = ServerTlsConfig::new().identity(self.identity.clone());
        match &self.ca {
            Some(ca) => config.client_ca_root(ca.clone()),
            None => config,
        }
    }

    /// The HTTP server side: this node's certificate and no client certificate, even with a CA (the OpenAI API's
    /// clients have none).
    pub fn https_server_config(&self) -> Arc<rustls::ServerConfig> {
        self.https.clone()
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

/// A gRPC server builder, serving TLS with `tls`'s [`Tls::server_config`] when given.
pub fn server(tls: Option<&Tls>) -> Result<Server> {
    let builder = Server::builder();
    match tls {
        Some(tls) => {
            builder.tls_config(tls.server_config()).map_err(|e| ProtoError::Tls(format!("server config: {e}")))
        }
        None => Ok(builder),
    }
}

/// A gRPC endpoint for `address` (`host:port`, `http://...` or `https://...`). With `tls` it is always TLS with
/// that client config; without, an `https://` address is TLS trusting the web PKI roots (no client certificate)
/// and anything else is plaintext.
pub fn endpoint(address: &str, tls: Option<&Tls>) -> Result<Endpoint> {
    let address = address.trim();
    let rest = address.split_once("://").map_or(address, |(_, rest)| rest);
    let https = tls.is_some() || address.starts_with("https://");
    let uri = format!("{}://{rest}", if https { "https" } else { "http" });
    let endpoint = Endpoint::from_shared(uri).map_err(|e| ProtoError::Address(format!("{address:?}: {e}")))?;
    let host = host_of(address);
    let config = match tls {
        Some(tls) => tls.client_config(host),
        None if https => ClientTlsConfig::new().domain_name(host).with_webpki_roots(),
        None => return Ok(endpoint),
    };
    endpoint.tls_config(config).map_err(|e| ProtoError::Tls(format!("client config for {address}: {e}")))
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
        let err = TlsFiles::from_parts(Some("c".into()), None, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("no key") && err.contains("--tls-key"), "{err}");
        assert!(TlsFiles::from_parts(None, Some("k".into()), None).is_err());
        assert!(TlsFiles::from_parts(None, None, Some("ca".into())).is_err());
        Ok(())
    }

    /// A throwaway directory for PEM files.
    fn scratch(name: &str) -> Result<PathBuf> {
        let dir = std::env::temp_dir().join(format!("strata-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| ProtoError::Tls(e.to_string()))?;
        Ok(dir)
    }

    fn write(path: &Path, text: &str) -> Result<()> {
        std::fs::write(path, text).map_err(|e| ProtoError::Tls(e.to_string()))
    }

    /// A self-signed certificate for `localhost` and its key, as PEM.
    fn self_signed() -> Result<(String, String)> {
        let key = rcgen::KeyPair::generate().map_err(|e| ProtoError::Tls(e.to_string()))?;
        let params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).map_err(|e| ProtoError::Tls(e.to_string()))?;
        let cert = params.self_signed(&key).map_err(|e| ProtoError::Tls(e.to_string()))?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    #[test]
    fn missing_and_non_pem_files_are_named() -> Result<()> {
        let dir = scratch("junk")?;
        let junk = dir.join("junk.pem");
        write(&junk, "not a pem")?;
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
    fn a_real_pair_loads_and_a_foreign_key_or_bad_ca_is_named() -> Result<()> {
        let dir = scratch("pair")?;
        let (cert, key) = self_signed()?;
        let (_, other_key) = self_signed()?;
        let (cert_path, key_path, other_path) = (dir.join("node.crt"), dir.join("node.key"), dir.join("other.key"));
        write(&cert_path, &cert)?;
        write(&key_path, &key)?;
        write(&other_path, &other_key)?;
        let files = TlsFiles { cert: cert_path.clone(), key: key_path.clone(), ca: Some(cert_path.clone()) };
        let tls = files.load()?;
        assert_eq!(tls.https_server_config().alpn_protocols, vec![b"http/1.1".to_vec()]);
        assert_eq!(format!("{tls:?}"), "Tls { mutual: true, .. }", "Debug must not print the key");
        let mismatched = TlsFiles { key: other_path, ..files.clone() };
        let err = mismatched.load().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("node.crt") && err.contains("other.key"), "{err}");
        let bad_ca = TlsFiles { ca: Some(key_path), ..files };
        let err = bad_ca.load().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("node.key") && err.contains("CERTIFICATE"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn files_deserialize_strictly() {
        let files: Option<TlsFiles> = serde_json::from_str(r#"{"cert":"c","key":"k"}"#).ok();
        assert_eq!(files, Some(TlsFiles { cert: "c".into(), key: "k".into(), ca: None }));
        assert!(serde_json::from_str::<TlsFiles>(r#"{"cert":"c"}"#).is_err(), "a key is required");
        assert!(serde_json::from_str::<TlsFiles>(r#"{"cert":"c","key":"k","cacert":"x"}"#).is_err());
    }

    #[test]
    fn endpoints_are_tls_when_asked_or_https() -> Result<()> {
        assert_eq!(endpoint("h:1", None)?.uri().to_string(), "http://h:1/");
        assert_eq!(endpoint("http://h:1", None)?.uri().scheme_str(), Some("http"));
        assert_eq!(endpoint("https://h:1", None)?.uri().scheme_str(), Some("https"));
        assert!(endpoint("h :1", None).is_err());
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
