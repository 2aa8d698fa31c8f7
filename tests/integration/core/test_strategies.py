"""Admission strategies and aging (issue 15): the order of each strategy, on SQLite (ORM
path) and, in the postgres run, on both paths; the aging bound with a controlled clock.

A strategy changes only the order: every test here admits through the ordinary services
(enqueue, settle) and reads the order from what the bridge published.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest
from django.conf import settings
from django.test import override_settings

from pools.core import (
    admission,
    line_places,
    per_key,
    pool_crud,
    settings_sync,
    strategies,
)
from pools.exceptions import PoolConfigurationError
from pools.models import Demand, Pool, QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
    pytest.mark.usefixtures("admission_path"),  # both paths on PostgreSQL
]

START = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


class Clock:
    """A fake ``timezone.now`` that moves only when told to."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now

    def tick(self, seconds: float = 1.0) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Iterator[Clock]:
    fake = Clock()
    with mock.patch("django.utils.timezone.now", fake):
        yield fake


def finish(rec: RecordingBridge, key: str) -> None:
    adm = [a for a in rec.admissions if a.key == key][-1]
    assert admission.settle(adm.entry_id, adm.token, "succeeded")


def drain(rec: RecordingBridge, first: str, count: int) -> list[str]:
    """Settle the holder of a one-slot pool ``count`` times; the keys admitted, in order."""
    order: list[str] = []
    holder = first
    for _ in range(count):
        before = len(rec.admissions)
        finish(rec, holder)
        admitted = [a.key for a in rec.admissions[before:]]
        assert len(admitted) == 1, admitted  # one slot: one admission per settle
        holder = admitted[0]
        order.append(holder)
    return order


def line(clock: Clock, pool: str, items: list[tuple[str, int, str]]) -> None:
    """Enqueue ``(key, priority, fairness key)`` one second apart."""
    for key, priority, fairness in items:
        clock.tick()
        submit(pool, key=key, priority=priority, fairness_key=fairness)


ITEMS = [("e1", 0, "A"), ("e2", 5, "A"), ("e3", 1, "B"), ("e4", 5, "A"), ("e5", 0, "C")]


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("priority", ["e2", "e4", "e3", "e1", "e5"]),  # priority, then first come
        ("fifo", ["e1", "e2", "e3", "e4", "e5"]),  # first come, priority ignored
        ("lifo", ["e5", "e4", "e3", "e2", "e1"]),  # last come first
        # one per key per round (A, B, C), first come within a key:
        # round 1: e1 (A) e3 (B) e5 (C); round 2: e2 (A); round 3: e4 (A)
        ("fair", ["e1", "e3", "e5", "e2", "e4"]),
    ],
)
def test_strategy__admits_in_its_order(
    strategy: str, expected: list[str], recorder: RecordingBridge, clock: Clock
) -> None:
    make_pool("p", 1, strategy=strategy)
    submit("p", key="holder")
    line(clock, "p", ITEMS)
    assert drain(recorder, "holder", len(ITEMS)) == expected


@pytest.mark.parametrize("strategy", ["priority", "fifo", "lifo", "fair"])
def test_strategy__positions_follow_the_admission_order(
    strategy: str, recorder: RecordingBridge, clock: Clock
) -> None:
    pool = make_pool("p", 1, strategy=strategy)
    submit("p", key="holder")
    line(clock, "p", ITEMS)
    ids = {e.key: e.queue_id for e in QueueEntry.objects.filter(key__startswith="e")}
    places = line_places.positions(pool, list(ids.values()))
    by_place = sorted(ids, key=lambda k: places[ids[k]])
    assert drain(recorder, "holder", len(ITEMS)) == by_place


def test_fair__a_key_served_this_round_waits_for_the_next(
    recorder: RecordingBridge, clock: Clock
) -> None:
    """A1 is admitted in round 1; A2 is round 2. B1 (round 1) goes first; a new key C,
    arriving after A2, still joins round 1 and goes before A2."""
    make_pool("p", 1, strategy="fair")
    line(clock, "p", [("a1", 0, "A"), ("b1", 0, "B"), ("a2", 0, "A")])
    assert [a.key for a in recorder.admissions] == ["a1"]
    order = drain(recorder, "a1", 1)
    line(clock, "p", [("c1", 0, "C")])
    order += drain(recorder, order[-1], 2)
    assert order == ["b1", "c1", "a2"]
    assert Pool.objects.get(name="p").fair_round == 2


