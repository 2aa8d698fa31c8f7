"""Per-pool daily spend caps: slot-seconds per UTC day, a controlled clock, rollover."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from django.utils import timezone

from pools import pool_fields
from pools.core import admission, capacity, declarations, explain, pool_crud, spendcap
from pools.exceptions import PoolConfigurationError
from pools.models import Pool, QueueEntry
from pools.states import EntryState
from pools.testing import spend_clock
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True)

DAY = datetime(2026, 3, 14, 23, 50, tzinfo=UTC)


def held_for(key: str, seconds: float) -> tuple[int, int]:
    """The claim of admitted ``key``, its admission moved ``seconds`` into the past."""
    entry = QueueEntry.objects.get(key=key)
    assert entry.state == EntryState.ADMITTED, entry.state
    QueueEntry.objects.filter(pk=entry.pk).update(
        admitted_at=timezone.now() - timedelta(seconds=seconds)
    )
    return entry.queue_id, entry.token


def state(key: str) -> str:
    return QueueEntry.objects.get(key=key).state


def test_spend_cap__spent_cap_stops_admission_until_the_next_utc_day(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 1, spend_cap=10)
    clock = [DAY]
    with spend_clock(lambda: clock[0]):
        submit("p", key="a")
        submit("p", key="b")
        submit("p", key="c")
        # a held its slot for 4 s: 4 of 10 slot-seconds, b is admitted.
        assert admission.settle(*held_for("a", 4), EntryState.SUCCEEDED)
        pool = Pool.objects.get(name="p")
        assert (pool.spend_day, pool.spent_today) == (date(2026, 3, 14), pytest.approx(4, abs=0.5))
        assert state("b") == EntryState.ADMITTED
        # b held it for 7 s: 11 >= 10, the cap is spent: c waits, and says why.
        assert admission.settle(*held_for("b", 7), EntryState.SUCCEEDED)
        assert state("c") == EntryState.WAITING
        assert Pool.objects.get(name="p").spent_today == pytest.approx(11, abs=0.5)
        got = explain.explain_key("c")
        assert got.blocked_by == "spend_cap"
        place = got.places[0]
        assert "has spent its daily spend cap" in place.message and place.detail["cap"] == 10
        midnight = datetime(2026, 3, 15, tzinfo=UTC)
        assert place.eta == midnight
        # The pass asked to be woken when the next UTC day starts.
        assert (["p"], midnight) in recorder.wakes
        # Later passes the same day admit nothing either.
        assert admission.admit(["p"]) == []
        # The next UTC day: the wake-up's pass admits c, and the day's spend starts at 0.
        clock[0] = midnight + timedelta(seconds=1)
        assert [a.key for a in admission.admit(["p"])] == ["c"]
        assert spendcap.spent(Pool.objects.get(name="p")) == 0
        assert admission.settle(*held_for("c", 2), EntryState.SUCCEEDED)
        pool = Pool.objects.get(name="p")
        assert (pool.spend_day, pool.spent_today) == (date(2026, 3, 15), pytest.approx(2, abs=0.5))


def test_spend_cap__counts_slots_times_seconds_and_is_persisted(
    recorder: RecordingBridge,
) -> None:
    make_pool("p", 3, spend_cap=100)
    with spend_clock(DAY):
        submit("p", 3, key="big")
        assert admission.settle(*held_for("big", 10), EntryState.SUCCEEDED)
    # Read back from the database (a restart): 3 slots x 10 s.
    pool = Pool.objects.get(name="p")
    assert pool.spent_today == pytest.approx(30, abs=1.5)
    with spend_clock(DAY):
        assert spendcap.spent(pool) == pool.spent_today and not spendcap.is_capped(pool)
    with spend_clock(DAY + timedelta(days=1)):
        assert spendcap.spent(pool) == 0


def test_spend_cap__pools_without_a_cap_count_nothing(recorder: RecordingBridge) -> None:
    make_pool("p", 1)
    submit("p", key="a")
    submit("p", key="b")
    assert admission.settle(*held_for("a", 50), EntryState.SUCCEEDED)
    pool = Pool.objects.get(name="p")
    assert (pool.spend_day, pool.spent_today) == (None, 0)
    assert state("b") == EntryState.ADMITTED


def test_spend_cap__multi_pool_entry_waits_for_its_capped_pool(recorder: RecordingBridge) -> None:
    make_pool("capped", 1, spend_cap=1)
    make_pool("free", 1)
    with spend_clock(DAY):
        submit("capped", key="a")
        submit({"capped": 1, "free": 1}, key="both")
        assert admission.settle(*held_for("a", 5), EntryState.SUCCEEDED)
        assert state("both") == EntryState.WAITING
        assert explain.explain_key("both").blocked_by == "spend_cap"


@pytest.mark.parametrize("bad", [0, -5, "8h", True])
def test_spend_cap__bad_values_are_refused(bad: object) -> None:
    with pytest.raises(PoolConfigurationError, match="positive number of slot-seconds"):
        declarations.parse("p", {"slots": 1, "spend_cap": bad})
    with pytest.raises(PoolConfigurationError) as info:
        pool_fields.check_fields({"spend_cap": bad})
    assert info.value.field == "spend_cap"


def test_spend_cap__from_settings() -> None:
    assert declarations.parse("p", {"slots": 1, "spend_cap": 3600}).spend_cap == 3600.0
    assert declarations.parse("p", {"slots": 1}).spend_cap is None
    pool = make_pool("q", 1)
    pool_crud.update_pool("q", spend_cap=7200)
    pool.refresh_from_db()
    assert pool.spend_cap == 7200


def test_spend_cap__a_paused_pool_still_counts_what_its_holders_spend(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """Pausing stops admission, not accounting: a settle in a paused capped pool adds its
    slot-seconds (on the fast path the function hands capped pools to Python, paused or not)."""
    make_pool("p", 2, spend_cap=100)
    submit("p", 2, key="a")
    capacity.set_paused("p", True)
    assert admission.settle(*held_for("a", 5), EntryState.SUCCEEDED)
    assert Pool.objects.get(name="p").spent_today == pytest.approx(10, abs=1)
