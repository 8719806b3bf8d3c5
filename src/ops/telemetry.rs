//! Logs and traces. Logs: human lines for development, JSON lines for production,
//! to stderr, written by a thread of their own (see [`init`]). Traces: OpenTelemetry
//! over OTLP/HTTP when `otel.endpoint` is set; each delivery's span continues the
//! producer's trace from the job's `traceparent`.
//!
//! Each log line is scrubbed of the configured passwords (`endpoint::scrub`) on its
//! way out. `ExpectedRefusals` is the flag `broker::probe` holds while it expects
//! the broker's refusals, which keeps lapin's log lines about them out of the log.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use lapin::types::FieldTable;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use secrecy::ExposeSecret;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::{LogFormat, LogSettings, OtelSettings};
use crate::endpoint::{passwords, redact_url, scrub};
use crate::headers::header_text;

/// Flushes and shuts the trace exporter down when dropped (end of `main`), then
/// writes out the log lines still queued.
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
    _log_lines: tracing_appender::non_blocking::WorkerGuard,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = provider.shutdown();
        }
    }
}

/// Installs the global subscriber; `RUST_LOG` overrides `log.filter`. Call it before
/// the async runtime starts: the OTLP exporter runs on a thread of its own. Every line
/// written has each of `secrets` (the configured passwords, see
/// [`Settings::passwords`](crate::config::Settings::passwords)) replaced by `***`: a
/// library's error or debug line may quote a connection address whole.
pub fn init(
    log: &LogSettings,
    otel: &OtelSettings,
    secrets: Vec<String>,
) -> anyhow::Result<TelemetryGuard> {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&log.filter))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour only on a terminal, never with NO_COLOR set (https://no-color.org), never
    // in JSON: logs written to a file or a pipe stay plain text.
    let ansi = log.format == LogFormat::Human
        && std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    // A line per email sent is a write(2) per email when each event writes stderr
    // itself. Instead the events queue their lines for a thread that writes out
    // whatever has queued up at once, with one call, then lingers (see [`Lingering`]).
    // Nothing is dropped: a full queue (128,000 lines) makes the callers wait.
    let (writer, log_lines) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .thread_name("postie-log")
        .finish(Lingering::new(std::io::stderr()));
    let writer = ScrubbingWriter {
        inner: writer,
        secrets: secrets.into(),
    };
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(ansi);
    let fmt = match log.format {
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .boxed(),
        LogFormat::Human => fmt.boxed(),
    };
    let provider = match &otel.endpoint {
        Some(endpoint) => {
            let endpoint = endpoint.expose_secret();
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(endpoint)
                .build()
                .map_err(|e| {
                    anyhow::anyhow!(
                        "otel.endpoint {}: {}",
                        redact_url(endpoint),
                        scrub(&e.to_string(), &passwords(endpoint))
                    )
                })?;
            let resource = opentelemetry_sdk::Resource::builder()
                .with_service_name(otel.service_name.clone())
                .build();
            Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(resource)
                    .build(),
            )
        }
        None => None,
    };
    let otel_layer = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("postie")));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt.with_filter(not_a_probe_refusal()))
        .with(otel_layer)
        .try_init();
    Ok(TelemetryGuard {
        provider,
        _log_lines: log_lines,
    })
}

/// Drops lapin's ERROR and WARN lines while the delay-mode probe runs: the refusals
/// it asks for (404 for a missing exchange, 503 or 406 for an unknown exchange type)
/// are answers, and a healthy start must not open with an error.
fn not_a_probe_refusal(
) -> tracing_subscriber::filter::FilterFn<impl Fn(&tracing::Metadata<'_>) -> bool> {
    tracing_subscriber::filter::filter_fn(|meta| {
        !(meta.is_event()
            && meta.target().starts_with("lapin")
            && *meta.level() <= tracing::Level::WARN
            && expecting_refusals())
    })
}

