//! Failover between transports: the [`Route`]s of `transport.providers`, in order of
//! preference, each with its own circuit breaker.
//!
//! A job goes to the first route whose breaker is closed ([`Routes::choose`]), unless
//! it is **pinned**: a send that failed after its email may have been handed over (no
//! answer after the request was written or the body sent: [`Clearance::uncertain`])
//! may have been accepted, so the job's later tries go to the same route and never
//! to another, which could make a second copy. Only **definite** failures count
//! towards a route's breaker: no connection, credentials
//! refused, and for an API a 5xx answer (the provider said it did not take it); an
//! SMTP relay's hang counts too, as it always has ([`Transport::opens_breaker`]). After `transport.breaker_threshold` in
//! a row the breaker opens, traffic moves to the next route, and the worker probes
//! the route until it answers ([`Routes::recovered`]); then it takes traffic back.
//! With one route this is the breaker postie always had. `Routes::judge` counts a
//! send's result on its route; the metrics are per provider.
//!
//! [`Clearance::uncertain`]: super::Clearance::uncertain
//! [`Transport::opens_breaker`]: super::Transport::opens_breaker

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;

use super::{SendError, Transport};
use crate::config::SendRate;
use crate::ops::metrics::{Metrics, ProviderLabel, ProviderResult};

/// A route's index in [`Routes`], in order of preference (0 is the primary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RouteId(pub(crate) usize);

/// One transport with its name, its fleet rate and its breaker.
pub(crate) struct Route {
    pub(crate) name: String,
    pub(super) transport: Arc<dyn Transport>,
    /// [`Transport::wants_fields`].
    pub(super) with_fields: bool,
    pub(crate) rate_limit: Option<SendRate>,
    pub(crate) rate_burst: Option<u32>,
    failures: AtomicU32,
    up: watch::Sender<bool>,
    counted: Counted,
}

/// The route's metric children, resolved once.
struct Counted {
    results: [Counter; ProviderResult::ALL.len()],
    open: Gauge,
}

/// What a send's result did to its route's breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// Nothing changed.
    None,
    /// This result opened the route's breaker (start its prober); `all_open` when no
    /// route is left closed.
    Opened {
        /// Every route's breaker is open now.
        all_open: bool,
    },
}

/// What a route is built from.
pub(super) struct RouteSpec {
    pub(super) name: String,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) rate_limit: Option<SendRate>,
    pub(super) rate_burst: Option<u32>,
}

/// The routes of an instance, in order of preference.
pub(crate) struct Routes {
    routes: Vec<Route>,
    threshold: u32,
}

impl Routes {
    /// `routes` (at least one), whose breakers open after `threshold` definite
    /// failures in a row; their metrics resolved in `metrics`.
    pub(super) fn new(routes: Vec<RouteSpec>, threshold: u32, metrics: &Metrics) -> Self {
        let routes = routes
            .into_iter()
            .map(|spec| {
                let RouteSpec {
                    name,
                    transport,
                    rate_limit,
                    rate_burst,
                } = spec;
                let label = |result| ProviderLabel {
                    provider: name.clone(),
                    result,
                };
                let counted = Counted {
                    results: ProviderResult::ALL
                        .map(|result| metrics.provider_sends.get_or_create(&label(result)).clone()),
                    open: metrics
                        .provider_circuit_open
                        .get_or_create(&crate::ops::metrics::ProviderName {
                            provider: name.clone(),
                        })
                        .clone(),
                };
                Route {
                    with_fields: transport.wants_fields(),
                    name,
                    transport,
                    rate_limit,
                    rate_burst,
                    failures: AtomicU32::new(0),
                    up: watch::Sender::new(true),
                    counted,
                }
            })
            .collect();
        Self {
            routes,
            threshold: threshold.max(1),
        }
    }

    /// Every route, in order of preference.
    pub(crate) fn all(&self) -> &[Route] {
        &self.routes
    }

    pub(crate) fn get(&self, id: RouteId) -> &Route {
        &self.routes[id.0]
    }

    /// The route named `name`, if there is one.
    pub(crate) fn named(&self, name: &str) -> Option<RouteId> {
        self.routes.iter().position(|r| r.name == name).map(RouteId)
    }

    /// The first route whose breaker is closed (the primary when every one is open:
    /// consumption is paused then, and a job already taken waits for it).
    pub(crate) fn choose(&self) -> RouteId {
        RouteId(self.routes.iter().position(Route::is_up).unwrap_or(0))
    }

    /// True while at least one route's breaker is closed.
    pub(crate) fn any_up(&self) -> bool {
        self.routes.iter().any(Route::is_up)
    }

    /// Counts a send's result on `id` and moves its breaker: a definite failure adds
    /// one to the count (opening it at the threshold), anything else ends the count.
    /// `failed` is the send's error, `None` when it was accepted.
    pub(crate) fn judge(&self, id: RouteId, failed: Option<&SendError>, uncertain: bool) -> Change {
        let route = self.get(id);
        route.count(ProviderResult::of(failed, uncertain));
        let opens = failed.is_some_and(|e| route.transport.opens_breaker(e, uncertain));
        if !opens {
            if !matches!(failed, Some(SendError::Withdrawn(_))) {
                route.failures.store(0, Ordering::Relaxed);
            }
            return Change::None;
        }
        let failures = route.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures < self.threshold || !route.up.send_if_modified(std::mem::take) {
            return Change::None;
        }
        route.counted.open.set(1);
        tracing::error!(
            provider = %route.name,
            failures,
            "{} unreachable: its circuit is open{}",
            route.name,
            match self.routes.iter().find(|r| r.is_up()) {
                Some(next) => format!("; sending through {} meanwhile", next.name),
                None => "; no provider left, pausing consumption".into(),
            }
        );
        Change::Opened {
            all_open: !self.any_up(),
        }
    }

