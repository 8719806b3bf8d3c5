//! `<p>.dead` and the broker's delivery limit: looking at a dead letter must never
//! drop it (invariant I13, issue 45).
//!
//! A quorum queue counts a message handed back to it as a delivery: RabbitMQ 4.x
//! counts a closed channel's unacked messages, `basic.reject` and a consumer's
//! returns, and drops a message (or dead-letters it, where the queue has a target)
//! past the queue's limit, 20 unless set; 3.x counts `basic.nack` too but has no
//! default limit (measured on 3.10.8 and 4.3.6: docs/brokers.md). `<p>.dead` has no
//! dead-letter target, so past its limit a letter is gone. postie keeps them two ways:
//!
//! - the queue: `<p>.dead` is declared with `x-delivery-limit` =
//!   [`DEAD_DELIVERY_LIMIT`] (2^31 − 1: a limit no number of looks reaches, on 3.x
//!   and 4.x alike);
//! - the reads ([`crate::dlq`]): a look cancels its consumer and hands every letter
//!   back with one `basic.nack` (requeue) before it closes its channel, which 4.x does
//!   not count (and 3.x counts without a limit).
//!
//! A queue's arguments cannot change once declared: a `<p>.dead` declared by an older
//! postie refuses the new declaration with 406. Start-up keeps it as it is
//! ([`Topology::declare_on`]) and warns; `postie status` reports it ([`dead_limit`])
//! and, with `amqp.management_url`, whether a policy gives it a limit; the fix's
//! `rabbitmqctl` policy command is `policy_command`. postie does not
//! set a policy itself: a policy replaces whichever one applied to the queue before,
//! and creating one takes the management API and the `policymaker` tag.

use lapin::options::QueueDeclareOptions;
use lapin::{Channel, Connection};

use super::declare::TopologyError;
use crate::topology::{Topology, DEAD_DELIVERY_LIMIT};

/// The smallest policy `delivery-limit` `postie status` takes as protection: a
/// million looks at each letter (RabbitMQ 4.x also takes `-1`, no limit).
pub(crate) const PROTECTIVE_LIMIT: i64 = 1_000_000;

/// How `<p>.dead` stands against looks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DeadLimit {
    /// Declared with postie's limit ([`DEAD_DELIVERY_LIMIT`]).
    Declared,
    /// Declared without a limit of its own (by an older postie): on RabbitMQ 4.x the
    /// broker's default of 20 applies, unless a policy sets another.
    Lacking,
    /// No such queue.
    Missing,
    /// The broker refused the check for another reason (its text).
    Unknown(String),
}

impl Topology {
    /// Declares everything on channels of `conn`, as start-up and `postie topology`
    /// do: a `<p>.dead` that an older postie declared without the delivery limit is
    /// kept as it is (declaring it anew would be refused with 406 and stop every
    /// instance), with a warning; what it found.
    pub(crate) async fn declare_on(&self, conn: &Connection) -> Result<DeadLimit, TopologyError> {
        let first = self.declare(&channel(conn).await?).await;
        match first {
            Ok(()) => Ok(DeadLimit::Declared),
            Err(TopologyError::Mismatch { what, detail })
                if what == format!("queue {}", self.dead_queue()) && lacks_limit(&detail) =>
            {
                tracing::warn!("{}", unprotected_warning(self.dead_queue()));
                // The refusal closed the first channel.
                let channel = channel(conn).await?;
                self.declare_with(&channel, true).await?;
                let _ = channel.close(200, "declared".into()).await;
                Ok(DeadLimit::Lacking)
            }
            Err(e) => Err(e),
        }
    }
}

async fn channel(conn: &Connection) -> Result<Channel, TopologyError> {
    conn.create_channel()
        .await
        .map_err(|source| TopologyError::Broker {
            what: "a channel for the topology".into(),
            source,
        })
}

