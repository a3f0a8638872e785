//! API keys and admin certificates: who may call the public APIs. With no key configured both APIs are open, as
//! before. With keys, every call must carry `Authorization: Bearer <key>` (HTTP header or gRPC metadata) except the
//! probes and introspection ([`Access::Open`]: `/health`, `/live`, `/metrics`, gRPC health and reflection), and the
//! calls that change the cluster (drain, cordon, uncordon) need an admin key. Keys are compared in constant time.
//!
//! Under mutual TLS a gRPC caller may instead prove it is an administrator with its client certificate: one the
//! cluster CA signed (the TLS handshake checked that) naming an admin identity (`--admin-cert-identity`) as its
//! subject common name or as a DNS or URI subject alternative name (a SPIFFE ID, say). Such a caller needs no key
//! for any call. Stage workers' own certificates carry other names, so they get no admin rights from them.
//!
//! The policy (which path needs what) is written once here for both APIs; the HTTP middleware
//! (`http::authorize`) and the gRPC layer ([`GrpcAuthLayer`]) only apply it, and the refusals become statuses in
//! the one error mapping (`api::service_error`, `http::errors`).

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, Request, Response, header};
use serde::{Deserialize, Serialize};
use strata_proto::COORDINATOR_SERVICE;
use subtle::ConstantTimeEq;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use x509_parser::extensions::GeneralName;

use crate::{Error, Result};

/// One API key. Its `Debug` never shows the key, so configs can be logged.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ApiKey(String);

impl ApiKey {
    /// A key; `ApiKey::check` says whether it is usable.
    pub fn new(key: impl Into<String>) -> Self {
        ApiKey(key.into())
    }

    /// The key as sent (`Bearer <key>`).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A key must be non-empty printable ASCII without spaces, so it fits an `Authorization` header as is.
    fn check(&self) -> std::result::Result<(), &'static str> {
        if self.0.is_empty() {
            return Err("is empty");
        }
        if !self.0.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("must be printable ASCII without spaces");
        }
        Ok(())
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Reads keys from a file, one per line; blank lines and lines starting with `#` are skipped, spaces around a key
/// are trimmed.
pub fn read_key_file(path: &std::path::Path) -> Result<Vec<ApiKey>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("cannot read API key file {}: {e}", path.display())))?;
    Ok(parse_keys(&text))
}

/// Keys in `text`, one per line (see [`read_key_file`]).
pub fn parse_keys(text: &str) -> Vec<ApiKey> {
    text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(ApiKey::new).collect()
}

/// Checks a list of keys (the config's `api_keys` or `admin_api_keys`), naming the list at fault.
pub fn check_keys(name: &str, keys: &[ApiKey]) -> Result<()> {
    for (i, key) in keys.iter().enumerate() {
        key.check().map_err(|why| Error::Config(format!("{name}[{i}] {why}")))?;
    }
    Ok(())
}

/// What a call needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Nothing: probes and introspection.
    Open,
    /// Any key, plain or admin.
    User,
    /// An admin key.
    Admin,
}

/// What an HTTP path needs: the probes and `/metrics` are open, everything else (unknown paths too) needs a key.
pub fn http_access(path: &str) -> Access {
    match path {
        "/health" | "/live" | "/metrics" => Access::Open,
        _ => Access::User,
    }
}

/// What a gRPC method (`/package.Service/Method`) needs: health and reflection are open, the node administration
/// calls need an admin key, everything else (unknown services too) a plain one.
pub fn grpc_access(path: &str) -> Access {
    let path = path.strip_prefix('/').unwrap_or(path);
    let (service, method) = path.split_once('/').unwrap_or((path, ""));
    match service {
        "grpc.health.v1.Health"
        | "grpc.reflection.v1.ServerReflection"
        | "grpc.reflection.v1alpha.ServerReflection" => Access::Open,
        s if s == COORDINATOR_SERVICE && matches!(method, "DrainNode" | "CordonNode" | "UncordonNode") => Access::Admin,
        _ => Access::User,
    }
}

