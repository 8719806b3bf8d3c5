-- Issue 28: the claim in one function, and no SQL that nothing calls.
--
-- postie_claim (0008) ran 0002's function, renamed postie_claim_locked, for every
-- row its one conditional UPDATE did not take. The two are one function now, its
-- three steps in order and unchanged:
--   1. a new key: INSERT ... ON CONFLICT DO NOTHING claims it (fence 1);
--   2. a claimable row (scheduled, retrying, dead, cancelled before this revision,
--      throttled): one conditional UPDATE, no row lock taken first (0008's fast path);
--   3. anything else, under the row lock (0002's path): the insert again (the row
--      may have been pruned since step 1), then sent -> 'done', cancelled through
--      this revision -> 'cancelled', an older revision -> 'stale', an expired lease
--      -> taken over ('claimed', prior_status 'sending'), a live lease -> 'busy'.
-- The signature and the columns returned are 0008's, so that an instance still
-- running the previous postie keeps claiming through a rolling upgrade.
--
-- postie_schedule (0002) was never called: the relay records scheduled jobs in
-- batches (inbox::claim, schedule_many), with the same rules.

CREATE OR REPLACE FUNCTION postie_claim(p_key text, p_owner text, p_lease_ms bigint, p_revision integer)
RETURNS TABLE (outcome text, fence bigint, attempts integer, prior_status text, wait_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    lease timestamptz := clock_timestamp() + p_lease_ms * interval '1 millisecond';
    r postie_inbox%ROWTYPE;
BEGIN
    -- 1. A new key.
    INSERT INTO postie_inbox AS i (key, status, owner, lease_until, revision)
    VALUES (p_key, 'sending', p_owner, lease, p_revision)
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT 'claimed'::text, 1::bigint, 0, 'new'::text, 0::bigint;
        RETURN;
    END IF;

    -- 2. A claimable row, in one UPDATE. Under READ COMMITTED a concurrent claim
    -- makes it wait and re-check the row, which is then 'sending': step 3.
    UPDATE postie_inbox i
       SET status = 'sending', owner = p_owner, lease_until = lease,
           fence = i.fence + 1, revision = p_revision, updated_at = now()
     WHERE i.key = p_key
       AND i.status IN ('scheduled', 'retrying', 'dead', 'cancelled', 'throttled')
       AND p_revision >= i.revision
       AND (i.cancelled_through IS NULL OR p_revision > i.cancelled_through)
    RETURNING i.fence, i.attempts INTO r.fence, r.attempts;
    IF FOUND THEN
        RETURN QUERY SELECT 'claimed'::text, r.fence, r.attempts, 'claimable'::text, 0::bigint;
        RETURN;
    END IF;

    -- 3. Everything else, under the row lock.
    INSERT INTO postie_inbox AS i (key, status, owner, lease_until, revision)
    VALUES (p_key, 'sending', p_owner, lease, p_revision)
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT 'claimed'::text, 1::bigint, 0, 'new'::text, 0::bigint;
        RETURN;
    END IF;

    SELECT * INTO r FROM postie_inbox i WHERE i.key = p_key FOR UPDATE;

    IF r.status = 'sent' THEN
        UPDATE postie_inbox i SET duplicates = i.duplicates + 1 WHERE i.key = p_key;
        RETURN QUERY SELECT 'done'::text, r.fence, r.attempts, r.status, 0::bigint;
    ELSIF r.cancelled_through IS NOT NULL AND p_revision <= r.cancelled_through THEN
        RETURN QUERY SELECT 'cancelled'::text, r.fence, r.attempts, r.status, 0::bigint;
    ELSIF p_revision < r.revision THEN
        RETURN QUERY SELECT 'stale'::text, r.fence, r.attempts, r.status, 0::bigint;
    ELSIF r.status IN ('scheduled', 'retrying', 'dead', 'cancelled', 'throttled')
       OR (r.status = 'sending' AND r.lease_until <= clock_timestamp()) THEN
        UPDATE postie_inbox i
           SET status = 'sending', owner = p_owner, lease_until = lease,
               fence = i.fence + 1, revision = p_revision,
               takeovers = i.takeovers + (r.status = 'sending')::int,
               updated_at = now()
         WHERE i.key = p_key;
        RETURN QUERY SELECT 'claimed'::text, r.fence + 1, r.attempts, r.status, 0::bigint;
    ELSE
        -- 'sending' under a live lease. A newer revision is remembered, so that the
        -- older one in flight is the last of its kind.
        UPDATE postie_inbox i SET revision = greatest(i.revision, p_revision) WHERE i.key = p_key;
        RETURN QUERY SELECT 'busy'::text, r.fence, r.attempts, r.status,
            greatest(1, ceil(extract(epoch FROM r.lease_until - clock_timestamp()) * 1000))::bigint;
    END IF;
END
$$;

DROP FUNCTION postie_claim_locked(text, text, bigint, integer);
DROP FUNCTION postie_schedule(text, integer, bigint);
