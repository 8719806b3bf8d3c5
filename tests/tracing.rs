//! A job's W3C `traceparent` becomes the parent of postie's delivery span, so the
//! producer's trace shows the email being sent. Uses the SDK's in-memory exporter
//! (this binary installs the global subscriber, hence one test in it).

mod support;

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use postie::testing::broker;
use support::{eventually, job, TestEnv};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN_ID: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_trace_is_the_parent_of_the_delivery_span() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("info"))
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")))
        .init();

    let env = TestEnv::new("tracing").await;
    let serving = env.serve(env.settings());
    let mut headers = FieldTable::default();
    headers.insert(
        "traceparent".into(),
        AMQPValue::LongString(format!("00-{TRACE_ID}-{PARENT_SPAN_ID}-01").into()),
    );
    let body = job("traced-1", "x@example.com").to_string();
    env.publish_raw(
        body.as_bytes(),
        broker::job_properties().with_headers(headers),
    )
    .await;
    let envr = &env;
    eventually("the email", Duration::from_secs(60), move || async move {
        (envr.sink.count().await == 1).then_some(())
    })
    .await;
    serving.stop().await;
    provider.force_flush().unwrap();

    let spans = exporter.get_finished_spans().unwrap();
    let delivery = spans
        .iter()
        .find(|s| s.name == "delivery" && s.span_context.trace_id().to_string() == TRACE_ID)
        .unwrap_or_else(|| {
            panic!(
                "no delivery span in the producer's trace among {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert_eq!(delivery.parent_span_id.to_string(), PARENT_SPAN_ID);
    let attributes: Vec<String> = delivery
        .attributes
        .iter()
        .map(|kv| format!("{}={}", kv.key, kv.value))
        .collect();
    assert!(
        attributes.contains(&"key=traced-1".to_string()),
        "{attributes:?}"
    );
    assert!(
        attributes.contains(&"outcome=sent".to_string()),
        "{attributes:?}"
    );
    // Never the body or the full recipient address.
    assert!(
        !attributes
            .iter()
            .any(|a| a.contains("x@example.com") || a.contains("Hello about")),
        "{attributes:?}"
    );
}
