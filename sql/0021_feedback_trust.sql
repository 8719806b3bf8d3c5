-- Issue 45: feedback only from who may send it.
--
-- The recipients an email went to (each trimmed and lower-cased, as the suppression
-- list compares them), recorded with its `sent` status, so that a bounce or a
-- complaint suppresses an address only when the email it names was sent to that
-- address. NULL for the rows sent before this migration, and for every other status.
ALTER TABLE postie_inbox ADD COLUMN IF NOT EXISTS recipients text[];

-- Mailgun signs only a timestamp and a token, not the event: each token seen, with the
-- SHA-256 of the request it came in, kept until it is past the signed window, so that
-- the same signature with another body is refused by every instance. Rows past their
-- expiry are deleted by the next request that adds one.
CREATE TABLE IF NOT EXISTS postie_webhook_tokens (
    source      text        NOT NULL,
    token       text        NOT NULL,
    body_sha256 text        NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (source, token)
);
CREATE INDEX IF NOT EXISTS postie_webhook_tokens_expires ON postie_webhook_tokens (expires_at);
