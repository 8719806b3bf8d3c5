-- The schema as all migrations in sql/ leave it: every table, index and function
-- postie uses, in one file to read. It is NOT how a database is set up: `postie
-- migrate` (or database.migrate_on_start) applies the numbered files in order and
-- records each in postie_migrations (src/inbox/migrate.rs).
--
-- Kept true by tests/schema_sql.rs, which migrates one fresh database, loads this
-- file into another, and compares their catalogs (columns, constraints, indexes,
-- function definitions). A new migration updates this file in the same commit.
--
-- Numbering: there is no 0006. No file of that number was ever committed (`git log
-- --all -- sql/`): 0004, 0005 and 0007 were written at the same time for issues 14, 13
-- and 15, and 0006 was skipped between them. Versions increase; they need not be
-- contiguous.
--
-- The row's states and the transition behind each change of status are drawn in
-- ARCHITECTURE.md, "The inbox's state machine".

-- One row per idempotency key: the source of truth for "has this email been sent?".
CREATE TABLE postie_inbox (
    key          text        PRIMARY KEY,
    status       text        NOT NULL CHECK (status IN
                 ('scheduled', 'sending', 'sent', 'retrying', 'dead', 'cancelled', 'throttled',
                  'suppressed')),  -- 0012: suppressed
    owner        text,                    -- instance holding the claim while 'sending'
    lease_until  timestamptz,             -- claim is exclusive until then
    fence        bigint      NOT NULL DEFAULT 1,  -- +1 on every claim; completions must match
    attempts     integer     NOT NULL DEFAULT 0,  -- SMTP attempts over the key's lifetime
    takeovers    integer     NOT NULL DEFAULT 0,  -- claims of an expired 'sending' lease
    duplicates   integer     NOT NULL DEFAULT 0,  -- deliveries suppressed as already sent
    last_error   text,
    message_id   text,
    due_at       timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    sent_at      timestamptz,
    -- 0002: revisions and cancels
    revision          integer NOT NULL DEFAULT 0,  -- highest job revision seen; older are stale
    cancelled_through integer,                     -- a cancel covers revisions up to this one
    cancelled_at      timestamptz,
    -- 0007: ladder mode keeps the job until it is finished, for the reconciler
    body          bytea,                  -- the job as published; NULL once finished
    reconciled_at timestamptz,            -- last re-publish by the reconciler
    -- 0009: the reconciler re-publishes only what the broker lost
    arrived_at    timestamptz,            -- a worker holds this scheduled job, unclaimed
    reconciled    integer NOT NULL DEFAULT 0,  -- re-publishes by the reconciler
    -- 0011: who sent it
    provider            text,             -- the transport that accepted the email
    provider_message_id text,             -- the id its API answered with (NULL for SMTP)
    -- 0013: what became of it after the 250
    feedback    text CHECK (feedback IN ('bounced', 'complained')),
    feedback_at timestamptz,
    -- 0014: the job's type, for its events and the rates per type (0015)
    type        text,
    -- 0016: the terminal status last recorded; no second event for the same one
    announced   text,
    -- 0017: a newer revision was recorded while this row was 'sending'; its
    -- completion, unless 'sent', leaves the row 'scheduled' for that revision
    rescheduled boolean NOT NULL DEFAULT false,
    -- 0019: the lane of a scheduled job (NULL: the default lane), for the reconciler
    lane        text,
    -- 0021: the recipients a sent email went to (trimmed, lower-cased); feedback
    -- about an address suppresses it only when the email it names went to it
    recipients  text[],
    -- 0025: a debounced job's series: its first version's arrival (the cap,
    -- max_wait, counts from it) and its latest's (an older one arriving late is stale)
    debounce_first_at timestamptz,
    debounce_last_at  timestamptz
);

-- Pending jobs by due time (ladder mode: postie pending, the reconciler). 0002.
CREATE INDEX postie_inbox_scheduled_due ON postie_inbox (due_at) WHERE status = 'scheduled';
-- Finished rows by age, for retention (0004). There is no index on status (0003).
CREATE INDEX postie_inbox_finished_updated ON postie_inbox (updated_at)
    WHERE status IN ('sent', 'dead', 'cancelled', 'throttled');
