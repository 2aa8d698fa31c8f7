"""The chaos checker catches what it claims to catch (synthetic records, no services)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.chaos.check import Body, check, max_overlap, read_bodies


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
