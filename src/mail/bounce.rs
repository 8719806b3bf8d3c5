//! Which refusals of a recipient put it on the suppression list (issue 30).
//!
//! Only a permanent reply (5xx) to RCPT TO is read, and only its enhanced status code
//! (RFC 3463) decides: a code in `suppression.hard_bounce_codes` (by default 5.1.1,
//! 5.1.2, 5.1.3, 5.1.6, 5.1.10, 5.2.1: no such mailbox, bad domain, bad address
//! syntax, moved, null MX, disabled) is a hard bounce; any other code is not (5.7.x is
//! policy or reputation, such as Gmail's "low reputation" 5.7.1 refusing real users;
//! 5.2.2 a full mailbox; 5.3.4 size; 5.5.x postie's own syntax). A 5xx without an
//! enhanced code is a strike: enough of them within a window suppress the address.
//! A 4xx never counts. `is_hard_status` reads a DSN's `Status` or a provider's
//! diagnostic by the same codes.

/// What a refusal of a recipient means for the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Bounce {
    /// Suppress now; the enhanced code.
    Hard(String),
    /// A bare 5xx: counts towards the strike threshold.
    Strike,
    /// Not a reason to suppress.
    Not,
}

/// Reads `reply` (the relay's reply as postie words it: `… (550): 5.1.1 …`).
pub(crate) fn classify(reply: &str, hard_codes: &[String]) -> Bounce {
    let Some(code) = basic_code(reply) else {
        return Bounce::Not;
    };
    if !code.starts_with('5') {
        return Bounce::Not;
    }
    match enhanced_code(reply) {
        Some(enhanced) if hard_codes.contains(&enhanced) => Bounce::Hard(enhanced),
        Some(_) => Bounce::Not,
        None => Bounce::Strike,
    }
}

/// Whether a DSN's `Status` or a provider's diagnostic (`smtp; 550 5.1.1 …`) names a
/// hard bounce: a permanent enhanced code in `hard_codes`. Feedback arrives after
/// the email was accepted, so a bare code without an enhanced one is not a strike.
pub(crate) fn is_hard_status(text: &str, hard_codes: &[String]) -> bool {
    enhanced_code(text).is_some_and(|code| code.starts_with('5') && hard_codes.contains(&code))
}

/// The first three-digit reply code in the text (`550`).
fn basic_code(reply: &str) -> Option<&str> {
    reply
        .split(|c: char| !c.is_ascii_digit())
        .find(|part| part.len() == 3 && matches!(part.as_bytes()[0], b'2'..=b'5'))
}

/// The first `class.subject.detail` token (`5.1.1`), RFC 3463's shape.
fn enhanced_code(reply: &str) -> Option<String> {
    reply
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map(|t| t.trim_matches('.'))
        .find(|token| {
            let parts: Vec<&str> = token.split('.').collect();
            parts.len() == 3
                && matches!(parts[0], "2" | "4" | "5")
                && parts[1..]
                    .iter()
                    .all(|p| (1..=3).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_mailbox_failures_are_hard_bounces() {
        let codes = crate::config::SuppressionSettings::default().hard_bounce_codes;
        let class = |reply: &str| classify(reply, &codes);
        assert_eq!(
            class("permanent error (550): 5.1.1 <a@x>: no such user"),
            Bounce::Hard("5.1.1".into())
        );
        assert_eq!(
            class("permanent error (550): 5.1.10 null MX"),
            Bounce::Hard("5.1.10".into())
        );
        assert_eq!(
            class("permanent error (551): 5.2.1 mailbox disabled"),
            Bounce::Hard("5.2.1".into())
        );
        for never in [
            "permanent error (550): 5.7.1 low reputation of the sending domain",
            "permanent error (552): 5.2.2 mailbox full",
            "permanent error (552): 5.3.4 message too big",
            "permanent error (501): 5.5.2 syntax error",
            "transient error (452): 4.2.2 over quota",
            "transient error (450): mailbox busy",
            "connection refused",
        ] {
            assert_eq!(class(never), Bounce::Not, "{never}");
        }
        assert_eq!(
            class("permanent error (550): no such user here"),
            Bounce::Strike
        );
        assert!(is_hard_status("5.1.1", &codes));
        assert!(is_hard_status("smtp; 550 5.1.1 user unknown", &codes));
        assert!(!is_hard_status("5.2.2", &codes));
        assert!(!is_hard_status("4.4.7", &codes));
    }
}
