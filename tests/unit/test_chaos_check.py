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