def test_fair__keyless_entries_are_one_group_and_a_steady_key_does_not_starve_others(
    recorder: RecordingBridge, clock: Clock
) -> None:
    make_pool("p", 1, strategy="fair")
    submit("p", key="holder", fairness_key="busy")
    # "busy" queues 20 entries; then two other tenants and a keyless entry arrive.
    line(clock, "p", [(f"busy{i}", 0, "busy") for i in range(20)])
    line(clock, "p", [("t1", 0, "tenant-1"), ("none", 0, ""), ("t2", 0, "tenant-2")])
    order = drain(recorder, "holder", 6)
    # "busy" was served in round 1 (the holder), so its entries are rounds 2..21; the
    # newcomers join round 1 (in arrival order), then "busy" goes on, one per round.
    assert order == ["t1", "none", "t2", "busy0", "busy1", "busy2"]


def test_fair__delayed_entry_gets_its_round_when_due(
    recorder: RecordingBridge, clock: Clock
) -> None:
    make_pool("p", 1, strategy="fair")
    submit("p", key="holder", fairness_key="A")
    line(clock, "p", [("a1", 0, "A"), ("a2", 0, "A")])
    # B's entry is due in 10 s: out of line (round 0 placeholder) until then.
    submit("p", key="b-later", fairness_key="B", not_before=clock.now + timedelta(seconds=10))
    assert Demand.objects.get(entry__key="b-later").state == "delayed"
    clock.tick(11)
    order = drain(recorder, "holder", 3)
    row = Demand.objects.get(entry__key="b-later")
    # A was served in round 1 (the holder) and waits in rounds 2-3; B joins when due, in
    # the round being served (1), so it goes first.
    assert row.line_round == 1, row.line_round
    assert order == ["b-later", "a1", "a2"]


def test_fairness_key__stored_on_the_entry_and_only_on_rows_of_fair_pools(
    recorder: RecordingBridge, clock: Clock
) -> None:
    make_pool("f", 1, strategy="fair")
    make_pool("g", 1)
    submit({"f": 1, "g": 1}, key="both", fairness_key="tenant-7")
    assert QueueEntry.objects.get(key="both").fairness_key == "tenant-7"
    rows = {d.pool.name: d.fairness_key for d in Demand.objects.select_related("pool")}
    assert rows == {"f": "tenant-7", "g": None}


def test_multi_pool__admitted_only_as_head_of_both_orders(
    recorder: RecordingBridge, clock: Clock
) -> None:
    """A lifo pool and a fifo pool: an entry naming both waits until it heads both lines."""
    make_pool("new", 1, strategy="lifo")
    make_pool("old", 1, strategy="fifo")
    submit("new", key="hn")
    submit("old", key="ho")
    line(clock, "new", [("n1", 0, "")])
    clock.tick()
    submit({"new": 1, "old": 1}, key="both")
    line(clock, "old", [("o1", 0, "")])
    line(clock, "new", [("n2", 0, "")])  # newest in "new": ahead of "both" there
    finish(recorder, "ho")  # "old" frees: its head is "both" (fifo), blocked in "new"
    assert QueueEntry.objects.get(key="both").state == EntryState.WAITING
    assert QueueEntry.objects.get(key="o1").state == EntryState.WAITING  # head of line
    finish(recorder, "hn")  # "new" admits its head n2 (lifo)
    assert QueueEntry.objects.get(key="n2").state == EntryState.ADMITTED
    finish(recorder, "n2")  # now "both" heads both lines
    assert QueueEntry.objects.get(key="both").state == EntryState.ADMITTED
    assert Pool.objects.get(name="new").held == 1 and Pool.objects.get(name="old").held == 1


def test_strategy_change__reorders_the_waiting_entries(
    recorder: RecordingBridge, clock: Clock
) -> None:
    make_pool("p", 1)
    submit("p", key="holder")
    line(clock, "p", ITEMS)
    pool_crud.update_pool("p", strategy="lifo")
    assert drain(recorder, "holder", 2) == ["e5", "e4"]
    pool_crud.update_pool("p", strategy="fair")
    # e1, e3 are round 1 (A, B), e2 round 2 (A): by rounds, then enqueue time.
    assert drain(recorder, "e4", 3) == ["e1", "e3", "e2"]


def test_aging__needs_strategy_priority() -> None:
    make_pool("p", 1, strategy="fifo")
    with pytest.raises(PoolConfigurationError, match="aging_seconds applies to strategy"):
        pool_crud.update_pool("p", aging_seconds=10)
    with pytest.raises(PoolConfigurationError, match="must be one of"):
        pool_crud.update_pool("p", strategy="random")
    with pytest.raises(PoolConfigurationError, match="aging_seconds must be a positive"):
        pool_crud.update_pool("p", strategy="priority", aging_seconds=0)


