//! OpenTelemetry context propagation through gRPC metadata (W3C `traceparent` / `tracestate`), so one trace
//! spans the coordinator and every stage of the pipeline.
//!
//! Clients add [`trace_interceptor`] to their generated client (`StageClient::with_interceptor`); servers call
//! [`set_parent_from_metadata`] on their request span. The propagator is used directly rather than through
//! OpenTelemetry's global, so nothing here depends on process-wide state.

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::error::Result;

/// Writes propagation fields into gRPC metadata; fields that are not valid ASCII metadata are skipped.
struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(&value)) {
            self.0.insert(key, value);
        }
    }
}

/// Reads propagation fields from gRPC metadata.
struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                KeyRef::Ascii(key) => Some(key.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Injects `cx`'s span context into `metadata` as W3C trace context; does nothing if `cx` has no valid span.
pub fn inject_context(cx: &Context, metadata: &mut MetadataMap) {
    TraceContextPropagator::new().inject_context(cx, &mut MetadataInjector(metadata));
}

/// Injects the context of the current `tracing` span (or, failing that, the current OpenTelemetry context).
pub fn inject_current_span(metadata: &mut MetadataMap) {
    let cx = tracing::Span::current().context();
    if cx.span().span_context().is_valid() {
        inject_context(&cx, metadata);
    } else {
        inject_context(&Context::current(), metadata);
    }
}

/// Client interceptor: adds the current span's trace context to every outgoing request.
pub fn trace_interceptor(mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
    inject_current_span(request.metadata_mut());
    Ok(request)
}

/// Extracts the caller's trace context from incoming metadata; an empty context if there is none.
pub fn extract_context(metadata: &MetadataMap) -> Context {
    TraceContextPropagator::new().extract(&MetadataExtractor(metadata))
}

/// Makes the caller's span (from `metadata`) the parent of `span`. Call it before the span is first entered.
/// Fails when no OpenTelemetry layer is installed or the span is disabled; servers usually ignore that.
pub fn set_parent_from_metadata(span: &tracing::Span, metadata: &MetadataMap) -> Result<()> {
    span.set_parent(extract_context(metadata))?;
    Ok(())
}

/// The W3C `traceparent` of `span`, which a micro-batch carries per sequence so that every stage's work on it
/// lands in the request's trace; `None` when the span is not exported (no OpenTelemetry layer, or disabled).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut fields = std::collections::HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut fields);
    fields.remove("traceparent")
}

/// The remote span context a `traceparent` names (an empty context for an empty or malformed one).
pub fn context_from_traceparent(traceparent: &str) -> Context {
    let fields = std::collections::HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    TraceContextPropagator::new().extract(&fields)
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    #[test]
    fn inject_then_extract_keeps_the_trace() {
        let trace_id = TraceId::from_bytes([0x4b; 16]);
        let span_id = SpanId::from_bytes([0x1f; 8]);
        let remote = SpanContext::new(trace_id, span_id, TraceFlags::SAMPLED, true, TraceState::default());
        let cx = Context::new().with_remote_span_context(remote);

        let mut metadata = MetadataMap::new();
        inject_context(&cx, &mut metadata);
        assert!(metadata.get("traceparent").is_some());

        let extracted = extract_context(&metadata);
        let extracted = extracted.span();
        let extracted = extracted.span_context();
        assert_eq!(extracted.trace_id(), trace_id);
        assert_eq!(extracted.span_id(), span_id);
        assert!(extracted.is_sampled());
    }

    #[test]
    fn empty_metadata_extracts_no_span() {
        let cx = extract_context(&MetadataMap::new());
        assert!(!cx.span().span_context().is_valid());
        let mut metadata = MetadataMap::new();
        inject_context(&Context::new(), &mut metadata);
        assert!(metadata.is_empty());
    }

    #[test]
    fn interceptor_carries_the_tracing_span_across_a_hop() -> Result<(), Box<dyn std::error::Error>> {
        let provider = SdkTracerProvider::builder().build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("strata-proto-test"));
        let subscriber = tracing_subscriber::registry().with(layer);

        tracing::subscriber::with_default(subscriber, || -> Result<(), Box<dyn std::error::Error>> {
            let client_span = tracing::info_span!("client");
            let client_trace = client_span.context().span().span_context().trace_id();
            assert_ne!(client_trace, TraceId::INVALID);

            let request = client_span.in_scope(|| trace_interceptor(tonic::Request::new(())))?;

            let server_span = tracing::info_span!("server");
            set_parent_from_metadata(&server_span, request.metadata())?;
            let server_cx = server_span.context();
            assert_eq!(server_cx.span().span_context().trace_id(), client_trace);

            // The same through a traceparent string, as micro-batches carry it per sequence.
            let traceparent = traceparent_of(&client_span).ok_or("an exported span has a traceparent")?;
            let remote = context_from_traceparent(&traceparent);
            assert_eq!(remote.span().span_context().trace_id(), client_trace);
            assert_eq!(remote.span().span_context().span_id(), client_span.context().span().span_context().span_id());
            assert!(!context_from_traceparent("").span().span_context().is_valid());
            assert!(!context_from_traceparent("00-zz-yy-01").span().span_context().is_valid());
            Ok(())
        })?;
        Ok(())
    }
}
