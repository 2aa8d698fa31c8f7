-- django-celery-pools: the PostgreSQL fast path of pools.admission (version 1).
--
-- The same rules as the Python implementation in pools/admission.py, in one round
-- trip: lock the pools named by an entry in name order (SELECT ... FOR UPDATE), change
-- the entry, and admit the heads of those pools that fit. Anything the fast path does
-- not decide itself (a multi-pool head, a head past its deadline, a head whose
-- not_before is still ahead) is reported as a 'fallback' row: the caller then runs the
-- full Python admission pass over those pools. Created by migration 0002.

-- Admit simple heads of the (already locked) pools p_pools; returns one 'admitted' row
-- per admission and one 'fallback' row per pool whose head needs the full pass.
CREATE OR REPLACE FUNCTION pools_admit_v1(p_pools bigint[], p_now timestamptz, p_lease double precision)
RETURNS TABLE(o_kind text, o_id bigint, o_key text, o_token bigint, o_task text,
              o_args jsonb, o_kwargs jsonb, o_options jsonb, o_pool text)
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    h record;
    v_free bigint;
    v_until timestamptz := p_now + make_interval(secs => p_lease);
BEGIN
    FOR r IN SELECT p.id, p.name, p.slots, p.paused FROM pools_pool p
             WHERE p.id = ANY(p_pools) ORDER BY p.name LOOP
        CONTINUE WHEN r.paused;
        SELECT r.slots - COALESCE(SUM(d.slots), 0) INTO v_free FROM pools_demand d
         WHERE d.pool_id = r.id AND d.state IN ('admitted', 'running');
        WHILE v_free > 0 LOOP
            SELECT d.entry_id, d.slots, e.demand, e.deadline, e.not_before INTO h
              FROM pools_demand d JOIN pools_queueentry e ON e.queue_id = d.entry_id
             WHERE d.pool_id = r.id AND d.state = 'waiting'
             ORDER BY d.priority DESC, d.enqueued_at, d.entry_id
             LIMIT 1;
            EXIT WHEN NOT FOUND;
            IF (h.deadline IS NOT NULL AND h.deadline <= p_now)
               OR (h.not_before IS NOT NULL AND h.not_before > p_now)
               OR (SELECT count(*) FROM jsonb_object_keys(h.demand)) > 1 THEN
                o_kind := 'fallback'; o_id := NULL; o_key := NULL; o_token := NULL;
                o_task := NULL; o_args := NULL; o_kwargs := NULL; o_options := NULL;
                o_pool := r.name;
                RETURN NEXT;
                EXIT;
            END IF;
            EXIT WHEN h.slots > v_free;  -- the head waits for all its slots: no backfill
            UPDATE pools_queueentry e
               SET state = 'admitted', token = e.token + 1, admitted_at = p_now,
                   lease_expires_at = v_until, worker = ''
             WHERE e.queue_id = h.entry_id AND e.state = 'waiting'
            RETURNING 'admitted', e.queue_id, e.key::text, e.token, e.task_name::text,
                      e.args, e.kwargs, e.options, r.name::text
              INTO o_kind, o_id, o_key, o_token, o_task, o_args, o_kwargs, o_options, o_pool;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'pools: admission raced on entry % (lock order broken)', h.entry_id;
            END IF;
            UPDATE pools_demand SET state = 'admitted' WHERE entry_id = h.entry_id;
            INSERT INTO pools_poolevent (at, kind, pool, entry_id, key, token, detail)
            VALUES (p_now, 'admitted', r.name, o_id, o_key, o_token,
                    jsonb_build_object('slots', h.slots));
            RETURN NEXT;
            v_free := v_free - h.slots;
        END LOOP;
    END LOOP;
END
$$;

-- Settle a held attempt (compare-and-set on its token) and admit the next entries.
-- Returns nothing when the token is stale, the entry settled already, or (p_live)
-- its lease has lapsed; otherwise one 'settled' row, then pools_admit_v1's rows.
CREATE OR REPLACE FUNCTION pools_settle_v1(
    p_entry bigint, p_token bigint, p_outcome text, p_reason text, p_live boolean,
    p_now timestamptz, p_lease double precision, p_lock_ms integer)
RETURNS TABLE(o_kind text, o_id bigint, o_key text, o_token bigint, o_task text,
              o_args jsonb, o_kwargs jsonb, o_options jsonb, o_pool text)
LANGUAGE plpgsql AS $$
DECLARE
    v_demand jsonb;
    v_pools bigint[];
    v_now timestamptz := p_now;
    v_key text;
    v_state text;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
    SELECT e.demand INTO v_demand FROM pools_queueentry e WHERE e.queue_id = p_entry;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT array_agg(l.id) INTO v_pools FROM (
        SELECT p.id FROM pools_pool p
         WHERE p.name IN (SELECT jsonb_object_keys(v_demand))
         ORDER BY p.name FOR UPDATE) l;
    -- cancel(terminate=True) marked it: the attempt ends as a cancellation.
    UPDATE pools_queueentry e
       SET state = CASE WHEN e.reason = 'terminating' THEN 'cancelled' ELSE p_outcome END,
           reason = CASE WHEN e.reason = 'terminating' THEN 'revoked' ELSE p_reason END,
           finished_at = v_now, lease_expires_at = NULL
     WHERE e.queue_id = p_entry AND e.token = p_token AND e.state IN ('admitted', 'running')
       AND (NOT p_live OR e.lease_expires_at >= v_now)
    RETURNING e.key::text, e.state INTO v_key, v_state;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE pools_demand SET state = v_state WHERE entry_id = p_entry;
    INSERT INTO pools_poolevent (at, kind, pool, entry_id, key, token, detail)
    SELECT v_now, 'settled', d.key, p_entry, v_key, p_token,
           jsonb_build_object('slots', d.value::int, 'outcome', v_state)
      FROM jsonb_each(v_demand) d;
    o_kind := 'settled'; o_id := p_entry; o_key := v_key; o_token := p_token; o_pool := NULL;
    RETURN NEXT;
    RETURN QUERY SELECT * FROM pools_admit_v1(v_pools, v_now, p_lease);
