-- django-celery-pools 0.2.0: a pool paused by a backoff that has ended is a 'fallback'
-- pool of pools_admit_v8 (stored functions version 8, body only). The functions skip a
-- paused pool, and only the Python pass ends a backoff: a timed wake-up, or any settle in
-- that pool, now hands it to that pass instead of leaving it paused until the sweep (the
-- PostgreSQL wake-up looked such pools up itself before every owed pass).

-- Admit simple heads of the (already locked) pools p_pools; returns one 'admitted' row
-- per admission, one 'fallback' row per pool whose head needs the full pass, one 'wake'
-- row per pool with a delayed entry due later, and (p_events) the events written.
CREATE OR REPLACE FUNCTION pools_admit_v8(
    p_pools bigint[], p_now timestamptz, p_lease double precision, p_events boolean)
RETURNS TABLE(o_kind text, o_entry bigint, o_key text, o_token bigint, o_pool text,
              o_task text, o_args jsonb, o_kwargs jsonb, o_options jsonb, o_demand jsonb,
              o_state text, o_reason text, o_asked bigint, o_limit bigint, o_at timestamptz,
              o_event bigint, o_event_kind text, o_detail jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    h record;
    a record;
    v_free bigint;
    v_taken bigint;
    v_seq bigint;
    v_round bigint;
    v_next timestamptz;
    v_until timestamptz := p_now + make_interval(secs => p_lease);
    -- Rate limits: the database clock (read at the first rated pool), the offset from it
    -- to the caller's clock, and the current pool's rates (count and window per index).
    v_clock timestamptz;
    v_fake timestamptz;  -- the setting pools.clock (tests), else NULL
    v_offset interval;
    v_counts bigint[];
    v_windows interval[];
    v_mark timestamptz;
    v_opens timestamptz;
    v_owed bigint;
BEGIN
    FOR r IN SELECT p.id, p.name, p.slots, p.held, p.admissions, p.paused, p.next_due_at,
                    p.pending_slots, p.strategy, p.fair_round, p.spend_cap, p.rate,
                    p.backoff_until
               FROM pools_pool p
             WHERE p.id = ANY(p_pools) ORDER BY p.name LOOP
        -- Work owed by calls that found this pool locked (pools_owedwork, pools_owe_v8):
        -- releases of settles, which the lock holder subtracts from held first, and
        -- admission passes (0 slots) of entries put in line, which this pass is. A row that
        -- a call is writing now is left to it: that call looks again after its commit.
        WITH t AS (SELECT o.id, o.slots FROM pools_owedwork o
                    WHERE o.pool_id = r.id AND o.pending FOR NO KEY UPDATE SKIP LOCKED),
             u AS (UPDATE pools_owedwork o SET slots = 0, pending = false FROM t
                    WHERE o.id = t.id RETURNING t.slots)
        SELECT COALESCE(sum(u.slots), 0) INTO v_owed FROM u;
        IF v_owed > 0 THEN
            UPDATE pools_pool p SET held = p.held - v_owed WHERE p.id = r.id;
            r.held := r.held - v_owed;
        END IF;
        IF r.spend_cap IS NOT NULL THEN
            -- A daily spend cap (pools_pool.spend_cap, migration 0016), paused or not: the
            -- Python pass adds a settled attempt's slot-seconds, then decides with the
            -- day's spend (pools/core/spendcap.py).
            RETURN QUERY SELECT * FROM pools_out_v8('fallback', pool => r.name::text);
            CONTINUE;
        END IF;
        v_next := r.next_due_at;
        -- Due delayed entries join the line as if sent at their due time. Pools whose
        -- next_due_at has not passed have none: no query for them.
        IF r.next_due_at IS NOT NULL AND r.next_due_at <= p_now THEN
            IF r.strategy = 'fair' THEN
                -- Due entries of a fair pool get their rounds on the Python pass.
                RETURN QUERY SELECT * FROM pools_out_v8('fallback', pool => r.name::text);
                CONTINUE;
            END IF;
            UPDATE pools_demand d SET state = 'waiting'
             WHERE d.id IN (
                SELECT d2.id FROM pools_demand d2
                  JOIN pools_queueentry e ON e.queue_id = d2.entry_id
                 WHERE d2.pool_id = r.id AND d2.state = 'delayed' AND d2.enqueued_at <= p_now
                   AND (SELECT count(*) FROM jsonb_object_keys(e.demand)) = 1
                 ORDER BY d2.enqueued_at
                 LIMIT 500);
            IF EXISTS (SELECT 1 FROM pools_demand d2
                        WHERE d2.pool_id = r.id AND d2.state = 'delayed'
                          AND d2.enqueued_at <= p_now)
            THEN
                -- Multi-pool (or very many) due entries: the full pass moves them.
                RETURN QUERY SELECT * FROM pools_out_v8('fallback', pool => r.name::text);
                CONTINUE;
            END IF;
            UPDATE pools_pool p SET next_due_at = (
                SELECT min(d2.enqueued_at) FROM pools_demand d2
                 WHERE d2.pool_id = r.id AND d2.state = 'delayed')
             WHERE p.id = r.id
            RETURNING p.next_due_at INTO v_next;
        END IF;
        IF v_next IS NOT NULL THEN
            RETURN QUERY SELECT * FROM pools_out_v8('wake', pool => r.name::text, at => v_next);
        END IF;
        IF r.paused THEN
            -- Paused by a backoff that has ended (pools/core/backoffs.py): the Python pass
            -- resumes the pool, then admits.
            IF r.backoff_until IS NOT NULL AND r.backoff_until <= p_now THEN
                RETURN QUERY SELECT * FROM pools_out_v8('fallback', pool => r.name::text);
            END IF;
            CONTINUE;
        END IF;
        IF r.pending_slots IS NOT NULL THEN
            -- Draining after a capacity change: the Python pass decides (and ends the drain).
            RETURN QUERY SELECT * FROM pools_out_v8('fallback', pool => r.name::text);
            CONTINUE;
        END IF;
        -- Slots held in this pool (sabotage marker for tests/contention.py: keep this line).
        v_free := r.slots - r.held;
        v_taken := 0;
        v_seq := r.admissions;
        v_round := r.fair_round;
        IF r.rate <> '' THEN
            -- The stored form is 'N/u,N/u' (pools/core/rates.py: render).
            SELECT array_agg(split_part(t.x, '/', 1)::bigint ORDER BY t.i),
                   array_agg(CASE split_part(t.x, '/', 2)
                                 WHEN 's' THEN interval '1 second'
                                 WHEN 'm' THEN interval '1 minute'
                                 WHEN 'h' THEN interval '1 hour'
                                 ELSE interval '1 day' END ORDER BY t.i)
              INTO v_counts, v_windows
              FROM unnest(string_to_array(r.rate, ',')) WITH ORDINALITY AS t(x, i);
            IF v_clock IS NULL THEN
                v_fake := NULLIF(current_setting('pools.clock', true), '')::timestamptz;
                v_clock := COALESCE(v_fake, clock_timestamp());
                v_offset := p_now - COALESCE(v_fake, statement_timestamp());
            END IF;
        END IF;
        WHILE v_free > 0 LOOP
            SELECT d.entry_id, d.slots, d.line_round, e.demand, e.deadline, e.job,
                   e.concurrency_policy, e.pinned_worker INTO h
              FROM pools_demand d JOIN pools_queueentry e ON e.queue_id = d.entry_id
             WHERE d.pool_id = r.id AND d.state = 'waiting'
             ORDER BY d.line_round, d.line_at, d.entry_id
             LIMIT 1;
            EXIT WHEN NOT FOUND;
            IF (h.deadline IS NOT NULL AND h.deadline <= p_now)
               OR (SELECT count(*) FROM jsonb_object_keys(h.demand)) > 1
               OR h.pinned_worker <> ''
               OR (h.concurrency_policy = 'forbid' AND h.job <> '') THEN
                RETURN QUERY SELECT * FROM pools_out_v8('fallback', pool => r.name::text);
                EXIT;
            END IF;
            EXIT WHEN h.slots > v_free;  -- the head waits for all its slots: no backfill
            IF r.rate <> '' THEN
                -- Every rate must have room: slot (admission number mod N) empty or W old.
                v_opens := NULL;
                FOR i IN 1 .. array_length(v_counts, 1) LOOP
                    SELECT m.at INTO v_mark FROM pools_ratemark m
                     WHERE m.pool_id = r.id AND m.rate_index = i - 1
                       AND m.slot = v_seq % v_counts[i];
                    IF FOUND AND v_mark > v_clock - v_windows[i] THEN
                        v_opens := GREATEST(v_opens, v_mark + v_windows[i]);
                    END IF;
                END LOOP;
                IF v_opens IS NOT NULL THEN
                    -- Held back by a rate: the head blocks its line until the window opens.
                    RETURN QUERY SELECT * FROM pools_out_v8(
                        'wake', pool => r.name::text, at => v_opens + v_offset);
                    EXIT;
                END IF;
                INSERT INTO pools_ratemark AS m (pool_id, rate_index, slot, at)
                SELECT r.id, i - 1, v_seq % v_counts[i], v_clock
                  FROM generate_subscripts(v_counts, 1) AS i
                ON CONFLICT (pool_id, rate_index, slot) DO UPDATE SET at = EXCLUDED.at;
            END IF;
            UPDATE pools_queueentry e
               SET state = 'admitted', token = e.token + 1, admitted_at = p_now,
                   lease_expires_at = v_until, worker = '', admission_seq = v_seq + 1
             WHERE e.queue_id = h.entry_id AND e.state = 'waiting'
            RETURNING e.queue_id, e.key::text AS key, e.token, e.task_name::text AS task,
                      e.args, e.kwargs, e.options
              INTO a;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'pools: admission raced on entry % (lock order broken)', h.entry_id;
            END IF;
            UPDATE pools_demand SET state = 'admitted' WHERE entry_id = h.entry_id;
            RETURN QUERY SELECT * FROM pools_out_v8(
                'admitted', entry => a.queue_id, key => a.key, token => a.token,
                pool => r.name::text, task => a.task, args => a.args, kwargs => a.kwargs,
                options => a.options);
            RETURN QUERY SELECT * FROM pools_out_v8(
                'event', entry => a.queue_id, key => a.key, token => a.token,
                pool => r.name::text, at => p_now, event_kind => 'admitted',
                detail => jsonb_build_object('slots', h.slots))
              WHERE p_events;
            v_free := v_free - h.slots;
            v_taken := v_taken + h.slots;
            v_seq := v_seq + 1;
            IF r.strategy = 'fair' THEN
                v_round := GREATEST(v_round, h.line_round);
            END IF;
        END LOOP;
        IF v_taken > 0 THEN
            UPDATE pools_pool p SET held = p.held + v_taken, admissions = v_seq,
                                    fair_round = v_round
             WHERE p.id = r.id;
        END IF;
    END LOOP;
END
$$;
