-- Issue 45: the key postie seals its own message headers with (src/headers/seal.rs),
-- so that a producer's publish cannot carry postie-attempt, postie-provider,
-- postie-tenant-slot or postie-due-at into the worker. One row, written by the first
-- instance that starts (32 random bytes from its operating system) and read by every
-- instance: the fleet shares it through its database, as it shares everything else.
-- Deleting the row rotates the key at the next start of every instance; copies in
-- flight then lose their postie-* headers once.
CREATE TABLE IF NOT EXISTS postie_header_key (
    id         smallint    PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    key        bytea       NOT NULL CHECK (octet_length(key) >= 32),
    created_at timestamptz NOT NULL DEFAULT now()
);
