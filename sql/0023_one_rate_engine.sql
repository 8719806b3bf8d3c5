-- Issue 47: one rate engine. Every GCRA row (the fleet's send rate, each transport's,
-- each tenant's slot in its lane) lives in postie_rate_limit and moves by one
-- function, postie_gcra_take, on one clock (clock_timestamp(), read once, as the
-- claim's lease reads it). A tenant's row is named 'tenant:<lane>:<tenant>' (a lane's
-- name has no ':').
--
-- postie_tenant_slots is no longer written. Its rows move here; the table stays for
-- the instances of the previous version that still run during a rolling upgrade
-- (their slots and these are apart until they stop), and retention prunes both.
CREATE OR REPLACE FUNCTION postie_gcra_take(p_name text, p_span_ms float8,
                                 OUT slot timestamptz, OUT ahead_ms float8)
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := clock_timestamp();
    v_span interval    := p_span_ms * interval '1 millisecond';
BEGIN
    -- The slot starts at the theoretical arrival time, or now if that has passed;
    -- taking it moves the time on by the span.
    INSERT INTO postie_rate_limit AS r (name, tat) VALUES (p_name, v_now + v_span)
    ON CONFLICT (name) DO UPDATE SET tat = greatest(r.tat, v_now) + v_span
    RETURNING r.tat - v_span INTO slot;
    ahead_ms := extract(epoch FROM slot - v_now) * 1000;
END
$$;

INSERT INTO postie_rate_limit (name, tat)
SELECT 'tenant:' || lane || ':' || tenant, tat FROM postie_tenant_slots
ON CONFLICT (name) DO UPDATE SET tat = greatest(postie_rate_limit.tat, EXCLUDED.tat);
