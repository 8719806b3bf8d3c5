-- Issue 32: the console's overview shows each transport's breaker on every instance.
-- A breaker lives in one instance's memory; the instance writes its state here when it
-- opens (the prober starts) and when it closes (the prober's probe answered), so that
-- one page shows the fleet. A row not updated for a while belongs to an instance that
-- stopped while the breaker was open; `inbox::breakers` deletes closed rows older than
-- a day whenever it writes, so the table holds at most a day of instances.
CREATE TABLE IF NOT EXISTS postie_breakers (
    owner      text        NOT NULL,  -- the instance (worker.owner, postie_inbox.owner)
    provider   text        NOT NULL,  -- the transport's name (transport.providers)
    open       boolean     NOT NULL,
    since      timestamptz NOT NULL DEFAULT now(),  -- when it took this state
    PRIMARY KEY (owner, provider)
);
