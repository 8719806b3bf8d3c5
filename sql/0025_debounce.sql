-- Issue 48, item 4: debounce. A debounced job's later versions replace the pending
-- one (a new revision each, assigned by postie: src/inbox/machine/debounce.rs). The
-- series' first arrival caps the due time (max_wait); its latest arrival keeps an
-- older version that reaches postie late from replacing a newer one.
ALTER TABLE postie_inbox
    ADD COLUMN IF NOT EXISTS debounce_first_at timestamptz,
    ADD COLUMN IF NOT EXISTS debounce_last_at  timestamptz;
