//! What the integration tests (`tests/`, `tests/model/`) reach of postie's internals,
//! and nothing else may: the library's public surface is the command line (`cli`)
//! and its settings (`config`); every other module is private, and an item is `pub`
//! only if it is named here (or is a public method or field of one that is), so that
//! the compiler reports the rest as dead code (`unreachable_pub`). Each list is what
//! the tests use of that module; a test that needs another internal adds it here.

/// RabbitMQ.
pub mod broker {
    pub use crate::broker::{
        confirm_channel, connect, job_properties, probe_plugin, publish_confirmed, resolve_mode,
        DelayLayout, Ladder, PublishError, Topology, ROUTING_KEY,
    };
}
/// The operator console.
pub mod console {
    pub use crate::console::{start, Credentials};
}
/// `postie serve`.
pub mod consume {
    pub use crate::consume::serve;
}
/// The producers' contract.
pub mod contract {
    pub use crate::contract::{
        due_at, peek_key_text, x_delay, AttachmentLimits, EmailJob, IdempotencyKey, ParseRules,
        Request,
    };
}
/// Dead letters.
pub mod dlq {
    pub use crate::dlq::{list, replay, table, DeadLetterSummary, ReplayFilter, ReplayReport};
}
/// Addresses and their secrets.
pub mod endpoint {
    pub use crate::endpoint::{is_loopback_host, passwords, redact_url};
}
/// Message headers.
pub mod headers {
    pub use crate::headers::{
        as_text, header_int, header_text, Seal, HEADER_ATTEMPT, HEADER_DEAD_KIND,
        HEADER_DEAD_REASON, HEADER_PUBLISHED_AT,
    };
}
/// The PostgreSQL inbox.
pub mod inbox {
    pub use crate::inbox::{
        record_event, Claim, Completion, Debounced, Debouncing, Inbox, Scheduled,
    };
}
/// The transports.
pub mod mail {
    pub use crate::mail::unsubscribe::{Link, Links, Refusal};
    pub use crate::mail::{Clearance, Email, Mailer, SendError};
}
/// Metrics, health, HTTP.
pub mod ops {
    pub use crate::ops::metrics;
}
/// The broker objects' names.
pub mod topology {
    pub use crate::topology::DEAD_DELIVERY_LIMIT;
}
/// The unit of work.
pub mod work {
    pub use crate::work::Limiter;
}