-- The reconciler's frontier: scheduled jobs a worker holds (0009).
CREATE INDEX postie_inbox_arrived_due ON postie_inbox (due_at)
    WHERE status = 'scheduled' AND arrived_at IS NOT NULL;
-- Suppressed rows by age, for retention (0012).
CREATE INDEX postie_inbox_suppressed_updated ON postie_inbox (updated_at)
    WHERE status = 'suppressed';

-- A notification's email, by its Message-ID or by the provider's id (0013).
CREATE INDEX postie_inbox_message_id ON postie_inbox (message_id)
    WHERE message_id IS NOT NULL;
CREATE INDEX postie_inbox_provider_message_id ON postie_inbox (provider_message_id)
    WHERE provider_message_id IS NOT NULL;

-- Recent sends per (type, recipient), for the per-type throttle's window (0002).
CREATE TABLE postie_throttle (
    kind       text NOT NULL,
    recipient  text NOT NULL,
    sends      timestamptz[] NOT NULL,
    PRIMARY KEY (kind, recipient)
);

-- Suppressed addresses (0012): per address and scope ('*' or a job type), why,
-- from what, until when; every add and remove in the audit; bare 5xx strikes.
CREATE TABLE postie_suppression (
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

CREATE TABLE postie_suppression_audit (
    id       bigserial   PRIMARY KEY,
    address  text        NOT NULL,
    scope    text        NOT NULL,
    action   text        NOT NULL CHECK (action IN ('add', 'remove')),
    reason   text,
    source   text        NOT NULL,
    evidence text,
    at       timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE postie_suppression_strikes (
    address text          PRIMARY KEY,
    strikes timestamptz[] NOT NULL
);

-- Bounces and complaints (0013): one row per (source, notification_id, address), so
-- a replayed notification inserts nothing; the job's key and type when matched.
CREATE TABLE postie_feedback (
    id              bigserial   PRIMARY KEY,
    source          text        NOT NULL,
    notification_id text        NOT NULL,
    kind            text        NOT NULL CHECK (kind IN ('bounce', 'complaint')),
    address         text        NOT NULL,
    key             text,
    type            text,
    evidence        text        NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (source, notification_id, address)
);
CREATE INDEX postie_feedback_received ON postie_feedback (received_at);

-- Mailgun's signature tokens (0021): each with the SHA-256 of the request it came in,
-- until past its signed window; the same token with another body is a replay.
CREATE TABLE postie_webhook_tokens (
    source      text        NOT NULL,
    token       text        NOT NULL,
    body_sha256 text        NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (source, token)
);
CREATE INDEX postie_webhook_tokens_expires ON postie_webhook_tokens (expires_at);

-- Emails sent per job type and minute (0015), added by each instance every few
-- seconds; with postie_feedback, the bounce and complaint rates per type.
CREATE TABLE postie_send_tally (
    minute timestamptz NOT NULL,
    type   text        NOT NULL,
    sent   bigint      NOT NULL,
    PRIMARY KEY (minute, type)
);

-- Delivery events (0014): the outbox of `<p>.events`, one row per outcome, written
-- with the change of status it reports and deleted once its publish is confirmed.
CREATE TABLE postie_events (
    id                  bigserial   PRIMARY KEY,
    key                 text        NOT NULL,
    outcome             text        NOT NULL CHECK (outcome IN
                        ('sent', 'dead', 'suppressed', 'throttled', 'cancelled', 'bounced',
                         'complained', 'unsubscribed')),
    type                text,
    message_id          text,
    provider            text,
    provider_message_id text,
    reason              text,
    attempts            integer     NOT NULL DEFAULT 0,
    occurred_at         timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Each instance's transport breakers (0018), for the console: written when one opens
-- and when it closes; closed rows older than a day deleted on each write.
CREATE TABLE postie_breakers (
    owner      text        NOT NULL,  -- the instance (worker.owner, postie_inbox.owner)
    provider   text        NOT NULL,  -- the transport's name (transport.providers)
    open       boolean     NOT NULL,
    since      timestamptz NOT NULL DEFAULT now(),  -- when it took this state
    PRIMARY KEY (owner, provider)
);

-- Every GCRA row (0005; 0023): the fleet's send rate per topology prefix, each
-- transport's, and each tenant's slot in its lane ('tenant:<lane>:<tenant>'); moved
-- only by postie_gcra_take.
CREATE TABLE postie_rate_limit (
    name text PRIMARY KEY,
    tat  timestamptz NOT NULL
);

-- Each tenant's next slot inside a lane with a tenant cap (0020): no longer written
-- since 0023 (postie_rate_limit holds them), kept for a rolling upgrade's older
-- instances, pruned by retention.
CREATE TABLE postie_tenant_slots (
    lane    text        NOT NULL,
    tenant  text        NOT NULL,
    tat     timestamptz NOT NULL,
    PRIMARY KEY (lane, tenant)
);

-- The key postie seals its own message headers with (0022): one row, written by
-- the first instance that starts.
CREATE TABLE postie_header_key (
    id         smallint    PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    key        bytea       NOT NULL CHECK (octet_length(key) >= 32),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The migration runner's record (created by the runner itself, before 0001;
-- checksum: SHA-256 of the file as applied, or as found when first recorded).
CREATE TABLE postie_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    checksum   text
);

-- The claim (0012: 0010's with 'suppressed' claimable; 0001, 0002 and 0008 before it). Outcomes:
--   'claimed'   : the caller owns the key under the returned fence; prior_status is
--                 'new', 'claimable' (the fast path) or the status it had ('sending':
--                 taken over from an expired lease, the known duplicate window);
--   'done'      : already sent; counted as a suppressed duplicate;
--   'cancelled' : a cancel covers this revision;
--   'stale'     : a newer revision of the key has been seen;
--   'busy'      : another live claim; wait_ms until its lease ends.
-- `attempts` is returned for instances of older postie versions only.
CREATE FUNCTION postie_claim(p_key text, p_owner text, p_lease_ms bigint, p_revision integer)
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

-- Cancel by key: a tombstone if the key is unknown; never un-sends. Returns the
-- status the key had ('new' if none) and the revision the cancel covers. (0002)
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

-- The one rate engine (0023): takes the next slot of GCRA row p_name for p_span_ms,
-- on one clock (clock_timestamp(), read once): the slot's start and how far ahead of
-- now it is.
CREATE FUNCTION postie_gcra_take(p_name text, p_span_ms float8,
                                 OUT slot timestamptz, OUT ahead_ms float8)
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := clock_timestamp();
    v_span interval    := p_span_ms * interval '1 millisecond';
BEGIN
    -- The slot starts at the theoretical arrival time, or now if that has passed;
    -- taking it moves the time on by the span.
    INSERT INTO postie_rate_limit AS r (name, tat) VALUES (p_name, v_now + v_span)
    ON CONFLICT (name) DO UPDATE SET tat = greatest(r.tat, v_now) + v_span
    RETURNING r.tat - v_span INTO slot;
    ahead_ms := extract(epoch FROM slot - v_now) * 1000;
END
$$;

-- The per-type throttle's window (0024), on the same clock: takes one send of p_kind
-- to p_recipient if fewer than p_limit were taken in the last p_window_ms; refused,
-- when the window next has room (Unix ms). A sliding window, not a GCRA row: "at
-- most N per window" has no GCRA configuration.
CREATE FUNCTION postie_window_take(p_kind text, p_recipient text,
                                   p_limit bigint, p_window_ms bigint,
                                   p_now timestamptz DEFAULT clock_timestamp(),
                                   OUT allowed boolean, OUT next_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_since timestamptz := p_now - p_window_ms * interval '1 millisecond';
BEGIN
    INSERT INTO postie_throttle AS t (kind, recipient, sends)
    VALUES (p_kind, p_recipient, ARRAY[p_now])
    ON CONFLICT (kind, recipient) DO UPDATE
       SET sends = ARRAY(SELECT s FROM unnest(t.sends) s WHERE s > v_since) || p_now
     WHERE (SELECT count(*) FROM unnest(t.sends) s WHERE s > v_since) < p_limit
    RETURNING true INTO allowed;
    IF allowed THEN
        RETURN;
    END IF;
    allowed := false;
    SELECT (extract(epoch FROM min(s)) * 1000)::bigint + p_window_ms INTO next_ms
      FROM postie_throttle t, unnest(t.sends) s
     WHERE t.kind = p_kind AND t.recipient = p_recipient AND s > v_since;
    next_ms := coalesce(next_ms, (extract(epoch FROM p_now) * 1000)::bigint);
END
$$;
