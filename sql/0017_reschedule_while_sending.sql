-- Issue 34, finding 1 of the model (tests/model): the relay's record of a newer
-- revision was dropped while an older one was being sent. `Inbox::schedule_many`
-- updated only `scheduled`, `cancelled` and `retrying` rows, so when the older
-- revision's send then failed, its retry was claimed and the superseded content went
-- out, and a broker that lost the newer revision left no scheduled row for the
-- reconciler to re-publish.
--
-- Now `schedule_many` records a newer revision on a `sending` row too (its revision,
-- due time and body; the row stays `sending`) and sets `rescheduled`. The claim's
-- completion (`inbox::COMPLETE`) then ends a send that did not succeed as `scheduled`
-- (the newer revision waits, for the worker or the reconciler; the older one is now
-- stale) instead of `retrying`, `dead`, `throttled` or `suppressed`; a `sent` stays
-- `sent` (an email that left cannot be rescheduled: the newer revision finds the key
-- done). Every claim clears the flag, so it only ever describes the send in progress.
--
-- Finding 2 of the same model: a cancel of a row whose sender crashed while
-- `sending` was never finished. The claim answered `cancelled` even under the
-- sender's live lease, the redelivery was acked, and `Inbox::finish_cancelled` ended
-- only `retrying` rows. Now a covered revision under a live lease is answered
-- `busy` (it comes back when the lease is out), and `finish_cancelled` also ends a
-- `sending` row whose lease ran out, moving the fence.
ALTER TABLE postie_inbox ADD COLUMN IF NOT EXISTS rescheduled boolean NOT NULL DEFAULT false;

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
           fence = i.fence + 1, revision = p_revision, rescheduled = false,
           updated_at = now()
     WHERE i.key = p_key
       AND i.status IN ('scheduled', 'retrying', 'dead', 'cancelled', 'throttled', 'suppressed')
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
    ELSIF r.cancelled_through IS NOT NULL AND p_revision <= r.cancelled_through
      AND NOT (r.status = 'sending' AND r.lease_until > clock_timestamp()) THEN
        -- (A cancel that came while another holds a live lease waits for that send's
        -- end, as 'busy': answered 'cancelled' now, nothing would end a row whose
        -- sender then crashed. Issue 34, the model's finding 2. 0017.)
        RETURN QUERY SELECT 'cancelled'::text, r.fence, r.attempts, r.status, 0::bigint;
    ELSIF p_revision < r.revision THEN
        RETURN QUERY SELECT 'stale'::text, r.fence, r.attempts, r.status, 0::bigint;
    ELSIF r.status IN ('scheduled', 'retrying', 'dead', 'cancelled', 'throttled', 'suppressed')
       OR (r.status = 'sending' AND r.lease_until <= clock_timestamp()) THEN
        UPDATE postie_inbox i
           SET status = 'sending', owner = p_owner, lease_until = lease,
               fence = i.fence + 1, revision = p_revision, rescheduled = false,
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
