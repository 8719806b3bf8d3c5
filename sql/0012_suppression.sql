-- Issue 30: suppression of addresses that hard-bounced or complained, and the
-- `suppressed` ending of a job left with no recipient.
--
-- postie_suppression: one row per (address, scope). `address` is the recipient's
-- address as postie normalises it (trimmed, lower-case); `scope` is '*' (every
-- email) or a job type. reason: hard_bounce, complaint, unsubscribe or manual;
-- source: what added it ('smtp' at send time, 'cli', a provider's name…); evidence:
-- the reply or report that caused it. A row past its expires_at no longer counts.
-- postie_suppression_audit: every add and remove, kept as long as the table is.
-- postie_suppression_strikes: bare 5xx replies (no enhanced status) per address,
-- counted towards suppression.threshold within suppression.window.
CREATE TABLE IF NOT EXISTS postie_suppression (
    address    text        NOT NULL,
    scope      text        NOT NULL DEFAULT '*',
    reason     text        NOT NULL
               CHECK (reason IN ('hard_bounce', 'complaint', 'unsubscribe', 'manual')),
    source     text        NOT NULL,
    evidence   text,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz,
    PRIMARY KEY (address, scope)
);

CREATE TABLE IF NOT EXISTS postie_suppression_audit (
    id       bigserial   PRIMARY KEY,
    address  text        NOT NULL,
    scope    text        NOT NULL,
    action   text        NOT NULL CHECK (action IN ('add', 'remove')),
    reason   text,
    source   text        NOT NULL,
    evidence text,
    at       timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS postie_suppression_strikes (
    address text          PRIMARY KEY,
    strikes timestamptz[] NOT NULL
);

-- `suppressed`: a job whose recipients are all suppressed ends here (acked, never
-- retried). Added NOT VALID, then validated: the validation scans the table without
-- blocking writes, as adding it at once would.
ALTER TABLE postie_inbox DROP CONSTRAINT IF EXISTS postie_inbox_status_check;
ALTER TABLE postie_inbox ADD CONSTRAINT postie_inbox_status_check CHECK (status IN
    ('scheduled', 'sending', 'sent', 'retrying', 'dead', 'cancelled', 'throttled',
     'suppressed')) NOT VALID;
ALTER TABLE postie_inbox VALIDATE CONSTRAINT postie_inbox_status_check;

-- Retention finds suppressed rows through their own small index (the finished-rows
-- index of 0004 is left as it is: rebuilding it would block writes).
CREATE INDEX IF NOT EXISTS postie_inbox_suppressed_updated ON postie_inbox (updated_at)
    WHERE status = 'suppressed';

-- The claim, as 0010's, with 'suppressed' among the claimable statuses: a job that
-- comes back (a replay, a new revision) is claimed and checked again.
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
    ELSIF r.cancelled_through IS NOT NULL AND p_revision <= r.cancelled_through THEN
        RETURN QUERY SELECT 'cancelled'::text, r.fence, r.attempts, r.status, 0::bigint;
    ELSIF p_revision < r.revision THEN
        RETURN QUERY SELECT 'stale'::text, r.fence, r.attempts, r.status, 0::bigint;
    ELSIF r.status IN ('scheduled', 'retrying', 'dead', 'cancelled', 'throttled', 'suppressed')
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
