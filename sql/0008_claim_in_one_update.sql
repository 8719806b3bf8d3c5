-- Claim (issue 16): a key the inbox already holds in a claimable state -- every
-- ladder job, which the relay recorded as scheduled, and every retry -- is claimed
-- by one conditional UPDATE. 0002's postie_claim first locked the row
-- (SELECT ... FOR UPDATE: a tuple lock and a WAL record of its own) and then
-- updated it. Claim + `sent` completion pairs on 400,000 scheduled rows (pgbench, 16
-- clients, 2 cores): 6,902/s with 0002's function, 7,222/s with this one, 7,774/s
-- on new keys, so it takes back a third of what claiming a scheduled row cost.
--
-- 0002's function stays, unchanged, as postie_claim_locked: the path for every row
-- the UPDATE does not take (sent, cancelled through this revision, stale, a live or
-- an expired lease). The UPDATE's conditions are exactly those under which 0002
-- claimed a row that was not 'sending'. Under READ COMMITTED a concurrent claim makes
-- the UPDATE wait and re-check the row, so it then finds 'sending' and falls through
-- to the locked path. prior_status is only ever read for 'sending' (a takeover); the
-- UPDATE, which never takes a 'sending' row, reports 'claimable'.
ALTER FUNCTION postie_claim(text, text, bigint, integer) RENAME TO postie_claim_locked;

CREATE FUNCTION postie_claim(p_key text, p_owner text, p_lease_ms bigint, p_revision integer)
RETURNS TABLE (outcome text, fence bigint, attempts integer, prior_status text, wait_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
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

    RETURN QUERY SELECT * FROM postie_claim_locked(p_key, p_owner, p_lease_ms, p_revision);
END
$$;
