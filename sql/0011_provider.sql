-- Issue 29: which transport sent a job, and the id its provider answered with.
--
-- provider: the name of the transport that accepted the email (transport.providers'
-- name for it; "smtp", "ses", … for a single transport). provider_message_id: the id
-- the provider's API answered with (SES MessageId, SendGrid X-Message-Id, Postmark
-- MessageID, Mailgun id); NULL for SMTP and the file transport, which answer none.
-- Both are set by the completion of a send only. Nullable, no default: adding them
-- rewrites no row, and an instance still running the previous postie (whose
-- completion does not name them) keeps working through a rolling upgrade.
ALTER TABLE postie_inbox ADD COLUMN IF NOT EXISTS provider text;
ALTER TABLE postie_inbox ADD COLUMN IF NOT EXISTS provider_message_id text;
