//! A run's JSON report written to disk (benchmarks, fault runs, perplexity), its folder made first.

use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

/// Writes `value` as pretty JSON to `path`, creating the folders above it.
pub fn write(path: &Path, value: &impl Serialize) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, serde_json::to_string_pretty(value)?).with_context(|| format!("writing {}", path.display()))
}
