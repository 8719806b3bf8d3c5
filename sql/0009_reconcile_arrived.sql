-- Issue 26: the reconciler re-publishes only what the broker lost.
--
-- arrived_at: a worker has received this scheduled job and is waiting its turn (the
-- send rate, an open breaker, a slow relay) before it claims it. Written in batches,
-- only for deliveries that wait (not on the fast path), and cleared when the relay
-- schedules the key again. A job that has arrived is not lost, so the reconciler
-- leaves it alone.
--
-- reconciled: how many times the reconciler re-published this row (also counted in
-- postie_reconciled_total).
ALTER TABLE postie_inbox
    ADD COLUMN arrived_at timestamptz,
    ADD COLUMN reconciled integer NOT NULL DEFAULT 0;

-- The reconciler's frontier: the latest due time among scheduled jobs workers hold.
-- Only rows a worker marked are in it, so the relay's inserts never touch it.
CREATE INDEX postie_inbox_arrived_due ON postie_inbox (due_at)
    WHERE status = 'scheduled' AND arrived_at IS NOT NULL;