/// Whether a 406's text says the existing queue has no `x-delivery-limit` where the
/// declaration has one (`inequivalent arg 'x-delivery-limit' … but current is none`,
/// 3.10 and 4.3 alike).
fn lacks_limit(detail: &str) -> bool {
    detail.contains("'x-delivery-limit'") && detail.contains("current is none")
}

/// `<p>.dead`'s standing, by declaring it with postie's arguments on a channel of its
/// own (the broker refuses a queue that lacks the limit); a missing queue is not
/// created.
pub(crate) async fn dead_limit(
    conn: &Connection,
    topology: &Topology,
) -> Result<DeadLimit, lapin::Error> {
    let queue = topology.dead_queue();
    if super::queue_state(conn, queue).await?.is_none() {
        return Ok(DeadLimit::Missing);
    }
    let channel = conn.create_channel().await?;
    let options = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    match channel
        .queue_declare(queue.into(), options, topology.dead_queue_args(false))
        .await
    {
        Ok(_) => {
            let _ = channel.close(200, "checked".into()).await;
            Ok(DeadLimit::Declared)
        }
        Err(e) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) if lacks_limit(amqp.get_message().as_str()) => {
                Ok(DeadLimit::Lacking)
            }
            lapin::ErrorKind::ProtocolError(amqp) => {
                Ok(DeadLimit::Unknown(amqp.get_message().to_string()))
            }
            _ => Err(e),
        },
    }
}

/// The warning for a `<p>.dead` without a limit of its own, with the fix.
pub(crate) fn unprotected_warning(queue: &str) -> String {
    format!(
        "{queue} has no delivery limit of its own (declared by an older postie): on \
         RabbitMQ 4.x the broker's default of 20 applies, and a dead letter is dropped once \
         readers have handed it back that often (postie's own reads hand letters back \
         uncounted, but an interrupted read or another client's counts). Give it a limit \
         with a policy: {}; or move its letters away, delete it and let postie declare it \
         again",
        policy_command(queue)
    )
}

/// The `rabbitmqctl` command of a policy that protects `queue` (on 3.x and 4.x).
pub(crate) fn policy_command(queue: &str) -> String {
    let pattern = format!("^{}$", queue.replace('.', "\\."));
    format!(
        "rabbitmqctl set_policy --apply-to queues --priority 10 postie-dead '{pattern}' \
         '{{\"delivery-limit\":{DEAD_DELIVERY_LIMIT}}}' (a policy replaces the one that \
         applied to the queue before: copy that one's keys into it)"
    )
}

/// Whether a policy's `delivery-limit` keeps every letter through any number of
/// looks in practice.
pub(crate) fn limit_protects(limit: i64) -> bool {
    !(0..PROTECTIVE_LIMIT).contains(&limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_brokers_refusal_of_a_queue_without_the_limit_is_told_apart() {
        // RabbitMQ 3.10.8 and 4.3.6 word it alike.
        let lacking = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue \
                       'p.dead' in vhost '/': received the value '2147483647' of type \
                       'signedint' but current is none";
        assert!(lacks_limit(lacking));
        let other = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue \
                     'p.dead' in vhost '/': received the value '2147483647' of type \
                     'signedint' but current is the value '20' of type 'long'";
        assert!(!lacks_limit(other));
        assert!(!lacks_limit(
            "PRECONDITION_FAILED - inequivalent arg 'x-queue-type'"
        ));
    }

    #[test]
    fn only_a_high_or_no_limit_protects() {
        assert!(limit_protects(-1));
        assert!(limit_protects(i64::from(DEAD_DELIVERY_LIMIT)));
        assert!(!limit_protects(20));
        assert!(!limit_protects(50_000));
    }

    #[test]
    fn the_fix_names_the_queue_exactly() {
        let command = policy_command("postie.dead");
        assert!(command.contains(r"'^postie\.dead$'"), "{command}");
        assert!(
            command.contains("\"delivery-limit\":2147483647"),
            "{command}"
        );
    }
}
