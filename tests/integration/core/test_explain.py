"""Why is it waiting (pools.core.explain) and the pool views (pools.core.snapshots), on a real database."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.utils import timezone
from pytest_django import DjangoAssertNumQueries

from pools.core import admission, entry_pages, explain, line_places, snapshots
from pools.exceptions import EntryNotFound, UnknownPool
from pools.models import Demand, Pool, QueueEntry
from pools.states import EntryState
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = [
    pytest.mark.django_db(transaction=True, available_apps=POOL_APPS),
    pytest.mark.usefixtures("admission_path"),  # both paths on PostgreSQL
]


def entry(key: str) -> QueueEntry:
    return QueueEntry.objects.get(key=key)


def place(key: str, pool: str) -> explain.PoolPlace:
    return next(p for p in explain.explain_key(key).places if p.pool == pool)


def finish(rec: RecordingBridge, key: str) -> None:
    adm = next(a for a in rec.admissions if a.key == key)
    assert admission.settle(adm.entry_id, adm.token, EntryState.SUCCEEDED)


def test_explain__pool_full_names_the_holders(recorder: RecordingBridge) -> None:
    make_pool("p", 2)
    submit(key="a")
    submit(key="b")
    submit(key="c")
    submit(key="d")
    c = place("c", "p")
    assert (c.position, c.blocked_by) == (1, "pool_full")
    ids = [entry(k).queue_id for k in ("a", "b")]
    assert [h["key"] for h in c.detail["holders"]] == ["a", "b"]
    assert c.message == f"Pool 'p' is full: 2 of 2 slot(s) held by #{ids[0]}, #{ids[1]}."
    d = place("d", "p")
    assert (d.position, d.blocked_by) == (2, "pool_full")
    assert d.message.endswith("1 entry ahead.")


def test_explain__head_of_line_names_the_head_that_needs_more_slots(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 3)
    submit(key="one")
    submit(key="big", slots=3)
    submit(key="small")
    big, small = place("big", "p"), place("small", "p")
    assert (big.position, big.blocked_by) == (1, "pool_full")
    assert (small.position, small.blocked_by) == (2, "head_of_line")
    assert small.detail["ahead"] == {"queue_id": entry("big").queue_id, "key": "big", "slots": 3}
    assert small.detail["free"] == 2
    assert "needs 3 slot(s) and only 2 of 3 are free" in small.message


def test_explain__paused_pool(recorder: RecordingBridge) -> None:
    make_pool("p", 1, paused=True)
    submit(key="w")
    w = place("w", "p")
    assert (w.position, w.blocked_by, w.eta) == (1, "paused", None)
    assert "paused" in w.message


def test_explain__not_before_entry_is_out_of_line_until_due(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="run")
    due = timezone.now() + timedelta(hours=1)
    submit(key="later", not_before=due, priority=9)
    submit(key="now")
    later = place("later", "p")
    assert (later.position, later.blocked_by) == (None, "not_before")
    assert later.detail["until"] == due.isoformat()
    assert later.eta == due
    # It does not take a place: the entry sent after it is first in line.
    assert place("now", "p").position == 1


def test_explain__multi_pool_entry_waiting_for_the_other_pool(recorder: RecordingBridge) -> None:
    make_pool("a", 1)
    make_pool("b", 1)
    submit("b", key="hold-b")
    submit({"a": 1, "b": 1}, key="both")
    a, b = explain.explain_key("both").places
    assert (a.pool, a.position, a.blocked_by) == ("a", 1, "other_pool")
    assert a.detail == {"pool": "b", "reason": "pool_full"}
    assert (b.pool, b.position, b.blocked_by) == ("b", 1, "pool_full")
    # The entry's own blocker is the full pool, not "waits for another pool".
    assert explain.explain_key("both").blocked_by == "pool_full"


def test_explain__held_and_finished_entries_are_not_blocked(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit(key="run")
    run = explain.explain_key("run")
    assert run.entry.state == EntryState.ADMITTED
    assert [(p.position, p.blocked_by) for p in run.places] == [(None, None)]
    assert run.places[0].message.startswith("Admitted: holds 1 slot(s) of pool 'p'")
    assert run.eta is None
    finish(recorder, "run")
    done = explain.explain_key("run")
    assert done.places[0].message == "Finished: succeeded."


def test_explain_key__unknown_key_and_latest_entry(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    with pytest.raises(EntryNotFound):
        explain.explain_key("nope")
    submit(key="same")
    finish(recorder, "same")
    submit(key="same")  # a retry reuses the task id
    assert explain.explain_key("same").entry.state == EntryState.ADMITTED


def test_eta__none_without_history_then_from_mean_hold(recorder: RecordingBridge) -> None:
    make_pool("p", 2)
    for k in ("h1", "h2", "w1", "w2", "w3"):
        submit(key=k)
    assert place("w1", "p").eta is None, "no finished holds yet"
    finish(recorder, "h1")  # admits w1
    finish(recorder, "h2")  # admits w2
    now = timezone.now()
    # Hold times of 10 s and 30 s: mean 20 s.
    for k, seconds in (("h1", 10), ("h2", 30)):
        QueueEntry.objects.filter(key=k).update(
            admitted_at=now - timedelta(seconds=seconds + 1), finished_at=now - timedelta(seconds=1)
        )
    submit(key="w4")
    submit(key="w5")
    # w3, w4, w5 wait at positions 1..3 of a 2-slot pool: waves ceil(p / 2).
    exp_now = timezone.now()
    got = {k: explain.explain_key(k, now=exp_now).places[0] for k in ("w3", "w4", "w5")}
    assert [got[k].position for k in ("w3", "w4", "w5")] == [1, 2, 3]
    assert got["w3"].eta == exp_now + timedelta(seconds=20)
    assert got["w4"].eta == exp_now + timedelta(seconds=20)
    assert got["w5"].eta == exp_now + timedelta(seconds=40)
    pool = Pool.objects.get(name="p")
    assert line_places.estimate_eta(pool, 3, exp_now) == exp_now + timedelta(seconds=40)


def _bulk_line(pool: Pool, count: int) -> list[QueueEntry]:
    rng = random.Random(5)
    base = timezone.now() - timedelta(hours=1)
    entries = QueueEntry.objects.bulk_create(
        QueueEntry(
            key=f"bulk-{i}",
            task_name="tests.fake",
            demand={pool.name: 1},
            priority=rng.randint(0, 2),
            enqueued_at=base + timedelta(seconds=rng.randint(0, 5)),
        )
        for i in range(count)
    )
    Demand.objects.bulk_create(
        Demand(entry=e, pool=pool, slots=1, priority=e.priority, enqueued_at=e.enqueued_at)
        for e in entries
    )
    return entries


def test_positions__match_the_admission_order_with_ties(recorder: RecordingBridge) -> None:
    pool = make_pool("p", 1)
    submit(key="run")
    entries = _bulk_line(pool, 60)
    order = sorted(entries, key=lambda e: (-e.priority, e.enqueued_at, e.queue_id))
    expected = {e.queue_id: i + 1 for i, e in enumerate(order)}
    sample = random.Random(1).sample(entries, 12)
    assert line_places.positions(pool, sample) == {e.queue_id: expected[e.queue_id] for e in sample}
    for e in sample[:3]:
        assert place(e.key, "p").position == expected[e.queue_id]
    assert line_places.positions(pool, [entry("run")]) == {}, "a holder is not in line"


@pytest.mark.parametrize("depth", [5, 500])
def test_explain__query_count_does_not_grow_with_the_line(
    recorder: RecordingBridge, depth: int, django_assert_num_queries: DjangoAssertNumQueries
) -> None:
    pool = make_pool("p", 1)
    submit(key="run")
    _bulk_line(pool, depth)
    submit(key="last")
    e = entry("last")
    # demands, holders, hold times, then position and head for the one pool.
    with django_assert_num_queries(5):
        got = explain.explain(e)
    assert got.places[0].position == depth + 1


# --------------------------------------------------------------------------- snapshots


def test_snapshot__counts_holders_head_and_recent(recorder: RecordingBridge) -> None:
    make_pool("p", 2, max_queued=None)
    for k in ("a", "b", "c", "d", "e"):
        submit(key=k)
    submit(key="later", not_before=timezone.now() + timedelta(hours=1))
    admission.cancel("e")
    s = snapshots.snapshot("p", head=2, recent=5)
    assert (s.slots, s.capacity, s.held, s.free) == (2, 2, 2, 0)
    assert s.counts["waiting"] == 2 and s.counts["admitted"] == 2
    assert s.waiting == 2
    assert [h.key for h in s.holders] == ["a", "b"]
    assert [(w.key, w.position, w.blocked_by) for w in s.head] == [
        ("c", 1, "pool_full"),
        ("d", 2, "pool_full"),
    ]
    assert [(r.key, r.state, r.reason) for r in s.recent] == [("e", "cancelled", "cancelled")]


def test_snapshot__unknown_pool() -> None:
    with pytest.raises(UnknownPool):
        snapshots.snapshot("nope")


def test_snapshot__multi_pool_head_waiting_for_a_pool_outside_the_view(
    recorder: RecordingBridge, django_assert_num_queries: DjangoAssertNumQueries
) -> None:
    make_pool("a", 1)
    make_pool("b", 1)
    submit("b", key="hold-b")
    submit({"a": 1, "b": 1}, key="both")
    with django_assert_num_queries(6):  # the 5 of a snapshot + pool b's gate
        (head,) = snapshots.snapshot("a").head
    assert (head.key, head.position, head.blocked_by) == ("both", 1, "other_pool")


@pytest.mark.parametrize("pools,depth", [(2, 3), (12, 40)])
def test_snapshot_all__query_count_is_fixed(
    recorder: RecordingBridge,
    pools: int,
    depth: int,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    for i in range(pools):
        pool = make_pool(f"p{i:02}", 1)
        submit(pool.name, key=f"run-{i}")
        _bulk_line(pool, depth) if i == 0 else submit(pool.name, key=f"w-{i}")
    submit({"p00": 1, "p01": 1}, key="multi")
    # pools with heads, counts, holders, history, head rows: every pool named is in the set.
    with django_assert_num_queries(5):
        snaps = snapshots.snapshot_all(head=5)
    mine = [s for s in snaps if s.name.startswith("p0") or s.name.startswith("p1")]
    assert len(mine) == pools
    assert mine[0].waiting == depth + 1
    assert [(w.position, w.blocked_by) for w in mine[0].head] == [
        (i, "pool_full") for i in (1, 2, 3, 4, 5)
    ][: depth + 1]


def test_entries_page__walks_the_line_in_order_with_positions(recorder: RecordingBridge) -> None:
    pool = make_pool("p", 1)
    submit(key="run")
    entries = _bulk_line(pool, 23)
    order = [e.key for e in sorted(entries, key=lambda e: (-e.priority, e.enqueued_at, e.queue_id))]
    seen: list[tuple[str, int | None]] = []
    cursor, pages = None, 0
    while True:
        page = entry_pages.entries_page("p", cursor=cursor, limit=10)
        seen.extend((i.key, i.position) for i in page.items)
        pages += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert pages == 3
    assert seen == [(k, i + 1) for i, k in enumerate(order)]
    held = entry_pages.entries_page("p", state="admitted")
    assert [i.key for i in held.items] == ["run"] and held.next_cursor is None


def test_entries_page__bad_cursor_and_state(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    with pytest.raises(entry_pages.InvalidCursor):
        entry_pages.entries_page("p", cursor="%%%")
    with pytest.raises(entry_pages.InvalidCursor):
        entry_pages.entries_page("p", state="sleeping")
    other_state = entry_pages.entries_page("p", state="admitted").next_cursor
    assert other_state is None
