"""Lifecycle signals: sent after commit, once per event of the stream (the logged rows and
the normal transitions the entries carry), never for rolled-back work, and on both
admission paths alike: connecting a receiver does not change the path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction
from pytest_django import DjangoAssertNumQueries, Settings

from pools import signals
from pools.core import admission, events, leases, rated_pools
from pools.models import PoolEvent, QueueEntry
from tests.conftest import POOL_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


class Heard:
    """Every pools signal received, as (signal name, event)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, PoolEvent]] = []

    def receiver(self, name: str) -> Any:
        def receive(sender: Any, event: PoolEvent, **kwargs: Any) -> None:
            assert sender is PoolEvent
            self.events.append((name, event))

        return receive

    def rows(self) -> list[tuple[Any, ...]]:
        return [
            (e.id, e.kind, e.pool, e.entry_id, e.key, e.token, e.detail, e.at)
            for _, e in self.events
        ]


@pytest.fixture
def heard() -> Iterator[Heard]:
    rec = Heard()
    connected = []
    for kind, signal in signals.BY_KIND.items():
        fn = rec.receiver(kind)
        signal.connect(fn, sender=PoolEvent, weak=False)
        connected.append((signal, fn))
    yield rec
    for signal, fn in connected:
        signal.disconnect(fn, sender=PoolEvent)


def stored_rows() -> list[tuple[Any, ...]]:
    """The event stream as read back from the database (entries and logged rows)."""
    return [
        (e.id, e.kind, e.pool, e.entry_id, e.key, e.token, e.detail, e.at)
        for e in events.stream(QueueEntry.objects.all(), PoolEvent.objects.order_by("id"))
    ]


def test_signals__one_per_event_row_in_order_on_both_paths(
    recorder: RecordingBridge, heard: Heard, admission_path: str
) -> None:
    make_pool("a", 1)
    make_pool("b", 2)
    first = submit({"a": 1, "b": 1}, key="first")
    submit("a", key="second")
    adm = recorder.admissions[0]
    assert first.admitted and adm.key == "first"
    assert leases.start(adm.entry_id, adm.token, worker="w1") is not None
    assert admission.settle(adm.entry_id, adm.token, "succeeded")
    assert recorder.keys() == ["first", "second"]
    kinds = [kind for kind, _ in heard.events]
    assert kinds == [
        "enqueued", "enqueued", "admitted", "admitted",  # first, in pools a and b
        "enqueued",  # second waits
        "started", "started",
        "settled", "settled", "admitted",  # second admitted by the settle
    ]  # fmt: skip
    # Each signal carries the event as the stream reads it back (time, detail and all),
    # in the order it happened; the normal transitions write no event row.
    assert heard.rows() == stored_rows()
    assert not PoolEvent.objects.exists()
    assert {e.detail["worker"] for k, e in heard.events if k == "started"} == {"w1"}


@pytest.mark.postgres
def test_signals__receivers_do_not_move_the_fast_path_off(
    recorder: RecordingBridge,
    heard: Heard,
    settings: Settings,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    """With receivers connected, enqueue and settle on PostgreSQL are still one query each."""
    settings.POOLS = {**settings.POOLS, "SQL_FAST_PATH": True}
    make_pool("p", 1)
    # Which pools have a rate is read once per process per pool name (then kept: the
    # conftest holds it for query-count tests); read it before counting.
    rated_pools.of(["p"])
    with django_assert_num_queries(1):
        assert submit("p", key="run").admitted
    with django_assert_num_queries(1):
        assert not submit("p", key="next").admitted
    adm = recorder.admissions[0]
    with django_assert_num_queries(1):
        assert admission.settle(adm.entry_id, adm.token, "succeeded")
    assert [k for k, _ in heard.events] == [
        "enqueued",
        "admitted",
        "enqueued",
        "settled",
        "admitted",
    ]


def test_signals__sent_after_commit_and_never_for_rolled_back_work(
    recorder: RecordingBridge, heard: Heard, admission_path: str
) -> None:
    make_pool("p", 1)
    with transaction.atomic():
        submit("p", key="kept")
        assert heard.events == [], "nothing is sent before the transaction commits"
    assert [k for k, _ in heard.events] == ["enqueued", "admitted"]

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        submit("p", key="rolled-back")
        raise Boom
    with transaction.atomic():
        try:
            with transaction.atomic():  # a savepoint rolled back inside a kept transaction
                submit("p", key="inner")
                raise Boom
        except Boom:
            pass
    assert [e.key for _, e in heard.events] == ["kept", "kept"]
    assert heard.rows() == stored_rows()