END
$$;

-- Start an admitted entry (admitted -> running, compare-and-set on its token) and log it.
-- Returns the entry's demand and lease end, or nothing when the token is stale.
-- All times come from the caller's clock (p_now), like the ORM path's.
CREATE OR REPLACE FUNCTION pools_start_v1(
    p_entry bigint, p_token bigint, p_worker text, p_now timestamptz, p_lease double precision)
RETURNS TABLE(o_demand jsonb, o_until timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := p_now;
    v_key text;
BEGIN
    UPDATE pools_queueentry e
       SET state = 'running', started_at = v_now, worker = left(p_worker, 255),
           lease_expires_at = v_now + make_interval(secs => p_lease)
     WHERE e.queue_id = p_entry AND e.token = p_token AND e.state = 'admitted'
    RETURNING e.demand, e.lease_expires_at, e.key::text INTO o_demand, o_until, v_key;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO pools_poolevent (at, kind, pool, entry_id, key, token, detail)
    SELECT v_now, 'started', d.key, p_entry, v_key, p_token,
           jsonb_build_object('slots', d.value::int, 'worker', p_worker)
      FROM jsonb_each(o_demand) d;
    RETURN NEXT;
END
$$;

-- Put a call in line (entry, one demand row per pool, 'enqueued' events) and admit what
-- fits. A refusal writes nothing and returns one 'refused' row: o_pool names the pool,
-- o_task says why ('unknown', 'capacity': demand above the pool's slots, 'full': the
-- line reached max_queued), o_id is the slots asked and o_token the pool's limit.
-- Otherwise one 'enqueued' row (o_id = the new entry), then pools_admit_v1's rows.
CREATE OR REPLACE FUNCTION pools_enqueue_v1(
    p_key text, p_task text, p_args jsonb, p_kwargs jsonb, p_options jsonb, p_demand jsonb,
    p_priority integer, p_now timestamptz, p_not_before timestamptz, p_deadline timestamptz,
    p_origin text, p_root text, p_parent text, p_attempt integer,
    p_lease double precision, p_lock_ms integer)
RETURNS TABLE(o_kind text, o_id bigint, o_key text, o_token bigint, o_task text,
              o_args jsonb, o_kwargs jsonb, o_options jsonb, o_pool text)
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    v_pools bigint[] := '{}';
    v_entry bigint;
    v_found integer := 0;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
    FOR r IN SELECT p.id, p.name, p.slots, p.max_queued, (p_demand ->> p.name)::int AS asked
               FROM pools_pool p
              WHERE p.name IN (SELECT jsonb_object_keys(p_demand))
              ORDER BY p.name FOR UPDATE LOOP
        v_pools := v_pools || r.id;
        v_found := v_found + 1;
        IF r.asked > r.slots THEN
            RETURN QUERY SELECT 'refused', r.asked::bigint, NULL::text, r.slots::bigint,
                                'capacity', NULL::jsonb, NULL::jsonb, NULL::jsonb, r.name::text;
            RETURN;
        END IF;
        IF r.max_queued IS NOT NULL AND (
            SELECT count(*) FROM (
                SELECT 1 FROM pools_demand d WHERE d.pool_id = r.id AND d.state = 'waiting'
                 LIMIT r.max_queued) w) >= r.max_queued THEN
            RETURN QUERY SELECT 'refused', r.asked::bigint, NULL::text, r.max_queued::bigint,
                                'full', NULL::jsonb, NULL::jsonb, NULL::jsonb, r.name::text;
            RETURN;
        END IF;
    END LOOP;
    IF v_found < (SELECT count(*) FROM jsonb_object_keys(p_demand)) THEN
        RETURN QUERY SELECT 'refused', NULL::bigint, NULL::text, NULL::bigint, 'unknown',
                            NULL::jsonb, NULL::jsonb, NULL::jsonb, min(k)::text
                       FROM jsonb_object_keys(p_demand) k
                      WHERE k NOT IN (SELECT p.name FROM pools_pool p);
        RETURN;
    END IF;
    INSERT INTO pools_queueentry (
        key, task_name, args, kwargs, options, demand, state, priority, enqueued_at,
        not_before, deadline, token, worker, origin, root_id, parent_id, attempt, reason)
    VALUES (p_key, p_task, p_args, p_kwargs, p_options, p_demand, 'waiting', p_priority, p_now,
            p_not_before, p_deadline, 0, '', p_origin, p_root, p_parent, p_attempt, '')
    RETURNING queue_id INTO v_entry;
    INSERT INTO pools_demand (entry_id, pool_id, slots, state, priority, enqueued_at)
    SELECT v_entry, p.id, (p_demand ->> p.name)::int, 'waiting', p_priority, p_now
      FROM pools_pool p WHERE p.id = ANY(v_pools);
    INSERT INTO pools_poolevent (at, kind, pool, entry_id, key, token, detail)
    SELECT p_now, 'enqueued', d.key, v_entry, p_key, 0, jsonb_build_object('slots', d.value::int)
      FROM jsonb_each(p_demand) d;
    RETURN QUERY SELECT 'enqueued', v_entry, p_key, 0::bigint, NULL::text,
                        NULL::jsonb, NULL::jsonb, NULL::jsonb, NULL::text;
    RETURN QUERY SELECT * FROM pools_admit_v1(v_pools, p_now, p_lease);
END
$$;
