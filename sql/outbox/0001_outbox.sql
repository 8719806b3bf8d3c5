-- postie's transactional outbox, installed in a PRODUCER's database by
-- `postie outbox install` (src/outbox/install.rs), under an advisory lock, and
-- recorded in postie.outbox_version: versioned apart from postie's own migrations.
--
-- A producer calls postie.enqueue inside the transaction that makes its business
-- change; postie serve (outbox.sources) publishes each committed row to <p>.delayed
-- and deletes it after the broker's confirm. A rolled-back enqueue leaves no row.

CREATE TABLE postie.outbox (
    id          bigserial PRIMARY KEY,
    job         jsonb       NOT NULL,
    -- The clock at the enqueue call, not the transaction's start: the job's delay
    -- counts from here (the relay publishes it as postie-published-at).
    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    due_at      timestamptz NOT NULL
);

COMMENT ON TABLE postie.outbox IS
    'Jobs enqueued by postie.enqueue, waiting for postie serve to publish them (outbox.sources)';

-- Refuses what postie would dead-letter anyway (DESIGN.md §1; the key rule of
-- src/contract/key.rs: "key", else "order_id" and "type"; null is absent, and a
-- present "key" is never passed over), stamps the row with the clock and wakes the
-- relay (NOTIFY is delivered at commit, and not at all on rollback).
CREATE FUNCTION postie.enqueue(job jsonb, due timestamptz) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    new_id bigint;
    stamped timestamptz := clock_timestamp();
BEGIN
    IF job IS NULL OR jsonb_typeof(job) <> 'object' THEN
        RAISE EXCEPTION 'postie.enqueue: the job must be a JSON object, not %',
            coalesce(jsonb_typeof(job), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF coalesce(jsonb_typeof(job -> 'key'), 'null') <> 'null' THEN
        IF jsonb_typeof(job -> 'key') <> 'string' OR btrim(job ->> 'key') = '' THEN
            RAISE EXCEPTION 'postie.enqueue: "key" must be a non-empty string'
                USING ERRCODE = '22023';
        END IF;
    ELSIF coalesce(jsonb_typeof(job -> 'order_id'), 'null') <> 'string'
       OR coalesce(jsonb_typeof(job -> 'type'), 'null') <> 'string' THEN
        RAISE EXCEPTION 'postie.enqueue: no idempotency key: give "key", or both "order_id" and "type"'
            USING ERRCODE = '22023';
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM (VALUES (job -> 'to'), (job -> 'cc'), (job -> 'bcc')) AS r(v)
         WHERE (jsonb_typeof(v) = 'array' AND jsonb_array_length(v) > 0)
            OR (jsonb_typeof(v) = 'string' AND btrim(v #>> '{}') <> '')
    ) THEN
        RAISE EXCEPTION 'postie.enqueue: no recipient in "to", "cc" or "bcc"'
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO postie.outbox (job, enqueued_at, due_at)
    VALUES (job, stamped, coalesce(due, stamped))
    RETURNING id INTO new_id;
    PERFORM pg_notify('postie_outbox', '');
    RETURN new_id;
END
$$;

-- A delay from now (the clock, not the transaction's start); '0' or none: at once.
CREATE FUNCTION postie.enqueue(job jsonb, delay interval DEFAULT '0') RETURNS bigint
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT postie.enqueue(job, clock_timestamp() + coalesce(delay, interval '0')) $$;

-- Only the roles `postie outbox install --app-role` names may enqueue.
REVOKE ALL ON FUNCTION postie.enqueue(jsonb, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION postie.enqueue(jsonb, interval) FROM PUBLIC;
