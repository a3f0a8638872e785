//! Dialling a coordinator: an `http://` URL in plaintext, an `https://` one over TLS presenting --tls-cert/--tls-key
//! and trusting --tls-ca (env `STRATA_TLS_*`, as the Helm chart sets them), or trusting the web PKI roots when no
//! TLS files are given. With `--api-key` (env `STRATA_API_KEY`) every call carries `authorization: Bearer <key>`.

use anyhow::{Context, Result};
use strata_proto::TlsArgs;
use strata_proto::pb::coordinator_client::CoordinatorClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// A coordinator client that sends its [`Credentials`] with every call.
pub type Client = CoordinatorClient<InterceptedService<Channel, Credentials>>;

/// `--api-key`: what the CLI presents to a coordinator that requires API keys.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ApiKeyArgs {
    /// API key sent as `authorization: Bearer <key>` (of a comma-separated list, as the coordinator's
    /// STRATA_API_KEY may hold, the first); drain, cordon and uncordon need an admin key.
    #[arg(long = "api-key", env = "STRATA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

impl ApiKeyArgs {
    /// The credentials to send (none without a key).
    pub fn credentials(&self) -> Result<Credentials> {
        let key = self.api_key.as_deref().and_then(|k| k.split(',').map(str::trim).find(|k| !k.is_empty()));
        if key.is_some_and(|k| !k.bytes().all(|b| b.is_ascii_graphic())) {
            anyhow::bail!("--api-key must be printable ASCII without spaces, as the coordinator's keys are");
        }
        let value = key.map(|k| MetadataValue::try_from(format!("Bearer {k}"))).transpose().context("--api-key")?;
        Ok(Credentials(value))
    }
}

/// The `authorization` metadata added to every call (nothing when empty).
#[derive(Clone, Debug, Default)]
pub struct Credentials(Option<MetadataValue<Ascii>>);

impl Interceptor for Credentials {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// The endpoint of the coordinator at `url`. The TLS files are read (and checked) only for an `https://` URL; an
/// `http://` one stays plaintext whatever they say.
pub fn endpoint(url: &str, tls: &TlsArgs) -> Result<Endpoint> {
    let tls = match tls.files()? {
        Some(files) if url.trim_start().starts_with("https://") => Some(files.load()?),
        _ => None,
    };
    strata_proto::endpoint(url, tls.as_ref()).with_context(|| format!("coordinator URL {url:?}"))
}

/// Connects a `Coordinator` client to `endpoint`, presenting no API key.
pub async fn connect(endpoint: &Endpoint) -> Result<Client> {
    connect_as(endpoint, &Credentials::default()).await
}

/// Connects a `Coordinator` client to `endpoint` that presents `credentials` with every call.
pub async fn connect_as(endpoint: &Endpoint, credentials: &Credentials) -> Result<Client> {
    Ok(CoordinatorClient::with_interceptor(endpoint.connect().await?, credentials.clone()))
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

    #[test]
    fn the_api_key_goes_into_the_authorization_metadata() -> Result<()> {
        let sent = |key: Option<&str>| -> Result<Option<String>> {
            let mut credentials = ApiKeyArgs { api_key: key.map(str::to_owned) }.credentials()?;
            let request = credentials.call(tonic::Request::new(()))?;
            Ok(request.metadata().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned))
        };
        assert_eq!(sent(None)?, None);
        assert_eq!(sent(Some("k1"))?.as_deref(), Some("Bearer k1"));
        assert_eq!(sent(Some(" k1 , k2"))?.as_deref(), Some("Bearer k1"), "the first of a list");
        assert_eq!(sent(Some(""))?, None);
        assert!(sent(Some("k\u{e9}")).is_err(), "not ASCII");
        assert!(sent(Some("a b")).is_err(), "a space inside the key");
        Ok(())
    }
}
