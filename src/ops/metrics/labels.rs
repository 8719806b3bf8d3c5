//! Metric labels as enums: each label's values spelled once (its `as_str`), and a
//! counter family whose children are resolved once each and then counted without a
//! hash, a lock or an allocation per message ([`Counters`]).

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::OnceLock;

use prometheus_client::encoding::{
    EncodeLabel, EncodeLabelSet, EncodeLabelValue, LabelSetEncoder, LabelValueEncoder,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// The values of one label.
pub trait LabelValue: Copy + Eq + Hash + Debug + Send + Sync + 'static {
    /// The label's name, e.g. `reason`.
    const NAME: &'static str;
    /// The value as exported.
    fn write(&self, out: &mut LabelValueEncoder) -> std::fmt::Result;
    /// The value's slot in a [`Counters`] cache, below 16 (None: no slot, the
    /// family is asked every time).
    fn slot(&self) -> Option<usize>;
}

/// Children a [`Counters`] caches.
const SLOTS: usize = 16;

/// A label set of one label, `V::NAME="value"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Label<V>(pub V);

/// Writes `V` as a label value.
#[derive(Debug)]
struct Value<V>(V);

impl<V: LabelValue> EncodeLabelValue for Value<V> {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        self.0.write(encoder)
    }
}

impl<V: LabelValue> EncodeLabelSet for Label<V> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> std::fmt::Result {
        (V::NAME, Value(self.0)).encode(encoder.encode_label())
    }
}

/// A counter per value of `V`. A child shows in `/metrics` from its first count on
/// (as with a plain `Family`); from then on it is counted straight from its slot.
#[derive(Debug)]
pub struct Counters<V: LabelValue> {
    family: Family<Label<V>, Counter>,
    children: [OnceLock<Counter>; SLOTS],
}

impl<V: LabelValue> Default for Counters<V> {
    fn default() -> Self {
        Self {
            family: Family::default(),
            children: Default::default(),
        }
    }
}

impl<V: LabelValue> Counters<V> {
    /// Counts one under `value`.
    pub fn inc(&self, value: V) {
        self.inc_by(value, 1);
    }

    /// Counts `n` under `value`.
    pub(crate) fn inc_by(&self, value: V, n: u64) {
        match value.slot().and_then(|slot| self.children.get(slot)) {
            Some(child) => {
                child
                    .get_or_init(|| self.family.get_or_create_owned(&Label(value)))
                    .inc_by(n);
            }
            None => {
                self.family.get_or_create(&Label(value)).inc_by(n);
            }
        }
    }

    /// The count under `value` (0 before the first).
    #[cfg(test)]
    pub(crate) fn get(&self, value: V) -> u64 {
        self.family.get(&Label(value)).map_or(0, |c| c.get())
    }

    /// The family, as registered.
    pub(super) fn family(&self) -> &Family<Label<V>, Counter> {
        &self.family
    }
}

/// Declares a label's values once: the enum, its `as_str`, and its [`LabelValue`].
macro_rules! label_enum {
    (
        $(#[$meta:meta])*
        $name:ident, $label:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )*
        }

        impl $name {
            /// The value as exported.
            pub(crate) fn as_str(self) -> &'static str {
                match self {
                    $( Self::$variant => $text, )*
                }
            }
        }

        impl LabelValue for $name {
            const NAME: &'static str = $label;
            fn write(&self, out: &mut LabelValueEncoder) -> std::fmt::Result {
                std::fmt::Write::write_str(out, self.as_str())
            }
            fn slot(&self) -> Option<usize> {
                Some(*self as usize)
            }
        }
    };
}

