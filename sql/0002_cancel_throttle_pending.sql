-- Cancel and reschedule by key (revisions and tombstones), per-recipient throttling,
-- and pending visibility in ladder mode. See README "Beyond the plugin".

ALTER TABLE postie_inbox DROP CONSTRAINT postie_inbox_status_check;
ALTER TABLE postie_inbox ADD CONSTRAINT postie_inbox_status_check CHECK (status IN
    ('scheduled', 'sending', 'sent', 'retrying', 'dead', 'cancelled', 'throttled'));
-- Highest job revision seen for the key; older deliveries are stale.
ALTER TABLE postie_inbox ADD COLUMN revision integer NOT NULL DEFAULT 0;
-- A cancel covers every revision up to this one (a tombstone when nothing else is known).
ALTER TABLE postie_inbox ADD COLUMN cancelled_through integer;
ALTER TABLE postie_inbox ADD COLUMN cancelled_at timestamptz;
CREATE INDEX postie_inbox_scheduled_due ON postie_inbox (due_at) WHERE status = 'scheduled';

-- Recent sends per (type, recipient), for the throttle's sliding window.
CREATE TABLE postie_throttle (
    kind       text NOT NULL,
    recipient  text NOT NULL,
    sends      timestamptz[] NOT NULL,
    PRIMARY KEY (kind, recipient)
);

-- Claim with revisions. New outcomes besides 'claimed', 'done' and 'busy':
--   'cancelled' : a cancel covers this revision;
--   'stale'     : a newer revision of the key has been seen.
DROP FUNCTION postie_claim(text, text, bigint);
CREATE FUNCTION postie_claim(p_key text, p_owner text, p_lease_ms bigint, p_revision integer)
RETURNS TABLE (outcome text, fence bigint, attempts integer, prior_status text, wait_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    r postie_inbox%ROWTYPE;
    lease timestamptz := clock_timestamp() + p_lease_ms * interval '1 millisecond';
BEGIN
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

-- Cancel by key: a tombstone if the key is unknown; never un-sends. Returns the
-- status the key had ('new' if none) and the revision the cancel covers.
CREATE FUNCTION postie_cancel(p_key text, p_revision integer)
RETURNS TABLE (prior_status text, covers integer)
LANGUAGE plpgsql AS $$
DECLARE
    r postie_inbox%ROWTYPE;
    through integer;
BEGIN
    INSERT INTO postie_inbox AS i (key, status, revision, cancelled_through, cancelled_at)
    VALUES (p_key, 'cancelled', coalesce(p_revision, 0), coalesce(p_revision, 0), now())
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT 'new'::text, coalesce(p_revision, 0);
        RETURN;
    END IF;
    SELECT * INTO r FROM postie_inbox i WHERE i.key = p_key FOR UPDATE;
    through := greatest(coalesce(r.cancelled_through, -1), coalesce(p_revision, r.revision));
    UPDATE postie_inbox i
       SET cancelled_through = through, cancelled_at = now(), updated_at = now(),
           status = CASE WHEN i.status IN ('sent', 'sending') THEN i.status ELSE 'cancelled' END
     WHERE i.key = p_key;
    RETURN QUERY SELECT r.status, through;
END
$$;

-- Ladder mode: the relay records each job it schedules (pending visibility).
-- Only a key nobody has claimed, sent or cancelled becomes or stays 'scheduled'.
CREATE FUNCTION postie_schedule(p_key text, p_revision integer, p_due_ms bigint)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO postie_inbox AS i (key, status, revision, due_at)
    VALUES (p_key, 'scheduled', p_revision, to_timestamp(p_due_ms / 1000.0))
    ON CONFLICT (key) DO UPDATE
       SET status = 'scheduled', due_at = EXCLUDED.due_at, revision = EXCLUDED.revision,
           updated_at = now()
     WHERE i.status IN ('scheduled', 'cancelled', 'retrying')
       AND EXCLUDED.revision >= i.revision
       AND (i.cancelled_through IS NULL OR EXCLUDED.revision > i.cancelled_through);
$$;
