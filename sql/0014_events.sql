-- Issue 30: delivery events for the producers, through an outbox in postie's own
-- database so that a crash (even kill -9) loses none.
--
-- postie_events: one row per outcome of a job, written in the same statement as the
-- change of status that it reports (the completions' COMPLETE, the cancel), and
-- deleted by the publisher (src/consume/events.rs) once the broker has confirmed its
-- publish to `<p>.events`. Delivery to the exchange is at least once: `id` is the
-- event's AMQP message_id, unique, for consumers to dedupe.
--   outcome : sent, dead, suppressed, throttled (the drop policy), cancelled; bounced
--             and complained are written by the feedback ingestion (inbox::events).
--   key, type, message_id, provider, provider_message_id, attempts : the job's, as its
--             inbox row has them when the event is written (type NULL if the job had
--             none or, for a cancel, if no delivery of the key was seen yet).
--   reason  : the dead letter's reason, the suppression's, the feedback's evidence.
--   occurred_at : when the outcome was recorded (a send: its sent_at).
-- Jobs dead-lettered without an inbox row (a body that is not a job, an invalid
-- job: refused before any claim) get no event: the dead-letter queue has them with
-- their reason, and with no readable key there is no one to tell.
CREATE TABLE IF NOT EXISTS postie_events (
    id                  bigserial   PRIMARY KEY,
    key                 text        NOT NULL,
    outcome             text        NOT NULL CHECK (outcome IN
                        ('sent', 'dead', 'suppressed', 'throttled', 'cancelled', 'bounced',
                         'complained')),
    type                text,
    message_id          text,
    provider            text,
    provider_message_id text,
    reason              text,
    attempts            integer     NOT NULL DEFAULT 0,
    occurred_at         timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The job's type, recorded by every completion, so that an event written later (a
-- cancel of a job that was retrying, a bounce, a complaint) can name it.
ALTER TABLE postie_inbox ADD COLUMN IF NOT EXISTS type text;
