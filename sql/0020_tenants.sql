-- Issue 33: fairness inside a lane. One row per lane and tenant that has a cap
-- (topology.lanes.<l>.tenant_rate_limit): the tenant's next free slot, a GCRA's
-- theoretical arrival time. A job takes the slot `tat` and moves it on by one
-- interval; a job whose slot is further ahead than the burst is deferred to it.
-- Rows whose slot has long passed are deleted by retention (inbox::prune).
CREATE TABLE IF NOT EXISTS postie_tenant_slots (
    lane    text        NOT NULL,
    tenant  text        NOT NULL,
    tat     timestamptz NOT NULL,
    PRIMARY KEY (lane, tenant)
);
