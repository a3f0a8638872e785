//! How to reach etcd: its endpoints and, for a secured etcd, the TLS files (the CA that signs etcd's certificate,
//! a client certificate when etcd asks for one) and the user to authenticate as. The one place these are checked
//! and turned into etcd-client's options, and the `--etcd-ca`, `--etcd-cert`, `--etcd-key`,
//! `--etcd-user` and `--etcd-password-file` flags every binary shares.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use serde::{Deserialize, Serialize};
use strata_proto::tls::read_pem;

use crate::cluster::{check_endpoints, parse_endpoints};
use crate::{Error, Result};

/// The env var that may hold the etcd password itself (the chart fills it from a Secret). There is no flag for
/// it: a password on the command line shows in `ps`.
pub const PASSWORD_ENV: &str = "STRATA_ETCD_PASSWORD";

/// Where etcd is and how to get in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdOptions {
    /// Client URLs, `http://host:2379` or (with `tls`) `https://host:2379`.
    pub endpoints: Vec<String>,
    /// TLS towards etcd; required exactly when the endpoints are `https://`.
    #[serde(default)]
    pub tls: Option<EtcdTls>,
    /// The etcd user to authenticate as, when etcd has auth enabled.
    #[serde(default)]
    pub user: Option<EtcdUser>,
}

/// PEM files for TLS towards etcd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdTls {
    /// The CA bundle etcd's server certificate must chain to.
    pub ca: PathBuf,
    /// A client certificate (for etcd's `--client-cert-auth`); needs `key`.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// The private key of `cert`.
    #[serde(default)]
    pub key: Option<PathBuf>,
}

/// An etcd user and its password.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdUser {
    /// The user name.
    pub name: String,
    /// Its password.
    pub password: EtcdPassword,
}

/// A password that never prints.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EtcdPassword(String);

impl fmt::Debug for EtcdPassword {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EtcdPassword(<redacted>)")
    }
}

impl EtcdPassword {
    /// A password.
    pub fn new(password: impl Into<String>) -> Self {
        Self(password.into())
    }

    /// The password in `path`, less a trailing newline (files written with `echo` have one, Secrets usually not).
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::EtcdCredentials(format!("reading the password file {}: {e}", path.display())))?;
        Ok(Self(text.trim_end_matches(['\n', '\r']).to_owned()))
    }

    /// The password itself, for the etcd client.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// [`PASSWORD_ENV`]'s value; `None` when unset or empty.
    pub fn from_env() -> Option<Self> {
        std::env::var(PASSWORD_ENV).ok().filter(|p| !p.is_empty()).map(Self)
    }
}

impl EtcdOptions {
    /// Plaintext, unauthenticated access to `endpoints`.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self { endpoints, tls: None, user: None }
    }

    /// Checks the settings fit together (reading no file): valid endpoints, TLS exactly for `https://` ones, a
    /// client certificate with its key, a user with a name and a password.
    pub fn check(&self) -> Result<()> {
        check_endpoints(&self.endpoints)?;
        let with_scheme = |scheme: &str| self.endpoints.iter().find(|e| e.starts_with(scheme)).cloned();
        match &self.tls {
            None => {
                if let Some(e) = with_scheme("https://") {
                    return Err(Error::EtcdTls(format!(
                        "endpoint {e} is https: give the CA that signs etcd's certificate (--etcd-ca, STRATA_ETCD_CA)"
                    )));
                }
            }
            Some(tls) => {
                if let Some(e) = with_scheme("http://") {
                    return Err(Error::EtcdTls(format!(
                        "an etcd CA is given but endpoint {e} is plaintext: use https:// (or drop --etcd-ca)"
                    )));
                }
                if tls.cert.is_some() != tls.key.is_some() {
                    return Err(Error::EtcdTls(
                        "a client certificate needs its key: give both --etcd-cert and --etcd-key".into(),
                    ));
                }
            }
        }
        match &self.user {
            Some(user) if user.name.trim().is_empty() => Err(Error::EtcdCredentials("the user name is empty".into())),
            Some(user) if user.password.expose().is_empty() => {
                Err(Error::EtcdCredentials(format!("user {:?} has an empty password", user.name)))
            }
            _ => Ok(()),
        }
    }

    /// etcd-client's options for these settings: checked, TLS files read (errors name the file), the user set, and
    /// timeouts and keep-alives as strata uses them everywhere.
    pub(crate) fn connect_options(&self) -> Result<ConnectOptions> {
        self.check()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(2));
        if let Some(tls) = &self.tls {
            options = options.with_tls(tls.load()?);
        }
        if let Some(user) = &self.user {
            // etcd's tokens expire (5 minutes idle by default); a long-running process must log in again.
            options = options.with_user(&user.name, user.password.expose()).with_auto_token_refresh(true);
        }
        Ok(options)
    }

    /// What the logs say about this access (never the password).
    pub(crate) fn describe(&self) -> String {
        let mut text = self.endpoints.join(",");
        if let Some(tls) = &self.tls {
            text.push_str(if tls.cert.is_some() { " (TLS, client certificate)" } else { " (TLS)" });
        }
        if let Some(user) = &self.user {
            text.push_str(&format!(" as user {:?}", user.name));
        }
        text
    }
}

