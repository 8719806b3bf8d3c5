-- Ladder mode: PostgreSQL is the schedule of record, the ladder the transport.
-- The relay keeps each scheduled job's body until the job is finished, so that the
-- reconciler can re-publish a job the ladder failed to deliver (a broker node lost
-- with expired messages still in its dead-letter process) once it is overdue.
ALTER TABLE postie_inbox
    ADD COLUMN body bytea,                  -- the job as published; NULL once finished
    ADD COLUMN reconciled_at timestamptz;   -- last re-publish by the reconciler

-- The reconciler scans scheduled rows by due time through postie_inbox_scheduled_due
-- (0002), as `postie pending` does.
