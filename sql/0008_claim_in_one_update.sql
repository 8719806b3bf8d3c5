-- Claim (issue 16): a key the inbox already holds in a claimable state -- every
-- ladder job, which the relay recorded as scheduled, and every retry -- is claimed
-- by one conditional UPDATE. 0002's postie_claim first locked the row
-- (SELECT ... FOR UPDATE: a tuple lock and a WAL record of its own) and then
-- updated it. Claim + `sent` completion pairs on 400,000 scheduled rows (pgbench, 16
-- clients, 2 cores): 6,902/s with 0002's function, 7,222/s with this one, 7,774/s
-- on new keys, so it takes back a third of what claiming a scheduled row cost.
--
-- The UPDATE's conditions are exactly those under which 0002 claimed a row that was
-- not 'sending': not sent, not cancelled through this revision, not stale. Under
-- READ COMMITTED a concurrent claim makes this UPDATE wait and re-check the row, so
-- it then finds 'sending' and falls through to the locked path below, unchanged from
-- 0002 (sent, cancelled, stale, busy, or an expired lease taken over). prior_status
-- is only ever read for 'sending' (a takeover); the fast path, which never takes a
-- 'sending' row, reports 'claimable'.
CREATE OR REPLACE FUNCTION postie_claim(p_key text, p_owner text, p_lease_ms bigint, p_revision integer)
RETURNS TABLE (outcome text, fence bigint, attempts integer, prior_status text, wait_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    r postie_inbox%ROWTYPE;
    lease timestamptz := clock_timestamp() + p_lease_ms * interval '1 millisecond';
    new_fence bigint;
    prior_attempts integer;
BEGIN
    INSERT INTO postie_inbox AS i (key, status, owner, lease_until, revision)
    VALUES (p_key, 'sending', p_owner, lease, p_revision)
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT 'claimed'::text, 1::bigint, 0, 'new'::text, 0::bigint;
        RETURN;
    END IF;

    UPDATE postie_inbox i
       SET status = 'sending', owner = p_owner, lease_until = lease,
           fence = i.fence + 1, revision = p_revision, updated_at = now()
     WHERE i.key = p_key
       AND i.status IN ('scheduled', 'retrying', 'dead', 'cancelled', 'throttled')
       AND p_revision >= i.revision
       AND (i.cancelled_through IS NULL OR p_revision > i.cancelled_through)
    RETURNING i.fence, i.attempts INTO new_fence, prior_attempts;
    IF FOUND THEN
        RETURN QUERY SELECT 'claimed'::text, new_fence, prior_attempts, 'claimable'::text, 0::bigint;
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