/// Checks a list of admin certificate identities: each a non-empty name without spaces or control characters.
pub fn check_identities(identities: &[String]) -> Result<()> {
    for (i, name) in identities.iter().enumerate() {
        if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(Error::Config(format!(
                "admin_cert_identities[{i}] {name:?} must be a non-empty name without spaces"
            )));
        }
    }
    Ok(())
}

/// The names a DER certificate is known by: its subject common names and its DNS and URI subject alternative
/// names. A certificate that does not parse has none.
pub fn certificate_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else { return Vec::new() };
    let mut names: Vec<String> =
        cert.subject().iter_common_name().filter_map(|cn| cn.as_str().ok()).map(str::to_owned).collect();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                GeneralName::DNSName(n) | GeneralName::URI(n) => names.push((*n).to_owned()),
                _ => {}
            }
        }
    }
    names
}

/// The keys and admin certificate identities the coordinator accepts. None: the APIs are open.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    user: Vec<ApiKey>,
    admin: Vec<ApiKey>,
    admin_identities: Vec<String>,
}

impl ApiKeys {
    /// Plain keys (`user`) and admin keys (`admin`; they also work as plain keys).
    pub fn new(user: Vec<ApiKey>, admin: Vec<ApiKey>) -> Self {
        ApiKeys { user, admin, admin_identities: Vec::new() }
    }

    /// These keys, and admin rights for gRPC callers whose verified client certificate names one of `identities`.
    pub fn with_admin_identities(self, identities: Vec<String>) -> Self {
        ApiKeys { admin_identities: identities, ..self }
    }

    /// Whether any key is set (so calls must present one).
    pub fn enabled(&self) -> bool {
        !self.user.is_empty() || !self.admin.is_empty()
    }

    /// Whether a call that needs `need` is allowed with the `Authorization` header in `headers` and, on gRPC under
    /// mutual TLS, the names of the caller's verified client certificate (`peer_names`). Admin calls are guarded as
    /// soon as keys or admin identities are set; the rest only by keys.
    pub fn check(&self, headers: &HeaderMap, peer_names: &[String], need: Access) -> Result<()> {
        let guarded = match need {
            Access::Open => false,
            Access::User => self.enabled(),
            Access::Admin => self.enabled() || !self.admin_identities.is_empty(),
        };
        if !guarded || peer_names.iter().any(|n| self.admin_identities.contains(n)) {
            return Ok(());
        }
        let missing = if self.admin_identities.is_empty() {
            "missing API key: send the header `Authorization: Bearer <key>`"
        } else {
            "missing API key: send the header `Authorization: Bearer <key>`, or present a client certificate with an admin identity"
        };
        let presented = bearer(headers).ok_or_else(|| Error::Unauthenticated(missing.into()))?;
        let admin = any_matches(&self.admin, presented);
        // Both lists are always compared, so the time taken does not say which list a key is in.
        let user = any_matches(&self.user, presented);
        match need {
            Access::Admin if admin => Ok(()),
            Access::Admin if user => {
                Err(Error::PermissionDenied("this call changes the cluster and needs an admin API key".into()))
            }
            Access::User if admin || user => Ok(()),
            _ => Err(Error::Unauthenticated("incorrect API key provided".into())),
        }
    }
}

/// The key of an `Authorization: Bearer <key>` header (scheme case-insensitive).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, key) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| key.trim_ascii())
}

/// Whether `presented` is one of `keys`, comparing every key in constant time (only the lengths can be told apart).
fn any_matches(keys: &[ApiKey], presented: &[u8]) -> bool {
    let found = keys.iter().fold(subtle::Choice::from(0), |found, key| found | key.0.as_bytes().ct_eq(presented));
    found.into()
}

/// A tower layer for the gRPC server that refuses calls [`ApiKeys`] does not allow with `UNAUTHENTICATED` or
/// `PERMISSION_DENIED`, before any service sees them.
#[derive(Debug, Clone)]
pub struct GrpcAuthLayer {
    keys: Arc<ApiKeys>,
}

