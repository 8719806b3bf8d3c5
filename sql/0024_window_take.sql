-- Issue 47: the per-type throttle's window moves into the rate engine's SQL, on its
-- clock. postie_window_take takes one send of p_kind to p_recipient if fewer than
-- p_limit were taken in the last p_window_ms, in one statement, reading the clock
-- once (p_now; a test passes its own). Refused: when the window next has room (the
-- oldest send inside it, plus the window), Unix ms.
--
-- It is a sliding window, not a GCRA row: "at most N per recipient per window" has
-- no GCRA configuration. A span of window/N with a burst of N lets 2N−1 through in
-- one window; a span of the whole window keeps N but gives a recipient who used the
-- N back one per window instead of N.
CREATE OR REPLACE FUNCTION postie_window_take(p_kind text, p_recipient text,
                                   p_limit bigint, p_window_ms bigint,
                                   p_now timestamptz DEFAULT clock_timestamp(),
                                   OUT allowed boolean, OUT next_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_since timestamptz := p_now - p_window_ms * interval '1 millisecond';
BEGIN
    INSERT INTO postie_throttle AS t (kind, recipient, sends)
    VALUES (p_kind, p_recipient, ARRAY[p_now])
    ON CONFLICT (kind, recipient) DO UPDATE
       SET sends = ARRAY(SELECT s FROM unnest(t.sends) s WHERE s > v_since) || p_now
     WHERE (SELECT count(*) FROM unnest(t.sends) s WHERE s > v_since) < p_limit
    RETURNING true INTO allowed;
    IF allowed THEN
        RETURN;
    END IF;
    allowed := false;
    SELECT (extract(epoch FROM min(s)) * 1000)::bigint + p_window_ms INTO next_ms
      FROM postie_throttle t, unnest(t.sends) s
     WHERE t.kind = p_kind AND t.recipient = p_recipient AND s > v_since;
    next_ms := coalesce(next_ms, (extract(epoch FROM p_now) * 1000)::bigint);
END
$$;
