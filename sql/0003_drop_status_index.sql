-- The index on status served only `postie status` (a GROUP BY over the whole table,
-- which reads every row anyway), yet every claim and every completion paid for it:
-- one more index entry per insert and per status change. Pending jobs keep their
-- partial index (postie_inbox_scheduled_due).
DROP INDEX IF EXISTS postie_inbox_status;