impl GrpcAuthLayer {
    /// A layer checking calls against `keys`.
    pub fn new(keys: Arc<ApiKeys>) -> Self {
        GrpcAuthLayer { keys }
    }
}

impl<S> tower_layer::Layer<S> for GrpcAuthLayer {
    type Service = GrpcAuth<S>;

    fn layer(&self, inner: S) -> GrpcAuth<S> {
        GrpcAuth { inner, keys: self.keys.clone() }
    }
}

/// The service [`GrpcAuthLayer`] wraps around the gRPC routes.
#[derive(Debug, Clone)]
pub struct GrpcAuth<S> {
    inner: S,
    keys: Arc<ApiKeys>,
}

impl<S, B> tonic::codegen::Service<Request<B>> for GrpcAuth<S>
where
    S: tonic::codegen::Service<Request<B>, Response = Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures_util::future::Either<std::future::Ready<Result<Self::Response, Self::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The names of the end-entity certificate the TLS handshake verified against the cluster CA, parsed only
        // when admin identities are configured: every call passes here, generation included.
        let names = if self.keys.admin_identities.is_empty() {
            Vec::new()
        } else {
            let peer = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>().and_then(TlsConnectInfo::peer_certs);
            peer.as_ref().and_then(|chain| chain.first()).map(|c| certificate_names(c)).unwrap_or_default()
        };
        match self.keys.check(req.headers(), &names, grpc_access(req.uri().path())) {
            Ok(()) => futures_util::future::Either::Right(self.inner.call(req)),
            Err(e) => {
                let status = tonic::Status::from(crate::api::service_error(&e));
                futures_util::future::Either::Left(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = authorization.and_then(|v| HeaderValue::from_str(v).ok()) {
            h.insert(header::AUTHORIZATION, v);
        }
        h
    }

    fn keys() -> ApiKeys {
        ApiKeys::new(vec![ApiKey::new("user-1"), ApiKey::new("user-2")], vec![ApiKey::new("admin-1")])
    }

    fn code(r: Result<()>) -> &'static str {
        match r {
            Ok(()) => "ok",
            Err(Error::Unauthenticated(_)) => "unauthenticated",
            Err(Error::PermissionDenied(_)) => "permission_denied",
            Err(_) => "other",
        }
    }

    #[test]
    fn keys_are_checked_by_what_the_call_needs() {
        let k = keys();
        let cases = [
            (None, Access::User, "unauthenticated"),
            (Some("Bearer nope"), Access::User, "unauthenticated"),
            (Some("Bearer user-1x"), Access::User, "unauthenticated"),
            (Some("Basic user-1"), Access::User, "unauthenticated"),
            (Some("Bearer "), Access::User, "unauthenticated"),
            (Some("Bearer user-2"), Access::User, "ok"),
            (Some("bearer user-1"), Access::User, "ok"),
            (Some("Bearer admin-1"), Access::User, "ok"),
            (Some("Bearer user-1"), Access::Admin, "permission_denied"),
            (Some("Bearer nope"), Access::Admin, "unauthenticated"),
            (None, Access::Admin, "unauthenticated"),
            (Some("Bearer admin-1"), Access::Admin, "ok"),
            (None, Access::Open, "ok"),
        ];
        for (auth, need, want) in cases {
            assert_eq!(code(k.check(&headers(auth), &[], need)), want, "{auth:?} {need:?}");
        }
        let open = ApiKeys::default();
        assert_eq!(code(open.check(&headers(None), &[], Access::Admin)), "ok", "no keys: open");
        let admin_only = ApiKeys::new(Vec::new(), vec![ApiKey::new("a")]);
        assert_eq!(code(admin_only.check(&headers(None), &[], Access::User)), "unauthenticated");
    }

    #[test]
    fn an_admin_certificate_identity_stands_in_for_the_admin_key() {
        let names = |n: &[&str]| n.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let k = keys().with_admin_identities(names(&["ops-admin", "spiffe://strata/admin"]));
        let admin_cert = names(&["someone", "ops-admin"]);
        let spiffe = names(&["spiffe://strata/admin"]);
        let node_cert = names(&["strata node", "localhost"]);
        let cases = [
            (None, &admin_cert, Access::Admin, "ok"),
            (None, &spiffe, Access::Admin, "ok"),
            (None, &admin_cert, Access::User, "ok"),
            (None, &node_cert, Access::Admin, "unauthenticated"),
            (None, &node_cert, Access::User, "unauthenticated"),
            (Some("Bearer user-1"), &node_cert, Access::Admin, "permission_denied"),
            (Some("Bearer admin-1"), &node_cert, Access::Admin, "ok"),
        ];
        for (auth, peer, need, want) in cases {
            assert_eq!(code(k.check(&headers(auth), peer, need)), want, "{auth:?} {peer:?} {need:?}");
        }
        // Identities without keys guard only the admin calls.
        let certs_only = ApiKeys::default().with_admin_identities(names(&["ops-admin"]));
        assert_eq!(code(certs_only.check(&headers(None), &node_cert, Access::User)), "ok");
        assert_eq!(code(certs_only.check(&headers(None), &node_cert, Access::Admin)), "unauthenticated");
        assert_eq!(code(certs_only.check(&headers(None), &admin_cert, Access::Admin)), "ok");
        assert!(check_identities(&names(&["ops-admin", "spiffe://x/y"])).is_ok());
        assert!(check_identities(&names(&["ok", "has space"])).is_err_and(|e| e.to_string().contains("[1]")));
        assert!(check_identities(&names(&[""])).is_err());
    }

    #[test]
    fn certificate_names_are_the_common_name_and_dns_and_uri_alternative_names() -> anyhow::Result<()> {
        let mut params = rcgen::CertificateParams::new(vec!["admin.example".to_owned(), "10.0.0.1".to_owned()])?;
        params.distinguished_name.push(rcgen::DnType::CommonName, "ops-admin");
        params.subject_alt_names.push(rcgen::SanType::URI("spiffe://strata/admin".try_into()?));
        let cert = params.self_signed(&rcgen::KeyPair::generate()?)?;
        let names = certificate_names(cert.der());
        assert_eq!(names, ["ops-admin", "admin.example", "spiffe://strata/admin"], "an IP address is no name");
        assert!(certificate_names(b"not a certificate").is_empty());
        Ok(())
    }

    #[test]
    fn the_policy_opens_probes_and_introspection_and_guards_cluster_changes() {
        assert_eq!(http_access("/health"), Access::Open);
        assert_eq!(http_access("/metrics"), Access::Open);
        assert_eq!(http_access("/v1/completions"), Access::User);
        assert_eq!(http_access("/nope"), Access::User);
        assert_eq!(grpc_access("/grpc.health.v1.Health/Check"), Access::Open);
        assert_eq!(grpc_access("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"), Access::Open);
        assert_eq!(grpc_access("/strata.v1.Coordinator/Generate"), Access::User);
        assert_eq!(grpc_access("/strata.v1.Coordinator/ClusterStatus"), Access::User);
        for m in ["DrainNode", "CordonNode", "UncordonNode"] {
            assert_eq!(grpc_access(&format!("/strata.v1.Coordinator/{m}")), Access::Admin, "{m}");
        }
        assert_eq!(grpc_access("/other.Service/DrainNode"), Access::User);
    }

    #[test]
    fn key_files_skip_blanks_and_comments_and_bad_keys_are_named() {
        let keys = parse_keys("# team a\n key-a \n\nkey-b\n");
        assert_eq!(keys, vec![ApiKey::new("key-a"), ApiKey::new("key-b")]);
        assert!(check_keys("api_keys", &keys).is_ok());
        let bad = check_keys("admin_api_keys", &[ApiKey::new("ok"), ApiKey::new("has space")]);
        assert!(bad.is_err_and(|e| e.to_string().contains("admin_api_keys[1]")));
        assert!(check_keys("api_keys", &[ApiKey::new("")]).is_err());
        assert_eq!(format!("{:?}", ApiKey::new("secret")), "ApiKey(<redacted>)");
    }
}
