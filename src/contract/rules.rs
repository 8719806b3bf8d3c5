//! What the contract allows around a body: its size, the default sender, the key space.
//!
//! The size is checked before any parse. `ParseRules::namespaced` puts every key in
//! its producer's key space under `worker.key_namespace`; the worker, the relay's
//! scheduled record and the DLQ's reading all use it.

use super::{invalid, AttachmentLimits, IdempotencyKey, InvalidJob};
use crate::config::{KeyNamespace, Settings};

/// What the contract allows around the body.
#[derive(Debug, Clone, Copy)]
pub struct ParseRules<'a> {
    /// Largest body in bytes.
    pub max_body_bytes: usize,
    /// Sender for jobs without `from`.
    pub default_from: Option<&'a str>,
    /// Whose key space keys live in (`worker.key_namespace`).
    pub key_namespace: KeyNamespace,
    /// The message's AMQP `user_id` property, checked by the broker.
    pub user_id: Option<&'a str>,
    /// What a job's `attachments` may hold (`attachments.*`).
    pub attachments: AttachmentLimits,
}

impl<'a> ParseRules<'a> {
    /// The rules `settings` set: `worker.max_body_bytes` and `transport.default_from`.
    pub(crate) fn from_settings(settings: &'a Settings) -> Self {
        Self {
            max_body_bytes: settings.worker.max_body_bytes,
            default_from: settings.transport.default_from.as_deref(),
            key_namespace: settings.worker.key_namespace,
            user_id: None,
            attachments: AttachmentLimits::of(&settings.attachments),
        }
    }

    /// The same rules for a message published with AMQP `user_id` `user_id`.
    pub(crate) fn for_user(self, user_id: Option<&'a str>) -> Self {
        Self { user_id, ..self }
    }

    /// `key` in the key space these rules name: as published, or (`worker.key_namespace
    /// = "user_id"`) in the namespace of the message's `user_id`, refused without one.
    pub(crate) fn namespaced(&self, key: &IdempotencyKey) -> Result<IdempotencyKey, InvalidJob> {
        match (self.key_namespace, self.user_id) {
            (KeyNamespace::Off, _) => Ok(key.clone()),
            (KeyNamespace::UserId, Some(user)) if !user.is_empty() => Ok(key.in_namespace(user)),
            (KeyNamespace::UserId, _) => invalid(
                "no AMQP user_id property: with worker.key_namespace = \"user_id\" every job \
                 and cancel request must be published with user_id set to the publishing \
                 RabbitMQ user",
            ),
        }
    }

    /// Refuses a body over `max_body_bytes`, by its length alone: checked before any
    /// parse, so an oversized body never costs more memory than itself.
    pub(crate) fn check_size(&self, body: &[u8]) -> Result<(), InvalidJob> {
        if body.len() > self.max_body_bytes {
            return invalid(format!(
                "body is {} bytes, over the limit of {}",
                body.len(),
                self.max_body_bytes
            ));
        }
        Ok(())
    }
}
