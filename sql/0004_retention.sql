-- Retention (issue 14): finished rows are pruned by age of their last change.
-- A partial index holds finished rows only, so a claim (a 'sending' row) adds no
-- entry; each completion to a finished status adds one, appended at the right edge
-- (updated_at grows). Completions already change `status`, which the partial index
-- postie_inbox_scheduled_due names in its predicate, so they were never HOT updates:
-- this index adds one b-tree insert to a write that already updates the heap and the
-- primary key. A suppressed duplicate (only `duplicates` changes) stays HOT-eligible.
CREATE INDEX IF NOT EXISTS postie_inbox_finished_updated ON postie_inbox (updated_at)
    WHERE status IN ('sent', 'dead', 'cancelled', 'throttled');
-- On a large existing inbox, build it first without blocking writes (outside a
-- transaction), and this migration then finds it:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS postie_inbox_finished_updated
--       ON postie_inbox (updated_at) WHERE status IN ('sent', 'dead', 'cancelled', 'throttled');
