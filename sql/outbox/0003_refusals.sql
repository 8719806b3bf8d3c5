-- Issue 45: an outbox that cannot wedge. Before this script one row the relay could
-- never publish (over the broker's max_message_size, a due time of 'infinity' that
-- postie.take could not subtract) was taken first by every pass, for good.
--
-- * postie.outbox_settings: the job size limit postie enforces (worker.max_body_bytes),
--   written by every `postie outbox install` (or its --max-body-bytes), read by enqueue.
-- * postie.enqueue refuses a job over that limit and a due time that is not finite.
-- * postie.take answers NULL for times it cannot compute, instead of failing the batch.
-- * postie.outbox_rejected: the rows the relay set aside with the reason (a refusal that
--   no retry changes), moved there by postie.reject; the rows after them go on.

CREATE TABLE postie.outbox_settings (
    only_row       boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    max_body_bytes integer NOT NULL CHECK (max_body_bytes > 0)
);

COMMENT ON TABLE postie.outbox_settings IS
    'The limits postie.enqueue applies, written by postie outbox install (worker.max_body_bytes)';

CREATE TABLE postie.outbox_rejected (
    id          bigint      PRIMARY KEY,
    job         jsonb       NOT NULL,
    enqueued_at timestamptz NOT NULL,
    due_at      timestamptz NOT NULL,
    rejected_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    reason      text        NOT NULL
);

COMMENT ON TABLE postie.outbox_rejected IS
    'Rows postie serve could never publish, set aside with the reason; the rows after them were relayed';

CREATE OR REPLACE FUNCTION postie.enqueue(job jsonb, due timestamptz) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    new_id bigint;
    stamped timestamptz := clock_timestamp();
    size bigint;
    max_bytes integer;
BEGIN
    IF job IS NULL OR jsonb_typeof(job) <> 'object' THEN
        RAISE EXCEPTION 'postie.enqueue: the job must be a JSON object, not %',
            coalesce(jsonb_typeof(job), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    -- The relay publishes job::text: that is the body whose size postie checks.
    SELECT s.max_body_bytes INTO max_bytes FROM postie.outbox_settings s;
    size := octet_length(job::text);
    IF size > max_bytes THEN
        RAISE EXCEPTION 'postie.enqueue: the job is % bytes, over postie''s limit of % bytes (worker.max_body_bytes)',
            size, max_bytes
            USING ERRCODE = '22023';
    END IF;
    IF due IS NOT NULL AND NOT isfinite(due) THEN
        RAISE EXCEPTION 'postie.enqueue: the due time must be finite, not %', due
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

-- As 0002's, but a time it cannot compute (a row due at 'infinity', from before this
-- script) is NULL instead of an error that failed every batch: the relay sets it aside.
CREATE OR REPLACE FUNCTION postie.take(n integer)
RETURNS TABLE (id bigint, job text, enqueued_ms bigint, delay_ms bigint, age_seconds float8)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT o.id, o.job::text,
           CASE WHEN isfinite(o.enqueued_at)
                THEN (extract(epoch FROM o.enqueued_at) * 1000)::bigint END,
           CASE WHEN isfinite(o.enqueued_at) AND isfinite(o.due_at)
                THEN (extract(epoch FROM o.due_at - o.enqueued_at) * 1000)::bigint END,
           CASE WHEN isfinite(o.enqueued_at)
                THEN extract(epoch FROM clock_timestamp() - o.enqueued_at)::float8 ELSE 0 END
      FROM postie.outbox o
     ORDER BY o.id
     LIMIT n
       FOR UPDATE SKIP LOCKED
$$;

-- Moves a row the relay holds (taken by postie.take in the same transaction) to
-- postie.outbox_rejected with the reason. SECURITY DEFINER: the relay's role may not
-- write either table itself.
CREATE FUNCTION postie.reject(row_id bigint, why text) RETURNS void
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH moved AS (
        DELETE FROM postie.outbox o WHERE o.id = row_id
        RETURNING o.id, o.job, o.enqueued_at, o.due_at)
    INSERT INTO postie.outbox_rejected (id, job, enqueued_at, due_at, reason)
    SELECT m.id, m.job, m.enqueued_at, m.due_at, left(why, 2000) FROM moved m
    ON CONFLICT (id) DO NOTHING
$$;

REVOKE ALL ON FUNCTION postie.reject(bigint, text) FROM PUBLIC;
