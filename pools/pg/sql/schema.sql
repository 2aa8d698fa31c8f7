-- django-celery-pools: the PostgreSQL fast path of pools.admission (the current schema).
--
-- This file holds the current stored functions. The initial migration runs it on a new
-- database; from 0.1.0 on, a change is also written as a delta (deltas/README.md and
-- docs/howto/sql-changes.md). The version suffix of the names (_v8) is VERSION in
-- pools/pg/functions.py; Python code calls the functions through functions.name().
--
-- The contract both paths implement is docs/concepts/contract.md. These functions are
-- the same rules as the Python implementation in pools/core/admission.py, in one round
-- trip: lock the pools named by an entry in name order (SELECT ... FOR NO KEY UPDATE), change the
-- entry, and admit the heads of those pools that fit. Anything the fast path does not
-- decide itself is reported as a 'fallback' row: the caller then runs the full Python
-- admission pass over those pools.
--
-- The bound: p_lock_ms sets lock_timeout for the rest of the transaction (set_config(...,
-- true)) before the first row lock. statement_timeout is set by the caller.
--
-- Rate limits (pools/core/rates.py; pools_pool.rate). For each rate N/W of a pool,
-- admission number k (0-based: the pool's admissions counter before it) may start only
-- when slot k mod N of the rate's ring (pools_ratemark) is empty or at least W old by the
-- database's clock; it then writes its time there (an upsert). The clock is read once per
-- call, after the pool locks (clock_timestamp(); the setting pools.clock replaces it when
-- set: the differential test moves a fake clock). A head held back by a rate blocks its
-- line and returns a 'wake' row for the moment its last window opens, on the caller's
-- clock (p_now - statement_timestamp() as the offset). Pools with a daily spend cap are
-- the Python pass's.
--
-- Strategies (pools/core/strategies.py): a line is read in (line_round, line_at, entry)
-- order (the pools_demand_line index), and an enqueue sets those two columns per pool:
-- * priority: (-priority, enqueued_at); with aging_seconds N: (0, enqueued_at - priority*N s);
-- * fifo: (0, enqueued_at); lifo: (-enqueued_at in microseconds since the epoch, enqueued_at);
-- * fair: (the key's round, enqueued_at), the round being max(pool.fair_round, the key's
--   last round + 1) (one probe of the pools_demand_fair_key index), and fairness_key set.
--   A delayed entry in a fair pool gets round 0 until due; a fair pool with due delayed
--   entries is a 'fallback' pool (the Python pass deals out their rounds). Admitting in a
--   fair pool raises its fair_round to the admitted entry's round.
-- The entry's fairness key is the last-but-one argument of the enqueue function.
--
-- Pool policies are left to the Python pass, decided there once:
-- * a pool with a pending capacity change (pools_pool.pending_slots, draining) is a
--   'fallback' pool: the Python pass admits at the old capacity and applies the new one
--   when the line is empty;
-- * a head that may be ineligible (concurrency_policy 'forbid' with a job, or pinned to a
--   worker) is a 'fallback' head: the Python pass checks the other instances of its job
--   and the worker's heartbeat;
-- * start refuses (returns nothing, like a stale token) a worker other than the one an
--   entry is pinned to;
-- * a settled entry's job is returned (o_detail), so the caller can run the pass over the
--   pools of a 'forbid' instance of it waiting in other pools;
-- * an enqueue into a pool that is draining, paused with paused_policy 'reject', or whose
--   full backlog has an overflow policy other than 'reject', writes nothing and returns
--   'refused' with reason 'policy': the caller then enqueues on the Python path.
--
-- Comments inside the function bodies are part of the stored functions: they stay as
-- shipped (a database that ran an older migration chain has them too).

-- One output row. Kinds and their columns:
--   refused   o_pool, o_reason ('unknown' | 'capacity' | 'full' | 'policy'), o_asked, o_limit
--   enqueued  o_entry, o_key, o_token
--   settled   o_entry, o_key, o_token, o_demand, o_state (the state it settled in),
--             o_detail ({"job": job} when the entry has a job, else NULL)
--   started   o_entry, o_key, o_token, o_demand, o_at (lease end)
--   admitted  o_entry, o_key, o_token, o_pool, o_task, o_args, o_kwargs, o_options
--   fallback  o_pool
--   wake      o_pool, o_at (when its next delayed entry is due, or its rate window opens;
--             a pool may have both: the caller takes the earlier)
--   event     o_event, o_event_kind, o_at, o_pool, o_entry, o_key, o_token, o_detail
CREATE OR REPLACE FUNCTION pools_out_v8(
    kind text, entry bigint DEFAULT NULL, key text DEFAULT NULL, token bigint DEFAULT NULL,
    pool text DEFAULT NULL, task text DEFAULT NULL, args jsonb DEFAULT NULL,
    kwargs jsonb DEFAULT NULL, options jsonb DEFAULT NULL, demand jsonb DEFAULT NULL,
    state text DEFAULT NULL, reason text DEFAULT NULL, asked bigint DEFAULT NULL,
    lim bigint DEFAULT NULL, at timestamptz DEFAULT NULL, event bigint DEFAULT NULL,
    event_kind text DEFAULT NULL, detail jsonb DEFAULT NULL)
RETURNS TABLE(o_kind text, o_entry bigint, o_key text, o_token bigint, o_pool text,
              o_task text, o_args jsonb, o_kwargs jsonb, o_options jsonb, o_demand jsonb,
              o_state text, o_reason text, o_asked bigint, o_limit bigint, o_at timestamptz,
              o_event bigint, o_event_kind text, o_detail jsonb)
LANGUAGE sql IMMUTABLE AS $$
    SELECT kind, entry, key, token, pool, task, args, kwargs, options, demand, state, reason,
           asked, lim, at, event, event_kind, detail
$$;

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

-- End a held attempt (compare-and-set on its token): the entry and its line rows take
-- the outcome's state. Returns the entry's key, the state it ended in and its job, or no
-- row when the token is stale, the entry settled already, or (p_live) its lease has
-- lapsed. The terminate mark (reason 'terminating') is read in the UPDATE: cancel writes
-- it to the entry row, whose row lock orders the two.
CREATE OR REPLACE FUNCTION pools_finish_v8(
    p_entry bigint, p_token bigint, p_outcome text, p_reason text, p_live boolean,
    p_now timestamptz)
RETURNS TABLE(o_key text, o_state text, o_job text)
LANGUAGE plpgsql AS $$
BEGIN
    -- cancel(terminate=True) marked it: the attempt ends as a cancellation.
    UPDATE pools_queueentry e
       SET state = CASE WHEN e.reason = 'terminating' THEN 'cancelled' ELSE p_outcome END,
           reason = CASE WHEN e.reason = 'terminating' THEN 'revoked' ELSE p_reason END,
           finished_at = p_now, lease_expires_at = NULL
     WHERE e.queue_id = p_entry AND e.token = p_token AND e.state IN ('admitted', 'running')
       AND (NOT p_live OR e.lease_expires_at >= p_now)
    RETURNING e.key::text, e.state::text, e.job::text INTO o_key, o_state, o_job;
    IF FOUND THEN
        UPDATE pools_demand SET state = o_state WHERE entry_id = p_entry;
        RETURN NEXT;
    END IF;
END
$$;

-- The 'settled' row of an entry and (p_events) its events.
CREATE OR REPLACE FUNCTION pools_settled_v8(
    p_entry bigint, p_token bigint, p_key text, p_demand jsonb, p_state text, p_job text,
    p_now timestamptz, p_events boolean)
RETURNS TABLE(o_kind text, o_entry bigint, o_key text, o_token bigint, o_pool text,
              o_task text, o_args jsonb, o_kwargs jsonb, o_options jsonb, o_demand jsonb,
              o_state text, o_reason text, o_asked bigint, o_limit bigint, o_at timestamptz,
              o_event bigint, o_event_kind text, o_detail jsonb)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM pools_out_v8(
        'settled', entry => p_entry, key => p_key, token => p_token, demand => p_demand,
        state => p_state,
        detail => CASE WHEN p_job <> '' THEN jsonb_build_object('job', p_job) END);
    RETURN QUERY SELECT o.* FROM jsonb_each(p_demand) d, pools_out_v8(
        'event', entry => p_entry, key => p_key, token => p_token, pool => d.key,
        at => p_now, event_kind => 'settled',
        detail => jsonb_build_object('slots', d.value::int, 'outcome', p_state)) o
      WHERE p_events;
END
$$;

-- Settle a held attempt (pools_finish_v8) and admit the next entries.
-- Returns nothing when the token is stale, the entry settled already, or (p_live)
-- its lease has lapsed; otherwise one 'settled' row, its events, then pools_admit_v8's rows.
CREATE OR REPLACE FUNCTION pools_settle_v8(
    p_entry bigint, p_token bigint, p_outcome text, p_reason text, p_live boolean,
    p_now timestamptz, p_lease double precision, p_events boolean, p_lock_ms integer)
RETURNS TABLE(o_kind text, o_entry bigint, o_key text, o_token bigint, o_pool text,
              o_task text, o_args jsonb, o_kwargs jsonb, o_options jsonb, o_demand jsonb,
              o_state text, o_reason text, o_asked bigint, o_limit bigint, o_at timestamptz,
              o_event bigint, o_event_kind text, o_detail jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_demand jsonb;
    v_pools bigint[];
    f record;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
    SELECT e.demand INTO v_demand FROM pools_queueentry e WHERE e.queue_id = p_entry;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT array_agg(l.id) INTO v_pools FROM (
        SELECT p.id FROM pools_pool p
         WHERE p.name IN (SELECT jsonb_object_keys(v_demand))
         ORDER BY p.name FOR NO KEY UPDATE) l;
    SELECT * INTO f FROM pools_finish_v8(p_entry, p_token, p_outcome, p_reason, p_live, p_now);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE pools_pool p SET held = p.held - (v_demand ->> p.name)::int
     WHERE p.id = ANY(v_pools);
    RETURN QUERY SELECT * FROM pools_settled_v8(
        p_entry, p_token, f.o_key, v_demand, f.o_state, f.o_job, p_now, p_events);
    RETURN QUERY SELECT * FROM pools_admit_v8(v_pools, p_now, p_lease, p_events);
END
$$;

-- Start an admitted entry (admitted -> running, compare-and-set on its token) and log it.
-- Returns one 'started' row (the entry's demand and lease end) and its events, or nothing
-- when the token is stale or the entry is pinned to another worker (node affinity). All times come from the caller's clock (p_now).
CREATE OR REPLACE FUNCTION pools_start_v8(
    p_entry bigint, p_token bigint, p_worker text, p_now timestamptz, p_lease double precision,
    p_events boolean, p_lock_ms integer)
RETURNS TABLE(o_kind text, o_entry bigint, o_key text, o_token bigint, o_pool text,
              o_task text, o_args jsonb, o_kwargs jsonb, o_options jsonb, o_demand jsonb,
              o_state text, o_reason text, o_asked bigint, o_limit bigint, o_at timestamptz,
              o_event bigint, o_event_kind text, o_detail jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_demand jsonb;
    v_until timestamptz;
    v_key text;
    v_worker text := left(p_worker, 255);
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
    -- The lease is renewed only when less than two thirds of it are left (the lease keeper
    -- renews every third): otherwise the start changes no indexed column (a HOT update).
    UPDATE pools_queueentry e
       SET state = 'running', started_at = p_now, worker = v_worker,
           lease_expires_at = CASE
               WHEN e.lease_expires_at >= p_now + make_interval(secs => p_lease * 2 / 3)
               THEN e.lease_expires_at
               ELSE p_now + make_interval(secs => p_lease) END
     WHERE e.queue_id = p_entry AND e.token = p_token AND e.state = 'admitted'
       AND (e.pinned_worker = '' OR e.pinned_worker = v_worker)
    RETURNING e.demand, e.lease_expires_at, e.key::text INTO v_demand, v_until, v_key;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM pools_out_v8(
        'started', entry => p_entry, key => v_key, token => p_token, demand => v_demand,
        at => v_until);
    RETURN QUERY SELECT o.* FROM jsonb_each(v_demand) d, pools_out_v8(
        'event', entry => p_entry, key => v_key, token => p_token, pool => d.key,
        at => p_now, event_kind => 'started',
        detail => jsonb_build_object('slots', d.value::int, 'worker', v_worker)) o
      WHERE p_events;
END
$$;

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

-- Write an entry and its line rows, one per pool of p_pools (locked by the caller, or
-- read without a lock by pools_enqueue_call_v8 for a pool whose line placement needs no
-- pool state), placed by each pool's strategy; returns the entry's id.
CREATE OR REPLACE FUNCTION pools_line_v8(
    p_key text, p_task text, p_args jsonb, p_kwargs jsonb, p_options jsonb, p_demand jsonb,
    p_priority integer, p_now timestamptz, p_not_before timestamptz, p_deadline timestamptz,
    p_origin text, p_root text, p_parent text, p_attempt integer, p_fairness_key text,
    p_pools bigint[])
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_entry bigint;
    v_delayed boolean := p_not_before IS NOT NULL AND p_not_before > p_now;
    v_at timestamptz;
BEGIN
    INSERT INTO pools_queueentry (
        key, task_name, args, kwargs, options, demand, state, priority, enqueued_at,
        not_before, deadline, token, worker, origin, root_id, parent_id, attempt, reason,
        fairness_key)
    VALUES (p_key, p_task, p_args, p_kwargs, p_options, p_demand, 'waiting', p_priority, p_now,
            p_not_before, p_deadline, 0, '', p_origin, p_root, p_parent, p_attempt, '',
            p_fairness_key)
    RETURNING queue_id INTO v_entry;
    v_at := CASE WHEN v_delayed THEN p_not_before ELSE p_now END;
    -- The place in each pool's line by its strategy (pools/core/strategies.py: place).
    INSERT INTO pools_demand (entry_id, pool_id, slots, state, priority, enqueued_at,
                              line_round, line_at, fairness_key)
    SELECT v_entry, p.id, (p_demand ->> p.name)::int,
           CASE WHEN v_delayed THEN 'delayed' ELSE 'waiting' END, p_priority, v_at,
           CASE
               WHEN p.strategy = 'fair' AND v_delayed THEN 0
               WHEN p.strategy = 'fair' THEN GREATEST(p.fair_round, COALESCE((
                   SELECT k.line_round FROM pools_demand k
                    WHERE k.pool_id = p.id AND k.fairness_key = p_fairness_key
                      AND k.state IN ('waiting', 'admitted', 'running', 'succeeded', 'failed',
                                      'retried')
                    ORDER BY k.line_round DESC LIMIT 1), 0) + 1)
               WHEN p.strategy = 'fifo' THEN 0
               WHEN p.strategy = 'lifo' THEN -floor(extract(epoch FROM v_at) * 1000000)::bigint
               WHEN p.aging_seconds IS NOT NULL THEN 0
               ELSE -p_priority
           END,
           CASE
               WHEN p.strategy = 'priority' AND p.aging_seconds IS NOT NULL
               THEN v_at - (p_priority::bigint * p.aging_seconds) * interval '1 second'
               ELSE v_at
           END,
           CASE WHEN p.strategy = 'fair' THEN p_fairness_key END
      FROM pools_pool p WHERE p.id = ANY(p_pools);
    IF v_delayed THEN
        UPDATE pools_pool p SET next_due_at = LEAST(COALESCE(p.next_due_at, p_not_before), p_not_before)
         WHERE p.id = ANY(p_pools);
    END IF;
    RETURN v_entry;
END
$$;

-- The 'enqueued' row of an entry and (p_events) its events.
CREATE OR REPLACE FUNCTION pools_enqueued_v8(
    p_entry bigint, p_key text, p_demand jsonb, p_now timestamptz, p_events boolean)
RETURNS TABLE(o_kind text, o_entry bigint, o_key text, o_token bigint, o_pool text,
              o_task text, o_args jsonb, o_kwargs jsonb, o_options jsonb, o_demand jsonb,
              o_state text, o_reason text, o_asked bigint, o_limit bigint, o_at timestamptz,
              o_event bigint, o_event_kind text, o_detail jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_entry bigint := p_entry;
BEGIN
    RETURN QUERY SELECT * FROM pools_out_v8(
        'enqueued', entry => v_entry, key => p_key, token => 0::bigint);
    RETURN QUERY SELECT o.* FROM jsonb_each(p_demand) d, pools_out_v8(
        'event', entry => v_entry, key => p_key, token => 0::bigint, pool => d.key,
        at => p_now, event_kind => 'enqueued',
        detail => jsonb_build_object('slots', d.value::int)) o
      WHERE p_events;
END
$$;

-- Put a call in line (entry, one demand row per pool, 'enqueued' events) and admit what
-- fits. A refusal writes nothing and returns one 'refused' row, in the contract's
-- precedence: the first unknown pool (by name), else the first pool (by name) whose
-- capacity is below the demand, else ('policy') the first pool (by name) that is paused
-- with paused_policy 'reject' or draining, else the first pool (by name) whose backlog
-- reached max_queued ('full', or 'policy' when its overflow policy drops an entry). Otherwise one 'enqueued' row, its events, then pools_admit_v8's rows.
CREATE OR REPLACE FUNCTION pools_enqueue_v8(
    p_key text, p_task text, p_args jsonb, p_kwargs jsonb, p_options jsonb, p_demand jsonb,
    p_priority integer, p_now timestamptz, p_not_before timestamptz, p_deadline timestamptz,
    p_origin text, p_root text, p_parent text, p_attempt integer,
    p_lease double precision, p_events boolean, p_fairness_key text, p_lock_ms integer)
RETURNS TABLE(o_kind text, o_entry bigint, o_key text, o_token bigint, o_pool text,
              o_task text, o_args jsonb, o_kwargs jsonb, o_options jsonb, o_demand jsonb,
              o_state text, o_reason text, o_asked bigint, o_limit bigint, o_at timestamptz,
              o_event bigint, o_event_kind text, o_detail jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    v_pools bigint[] := '{}';
    v_entry bigint;
    v_unknown text;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
    -- The locks first (name order), then the refusals in the contract's precedence.
    FOR r IN SELECT p.id FROM pools_pool p
              WHERE p.name IN (SELECT jsonb_object_keys(p_demand))
              ORDER BY p.name FOR NO KEY UPDATE LOOP
        v_pools := v_pools || r.id;
    END LOOP;
    SELECT min(k) INTO v_unknown FROM jsonb_object_keys(p_demand) k
     WHERE k NOT IN (SELECT p.name FROM pools_pool p WHERE p.id = ANY(v_pools));
    IF v_unknown IS NOT NULL THEN
        RETURN QUERY SELECT * FROM pools_out_v8('refused', pool => v_unknown, reason => 'unknown');
        RETURN;
    END IF;
    FOR r IN SELECT p.name, p.slots, (p_demand ->> p.name)::int AS asked
               FROM pools_pool p WHERE p.id = ANY(v_pools) ORDER BY p.name LOOP
        IF r.asked > r.slots THEN
            RETURN QUERY SELECT * FROM pools_out_v8(
                'refused', pool => r.name::text, reason => 'capacity', asked => r.asked::bigint,
                lim => r.slots::bigint);
            RETURN;
        END IF;
    END LOOP;
    -- Paused with paused_policy 'reject', or draining: the Python path refuses it.
    FOR r IN SELECT p.name FROM pools_pool p
              WHERE p.id = ANY(v_pools)
                AND ((p.paused AND p.paused_policy = 'reject') OR p.pending_slots IS NOT NULL)
              ORDER BY p.name LIMIT 1 LOOP
        RETURN QUERY SELECT * FROM pools_out_v8('refused', pool => r.name::text, reason => 'policy');
        RETURN;
    END LOOP;
    FOR r IN SELECT p.id, p.name, p.max_queued, p.overflow, (p_demand ->> p.name)::int AS asked
               FROM pools_pool p WHERE p.id = ANY(v_pools) AND p.max_queued IS NOT NULL
              ORDER BY p.name LOOP
        IF (SELECT count(*) FROM (
                SELECT 1 FROM pools_demand d
                 WHERE d.pool_id = r.id AND d.state IN ('waiting', 'delayed')
                 LIMIT r.max_queued) w) >= r.max_queued THEN
            -- A full backlog that drops an entry instead: the Python path does it.
            RETURN QUERY SELECT * FROM pools_out_v8(
                'refused', pool => r.name::text,
                reason => CASE WHEN r.overflow = 'reject' THEN 'full' ELSE 'policy' END,
                asked => r.asked::bigint, lim => r.max_queued::bigint);
            RETURN;
        END IF;
    END LOOP;
    v_entry := pools_line_v8(p_key, p_task, p_args, p_kwargs, p_options, p_demand, p_priority,
                             p_now, p_not_before, p_deadline, p_origin, p_root, p_parent,
                             p_attempt, p_fairness_key, v_pools);
    RETURN QUERY SELECT * FROM pools_enqueued_v8(v_entry, p_key, p_demand, p_now, p_events);
    RETURN QUERY SELECT * FROM pools_admit_v8(v_pools, p_now, p_lease, p_events);
END
$$;

-- Contention (docs/concepts/admission.md#contention). The procedures below are what a call
-- outside a transaction runs: a settle or an enqueue that finds its one pool's row locked
-- by another call does not wait for it. The settle ends its entry and leaves the release
-- in pools_owedwork (pools_owe_v8); the enqueue puts its entry in line. The holder of the lock admits
-- for everyone: pools_admit_v8 subtracts owed releases first, and every call that held a
-- pool's lock looks again right after it commits (pools_recheck_v8), as does a call that
-- left work, after its own commit. So no work waits for a lock holder that has already
-- looked: a holder's look comes after its commit, hence after any work committed while it
-- held the lock. Calls inside a caller's transaction run the functions above (they wait
-- for the lock) and the caller looks again after its commit (pools/pg/engine.py), as the
-- ORM engine's lock holders do (pools/core/locking.py).
--
-- Results come back as one jsonb array of the output rows (pools_out_v8's columns), in
-- the INOUT argument o_rows.

-- Leave work owed to the holder of pool p_pool's lock (a release of p_slots, or with 0 an
-- admission pass) in one of the pool's rows of pools_owedwork (at most 16) that no other
-- call holds (a holder taking the work, or another call leaving some): updates of a few
-- rows that touch no index (HOT), not an insert and a delete per call, whose dead index
-- entries every look for owed work would walk until a vacuum. When every row is held, or
-- the pool has none yet, the call writes its connection's own row (slot: backend pid mod
-- 16), made if missing; only a call on the same slot can make it wait, for its commit.
CREATE OR REPLACE FUNCTION pools_owe_v8(p_pool bigint, p_slots integer)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    SELECT o.id INTO v_id FROM pools_owedwork o
     WHERE o.pool_id = p_pool
     ORDER BY (o.slot + pg_backend_pid()) % 16
     LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED;
    IF FOUND THEN
        UPDATE pools_owedwork o SET slots = o.slots + p_slots, pending = true
         WHERE o.id = v_id;
        RETURN;
    END IF;
    INSERT INTO pools_owedwork AS o (pool_id, slot, slots, pending)
    VALUES (p_pool, pg_backend_pid() % 16, p_slots, true)
    ON CONFLICT (pool_id, slot) DO UPDATE SET slots = o.slots + EXCLUDED.slots, pending = true;
END
$$;

-- After a commit: while a pool named in p_pools has work owed to its lock holder (rows of
-- pools_owedwork), lock those pools without waiting (a pool locked by another call is
-- left to that call, which looks again after its commit), admit (pools_admit_v8, which
-- takes the owed work) and commit. Appends the rows to o_rows. After 50 rounds it stops
-- and adds a 'wake' row due now for the pools that still have work (the caller runs a
-- pass for them).
CREATE OR REPLACE PROCEDURE pools_recheck_v8(
    p_pools text[], p_now timestamptz, p_lease double precision, p_events boolean,
    p_lock_ms integer, INOUT o_rows jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_work bigint[];
    v_locked bigint[];
    v_rows jsonb;
BEGIN
    o_rows := COALESCE(o_rows, '[]'::jsonb);
    FOR i IN 1 .. 51 LOOP
        PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
        SELECT array_agg(p.id ORDER BY p.name) INTO v_work FROM pools_pool p
         WHERE p.name = ANY(p_pools)
           AND EXISTS (SELECT 1 FROM pools_owedwork o WHERE o.pool_id = p.id AND o.pending);
        EXIT WHEN v_work IS NULL;
        IF i > 50 THEN
            SELECT jsonb_agg(to_jsonb(w)) INTO v_rows
              FROM pools_pool p, pools_out_v8('wake', pool => p.name::text, at => p_now) w
             WHERE p.id = ANY(v_work);
            o_rows := o_rows || v_rows;
            EXIT;
        END IF;
        SELECT array_agg(l.id) INTO v_locked FROM (
            SELECT p.id FROM pools_pool p WHERE p.id = ANY(v_work)
             ORDER BY p.name FOR NO KEY UPDATE SKIP LOCKED) l;
        EXIT WHEN v_locked IS NULL;
        SELECT jsonb_agg(to_jsonb(a)) INTO v_rows
          FROM pools_admit_v8(v_locked, p_now, p_lease, p_events) a;
        o_rows := o_rows || COALESCE(v_rows, '[]'::jsonb);
        COMMIT;
    END LOOP;
END
$$;

-- pools_enqueue_v8 for a call outside a transaction. A call sent now to one pool with no
-- policy that needs its lock (not paused or draining, no backlog bound, rate or spend cap;
-- strategy priority or fifo), whose row another call holds, is put in line without
-- waiting (pools_line_v8) and returns its 'enqueued' row: the holder admits it. Anything
-- else runs pools_enqueue_v8. Then pools_recheck_v8 over its pools.
CREATE OR REPLACE PROCEDURE pools_enqueue_call_v8(
    p_key text, p_task text, p_args jsonb, p_kwargs jsonb, p_options jsonb, p_demand jsonb,
    p_priority integer, p_now timestamptz, p_not_before timestamptz, p_deadline timestamptz,
    p_origin text, p_root text, p_parent text, p_attempt integer,
    p_lease double precision, p_events boolean, p_fairness_key text, p_lock_ms integer,
    INOUT o_rows jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_name text;
    v_names text[];
    v_pool bigint;
    v_entry bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
    IF (p_not_before IS NULL OR p_not_before <= p_now)
       AND (SELECT count(*) FROM jsonb_object_keys(p_demand)) = 1 THEN
        v_name := (SELECT k FROM jsonb_object_keys(p_demand) k);
        PERFORM 1 FROM pools_pool p WHERE p.name = v_name FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            SELECT p.id INTO v_pool FROM pools_pool p
             WHERE p.name = v_name AND (p_demand ->> v_name)::int <= p.slots
               AND NOT p.paused AND p.pending_slots IS NULL AND p.max_queued IS NULL
               AND p.rate = '' AND p.spend_cap IS NULL AND p.strategy IN ('priority', 'fifo');
            IF FOUND THEN
                v_entry := pools_line_v8(p_key, p_task, p_args, p_kwargs, p_options, p_demand,
                                         p_priority, p_now, p_not_before, p_deadline, p_origin,
                                         p_root, p_parent, p_attempt, p_fairness_key,
                                         ARRAY[v_pool]);
                -- Owed to the holder: an admission pass (no slots to release).
                PERFORM pools_owe_v8(v_pool, 0);
                SELECT jsonb_agg(to_jsonb(x)) INTO o_rows
                  FROM pools_enqueued_v8(v_entry, p_key, p_demand, p_now, p_events) x;
                COMMIT;
                CALL pools_recheck_v8(ARRAY[v_name], p_now, p_lease, p_events, p_lock_ms, o_rows);
                RETURN;
            END IF;
        END IF;
    END IF;
    SELECT COALESCE(jsonb_agg(to_jsonb(x)), '[]'::jsonb) INTO o_rows
      FROM pools_enqueue_v8(p_key, p_task, p_args, p_kwargs, p_options, p_demand, p_priority,
                            p_now, p_not_before, p_deadline, p_origin, p_root, p_parent,
                            p_attempt, p_lease, p_events, p_fairness_key, p_lock_ms) x;
    COMMIT;
    v_names := ARRAY(SELECT jsonb_object_keys(p_demand));
    CALL pools_recheck_v8(v_names, p_now, p_lease, p_events, p_lock_ms, o_rows);
END
$$;

-- pools_settle_v8 for a call outside a transaction. An entry of one pool without a rate,
-- spend cap or pending capacity, whose row another call holds, is ended without waiting
-- (pools_finish_v8) and its slots are owed (pools_owe_v8): the holder subtracts them
-- and admits. Anything else runs pools_settle_v8. Then pools_recheck_v8 over its pools.
CREATE OR REPLACE PROCEDURE pools_settle_call_v8(
    p_entry bigint, p_token bigint, p_outcome text, p_reason text, p_live boolean,
    p_now timestamptz, p_lease double precision, p_events boolean, p_lock_ms integer,
    INOUT o_rows jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_demand jsonb;
    v_name text;
    v_names text[];
    v_pool bigint;
    f record;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms || 'ms', true);
    SELECT e.demand INTO v_demand FROM pools_queueentry e WHERE e.queue_id = p_entry;
    IF FOUND AND (SELECT count(*) FROM jsonb_object_keys(v_demand)) = 1 THEN
        v_name := (SELECT k FROM jsonb_object_keys(v_demand) k);
        PERFORM 1 FROM pools_pool p WHERE p.name = v_name FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            SELECT p.id INTO v_pool FROM pools_pool p
             WHERE p.name = v_name AND p.rate = '' AND p.spend_cap IS NULL
               AND p.pending_slots IS NULL;
            IF FOUND THEN
                SELECT * INTO f
                  FROM pools_finish_v8(p_entry, p_token, p_outcome, p_reason, p_live, p_now);
                IF NOT FOUND THEN
                    o_rows := '[]'::jsonb;
                    RETURN;
                END IF;
                PERFORM pools_owe_v8(v_pool, (v_demand ->> v_name)::int);
                SELECT jsonb_agg(to_jsonb(x)) INTO o_rows
                  FROM pools_settled_v8(p_entry, p_token, f.o_key, v_demand, f.o_state,
                                        f.o_job, p_now, p_events) x;
                COMMIT;
                CALL pools_recheck_v8(ARRAY[v_name], p_now, p_lease, p_events, p_lock_ms, o_rows);
                RETURN;
            END IF;
        END IF;
    END IF;
    SELECT COALESCE(jsonb_agg(to_jsonb(x)), '[]'::jsonb) INTO o_rows
      FROM pools_settle_v8(p_entry, p_token, p_outcome, p_reason, p_live, p_now, p_lease,
                           p_events, p_lock_ms) x;
    COMMIT;
    IF v_demand IS NOT NULL THEN
        v_names := ARRAY(SELECT jsonb_object_keys(v_demand));
        CALL pools_recheck_v8(v_names, p_now, p_lease, p_events, p_lock_ms, o_rows);
    END IF;
END
$$;
