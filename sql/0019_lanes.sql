-- Issue 33: lanes. The relay records a scheduled job's lane (NULL: the default lane)
-- so that the reconciler judges each lane's jobs by that lane's queue and frontier:
-- lanes drain at their own pace, and a bulk job waiting its turn behind a long
-- backlog is not lost because transactional jobs due later were already sent.
ALTER TABLE postie_inbox ADD COLUMN IF NOT EXISTS lane text;