    /// The prober reached route `id`: closes its breaker. True if it was open.
    pub(crate) fn recovered(&self, id: RouteId) -> bool {
        let route = self.get(id);
        route.failures.store(0, Ordering::Relaxed);
        let closed = route.up.send_if_modified(|up| !std::mem::replace(up, true));
        if closed {
            route.counted.open.set(0);
            tracing::info!(provider = %route.name, "{} answers again: its circuit is closed", route.name);
        }
        closed
    }
}

impl Route {
    /// True while its breaker is closed.
    pub(crate) fn is_up(&self) -> bool {
        *self.up.borrow()
    }

    /// Resolves once its breaker is closed.
    pub(crate) async fn wait_up(&self) {
        let mut up = self.up.subscribe();
        let _ = up.wait_for(|up| *up).await;
    }

    /// Resolves once its breaker is open.
    pub(crate) async fn wait_down(&self) {
        let mut up = self.up.subscribe();
        let _ = up.wait_for(|up| !*up).await;
    }

    fn count(&self, result: ProviderResult) {
        self.counted.results[result as usize].inc();
    }
}

impl ProviderResult {
    /// The class of a send's result.
    fn of(failed: Option<&SendError>, uncertain: bool) -> Self {
        match failed {
            None => Self::Sent,
            Some(_) if uncertain => Self::Uncertain,
            Some(SendError::Throttled(_)) => Self::Throttled,
            // An attachment's store fails before any send: never judged on a route.
            Some(SendError::Transient(_) | SendError::Unavailable(_)) => Self::Transient,
            Some(SendError::Permanent(_)) => Self::Permanent,
            Some(SendError::Unreachable(_)) => Self::Unreachable,
            Some(SendError::Withdrawn(_)) => Self::Withdrawn,
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::future::BoxFuture;
    use futures_util::FutureExt;

    use super::*;
    use crate::mail::{Clearance, Email};

    /// A transport the breaker's arithmetic is tested with: it is never sent through.
    struct Idle;

    impl Transport for Idle {
        fn send<'a>(
            &'a self,
            _: &'a Email,
            _: &'a Clearance,
        ) -> BoxFuture<'a, Result<Option<String>, SendError>> {
            async { unreachable!("the breaker's tests send nothing") }.boxed()
        }
        fn probe(&self) -> BoxFuture<'_, bool> {
            async { true }.boxed()
        }
    }

    fn routes(names: &[&str], metrics: &Metrics) -> Routes {
        let routes = names
            .iter()
            .map(|n| RouteSpec {
                name: n.to_string(),
                transport: Arc::new(Idle),
                rate_limit: None,
                rate_burst: None,
            })
            .collect();
        Routes::new(routes, 2, metrics)
    }

    #[test]
    fn traffic_moves_on_after_definite_failures_and_comes_back_to_the_primary() {
        let metrics = Metrics::new();
        let r = routes(&["primary", "secondary"], &metrics);
        let (primary, secondary) = (RouteId(0), RouteId(1));
        let refused = SendError::Unreachable("connection refused".into());
        let hung = SendError::Unreachable("no answer after the body".into());
        assert_eq!(r.choose(), primary);
        assert_eq!(r.judge(primary, Some(&refused), false), Change::None);
        // Any answer ends the count.
        assert_eq!(
            r.judge(primary, Some(&SendError::Transient("451".into())), false),
            Change::None
        );
        assert_eq!(r.judge(primary, Some(&refused), false), Change::None);
        assert_eq!(
            r.judge(primary, Some(&hung), true),
            Change::Opened { all_open: false },
            "an SMTP relay's hang counts, as it always has"
        );
        assert_eq!(r.choose(), secondary);
        assert!(r.any_up());
        assert_eq!(r.named("secondary"), Some(secondary));
        assert_eq!(r.judge(secondary, Some(&refused), false), Change::None);
        assert_eq!(
            r.judge(secondary, Some(&refused), false),
            Change::Opened { all_open: true }
        );
        assert!(!r.any_up());
        assert_eq!(
            r.choose(),
            primary,
            "none up: the primary, and consumption pauses"
        );
        assert!(r.recovered(primary));
        assert!(
            !r.recovered(primary),
            "closing a closed breaker changes nothing"
        );
        assert_eq!(r.choose(), primary, "the primary takes traffic back");
        let text = metrics.render();
        for line in [
            "postie_provider_sends_total{provider=\"primary\",result=\"unreachable\"} 2",
            "postie_provider_sends_total{provider=\"primary\",result=\"uncertain\"} 1",
            "postie_provider_sends_total{provider=\"primary\",result=\"transient\"} 1",
            "postie_provider_circuit_open{provider=\"primary\"} 0",
            "postie_provider_circuit_open{provider=\"secondary\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn a_withdrawn_send_neither_counts_nor_ends_the_count() {
        let metrics = Metrics::new();
        let r = routes(&["only"], &metrics);
        let refused = SendError::Unreachable("refused".into());
        let withdrawn = SendError::Withdrawn("claim lost".into());
        assert_eq!(r.judge(RouteId(0), Some(&refused), false), Change::None);
        assert_eq!(r.judge(RouteId(0), Some(&withdrawn), false), Change::None);
        assert_eq!(
            r.judge(RouteId(0), Some(&refused), false),
            Change::Opened { all_open: true }
        );
        assert_eq!(r.judge(RouteId(0), None, false), Change::None);
        assert!(!r.any_up(), "only the prober closes an open breaker");
    }
}
