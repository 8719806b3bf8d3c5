-- postie.take, the relay's batch: a script of its own, so that an outbox installed
-- by 0001 alone gets it from the next `postie outbox install`.
--
-- The relay's batch: the oldest rows no other relay holds, locked until the relay's
-- transaction ends (it deletes them after the broker's confirms, then commits).
-- SECURITY DEFINER because a row lock needs the UPDATE privilege, which the relay's
-- role does not get: it may only take, read and delete.
CREATE FUNCTION postie.take(n integer)
RETURNS TABLE (id bigint, job text, enqueued_ms bigint, delay_ms bigint, age_seconds float8)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT o.id, o.job::text,
           (extract(epoch FROM o.enqueued_at) * 1000)::bigint,
           (extract(epoch FROM o.due_at - o.enqueued_at) * 1000)::bigint,
           extract(epoch FROM clock_timestamp() - o.enqueued_at)::float8
      FROM postie.outbox o
     ORDER BY o.id
     LIMIT n
       FOR UPDATE SKIP LOCKED
$$;

-- Only the roles `postie outbox install --relay-role` names may take.
REVOKE ALL ON FUNCTION postie.take(integer) FROM PUBLIC;
