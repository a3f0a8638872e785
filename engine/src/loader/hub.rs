//! `ORG/NAME[@REVISION]` model names, resolved offline in the Hugging Face hub cache the way `huggingface_hub`
//! lays it out: `<cache>/models--ORG--NAME/refs/<revision>` holds a commit hash, and
//! `<cache>/models--ORG--NAME/snapshots/<hash>/` the files (symlinks into `blobs/`). Every binary opens models
//! through [`crate::loader::ModelFiles::open`], which calls [`resolve_model_path`]: this is the one place.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// A Hugging Face hub cache directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubCache {
    root: PathBuf,
}

/// A model named by its Hub repository, optionally at a revision (branch, tag or commit hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubSpec<'a> {
    /// `ORG/NAME`.
    pub repo: &'a str,
    /// What follows `@`, `main` when absent.
    pub revision: &'a str,
}

impl<'a> HubSpec<'a> {
    /// Parses `ORG/NAME` or `ORG/NAME@REVISION`; `None` for anything else (an absolute path, `./x`, `a/b/c`).
    pub fn parse(spec: &'a str) -> Option<Self> {
        let (repo, revision) = match spec.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (spec, "main"),
        };
        let (org, name) = repo.split_once('/')?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let rev_ok = !revision.is_empty() && !revision.contains(['/', '\\']) && !revision.starts_with('.');
        (part_ok(org) && part_ok(name) && rev_ok).then_some(HubSpec { repo, revision })
    }
}

impl HubCache {
    /// A cache at `root` (the directory holding `models--*`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        HubCache { root: root.into() }
    }

    /// The cache `huggingface_hub` uses: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    /// Read here rather than in each binary's `main` because it is the Hugging Face tools' process-wide
    /// convention, not a strata setting, and every binary must agree on it.
    pub fn from_env() -> Option<Self> {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        var("HF_HUB_CACHE")
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/huggingface/hub")))
            .map(HubCache::new)
    }

    /// The snapshot directory of `spec`, or what is missing.
    pub fn snapshot(&self, spec: &HubSpec) -> std::result::Result<PathBuf, String> {
        let repo_dir = self.root.join(format!("models--{}", spec.repo.replace('/', "--")));
        if !repo_dir.is_dir() {
            return Err(format!("no {}", repo_dir.display()));
        }
        let snapshots = repo_dir.join("snapshots");
        let ref_file = repo_dir.join("refs").join(spec.revision);
        let commit = match std::fs::read_to_string(&ref_file) {
            Ok(hash) => hash.trim().to_string(),
            // A revision may be the commit hash itself, with no ref naming it.
            Err(_) if snapshots.join(spec.revision).is_dir() => spec.revision.to_string(),
            Err(_) => {
                return Err(format!(
                    "no {} and no snapshot {}",
                    ref_file.display(),
                    snapshots.join(spec.revision).display()
                ));
            }
        };
        let dir = snapshots.join(&commit);
        if dir.is_dir() {
            Ok(dir)
        } else {
            Err(format!("{} names {commit}, but {} is missing", ref_file.display(), dir.display()))
        }
    }
}

