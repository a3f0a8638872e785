//! Dialling a coordinator: an `http://` URL in plaintext, an `https://` one over TLS presenting --tls-cert/--tls-key
//! and trusting --tls-ca (env `STRATA_TLS_*`, as the Helm chart sets them), or trusting the web PKI roots when no
//! TLS files are given.

use anyhow::{Context, Result};
use strata_proto::TlsArgs;
use strata_proto::pb::coordinator_client::CoordinatorClient;
use tonic::transport::{Channel, Endpoint};

/// The endpoint of the coordinator at `url`. The TLS files are read (and checked) only for an `https://` URL; an
/// `http://` one stays plaintext whatever they say.
pub fn endpoint(url: &str, tls: &TlsArgs) -> Result<Endpoint> {
    let tls = match tls.files()? {
        Some(files) if url.trim_start().starts_with("https://") => Some(files.load()?),
        _ => None,
    };
    strata_proto::endpoint(url, tls.as_ref()).with_context(|| format!("coordinator URL {url:?}"))
}

/// Connects a `Coordinator` client to `endpoint`.
pub async fn connect(endpoint: &Endpoint) -> Result<CoordinatorClient<Channel>> {
    Ok(CoordinatorClient::new(endpoint.connect().await?))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn tls(cert: Option<&str>, key: Option<&str>, ca: Option<&str>) -> TlsArgs {
        TlsArgs { tls_cert: cert.map(PathBuf::from), tls_key: key.map(PathBuf::from), tls_ca: ca.map(PathBuf::from) }
    }

    #[test]
    fn the_url_scheme_decides_and_files_are_only_read_for_https() -> Result<()> {
        let none = TlsArgs::default();
        assert_eq!(endpoint("http://h:1", &none)?.uri().scheme_str(), Some("http"));
        assert_eq!(endpoint("https://h:1", &none)?.uri().scheme_str(), Some("https"));
        let missing = tls(Some("/nope/c.pem"), Some("/nope/k.pem"), None);
        assert_eq!(endpoint("http://h:1", &missing)?.uri().scheme_str(), Some("http"), "plaintext ignores the files");
        let err = endpoint("https://h:1", &missing).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(err.contains("/nope/c.pem"), "{err}");
        let half = endpoint("https://h:1", &tls(Some("/c.pem"), None, None)).err().map(|e| format!("{e:#}"));
        assert!(half.as_deref().is_some_and(|e| e.contains("--tls-key")), "{half:?}");
        Ok(())
    }
}