label_enum! {
    /// What a delivery event reports (`outcome`): the job's terminal status, or what
    /// its feedback said after the send (issue 30).
    EventOutcome, "outcome" {
        /// Sent: the relay or the provider accepted it.
        Sent = "sent",
        /// Dead-lettered, with a reason.
        Dead = "dead",
        /// Never sent: every recipient is suppressed.
        Suppressed = "suppressed",
        /// Dropped by its type's throttle (drop policy).
        Throttled = "throttled",
        /// Cancelled before it was sent.
        Cancelled = "cancelled",
        /// Bounced after it was sent (a DSN or a provider's notification).
        Bounced = "bounced",
        /// The recipient complained (ARF or a provider's notification).
        Complained = "complained",
        /// The recipient left the job's scope by its one-click unsubscribe link.
        Unsubscribed = "unsubscribed",
    }
}

impl EventOutcome {
    /// Every outcome.
    pub(crate) const ALL: [Self; 8] = [
        Self::Sent,
        Self::Dead,
        Self::Suppressed,
        Self::Throttled,
        Self::Cancelled,
        Self::Bounced,
        Self::Complained,
        Self::Unsubscribed,
    ];

    /// The outcome `text` names (as `postie_events.outcome` holds it), if any.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == text)
    }
}

label_enum! {
    /// Why a job was dead-lettered (`reason`).
    DeadReason, "reason" {
        /// Could never become an email.
        Invalid = "invalid",
        /// SMTP 5xx.
        Permanent = "permanent",
        /// Every retry step used.
        RetriesExhausted = "retries_exhausted",
    }
}

label_enum! {
    /// A dependency postie talks to (`dependency`).
    Dependency, "dependency" {
        /// RabbitMQ.
        Rabbitmq = "rabbitmq",
        /// PostgreSQL.
        Postgresql = "postgresql",
        /// The SMTP relay.
        Smtp = "smtp",
    }
}

label_enum! {
    /// Where the relay sent a job (`route`).
    RelayRoute, "route" {
        /// Into the delay ladder.
        Ladder = "ladder",
        /// Straight to work.
        Now = "now",
    }
}

label_enum! {
    /// What became of a job over its type's throttle (`policy`).
    ThrottlePolicy, "policy" {
        /// Dropped.
        Drop = "drop",
        /// Deferred to the end of the window.
        Defer = "defer",
    }
}

label_enum! {
    /// What a prune deleted (`kind`).
    Pruned, "kind" {
        /// Finished inbox rows.
        Finished = "finished",
        /// Cancel tombstones.
        Tombstone = "tombstone",
        /// Throttle rows.
        Throttle = "throttle",
        /// Bounce and complaint records and send tallies (the rates' rows).
        Feedback = "feedback",
    }
}

/// The retry step (queue index) a job went to (`step`), written as its number.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Step(pub u32);

impl LabelValue for Step {
    const NAME: &'static str = "step";
    fn write(&self, out: &mut LabelValueEncoder) -> std::fmt::Result {
        EncodeLabelValue::encode(&self.0, out)
    }
    fn slot(&self) -> Option<usize> {
        usize::try_from(self.0).ok().filter(|&s| s < SLOTS)
    }
}

label_enum! {
    /// Why a recipient is on the suppression list (`reason`).
    Suppressed, "reason" {
        /// No such mailbox (5.1.1 …), or bare 5xx strikes.
        HardBounce = "hard_bounce",
        /// A spam complaint.
        Complaint = "complaint",
        /// An unsubscribe.
        Unsubscribe = "unsubscribe",
        /// An operator's entry.
        Manual = "manual",
    }
}

label_enum! {
    /// What became of one send through a provider (`result`).
    ProviderResult, "result" {
        /// Accepted.
        Sent = "sent",
        /// The provider throttled this sender.
        Throttled = "throttled",
        /// A transient refusal (SMTP 4xx, an API's 5xx).
        Transient = "transient",
        /// A permanent refusal (SMTP 5xx, an API's 4xx).
        Permanent = "permanent",
        /// No connection, or credentials refused.
        Unreachable = "unreachable",
        /// No answer after the email was handed over: it may have been accepted.
        Uncertain = "uncertain",
        /// Stopped before the body: the claim was lost.
        Withdrawn = "withdrawn",
    }
}

