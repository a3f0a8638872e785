//! Dialling a coordinator: an `http://` URL in plaintext, an `https://` one over TLS presenting --tls-cert/--tls-key
//! and trusting --tls-ca (env `STRATA_TLS_*`, as the Helm chart sets them), or trusting the web PKI roots when no
//! TLS files are given.

use std::path::PathBuf;

use anyhow::{Context, Result};
use strata_proto::TlsFiles;
use strata_proto::pb::coordinator_client::CoordinatorClient;
use tonic::transport::{Channel, Endpoint};

/// The TLS flags of every command that talks to a coordinator.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TlsArgs {
    /// PEM client certificate for an https:// coordinator (required when it was started with a CA: mutual TLS).
    #[arg(long, env = "STRATA_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "STRATA_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA the coordinator's certificate must chain to (needs --tls-cert and --tls-key; without it the web PKI
    /// roots are trusted).
    #[arg(long, env = "STRATA_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The endpoint of the coordinator at `url`. The TLS files are read (and checked) only for an `https://` URL;
    /// an `http://` one stays plaintext whatever they say.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint> {
        let files = TlsFiles::from_parts(self.tls_cert.clone(), self.tls_key.clone(), self.tls_ca.clone())?;
        let tls = match files {
            Some(files) if url.trim_start().starts_with("https://") => Some(files.load()?),
            _ => None,
        };
        strata_proto::endpoint(url, tls.as_ref()).with_context(|| format!("coordinator URL {url:?}"))
    }
}

/// Connects a `Coordinator` client to `endpoint`.
pub async fn connect(endpoint: &Endpoint) -> Result<CoordinatorClient<Channel>> {
    Ok(CoordinatorClient::new(endpoint.connect().await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(cert: Option<&str>, key: Option<&str>, ca: Option<&str>) -> TlsArgs {
        TlsArgs { tls_cert: cert.map(PathBuf::from), tls_key: key.map(PathBuf::from), tls_ca: ca.map(PathBuf::from) }
    }

    #[test]
    fn the_url_scheme_decides_and_files_are_only_read_for_https() -> Result<()> {
        assert_eq!(TlsArgs::default().endpoint("http://h:1")?.uri().scheme_str(), Some("http"));
        assert_eq!(TlsArgs::default().endpoint("https://h:1")?.uri().scheme_str(), Some("https"));
        let missing = tls(Some("/nope/c.pem"), Some("/nope/k.pem"), None);
        assert_eq!(missing.endpoint("http://h:1")?.uri().scheme_str(), Some("http"), "plaintext ignores the files");
        let err = missing.endpoint("https://h:1").err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(err.contains("/nope/c.pem"), "{err}");
        let half = tls(Some("/c.pem"), None, None).endpoint("https://h:1").err().map(|e| format!("{e:#}"));
        assert!(half.as_deref().is_some_and(|e| e.contains("--tls-key")), "{half:?}");
        Ok(())
    }
}
