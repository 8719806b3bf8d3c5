-- Issue 50: one-click unsubscribe. A recipient's one-click POST (or the mailto form)
-- suppresses the address for the link's scope (postie_suppression, reason
-- 'unsubscribe', source 'one-click' or 'mailto') and writes an 'unsubscribed' event
-- for the job whose email carried the link, in one transaction
-- (src/inbox/unsubscribe.rs). The constraint is replaced NOT VALID, then validated:
-- the validation scans the table without blocking writes.
ALTER TABLE postie_events DROP CONSTRAINT IF EXISTS postie_events_outcome_check;
ALTER TABLE postie_events ADD CONSTRAINT postie_events_outcome_check CHECK (outcome IN
    ('sent', 'dead', 'suppressed', 'throttled', 'cancelled', 'bounced', 'complained',
     'unsubscribed')) NOT VALID;
ALTER TABLE postie_events VALIDATE CONSTRAINT postie_events_outcome_check;