impl EtcdTls {
    /// Reads the files into a client TLS config. The server name checked is each endpoint's host.
    fn load(&self) -> Result<TlsOptions> {
        let read = |path: &Path, kind| read_pem(path, kind).map_err(|e| Error::EtcdTls(e.to_string()));
        let config = TlsOptions::new().ca_certificate(Certificate::from_pem(read(&self.ca, "CERTIFICATE")?));
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                Ok(config.identity(Identity::from_pem(read(cert, "CERTIFICATE")?, read(key, "PRIVATE KEY")?)))
            }
            _ => Ok(config),
        }
    }
}

/// The etcd security flags (each with its env fallback, as the Helm chart sets them), shared by every binary that
/// talks to etcd. The endpoints flag itself stays with each binary, whose help says what omitting it means.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdArgs {
    /// PEM CA bundle that signs etcd's server certificate: talk to etcd over TLS (bare host:port endpoints become
    /// https://).
    #[arg(long, env = "STRATA_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// PEM client certificate presented to etcd (for etcd's --client-cert-auth); needs --etcd-key and --etcd-ca.
    #[arg(long, env = "STRATA_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, env = "STRATA_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user to authenticate as (etcd with auth enabled); its password comes from --etcd-password-file or the
    /// STRATA_ETCD_PASSWORD env var, never from the command line.
    #[arg(long, env = "STRATA_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding --etcd-user's password (a trailing newline is ignored).
    #[arg(long, env = "STRATA_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// The password from STRATA_ETCD_PASSWORD: env only, as a flag would show in `ps`.
    #[arg(skip = EtcdPassword::from_env())]
    pub etcd_password: Option<EtcdPassword>,
}

