-- Issue 30: what happened after the 250. Bounces and complaints reach postie from
-- three places: the relay's refusal at send time (source 'smtp' or the provider's
-- name), the providers' webhooks (/feedback/<provider>: 'ses', 'sendgrid',
-- 'postmark', 'mailgun') and reports fed to `postie feedback ingest` ('dsn', 'arf').
--
-- postie_feedback: one row per (source, notification_id, address). notification_id
-- is what the source calls the notification (SNS MessageId, sg_event_id, Postmark's
-- ID, Mailgun's event id, a report's Message-ID, or key/attempt at send time), so a
-- duplicated or replayed notification inserts nothing. `key` and `type` are the job's
-- when the notification was matched to one (by Message-ID or the provider's id); the
-- bounce and complaint rates per type are read from here.
CREATE TABLE IF NOT EXISTS postie_feedback (
    id              bigserial   PRIMARY KEY,
    source          text        NOT NULL,
    notification_id text        NOT NULL,
    kind            text        NOT NULL CHECK (kind IN ('bounce', 'complaint')),
    address         text        NOT NULL,
    key             text,
    type            text,
    evidence        text        NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (source, notification_id, address)
);
CREATE INDEX IF NOT EXISTS postie_feedback_received ON postie_feedback (received_at);

-- The job's row says what became of the email after it was sent.
ALTER TABLE postie_inbox
    ADD COLUMN IF NOT EXISTS feedback    text CHECK (feedback IN ('bounced', 'complained')),
    ADD COLUMN IF NOT EXISTS feedback_at timestamptz;

-- A notification names the email by its Message-ID (DSN, ARF, Mailgun, SES's headers)
-- or by the provider's id (SES, SendGrid, Postmark): both found by index.
CREATE INDEX IF NOT EXISTS postie_inbox_message_id ON postie_inbox (message_id)
    WHERE message_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS postie_inbox_provider_message_id ON postie_inbox (provider_message_id)
    WHERE provider_message_id IS NOT NULL;
