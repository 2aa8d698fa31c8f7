"""The chaos checker catches what it claims to catch (synthetic records, no services)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tests.chaos.check import (
    Body,
    Stall,
    Transition,
    Waiter,
    check,
    lost_with_their_process,
    max_overlap,
    read_bodies,
    stamp_skews,
    starved_heads,
)


def body(entry: int, start: float, end: float | None, valid_until: float, *, token: int = 1,
         demand: dict[str, int] | None = None, pid: int = 1, last: float | None = None,
         paused: bool = False) -> Body:  # fmt: skip
    """A body; ``last`` (last sign of life) defaults to its end, paused bodies aside."""
    if last is None and not paused:
        last = end
    return Body(
        key=f"k{entry}",
        entry=entry,
        token=token,
        demand=demand or {"p": 1},
        start=start,
        end=end,
        valid_until=valid_until,
        pid=pid,
        last=last,
        paused=paused,
    )


def test_overlap_beyond_capacity__is_a_violation() -> None:
    found = check([body(1, 0, 2, 10), body(2, 1, 3, 10)], {"p": 1})
    assert found.oversubscribed and "pool p: 2 slots" in found.oversubscribed[0]


def test_back_to_back_bodies__are_not_an_overlap() -> None:
    assert not check([body(1, 0, 1, 10), body(2, 1, 2, 10)], {"p": 1})


def test_paused_body__counts_only_while_its_lease_was_valid() -> None:
    # Body 1 is paused at t=1, its lease lapses at t=3, body 2 takes the slot at t=4, body 1
    # resumes and ends at t=8: a frozen process cannot fence itself, only [0, 3] counts.
    bodies = [body(1, 0, 8, 3, paused=True), body(2, 4, 5, 20)]
    assert not check(bodies, {"p": 1})
    assert max_overlap(bodies)["p"][0] == 1


def test_body_outliving_its_lease__counts_to_its_last_sign_of_life() -> None:
    # The same records without a pause: body 1 ran past its lease (a keeper that did not
    # fence it, as behind a silent partition). Counted to its end, it overlaps body 2.
    found = check([body(1, 0, 8, 3), body(2, 4, 5, 20)], {"p": 1})
    assert found.oversubscribed and found.same_entry_twice == []


def test_killed_body__counts_until_its_last_tick() -> None:
    # Body 1 was SIGKILLed (no end line) after its last tick at t=1.2.
    assert check([body(1, 0, None, 3, last=1.2), body(2, 1, 2.5, 20)], {"p": 1}).oversubscribed
    assert not check([body(1, 0, None, 3, last=1.2), body(2, 1.3, 4, 20)], {"p": 1})


def test_multi_pool_demand__counts_its_slots_in_each_pool() -> None:
    ac = {"a": 1, "c": 2}
    found = check(
        [body(1, 0, 2, 10, demand=ac), body(2, 1, 3, 10, demand={"c": 1})], {"a": 3, "c": 2}
    )
    assert [line.split(":")[0] for line in found.oversubscribed] == ["pool c"]


def test_same_claim_running_twice_at_once__is_a_violation() -> None:
    found = check([body(1, 0, 2, 10, pid=1), body(1, 1, 3, 10, pid=2)], {"p": 2})
    assert found.same_claim_twice


def test_same_entry_two_tokens_at_once__is_a_violation() -> None:
    found = check([body(1, 0, 2, 10, token=1), body(1, 1, 3, 10, token=2, pid=2)], {"p": 2})
    assert found.same_entry_twice and not found.same_claim_twice


def test_read_bodies__start_ticks_and_end_lines(tmp_path: Path) -> None:
    common = {"token": 1, "demand": {"p": 1}}
    lines = [
        {"kind": "start", "entry": 1, "pid": 7, "key": "a", "t": 1.0, "valid_until": 4.0},
        {"kind": "tick", "entry": 1, "pid": 7, "key": "a", "t": 1.1},
        {"kind": "end", "entry": 1, "pid": 7, "key": "a", "t": 2.0, "valid_until": 5.0},
        {"kind": "start", "entry": 2, "pid": 8, "key": "b", "t": 1.5, "valid_until": 4.5},
        {"kind": "tick", "entry": 2, "pid": 8, "key": "b", "t": 1.6},
        {"kind": "tick", "entry": 2, "pid": 8, "key": "b", "t": 1.7},
    ]
    (tmp_path / "bodies-7.jsonl").write_text(
        "".join(json.dumps({**common, **x}) + "\n" for x in lines)
    )
    first, second = read_bodies(tmp_path)
    assert (first.start, first.end, first.valid_until, first.holds_until) == (1.0, 2.0, 5.0, 2.0)
    assert (second.end, second.last, second.holds_until) == (None, 1.7, 1.7)
    # pid 8 was paused at 1.65 (resumed at 9): counted to its lease end, as a frozen body.
    _, paused = read_bodies(tmp_path, {8: [(1.65, 9.0)]})
    assert paused.paused and paused.holds_until == 4.5
    # A pause of the same pid outside the body's life does not mark it.
    _, later = read_bodies(tmp_path, {8: [(3.0, 9.0)]})
    assert not later.paused


def test_recovery__counts_from_the_fault_to_the_next_start_of_work_that_was_waiting() -> None:
    from tests.chaos.run import Fault, recovery

    fault = Fault(kind="sigkill", at=0.5, started=10.0, ended=11.0)
    bodies = [body(1, 5, 6, 20), body(2, 14, 15, 30), body(3, 12, 13, 30)]
    # k3 was sent after the fault ended (an idle pool picking up new work), k2 before it.
    submitted = {"k1": 1.0, "k2": 9.0, "k3": 11.5}
    assert recovery(fault, bodies, submitted) == 4.0


def test_recovery__is_none_when_nothing_was_waiting() -> None:
    from tests.chaos.run import Fault, recovery

    fault = Fault(kind="sigkill", at=0.99, started=10.0, ended=11.0)
    bodies = [body(1, 5, 6, 20), body(2, 240, 241, 300)]
    assert recovery(fault, bodies, {"k1": 1.0, "k2": 239.0}) is None


def test_typed_arguments__survive_celerys_json_and_the_checker_accepts_them() -> None:
    """What ``chaos.typed_b`` returns on plain Celery (kombu's JSON both ways) is no
    mismatch: the check compares like with like."""
    import random

    from kombu.utils.json import dumps, loads

    from tests.chaos.check import typed_mismatches
    from tests.chaos.tasks import typed_arguments, typed_result

    rng = random.Random(7)
    expected, outcomes = {}, {}
    for i in range(50):
        values, kwargs = typed_arguments(rng)
        expected[f"k{i}"] = typed_result(values, kwargs)
        outcomes[f"k{i}"] = ("SUCCESS", loads(dumps(typed_result(values, kwargs))))
    assert typed_mismatches(expected, outcomes) == []
    kinds = {type(v).__name__ for v in expected["k0"]["values"]}
    assert {"date", "datetime", "UUID", "Decimal", "bytes", "list"} <= kinds


def test_typed_mismatches__a_value_that_changed_type_or_zone_or_a_call_that_failed() -> None:
    import datetime as dt
    import uuid
    from decimal import Decimal

    from tests.chaos.check import typed_mismatches

    naive = dt.datetime(2026, 12, 5, 10, 0)
    want = {"values": [dt.date(2026, 12, 5), naive, uuid.UUID(int=1), Decimal("1.10"), b"\x00"]}

    def with_value(i: int, value: object) -> dict[str, object]:
        values = list(want["values"])
        values[i] = value
        return {"values": values}

    outcomes = {
        "same": ("SUCCESS", {"values": list(want["values"])}),
        "text": ("SUCCESS", with_value(0, "2026-12-05")),  # a date come back as its text
        "aware": ("SUCCESS", with_value(1, naive.replace(tzinfo=dt.UTC))),
        "uuid": ("SUCCESS", with_value(2, str(uuid.UUID(int=1)))),
        "float": ("SUCCESS", with_value(3, 1.1)),
        "bytes": ("SUCCESS", with_value(4, "\x00")),
        "failed": ("FAILURE", ValueError("Expecting value")),
        "cancelled": ("REVOKED", None),
    }
    found = typed_mismatches(dict.fromkeys(outcomes, want) | {"lost": want}, outcomes,
                             skip=["cancelled"])  # fmt: skip
    flagged = {line.split()[2] for line in found}
    assert flagged == {"text", "aware", "uuid", "float", "bytes", "failed", "lost"}
    assert any("ended MISSING" in line for line in found)


def test_readmitted__counts_entries_that_ran_under_a_later_admission_by_task() -> None:
    from dataclasses import replace

    from tests.chaos.check import readmitted

    bodies = [
        replace(body(1, 0, 1, 5), task="single_a"),
        replace(body(2, 0, 1, 5, token=2), task="typed_b"),
        replace(body(2, 2, 3, 8, token=3), task="typed_b"),  # same entry: counted once
        replace(body(3, 0, 1, 5, token=2), task="single_b"),
    ]
    assert readmitted(bodies) == {"typed_b": {2}, "single_b": {3}}


def test_readmission_allowance__bounded_by_process_faults_none_with_restarts() -> None:
    from tests.chaos.check import readmission_allowance

    assert readmission_allowance(["sigkill", "sigstop", "cancel_burst"], concurrency=2) == 8
    assert readmission_allowance([], concurrency=3) == 0
    assert readmission_allowance(["sigkill", "redis_restart"], concurrency=3) is None


# ----------------------------------------------------------------------------- lost wake-ups


def life(entry: int, demand: dict[str, int], **times: float | list[float]) -> list[Transition]:
    """The database's stream of one entry: ``enqueued=0.5, admitted=1.2, settled=2``, and
    ``requeued=[...]`` for the logged requeues."""
    out = []
    for kind, at in times.items():
        for t in at if isinstance(at, list) else [at]:
            out += [Transition(t, kind, entry, pool, slots) for pool, slots in demand.items()]
    return out


def starved(stream: list[Transition], capacity: dict[str, int], **kwargs: Any) -> list[str]:
    waiters = kwargs.pop("waiters", {})
    return [str(e) for e in starved_heads(stream, waiters, capacity, **kwargs)]


def test_starved_heads__a_head_waiting_150_ms_with_its_slot_free_is_counted() -> None:
    stream = [
        *life(1, {"p": 1}, enqueued=0, admitted=0, settled=1.0),
        *life(2, {"p": 1}, enqueued=0.5, admitted=1.15, settled=2),
    ]
    assert starved(stream, {"p": 1}) == ["entry 2 (p 1) head with free slots for 150 ms"]


def test_starved_heads__a_wait_under_100_ms_is_not_counted() -> None:
    stream = [
        *life(1, {"p": 1}, enqueued=0, admitted=0, settled=1.0),
        *life(2, {"p": 1}, enqueued=0.5, admitted=1.08, settled=2),
    ]
    assert starved(stream, {"p": 1}) == []


def test_starved_heads__a_head_without_enough_free_slots_is_not_counted() -> None:
    stream = [
        *life(1, {"p": 1}, enqueued=0, admitted=0, settled=5),
        *life(2, {"p": 2}, enqueued=0.5, admitted=5, settled=6),
    ]
    assert starved(stream, {"p": 2}) == []


def test_starved_heads__an_entry_behind_a_head_that_does_not_fit_is_not_counted() -> None:
    stream = [
        *life(1, {"p": 1}, enqueued=0, admitted=0, settled=5),
        *life(2, {"p": 2}, enqueued=0.5, admitted=5, settled=6),  # the head: waits for both
        *life(3, {"p": 1}, enqueued=0.6, admitted=6, settled=7),  # one slot free, not the head
    ]
    assert starved(stream, {"p": 2}) == []
    # Ahead by priority, entry 3 is the head: it waits 4.4 s with a slot free.
    waiters = {3: Waiter(priority=5)}
    assert starved(stream, {"p": 2}, waiters=waiters) == [
        "entry 3 (p 1) head with free slots for 4400 ms"
    ]


def test_starved_heads__a_killed_workers_slot_is_held_until_the_requeue() -> None:
    # Entry 1's worker was killed: its claim lapsed and the sweep requeued it at 4.0 (its
    # first admission time is not in the stream); admitted again at 4.0, settled at 4.5.
    stream = [
        *life(1, {"p": 1}, enqueued=0, requeued=[4.0], admitted=4.0, settled=4.5),
        *life(2, {"p": 1}, enqueued=0.5, admitted=4.5, settled=5),
    ]
    assert starved(stream, {"p": 1}) == []
    # The same, requeued twice: held all along too.
    stream = [
        *life(1, {"p": 1}, enqueued=0, requeued=[2.0, 4.0], admitted=4.0, settled=4.5),
        *life(2, {"p": 1}, enqueued=0.5, admitted=4.5, settled=5),
    ]
    assert starved(stream, {"p": 1}) == []
    # Back in line at 4.0 but admitted again only at 4.3 while its slot was free: counted.
    stream = [*life(1, {"p": 1}, enqueued=0, requeued=[4.0], admitted=4.3, settled=4.5)]
    assert starved(stream, {"p": 1}) == ["entry 1 (p 1) head with free slots for 300 ms"]


def test_starved_heads__a_readmission_stamped_before_its_requeue_is_ordered_by_token() -> None:
    # Entry 1 (token 1) was requeued at 4.0 and admitted again (token 2) by a call that had
    # read its clock at 3.9, before it waited for the lock the requeue held: the stamps say
    # admitted, then requeued; the tokens say the other way round. Held all along.
    stream = [
        *life(1, {"p": 1}, enqueued=0),
        Transition(3.9, "admitted", 1, "p", 1, token=2),
        Transition(4.0, "requeued", 1, "p", 1, token=1),
        Transition(4.5, "settled", 1, "p", 1, token=2),
        *life(2, {"p": 1}, enqueued=0.5, admitted=4.5, settled=5),
    ]
    assert stamp_skews(stream) == [1]
    assert starved(stream, {"p": 1}) == []
    # Read by stamps alone, entry 1 would be back in line from 4.0 for good, its slot free.
    unordered = [replace(t, token=0) for t in stream]
    assert stamp_skews(unordered) == []
    assert "entry 1 (p 1) head with free slots for inf ms" in starved(unordered, {"p": 1})
    # A requeue of the token it was last admitted with, stamped after that admission, is
    # not a skew: the entry is back in line (here until it expired at 4.3).
    stream = [
        *life(1, {"p": 1}, enqueued=3.85),
        Transition(3.9, "admitted", 1, "p", 1, token=2),
        Transition(4.0, "requeued", 1, "p", 1, token=2),
        Transition(4.3, "expired", 1, "p", 1),
    ]
    assert stamp_skews(stream) == []
    assert starved(stream, {"p": 1}) == ["entry 1 (p 1) head with free slots for 300 ms"]


def test_lost_with_their_process__a_kill_between_a_release_and_its_follow_up() -> None:
    # Entry 1 (on worker w1, body pid 11) settles at 1.0, freeing pool c for multi-pool
    # entry 2, whose pass was that settle's follow-up; w1 is SIGKILLed at 1.01, and the
    # sweep (every second) admits entry 2 at 1.95: a 950 ms wait, not a lost wake-up.
    stream = [
        *life(1, {"c": 2}, enqueued=0, admitted=0, settled=1.0),
        *life(2, {"a": 1, "c": 2}, enqueued=0.5, admitted=1.95, settled=3),
    ]
    episodes = starved_heads(stream, {}, {"a": 1, "c": 2})
    assert [str(e) for e in episodes] == [
        "entry 2 (a 1, c 2) head with free slots for 950 ms"
    ]
    releasers = {1: ("w1", 11), 2: ("w2", 12)}

    def lost(*stalls: Stall, sweep: float = 1.0) -> list[Any]:
        return lost_with_their_process(episodes, stream, releasers, stalls, sweep)

    assert lost(Stall(1.01, worker="w1")) == episodes
    assert lost(Stall(1.01, pid=11)) == episodes  # paused instead (SIGSTOP)
    # Another worker killed, or the same one long after the release: counted.
    assert lost(Stall(1.01, worker="w2")) == []
    assert lost(Stall(1.01, pid=12)) == []
    assert lost(Stall(1.6, worker="w1")) == []
    # The wait outlasted the next sweep after the kill: counted.
    assert lost(Stall(1.01, worker="w1"), sweep=0.3) == []


def test_starved_heads__not_while_the_database_was_down_and_shortly_after() -> None:
    stream = [
        *life(1, {"p": 1}, enqueued=0, admitted=0, settled=1.0),
        *life(2, {"p": 1}, enqueued=0.5, admitted=3.0, settled=4),
    ]
    assert starved(stream, {"p": 1}, down=[(0.9, 1.0)]) == []  # within the grace after it
    assert starved(stream, {"p": 1}, down=[(10, 11)]) == [
        "entry 2 (p 1) head with free slots for 2000 ms"
    ]


def test_starved_heads__a_delayed_entry_counts_once_it_is_due() -> None:
    stream = [*life(1, {"p": 1}, enqueued=0, admitted=2.05, settled=3)]
    assert starved(stream, {"p": 1}, waiters={1: Waiter(not_before=2.0)}) == []
    stream = [*life(1, {"p": 1}, enqueued=0, admitted=2.5, settled=3)]
    assert starved(stream, {"p": 1}, waiters={1: Waiter(not_before=2.0)}) == [
        "entry 1 (p 1) head with free slots for 500 ms"
    ]


def test_starved_heads__entries_of_uncounted_pools_are_left_out() -> None:
    stream = [*life(1, {"p": 1, "q": 1}, enqueued=0, admitted=2.5, settled=3)]
    assert starved(stream, {"p": 1, "q": 1}) == [
        "entry 1 (p 1, q 1) head with free slots for 2500 ms"
    ]
    assert starved(stream, {"p": 1, "q": 1}, uncounted_pools=["q"]) == []


def test_starved_heads__a_multi_pool_entry_must_head_every_line() -> None:
    stream = [
        *life(1, {"q": 1}, enqueued=0, admitted=0, settled=5),
        *life(2, {"q": 2}, enqueued=0.1, admitted=5, settled=6),  # heads q, does not fit
        *life(3, {"p": 1, "q": 1}, enqueued=0.2, admitted=6, settled=7),  # heads p only
    ]
    assert starved(stream, {"p": 1, "q": 2}) == []


def test_starved_heads__a_multi_pool_head_counts_from_half_a_second() -> None:
    """The Python pass that admits it waits for every lock first (see
    ``check.MULTI_POOL_THRESHOLD``): 300 ms is not counted, 600 ms is; a one-pool head's
    300 ms is."""
    stream = [*life(1, {"p": 1, "q": 1}, enqueued=0, admitted=0.3, settled=1)]
    assert starved(stream, {"p": 1, "q": 1}) == []
    stream = [*life(1, {"p": 1, "q": 1}, enqueued=0, admitted=0.6, settled=1)]
    assert starved(stream, {"p": 1, "q": 1}) == [
        "entry 1 (p 1, q 1) head with free slots for 600 ms"
    ]
    stream = [*life(1, {"p": 1}, enqueued=0, admitted=0.3, settled=1)]
    assert starved(stream, {"p": 1}) == ["entry 1 (p 1) head with free slots for 300 ms"]
