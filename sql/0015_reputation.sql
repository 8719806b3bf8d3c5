-- Issue 30: bounce and complaint rates per job type, over the last hour and day.
--
-- postie_send_tally: emails sent per job type and minute. Each instance counts its
-- sends in memory and adds them here every few seconds (one statement per instance
-- per flush, not one per email); retention deletes minutes older than two days. The
-- bounces and complaints are postie_feedback's rows (0013).
--
-- A bounce or complaint matched to a job later (a webhook, a report) is counted
-- under the type its row keeps (postie_inbox.type, 0014).
CREATE TABLE IF NOT EXISTS postie_send_tally (
    minute timestamptz NOT NULL,
    type   text        NOT NULL,
    sent   bigint      NOT NULL,
    PRIMARY KEY (minute, type)
);
