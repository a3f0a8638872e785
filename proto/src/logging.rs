//! How every strata binary logs and exports traces: one filter (`--log` / `STRATA_LOG`, an `EnvFilter` string,
//! falling back to `RUST_LOG`, then `info`), one output format (`--log-format text|json` / `STRATA_LOG_FORMAT`),
//! always on stderr so that a command's stdout stays its output, and, with `--otlp-endpoint` /
//! `OTEL_EXPORTER_OTLP_ENDPOINT`, the spans the filter lets through exported over OTLP/gRPC under
//! `OTEL_SERVICE_NAME` (default: the binary's name).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

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

/// The `--log`, `--log-format` and `--otlp-endpoint` flags (env `STRATA_LOG`, `STRATA_LOG_FORMAT`,
/// `OTEL_EXPORTER_OTLP_ENDPOINT`), shared by every binary.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct LogArgs {
    /// What to log, as a tracing `EnvFilter` (`info`, `warn,strata_coordinator=debug`); without it `RUST_LOG`,
    /// else `info`.
    #[arg(long = "log", env = "STRATA_LOG", value_name = "FILTER", global = true, value_parser = parse_filter)]
    pub filter: Option<String>,
    /// Log line format: `text` or `json`.
    #[arg(long, env = "STRATA_LOG_FORMAT", value_enum, default_value_t, global = true)]
    pub log_format: LogFormat,
    /// Export spans over OTLP/gRPC to this collector, e.g. `http://otel-collector:4317` (service name from
    /// `OTEL_SERVICE_NAME`; batching from the `OTEL_BSP_*` variables). Without it nothing is exported.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL", global = true)]
    pub otlp_endpoint: Option<String>,
}

/// What [`LogArgs::init`] set up; dropping it flushes the spans not yet exported.
#[must_use = "spans are flushed when this is dropped: keep it until the end of main"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// The exporter's gRPC client lives here, so export works in sync and async binaries alike.
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("could not flush the last spans to the OTLP collector: {e}");
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// An OTLP/gRPC span exporter to `endpoint` as `service`, with the runtime its client runs on.
fn otlp_provider(endpoint: &str, service: &str) -> Result<(SdkTracerProvider, tokio::runtime::Runtime), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the exporter's runtime: {e}"))?;
    let exporter = {
        // The client connects lazily on this runtime (entering it does not block, unlike `block_on`, so this
        // works inside `#[tokio::main]` too).
        let _rt = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()
            .map_err(|e| format!("cannot export spans to {endpoint}: {e}"))?
    };
    let name = std::env::var("OTEL_SERVICE_NAME").ok().filter(|n| !n.is_empty()).unwrap_or_else(|| service.into());
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(name).build())
        .build();
    Ok((provider, runtime))
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

    /// Installs the process-wide subscriber, exporting spans when `--otlp-endpoint` is set (as `service` unless
    /// `OTEL_SERVICE_NAME` says otherwise). Call once, first thing in `main`, and keep what it returns until the
    /// end; a second call changes nothing. A collector that cannot be set up is reported and logging goes on.
    pub fn init(&self, service: &str) -> Telemetry {
        let mut telemetry = Telemetry { provider: None, runtime: None };
        let mut otel_error = None;
        let otel = match self.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) {
            Some(endpoint) => match otlp_provider(endpoint, service) {
                Ok((provider, runtime)) => {
                    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("strata"));
                    telemetry = Telemetry { provider: Some(provider), runtime: Some(runtime) };
                    Some(layer)
                }
                Err(e) => {
                    otel_error = Some(e);
                    None
                }
            },
            None => None,
        };
        let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
        let (text, json) = match self.log_format {
            LogFormat::Text => (Some(fmt), None),
            LogFormat::Json => (None, Some(tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr))),
        };
        // `try_init` fails only when a subscriber is already set (a test harness's, say); that one stays.
        let _ = tracing_subscriber::registry().with(self.env_filter()).with(text).with(json).with(otel).try_init();
        match (otel_error, &self.otlp_endpoint) {
            (Some(e), _) => tracing::error!(error = %e, "not exporting traces"),
            (None, Some(endpoint)) if telemetry.provider.is_some() => {
                tracing::info!(endpoint = %endpoint, "exporting traces over OTLP");
            }
            _ => {}
        }
        telemetry
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
        let cli = Cli::try_parse_from(["x", "--otlp-endpoint", "http://collector:4317"])?;
        assert_eq!(cli.log.otlp_endpoint.as_deref(), Some("http://collector:4317"));
        Ok(())
    }
}