/// The path to open for `--model`: a path that exists is itself; otherwise `ORG/NAME[@REVISION]` is looked up in
/// `cache` (a snapshot holding `config.json` is a Hugging Face directory; one holding no `config.json` and a single
/// `.gguf` file is that file). Anything else is returned as given, for the caller's not-found error.
pub fn resolve_model_path(path: &Path, cache: Option<&HubCache>) -> Result<PathBuf> {
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let Some(spec) = path.to_str().and_then(HubSpec::parse) else {
        return Ok(path.to_path_buf());
    };
    let not_found = |reason: String| Error::NotInHubCache { spec: path.display().to_string(), reason };
    let cache =
        cache.ok_or_else(|| not_found("no cache directory: HF_HUB_CACHE, HF_HOME and HOME are unset".into()))?;
    let dir = cache.snapshot(&spec).map_err(not_found)?;
    if dir.join("config.json").exists() {
        return Ok(dir);
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| Error::io(&dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(not_found(format!("{} has no config.json and no .gguf file", dir.display()))),
        _ => Err(not_found(format!(
            "{} has no config.json and {} .gguf files: name one by its path",
            dir.display(),
            ggufs.len()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lays out `models--org--name` as `huggingface_hub` does: files in `blobs/`, symlinked from the snapshot.
    fn repo(cache: &Path, repo: &str, commit: &str, refs: &[&str], files: &[&str]) {
        let dir = cache.join(format!("models--{}", repo.replace('/', "--")));
        let snap = dir.join("snapshots").join(commit);
        std::fs::create_dir_all(dir.join("blobs")).expect("temp files");
        std::fs::create_dir_all(dir.join("refs")).expect("temp files");
        std::fs::create_dir_all(&snap).expect("temp files");
        for f in files {
            let blob = dir.join("blobs").join(format!("{commit}-{f}"));
            std::fs::write(&blob, f).expect("temp files");
            std::os::unix::fs::symlink(&blob, snap.join(f)).expect("temp files");
        }
        for r in refs {
            std::fs::write(dir.join("refs").join(r), commit).expect("temp files");
        }
    }

    #[test]
    fn parses_names_and_revisions() {
        assert_eq!(HubSpec::parse("org/name"), Some(HubSpec { repo: "org/name", revision: "main" }));
        assert_eq!(HubSpec::parse("Org/Na.me-1@v2"), Some(HubSpec { repo: "Org/Na.me-1", revision: "v2" }));
        for not_a_name in ["/abs/path", "./m", "a/b/c", "name", "org/", "../x", "org/name@", "org/name@../x"] {
            assert_eq!(HubSpec::parse(not_a_name), None, "{not_a_name}");
        }
    }

    #[test]
    fn resolves_main_a_branch_and_a_bare_commit() {
        let tmp = tempfile::tempdir().expect("temp files");
        let cache = HubCache::new(tmp.path());
        repo(tmp.path(), "org/model", "aaaa", &["main"], &["config.json", "tokenizer.json"]);
        repo(tmp.path(), "org/model", "bbbb", &["dev"], &["config.json"]);
        let snap = |c: &str| tmp.path().join("models--org--model/snapshots").join(c);
        let resolve = |s: &str| resolve_model_path(Path::new(s), Some(&cache));
        assert_eq!(resolve("org/model").expect("resolves"), snap("aaaa"));
        assert_eq!(resolve("org/model@dev").expect("resolves"), snap("bbbb"));
        assert_eq!(resolve("org/model@bbbb").expect("resolves"), snap("bbbb"));
        // The snapshot's files are symlinks into blobs/, and read through.
        assert_eq!(std::fs::read_to_string(snap("aaaa").join("tokenizer.json")).expect("temp files"), "tokenizer.json");
    }

    #[test]
    fn a_gguf_only_snapshot_resolves_to_its_file() {
        let tmp = tempfile::tempdir().expect("temp files");
        repo(tmp.path(), "org/m-GGUF", "cccc", &["main"], &["m.Q4_0.gguf", "README.md"]);
        let got = resolve_model_path(Path::new("org/m-GGUF"), Some(&HubCache::new(tmp.path()))).expect("resolves");
        assert_eq!(got, tmp.path().join("models--org--m-GGUF/snapshots/cccc/m.Q4_0.gguf"));
    }

    #[test]
    fn an_existing_path_wins_over_the_cache() {
        let tmp = tempfile::tempdir().expect("temp files");
        let local = tmp.path().join("org/model");
        std::fs::create_dir_all(&local).expect("temp files");
        repo(&tmp.path().join("cache"), "org/model", "aaaa", &["main"], &["config.json"]);
        let cache = HubCache::new(tmp.path().join("cache"));
        assert_eq!(resolve_model_path(&local, Some(&cache)).expect("resolves"), local);
    }

    #[test]
    fn missing_names_say_where_they_were_looked_for() {
        let tmp = tempfile::tempdir().expect("temp files");
        let cache = HubCache::new(tmp.path());
        let err = resolve_model_path(Path::new("org/absent"), Some(&cache)).expect_err("must fail").to_string();
        assert!(err.contains("org/absent") && err.contains("models--org--absent"), "{err}");
        repo(tmp.path(), "org/model", "aaaa", &["main"], &["config.json"]);
        let err = resolve_model_path(Path::new("org/model@v9"), Some(&cache)).expect_err("must fail").to_string();
        assert!(err.contains("refs/v9"), "{err}");
        // Not a hub name: handed back for the caller's not-found error.
        assert_eq!(
            resolve_model_path(Path::new("/no/such.gguf"), Some(&cache)).expect("resolves"),
            Path::new("/no/such.gguf")
        );
    }
}
