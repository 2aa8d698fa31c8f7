-- django-celery-pools 0.2.0: the start of an entry admitted in a pool with a rate as one
-- stored function (pools_start_rated_v8, new in version 8): the check of each rate's ring
-- of starts, the start and the marks under the pools' locks, where the ORM path took 12
-- queries (docs/benchmarks.md#rated-starts-round-eight).

-- Start an entry admitted in a pool with a rate (pools/core/starts.py, the same rule):
-- under the locks of its pools (name order, then the entry row), for each rate N/W of
-- each of them, the slot (starts mod N) of the rate's ring of starts (pools_ratemark,
-- rate_index 1000 + i) must be empty or hold a time at most clock - (W + p_margin), the
-- clock being the database's (clock_timestamp(), or the setting pools.clock). Then the
-- start is pools_start_v8's, each rate's slot gets the clock and each rated pool's starts
-- counter moves on. Otherwise it returns one 'wake' row: o_at = when its place comes
-- (database clock), o_detail.seconds = how long from the check, o_demand = the entry's
-- pools. Returns nothing when the token is stale or the entry is pinned to another worker.
-- The caller looks for work left to the pools' lock holder after it commits.
CREATE OR REPLACE FUNCTION pools_start_rated_v8(
    p_entry bigint, p_token bigint, p_worker text, p_now timestamptz, p_lease double precision,
    p_margin double precision, p_events boolean, p_lock_ms integer)
RETURNS TABLE(o_kind text, o_entry bigint, o_key text, o_token bigint, o_pool text,
              o_task text, o_args jsonb, o_kwargs jsonb, o_options jsonb, o_demand jsonb,
              o_state text, o_reason text, o_asked bigint, o_limit bigint, o_at timestamptz,
              o_event bigint, o_event_kind text, o_detail jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_demand jsonb;
    v_rated bigint[];
    v_clock timestamptz;
    v_opens timestamptz;
    v_mark timestamptz;
    v_margin interval := make_interval(secs => p_margin);
    r record;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
    SELECT e.demand INTO v_demand FROM pools_queueentry e
     WHERE e.queue_id = p_entry AND e.token = p_token AND e.state = 'admitted';
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM 1 FROM pools_pool p WHERE p.name IN (SELECT jsonb_object_keys(v_demand))
     ORDER BY p.name FOR NO KEY UPDATE;
    PERFORM 1 FROM pools_queueentry e
     WHERE e.queue_id = p_entry AND e.token = p_token AND e.state = 'admitted' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_clock := COALESCE(NULLIF(current_setting('pools.clock', true), '')::timestamptz,
                        clock_timestamp());
    FOR r IN SELECT p.id, p.starts, t.i,
                    split_part(t.x, '/', 1)::bigint AS n,
                    CASE split_part(t.x, '/', 2)
                        WHEN 's' THEN interval '1 second'
                        WHEN 'm' THEN interval '1 minute'
                        WHEN 'h' THEN interval '1 hour'
                        ELSE interval '1 day' END AS w
               FROM pools_pool p,
                    unnest(string_to_array(p.rate, ',')) WITH ORDINALITY AS t(x, i)
              WHERE p.name IN (SELECT jsonb_object_keys(v_demand)) AND p.rate <> ''
    LOOP
        v_rated := array_append(v_rated, r.id);
        SELECT m.at INTO v_mark FROM pools_ratemark m
         WHERE m.pool_id = r.id AND m.rate_index = 1000 + r.i - 1 AND m.slot = r.starts % r.n;
        IF FOUND AND v_mark > v_clock - r.w - v_margin THEN
            v_opens := GREATEST(v_opens, v_mark + r.w + v_margin);
        END IF;
    END LOOP;
    IF v_opens IS NOT NULL THEN
        RETURN QUERY SELECT * FROM pools_out_v8(
            'wake', entry => p_entry, token => p_token, demand => v_demand, at => v_opens,
            detail => jsonb_build_object('seconds', extract(epoch FROM v_opens - v_clock)));
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM pools_start_v8(
        p_entry, p_token, p_worker, p_now, p_lease, p_events, p_lock_ms);
    IF FOUND AND v_rated IS NOT NULL THEN
        INSERT INTO pools_ratemark AS m (pool_id, rate_index, slot, at)
        SELECT p.id, 1000 + t.i - 1, p.starts % split_part(t.x, '/', 1)::bigint, v_clock
          FROM pools_pool p,
               unnest(string_to_array(p.rate, ',')) WITH ORDINALITY AS t(x, i)
         WHERE p.id = ANY(v_rated)
        ON CONFLICT (pool_id, rate_index, slot) DO UPDATE SET at = EXCLUDED.at;
        UPDATE pools_pool p SET starts = p.starts + 1
         WHERE p.id IN (SELECT DISTINCT unnest(v_rated));
    END IF;
END
$$;