impl ProviderResult {
    /// Every value, in slot order.
    pub(crate) const ALL: [Self; 7] = [
        Self::Sent,
        Self::Throttled,
        Self::Transient,
        Self::Permanent,
        Self::Unreachable,
        Self::Uncertain,
        Self::Withdrawn,
    ];
}

/// `provider="name",result="…"`: a provider's sends by result.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct ProviderLabel {
    /// The provider's name (`transport.providers`; a handful per instance).
    pub provider: String,
    /// What became of the send.
    pub result: ProviderResult,
}

impl EncodeLabelSet for ProviderLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> std::fmt::Result {
        ("provider", self.provider.as_str()).encode(encoder.encode_label())?;
        (ProviderResult::NAME, Value(self.result)).encode(encoder.encode_label())
    }
}

/// `provider="name"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ProviderName {
    /// The provider's name.
    pub provider: String,
}

label_enum! {
    /// Which webhook sent a notification (`provider`).
    FeedbackSource, "provider" {
        /// Amazon SES through SNS.
        Ses = "ses",
        /// SendGrid's event webhook.
        Sendgrid = "sendgrid",
        /// Postmark's webhooks.
        Postmark = "postmark",
        /// Mailgun's webhooks.
        Mailgun = "mailgun",
    }
}

label_enum! {
    /// What became of a one-click unsubscribe request (`result`, issue 50).
    UnsubscribeResult, "result" {
        /// A POST that suppressed the address for the link's scope.
        Unsubscribed = "unsubscribed",
        /// A POST for an address already suppressed for that scope: nothing changed.
        Duplicate = "duplicate",
        /// A GET: the confirmation page, nothing changed.
        Page = "page",
        /// Not a token postie makes, or a POST without RFC 8058's body (400).
        Malformed = "malformed",
        /// Tampered, or signed by a key not accepted now (403).
        Forbidden = "forbidden",
        /// The database did not answer (503).
        Unavailable = "unavailable",
    }
}

label_enum! {
    /// What became of a notification (`result`).
    FeedbackResult, "result" {
        /// New and matched to its job.
        Recorded = "recorded",
        /// Seen before: nothing changed.
        Duplicate = "duplicate",
        /// New, no job matched (the address is still suppressed).
        Unmatched = "unmatched",
        /// Unsigned, badly signed, stale or unauthenticated.
        Refused = "refused",
        /// Not a payload of the provider's.
        Malformed = "malformed",
    }
}

/// `provider="ses",result="…"`: feedback notifications by webhook and result.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct FeedbackLabel {
    /// The webhook.
    pub provider: FeedbackSource,
    /// What became of it.
    pub result: FeedbackResult,
}

impl EncodeLabelSet for FeedbackLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> std::fmt::Result {
        (FeedbackSource::NAME, Value(self.provider)).encode(encoder.encode_label())?;
        (FeedbackResult::NAME, Value(self.result)).encode(encoder.encode_label())
    }
}

label_enum! {
    /// What a provider or a relay said after (or instead of) the 250 (`kind`).
    FeedbackKind, "kind" {
        /// A bounce.
        Bounce = "bounce",
        /// A complaint.
        Complaint = "complaint",
    }
}

label_enum! {
    /// The window of a rate (`window`).
    RateWindow, "window" {
        /// The last hour.
        Hour = "1h",
        /// The last day.
        Day = "1d",
    }
}

/// `type="…",kind="…",window="…"`: one job type's bounce or complaint rate. The
/// types are the producers' (`postie_send_tally` keeps at most 1,000 apart per
/// instance).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct RateLabel {
    /// The job type.
    pub kind: String,
    /// Bounces or complaints.
    pub feedback: FeedbackKind,
    /// Over the last hour or day.
    pub window: RateWindow,
}

impl EncodeLabelSet for RateLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> std::fmt::Result {
        ("type", self.kind.as_str()).encode(encoder.encode_label())?;
        (FeedbackKind::NAME, Value(self.feedback)).encode(encoder.encode_label())?;
        (RateWindow::NAME, Value(self.window)).encode(encoder.encode_label())
    }
}
