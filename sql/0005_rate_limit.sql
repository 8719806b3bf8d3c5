-- The fleet-wide send-rate limit (smtp.rate_limit): one GCRA row per topology
-- prefix. `tat` is the theoretical arrival time: instances reserve slices of tokens
-- by moving it forward in one UPDATE (see inbox::rate).
CREATE TABLE postie_rate_limit (
    name text PRIMARY KEY,
    tat  timestamptz NOT NULL
);
