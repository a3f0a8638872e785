//! How every strata binary logs: one filter (`--log` / `STRATA_LOG`, an `EnvFilter` string, falling back to
//! `RUST_LOG`, then `info`) and one output format (`--log-format text|json` / `STRATA_LOG_FORMAT`), always on
//! stderr so that a command's stdout stays its output.

use tracing_subscriber::EnvFilter;

/// The level logged when neither `--log`/`STRATA_LOG` nor `RUST_LOG` says otherwise.
pub const DEFAULT_LOG_FILTER: &str = "info";

/// How log lines are written.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// The `--log` and `--log-format` flags (env `STRATA_LOG`, `STRATA_LOG_FORMAT`), shared by every binary.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct LogArgs {
    /// What to log, as a tracing `EnvFilter` (`info`, `warn,strata_coordinator=debug`); without it `RUST_LOG`,
    /// else `info`.
    #[arg(long = "log", env = "STRATA_LOG", value_name = "FILTER", global = true, value_parser = parse_filter)]
    pub filter: Option<String>,
    /// Log line format: `text` or `json`.
    #[arg(long, env = "STRATA_LOG_FORMAT", value_enum, default_value_t, global = true)]
    pub log_format: LogFormat,
}

/// Accepts only filters `EnvFilter` can parse, so a typo stops the binary at start instead of silencing logs.
fn parse_filter(s: &str) -> Result<String, String> {
    EnvFilter::try_new(s).map(|_| s.to_owned()).map_err(|e| format!("not a log filter: {e}"))
}

impl LogArgs {
    /// The filter in effect: the flag, else a valid `RUST_LOG`, else [`DEFAULT_LOG_FILTER`].
    fn env_filter(&self) -> EnvFilter {
        match &self.filter {
            Some(f) => EnvFilter::new(f),
            None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER)),
        }
    }

    /// Installs the process-wide subscriber. Call once, first thing in `main`; a second call changes nothing.
    pub fn init(&self) {
        let builder = tracing_subscriber::fmt().with_env_filter(self.env_filter()).with_writer(std::io::stderr);
        // `try_init` fails only when a subscriber is already set (a test harness's, say); that one stays.
        let _ = match self.log_format {
            LogFormat::Text => builder.try_init(),
            LogFormat::Json => builder.json().try_init(),
        };
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    #[test]
    fn flags_parse_and_bad_filters_are_refused() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from(["x", "--log", "warn,strata_proto=debug", "--log-format", "json"])?;
        assert_eq!(cli.log.filter.as_deref(), Some("warn,strata_proto=debug"));
        assert_eq!(cli.log.log_format, LogFormat::Json);
        assert!(Cli::try_parse_from(["x", "--log", "strata=loud"]).is_err());
        assert!(Cli::try_parse_from(["x", "--log-format", "xml"]).is_err());
        assert_eq!(LogArgs::default().log_format, LogFormat::Text);
        Ok(())
    }
}