def test_settings__strategy_and_aging_sync_from_definitions(recorder: RecordingBridge) -> None:
    pools = {
        "fair-pool": {"slots": 2, "strategy": "fair"},
        "aged": {"slots": 1, "aging_seconds": 30},
    }
    with override_settings(POOLS={**settings.POOLS, "DEFINITIONS": pools}):
        settings_sync.sync()
        assert Pool.objects.get(name="fair-pool").strategy == "fair"
        aged = Pool.objects.get(name="aged")
        assert (aged.strategy, aged.aging_seconds) == ("priority", 30)
    bad = {"x": {"slots": 1, "strategy": "lifo", "aging_seconds": 5}}
    with override_settings(POOLS={**settings.POOLS, "DEFINITIONS": bad}):
        with pytest.raises(PoolConfigurationError, match=r"POOLS\['DEFINITIONS'\]\['x'\]"):
            settings_sync.sync()


# --------------------------------------------------------------------------- aging bound

HIGH = 5
TICKS = 60


def starve(rec: RecordingBridge, clock: Clock, aging: int | None) -> int | None:
    """A one-slot pool under a saturating stream of priority-HIGH entries, one a second
    (each second one arrives and the holder finishes); a priority-0 entry waits from t=0.
    Returns the second at which it was admitted, or None within TICKS seconds."""
    make_pool("p", 1, aging_seconds=aging)
    submit("p", key="h0", priority=HIGH)
    submit("p", key="low", priority=0)
    holder = "h0"
    for second in range(1, TICKS + 1):
        clock.tick()
        submit("p", key=f"h{second}", priority=HIGH)
        holder = drain(rec, holder, 1)[0]
        if holder == "low":
            return second
    return None


def test_aging__without_it_a_low_priority_entry_starves(
    recorder: RecordingBridge, clock: Clock
) -> None:
    assert starve(recorder, clock, aging=None) is None
    assert QueueEntry.objects.get(key="low").state == EntryState.WAITING


@pytest.mark.parametrize("aging", [2, 5])
def test_aging__admits_a_low_priority_entry_within_its_bound(
    aging: int, recorder: RecordingBridge, clock: Clock
) -> None:
    """Effective priority = priority + seconds waited / aging_seconds: the low entry passes
    every HIGH entry that arrived more than (HIGH - 0) x aging_seconds after it, so it is
    admitted by then (plus the one admission per second the stream allows)."""
    second = starve(recorder, clock, aging=aging)
    bound = HIGH * aging
    assert second is not None and second <= bound, (second, bound)
    low = QueueEntry.objects.get(key="low")
    assert low.admitted_at is not None
    assert low.admitted_at - low.enqueued_at <= timedelta(seconds=bound)


def test_aging__place_is_the_enqueue_time_moved_back_by_priority(
    recorder: RecordingBridge, clock: Clock
) -> None:
    make_pool("p", 1, aging_seconds=10)
    submit("p", key="holder")
    submit("p", key="x", priority=3)
    row = Demand.objects.get(entry__key="x")
    assert (row.line_round, row.line_at) == (0, row.enqueued_at - timedelta(seconds=30))
    assert strategies.aging_of(Pool.objects.get(name="p")) == 10


def test_command__list_and_inspect_show_strategy_and_keys(recorder: RecordingBridge) -> None:
    from io import StringIO

    from django.core.management import call_command

    make_pool("fairly", 1, strategy="fair")
    make_pool("aged", 1, aging_seconds=30)
    submit("fairly", key="run", fairness_key="acme")
    submit("fairly", key="next", fairness_key="globex")
    out = StringIO()
    call_command("pools", "list", stdout=out)
    listing = out.getvalue()
    assert "(fair)" in listing and "(priority, aging 30s)" in listing, listing
    out = StringIO()
    call_command("pools", "inspect", "fairly", stdout=out)
    assert "key=globex" in out.getvalue(), out.getvalue()


def test_templates__per_key_pools_take_the_template_strategy(recorder: RecordingBridge) -> None:
    templates = {"tenant:{tenant_id}": {"slots": 1, "strategy": "fair"}}
    with override_settings(POOLS={**settings.POOLS, "TEMPLATES": templates}):
        pool = per_key.ensure_pool("tenant:acme", "tenant:{tenant_id}")
    assert (pool.strategy, pool.aging_seconds) == ("fair", None)