/// While one is alive, lapin's ERROR and WARN lines are expected refusals, not faults:
/// the log filter drops them. `broker::probe` holds one while it asks the broker
/// questions whose answer may be a refusal; it runs at start-up, before the service
/// opens its own connections.
pub(crate) struct ExpectedRefusals(());

static EXPECTING: AtomicUsize = AtomicUsize::new(0);

impl ExpectedRefusals {
    /// Lapin's ERROR and WARN lines are dropped until the guard is dropped.
    pub(crate) fn begin() -> Self {
        EXPECTING.fetch_add(1, Ordering::SeqCst);
        Self(())
    }
}

impl Drop for ExpectedRefusals {
    fn drop(&mut self) {
        EXPECTING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// True while an [`ExpectedRefusals`] is alive.
pub(crate) fn expecting_refusals() -> bool {
    EXPECTING.load(Ordering::SeqCst) > 0
}

/// How long the log thread waits after writing lines out before it looks for more.
const LINGER: std::time::Duration = std::time::Duration::from_millis(5);

/// The log thread's output: lines gather in a buffer, and a flush (the thread's, once
/// it has taken every queued line) writes them with one call and then sleeps for
/// [`LINGER`]. Without the pause the thread woke for each line under load (a futex
/// wake by the sender, spins, a write: four system calls an email, about a sixth of
/// postie's); with it the lines of 5 ms go out together and the senders, finding no
/// thread waiting, wake none. A line reaches stderr at most 5 ms later; lines still
/// queued at shutdown are written before postie exits ([`TelemetryGuard`]).
struct Lingering<W: std::io::Write> {
    out: std::io::BufWriter<W>,
}

impl<W: std::io::Write> Lingering<W> {
    fn new(out: W) -> Self {
        Self {
            out: std::io::BufWriter::with_capacity(64 * 1024, out),
        }
    }
}

impl<W: std::io::Write> std::io::Write for Lingering<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.out.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let wrote = !self.out.buffer().is_empty();
        self.out.flush()?;
        if wrote {
            std::thread::sleep(LINGER);
        }
        Ok(())
    }
}

/// The log writer, each line scrubbed of the configured passwords.
struct ScrubbingWriter {
    inner: tracing_appender::non_blocking::NonBlocking,
    secrets: Arc<[String]>,
}

impl<'a> MakeWriter<'a> for ScrubbingWriter {
    type Writer = Scrubbed;

    fn make_writer(&'a self) -> Self::Writer {
        Scrubbed {
            inner: self.inner.clone(),
            secrets: self.secrets.clone(),
        }
    }
}

/// One event's writer: the formatter hands it the whole line in one `write`.
struct Scrubbed {
    inner: tracing_appender::non_blocking::NonBlocking,
    secrets: Arc<[String]>,
}

impl std::io::Write for Scrubbed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        if !self.secrets.iter().any(|s| text.contains(s.as_str())) {
            return self.inner.write(buf);
        }
        self.inner
            .write_all(scrub(&text, &self.secrets).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The producer's trace context from the W3C `traceparent` / `tracestate` headers
/// (an empty context when there are none or they are malformed).
pub(crate) fn parent_context(headers: Option<&FieldTable>) -> opentelemetry::Context {
    let mut carrier = HashMap::new();
    for name in ["traceparent", "tracestate"] {
        if let Some(value) = header_text(headers, name) {
            carrier.insert(name.to_string(), value);
        }
    }
    TraceContextPropagator::new().extract(&carrier)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::AMQPValue;
    use opentelemetry::trace::TraceContextExt;

    #[test]
    fn reads_a_w3c_traceparent_header() {
        let mut headers = FieldTable::default();
        headers.insert(
            "traceparent".into(),
            AMQPValue::LongString("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
        );
        let cx = parent_context(Some(&headers));
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid() && sc.is_remote());
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(!parent_context(None).span().span_context().is_valid());
    }
}
