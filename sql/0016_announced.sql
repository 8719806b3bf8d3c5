-- Issue 30: one delivery event per (key, outcome). A job recorded `dead`,
-- `suppressed` or `throttled` whose delivery was not acked before its instance died
-- is delivered again, claimed (those statuses are claimable: a DLQ replay is how a
-- dead job comes back) and may be recorded the same way again. Its outcome did not
-- change, so it gets no second event.
--
-- postie_inbox.announced: the terminal status the last completion recorded; a
-- completion writes an event only for a status other than this one (the statement
-- reads the value it had before it, `inbox::events`).
ALTER TABLE postie_inbox ADD COLUMN IF NOT EXISTS announced text;