impl EtcdArgs {
    /// The etcd access for the endpoint list `endpoints` (the binary's `--etcd`); `None` when it is absent or
    /// blank, which is an error if any etcd security flag is given. Reads the password file; the TLS files are read
    /// when connecting.
    pub fn options(&self, endpoints: Option<&str>) -> Result<Option<EtcdOptions>> {
        let Some(list) = endpoints.filter(|l| !l.trim().is_empty()) else {
            let given = self.etcd_ca.is_some()
                || self.etcd_cert.is_some()
                || self.etcd_key.is_some()
                || self.etcd_user.is_some()
                || self.etcd_password_file.is_some();
            if given {
                return Err(Error::EtcdFlagsWithoutEndpoints);
            }
            return Ok(None);
        };
        let tls = match (&self.etcd_ca, &self.etcd_cert, &self.etcd_key) {
            (None, None, None) => None,
            (Some(ca), cert, key) => Some(EtcdTls { ca: ca.clone(), cert: cert.clone(), key: key.clone() }),
            (None, _, _) => {
                return Err(Error::EtcdTls(
                    "--etcd-cert and --etcd-key need --etcd-ca, the CA that signs etcd's certificate".into(),
                ));
            }
        };
        let password = match (&self.etcd_password_file, &self.etcd_password) {
            (Some(_), Some(_)) => {
                return Err(Error::EtcdCredentials(format!(
                    "both --etcd-password-file and {PASSWORD_ENV} are set; use one"
                )));
            }
            (Some(file), None) => Some(EtcdPassword::read(file)?),
            (None, password) => password.clone(),
        };
        let user = match (&self.etcd_user, password) {
            (Some(name), Some(password)) => Some(EtcdUser { name: name.clone(), password }),
            (None, None) => None,
            (Some(name), None) => {
                return Err(Error::EtcdCredentials(format!(
                    "--etcd-user {name:?} needs a password: --etcd-password-file (STRATA_ETCD_PASSWORD_FILE) or \
                     {PASSWORD_ENV}"
                )));
            }
            (None, Some(_)) => {
                return Err(Error::EtcdCredentials("an etcd password is given without --etcd-user".into()));
            }
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let options = EtcdOptions { endpoints: parse_endpoints(list, scheme)?, tls, user };
        options.check()?;
        Ok(Some(options))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn tls(cert: bool) -> EtcdTls {
        let path = |p: &str| cert.then(|| PathBuf::from(p));
        EtcdTls { ca: "/ca.pem".into(), cert: path("/c.pem"), key: path("/k.pem") }
    }

    #[test]
    fn tls_goes_with_https_and_a_certificate_with_its_key() {
        let err = |o: &EtcdOptions| o.check().err().map(|e| e.to_string()).unwrap_or_default();
        let https = EtcdOptions::new(vec!["https://e:2379".into()]);
        assert!(err(&https).contains("--etcd-ca"), "{}", err(&https));
        let with_ca = EtcdOptions { tls: Some(tls(true)), ..https.clone() };
        assert!(with_ca.check().is_ok());
        let mixed = EtcdOptions { endpoints: vec!["https://a:1".into(), "http://b:1".into()], ..with_ca.clone() };
        assert!(err(&mixed).contains("http://b:1") && err(&mixed).contains("https://"), "{}", err(&mixed));
        let no_key = EtcdOptions { tls: Some(EtcdTls { key: None, ..tls(true) }), ..https };
        assert!(err(&no_key).contains("--etcd-key"), "{}", err(&no_key));
    }

    #[test]
    fn users_need_a_name_and_a_password_that_never_prints() {
        let user = |name: &str, password: &str| EtcdOptions {
            user: Some(EtcdUser { name: name.into(), password: EtcdPassword::new(password) }),
            ..EtcdOptions::new(vec!["http://e:2379".into()])
        };
        assert!(user("root", "s3cret").check().is_ok());
        assert!(matches!(user("", "s3cret").check(), Err(Error::EtcdCredentials(_))));
        assert!(matches!(user("root", "").check(), Err(Error::EtcdCredentials(_))));
        let shown = format!("{:?} {}", user("root", "s3cret"), user("root", "s3cret").describe());
        assert!(!shown.contains("s3cret") && shown.contains("root"), "{shown}");
    }

    #[test]
    fn tls_files_are_named_when_unreadable() {
        let options = EtcdOptions { tls: Some(tls(false)), ..EtcdOptions::new(vec!["https://e:2379".into()]) };
        let err = options.connect_options().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("/ca.pem"), "{err}");
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        etcd: EtcdArgs,
    }

    fn parse(args: &[&str]) -> EtcdArgs {
        let mut etcd = Cli::parse_from([&["test"][..], args].concat()).etcd;
        // The tests must not depend on the environment they run in.
        etcd.etcd_password = None;
        etcd
    }

    #[test]
    fn flags_make_options_and_bad_combinations_are_named() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("password");
        std::fs::write(&file, "s3cret\n")?;
        let file = file.to_str().unwrap_or_default();
        let plain = parse(&[]).options(Some("a:2379"))?;
        assert_eq!(plain, Some(EtcdOptions::new(vec!["http://a:2379".into()])));
        assert_eq!(parse(&[]).options(None)?, None);
        let secure = parse(&["--etcd-ca", "/ca", "--etcd-cert", "/c", "--etcd-key", "/k"]);
        let secure = secure.options(Some("a:2379,https://b:2379"))?.map(|o| o.endpoints);
        assert_eq!(secure, Some(vec!["https://a:2379".to_owned(), "https://b:2379".to_owned()]));
        let user = parse(&["--etcd-user", "root", "--etcd-password-file", file]).options(Some("a:1"))?;
        let user = user.and_then(|o| o.user);
        assert_eq!(user, Some(EtcdUser { name: "root".into(), password: EtcdPassword::new("s3cret") }));

        let err = |args: &[&str], list: Option<&str>| {
            parse(args).options(list).err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(err(&["--etcd-user", "root"], Some("a:1")).contains("needs a password"));
        assert!(err(&["--etcd-cert", "/c", "--etcd-key", "/k"], Some("a:1")).contains("--etcd-ca"));
        assert!(err(&["--etcd-ca", "/ca"], Some("http://a:1")).contains("http://a:1"));
        assert!(err(&["--etcd-ca", "/ca"], None).contains("need --etcd"));
        assert!(err(&["--etcd-user", "u", "--etcd-password-file", "/nope"], Some("a:1")).contains("/nope"));
        let mut both = parse(&["--etcd-user", "u", "--etcd-password-file", file]);
        both.etcd_password = Some(EtcdPassword::new("x"));
        assert!(both.options(Some("a:1")).is_err_and(|e| e.to_string().contains("use one")));
        Ok(())
    }
}
