//! Where a cluster lives: its name (the key segment under `/strata/`) and the etcd endpoints that hold it. The one
//! place both are parsed and checked, for every binary's flags and the coordinator's config.

use crate::{Error, Result};

/// Checks that `name` can be a key segment: non-empty, only `[A-Za-z0-9._-]`.
pub fn check_cluster_name(name: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || !name.chars().all(allowed) {
        return Err(Error::InvalidClusterName(name.to_owned()));
    }
    Ok(())
}

/// Parses a comma-separated endpoint list (`a:2379, https://b:2379`); a bare `host:port` means
/// `<scheme>://host:port` (`https` when the etcd CA is given). Blank entries are skipped, so an empty list parses to
/// no endpoint (callers decide whether that means the embedded registry or an error).
pub(crate) fn parse_endpoints(list: &str, scheme: &str) -> Result<Vec<String>> {
    list.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| {
            let url = if e.contains("://") { e.to_owned() } else { format!("{scheme}://{e}") };
            check_endpoint(&url)?;
            Ok(url)
        })
        .collect()
}

/// Checks an endpoint list as given in a config file: at least one, each an `http://` or `https://` URL with a host.
pub(crate) fn check_endpoints(endpoints: &[String]) -> Result<()> {
    if endpoints.is_empty() {
        return Err(Error::NoEndpoints);
    }
    endpoints.iter().try_for_each(|e| check_endpoint(e))
}

fn check_endpoint(url: &str) -> Result<()> {
    let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"));
    if rest.is_none_or(|r| r.trim_matches('/').is_empty()) {
        return Err(Error::InvalidEndpoint(url.to_owned()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_get_a_scheme_and_bad_ones_are_named() -> Result<()> {
        assert_eq!(parse_endpoints("a:2379, https://b:2379,", "http")?, ["http://a:2379", "https://b:2379"]);
        assert_eq!(parse_endpoints(" , ", "http")?, Vec::<String>::new());
        assert!(
            matches!(parse_endpoints("ftp://a:2379", "http"), Err(Error::InvalidEndpoint(e)) if e == "ftp://a:2379")
        );
        assert!(matches!(parse_endpoints("http://", "http"), Err(Error::InvalidEndpoint(_))));
        assert!(matches!(check_endpoints(&[]), Err(Error::NoEndpoints)));
        assert!(check_endpoints(&["a:2379".into()]).is_err(), "a config file's endpoints carry their scheme");
        check_endpoints(&["https://a:2379".into()])
    }

    #[test]
    fn cluster_names_are_key_segments() {
        assert!(check_cluster_name("prod-1.eu_west").is_ok());
        for bad in ["", "a/b", "a b", "é"] {
            assert!(matches!(check_cluster_name(bad), Err(Error::InvalidClusterName(_))), "{bad:?} accepted");
        }
    }
}
