//! Fault rules: parsing, validation and matching.

use serde::{Deserialize, Serialize};

/// Point of the SMTP conversation a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Stage {
    /// The greeting after the TCP connection is accepted.
    Connect,
    /// The reply to `MAIL FROM`.
    Mail,
    /// The reply to `RCPT TO`.
    Rcpt,
    /// The reply to the `DATA` command (normally 354), or to a transaction's first
    /// `BDAT` before its chunk is read (`drop` then leaves the chunk unread).
    Data,
    /// The reply after the terminating dot, or after the chunk of `BDAT … LAST`
    /// (normally 250).
    DataEnd,
}

/// What a firing rule does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ActionSpec", into = "ActionSpec")]
pub(crate) enum Action {
    /// Send this reply line instead of the normal one.
    Reply(String),
    /// Close the connection without replying; at `data_end`, `deliver` records
    /// the message first.
    Drop {
        /// Record the message before dropping (only meaningful at `data_end`).
        deliver: bool,
    },
    /// Sleep this many milliseconds, then proceed normally.
    DelayMs(u64),
    /// Never answer again: the session reads and discards whatever the client sends
    /// until it closes (a hung relay, or a middlebox that dropped the return path).
    /// Removing the rule later does not wake a session it has hung.
    Hang,
}

/// Wire form of [`Action`]: exactly one of `reply`, `drop`, `delay_ms`, `hang`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reply: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    drop: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    deliver: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    delay_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hang: Option<bool>,
}

/// The error for an action that names none, or more than one, of its kinds.
const ONE_ACTION: &str = "action must have exactly one of \"reply\", \"drop\" (with optional \
                          \"deliver\"), \"delay_ms\" or \"hang\"";

impl TryFrom<ActionSpec> for Action {
    type Error = String;

    fn try_from(spec: ActionSpec) -> Result<Self, Self::Error> {
        if let Some(hang) = spec.hang {
            return match (hang, spec.reply, spec.drop, spec.deliver, spec.delay_ms) {
                (true, None, None, None, None) => Ok(Action::Hang),
                (false, ..) => Err("\"hang\" must be true".to_owned()),
                _ => Err(ONE_ACTION.to_owned()),
            };
        }
        match (spec.reply, spec.drop, spec.delay_ms) {
            (Some(reply), None, None) if spec.deliver.is_none() => {
                validate_reply(&reply)?;
                Ok(Action::Reply(reply))
            }
            (None, Some(true), None) => Ok(Action::Drop {
                deliver: spec.deliver.unwrap_or(false),
            }),
            (None, Some(false), None) => Err("\"drop\" must be true".to_owned()),
            (None, None, Some(ms)) if spec.deliver.is_none() => Ok(Action::DelayMs(ms)),
            _ => Err(ONE_ACTION.to_owned()),
        }
    }
}

impl From<Action> for ActionSpec {
    fn from(action: Action) -> Self {
        match action {
            Action::Reply(reply) => ActionSpec {
                reply: Some(reply),
                ..ActionSpec::default()
            },
            Action::Drop { deliver } => ActionSpec {
                drop: Some(true),
                deliver: Some(deliver),
                ..ActionSpec::default()
            },
            Action::DelayMs(ms) => ActionSpec {
                delay_ms: Some(ms),
                ..ActionSpec::default()
            },
            Action::Hang => ActionSpec {
                hang: Some(true),
                ..ActionSpec::default()
            },
        }
    }
}

/// Checks that a reply is a single line starting with a 2xx-5xx code.
pub(crate) fn validate_reply(reply: &str) -> Result<(), String> {
    let code_ok = reply.len() >= 3
        && reply.as_bytes()[..3].iter().all(u8::is_ascii_digit)
        && matches!(reply.as_bytes()[0], b'2'..=b'5')
        && matches!(reply.as_bytes().get(3), None | Some(b' '));
    if !code_ok {
        return Err(format!(
            "reply {reply:?} must start with a 3-digit code (2xx-5xx) followed by a space"
        ));
    }
    if reply.contains(['\r', '\n']) {
        return Err("reply must be a single line".to_owned());
    }
    Ok(())
}

/// One fault-injection rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FaultRule {
    /// Stage the rule applies to.
    pub(crate) stage: Stage,
    /// Only match when a recipient of the current transaction (at `rcpt`, also the
    /// address being given) contains this substring. A rule with this field never
    /// matches at `connect` or `mail`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rcpt_contains: Option<String>,
    /// What to do when the rule fires.
    pub(crate) action: Action,
    /// Remaining firings; `None` means unlimited.
    #[serde(default)]
    pub(crate) times: Option<u64>,
}

impl FaultRule {
    /// Whether the rule may still fire.
    pub(crate) fn is_active(&self) -> bool {
        self.times != Some(0)
    }

    /// Whether the rule applies at `stage` given the transaction's recipients.
    pub(crate) fn matches(&self, stage: Stage, rcpts: &[String], candidate: Option<&str>) -> bool {
        if self.stage != stage {
            return false;
        }
        let Some(needle) = self.rcpt_contains.as_deref() else {
            return true;
        };
        if matches!(stage, Stage::Connect | Stage::Mail) {
            return false;
        }
        rcpts
            .iter()
            .map(String::as_str)
            .chain(candidate)
            .any(|addr| addr.contains(needle))
    }

    /// Records one firing.
    pub(crate) fn consume(&mut self) {
        if let Some(n) = self.times.as_mut() {
            *n = n.saturating_sub(1);
        }
    }
}
