-- postie's inbox: one row per idempotency key, the source of truth for
-- "has this email been sent?". Its states and transitions: ARCHITECTURE.md, "The
-- inbox's state machine"; the schema as all migrations leave it: sql/schema.sql.

CREATE TABLE postie_inbox (
    key          text        PRIMARY KEY,
    status       text        NOT NULL
                 CHECK (status IN ('sending', 'sent', 'retrying', 'dead')),
    owner        text,                    -- instance holding the claim while 'sending'
    lease_until  timestamptz,             -- claim is exclusive until then
    fence        bigint      NOT NULL DEFAULT 1,  -- +1 on every claim; completes must match
    attempts     integer     NOT NULL DEFAULT 0,  -- SMTP attempts over the key's lifetime
    takeovers    integer     NOT NULL DEFAULT 0,  -- claims of an expired 'sending' lease
    duplicates   integer     NOT NULL DEFAULT 0,  -- deliveries suppressed as already sent
    last_error   text,
    message_id   text,
    due_at       timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    sent_at      timestamptz
);

CREATE INDEX postie_inbox_status ON postie_inbox (status);

-- Claim a key in one round trip. Outcomes:
--   'claimed' : the caller owns the key under the returned fence;
--               prior_status says what it was ('new', 'retrying', 'dead' or
--               'sending' = taken over from an expired lease: the old owner may
--               have sent, so this is the known duplicate window);
--   'done'    : already sent; counted as a suppressed duplicate;
--   'busy'    : another live claim; wait_ms until its lease ends.
CREATE FUNCTION postie_claim(p_key text, p_owner text, p_lease_ms bigint)
RETURNS TABLE (outcome text, fence bigint, attempts integer, prior_status text, wait_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    r postie_inbox%ROWTYPE;
    lease timestamptz := clock_timestamp() + p_lease_ms * interval '1 millisecond';
BEGIN
    INSERT INTO postie_inbox AS i (key, status, owner, lease_until)
    VALUES (p_key, 'sending', p_owner, lease)
    ON CONFLICT (key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT 'claimed'::text, 1::bigint, 0, 'new'::text, 0::bigint;
        RETURN;
    END IF;

    SELECT * INTO r FROM postie_inbox i WHERE i.key = p_key FOR UPDATE;

    IF r.status IN ('retrying', 'dead')
       OR (r.status = 'sending' AND r.lease_until <= clock_timestamp()) THEN
        UPDATE postie_inbox i
           SET status = 'sending', owner = p_owner, lease_until = lease,
               fence = i.fence + 1,
               takeovers = i.takeovers + (r.status = 'sending')::int,
               updated_at = now()
         WHERE i.key = p_key;
        RETURN QUERY SELECT 'claimed'::text, r.fence + 1, r.attempts, r.status, 0::bigint;
    ELSIF r.status = 'sent' THEN
        UPDATE postie_inbox i SET duplicates = i.duplicates + 1 WHERE i.key = p_key;
        RETURN QUERY SELECT 'done'::text, r.fence, r.attempts, r.status, 0::bigint;
    ELSE
        RETURN QUERY SELECT 'busy'::text, r.fence, r.attempts, r.status,
            greatest(1, ceil(extract(epoch FROM r.lease_until - clock_timestamp()) * 1000))::bigint;
    END IF;
END
$$;
