"""Global rate limits on pools (issue 17): exact sliding windows kept under the pool lock.

Time is moved by ageing a pool's marks (the admission times of its rings, by the
database's clock), as ``test_spend_cap`` moves ``admitted_at``; one test waits for a real
1-second window to open.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db.models import F
from django.utils import timezone

from pools.core import admission, explain, per_key, pool_crud, rates, settings_sync
from pools.core.records import Submission
from pools.models import Pool, QueueEntry, RateMark
from pools.specs import PoolSpec
from pools.states import EntryState
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True)


def state(key: str) -> str:
    return QueueEntry.objects.get(key=key).state


def admitted(*keys: str) -> list[str]:
    return [k for k in keys if state(k) == EntryState.ADMITTED]


def age(pool: str, seconds: float, *, oldest: int | None = None) -> None:
    """Move the pool's marks ``seconds`` into the past (only its ``oldest`` marks if given)."""
    marks = RateMark.objects.filter(pool__name=pool)
    if oldest is not None:
        ids = list(marks.order_by("at", "slot").values_list("pk", flat=True)[:oldest])
        marks = marks.filter(pk__in=ids)
    marks.update(at=F("at") - timedelta(seconds=seconds))


def settle(key: str) -> None:
    entry = QueueEntry.objects.get(key=key)
    assert admission.settle(entry.queue_id, entry.token, EntryState.SUCCEEDED)


def test_rates__a_burst_beyond_the_limit_is_held_back(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="3/m")
    keys = [f"k{i}" for i in range(5)]
    for key in keys:
        submit("p", key=key)
    assert admitted(*keys) == ["k0", "k1", "k2"]
    assert admission.admit(["p"]) == []
    assert RateMark.objects.filter(pool__name="p").count() == 3
    assert Pool.objects.get(name="p").admissions == 3


def test_rates__the_window_opening_admits_exactly_the_next_ones(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="3/m")
    keys = [f"k{i}" for i in range(8)]
    for key in keys:
        submit("p", key=key)
    assert len(admitted(*keys)) == 3
    # One admission leaves the window: exactly one more start.
    age("p", 60, oldest=1)
    assert [a.key for a in admission.admit(["p"])] == ["k3"]
    assert admission.admit(["p"]) == []
    # A minute later all of them have left it: three more, in order.
    age("p", 60)
    assert [a.key for a in admission.admit(["p"])] == ["k4", "k5", "k6"]
    assert state("k7") == EntryState.WAITING


def test_rates__just_inside_the_window_still_counts(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="1/m")
    submit("p", key="a")
    submit("p", key="b")
    age("p", 59)
    assert admission.admit(["p"]) == []
    age("p", 1.5)
    assert [a.key for a in admission.admit(["p"])] == ["b"]


def test_rates__every_rate_must_have_room(recorder: RecordingBridge, admission_path: str) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="2/s,3/m")
    keys = [f"k{i}" for i in range(6)]
    for key in keys:
        submit("p", key=key)
    assert admitted(*keys) == ["k0", "k1"]  # 2/s binds
    age("p", 1.5)
    assert [a.key for a in admission.admit(["p"])] == ["k2"]  # then 3/m
    age("p", 1.5)
    assert admission.admit(["p"]) == []
    age("p", 60)
    assert [a.key for a in admission.admit(["p"])] == ["k3", "k4"]  # 2/s again


def test_rates__slots_and_rate_together(recorder: RecordingBridge, admission_path: str) -> None:
    make_pool("p", 1, rate="2/m")
    for key in "abc":
        submit("p", key=key)
    assert admitted("a", "b", "c") == ["a"]  # the slot binds
    settle("a")
    assert state("b") == EntryState.ADMITTED
    settle("b")
    # The slot is free, the rate is not.
    assert state("c") == EntryState.WAITING
    got = explain.explain_key("c")
    assert got.blocked_by == "rate_limited"
    place = got.places[0]
    assert place.detail["rate"] == ["2/m"] and "has used its rate (2/m)" in place.message
    age("p", 60, oldest=1)
    assert [a.key for a in admission.admit(["p"])] == ["c"]


def test_rates__a_rate_blocked_head_blocks_its_line(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """Order is kept: the head held back by a rate waits, nothing passes it, and the next
    window goes to the highest priority first; a multi-pool head blocks its other pool too."""
    make_pool("p", rates.UNLIMITED_SLOTS, rate="1/m")
    make_pool("other", 5)
    submit("p", key="first")
    submit({"other": 1, "p": 1}, key="both")
    submit("other", key="behind")
    assert admitted("first", "both", "behind") == ["first"]
    assert explain.explain_key("both").blocked_by == "rate_limited"
    assert explain.explain_key("behind").blocked_by == "head_of_line"
    submit("p", key="urgent", priority=10)
    age("p", 60)
    assert [a.key for a in admission.admit(["other", "p"])] == ["urgent"]
    age("p", 60)
    got = [a.key for a in admission.admit(["other", "p"])]
    assert got == ["both", "behind"]


def test_rates__wake_up_when_the_window_opens(recorder: RecordingBridge) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="1/m")
    submit("p", key="a")
    recorder.wakes.clear()
    submit("p", key="b")
    mark = RateMark.objects.get(pool__name="p").at
    waking = [when for names, when in recorder.wakes if names == ["p"]]
    assert waking, recorder.wakes
    # The moment the window opens, on this process's clock (the same host: offset ~0).
    assert abs((waking[-1] - (mark + timedelta(minutes=1))).total_seconds()) < 1
    place = explain.explain_key("b").places[0]
    assert place.blocked_by == "rate_limited"
    assert place.eta is not None and abs((place.eta - waking[-1]).total_seconds()) < 1
    assert abs((datetime.fromisoformat(place.detail["until"]) - waking[-1]).total_seconds()) < 1


def test_rates__a_real_window_opens_on_time(recorder: RecordingBridge, admission_path: str) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="2/s")
    for key in "abc":
        submit("p", key=key)
    assert admitted("a", "b", "c") == ["a", "b"]
    (wake,) = {when for names, when in recorder.wakes if names == ["p"]}
    time.sleep(max(0.0, (wake - timezone.now()).total_seconds()) + 0.01)
    assert [a.key for a in admission.admit(["p"])] == ["c"]


def test_rates__the_eta_of_later_entries_counts_the_windows(recorder: RecordingBridge) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="2/m")
    for key in "abcdefg":
        submit("p", key=key)
    mark = RateMark.objects.filter(pool__name="p").order_by("at").first()
    assert mark is not None
    # c, d: the first window; e, f: the next one; g: the one after.
    etas = {k: explain.explain_key(k).places[0].eta for k in "cdefg"}
    for key, windows_ahead in {"c": 1, "d": 1, "e": 2, "f": 2, "g": 3}.items():
        when = etas[key]
        assert when is not None
        expected = mark.at + timedelta(minutes=windows_ahead)
        assert abs((when - expected).total_seconds()) < 1, (key, when, expected)


def test_rates__a_requeue_after_a_lost_lease_counts_as_a_new_start(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="2/m")
    submit("p", key="a")
    entry = QueueEntry.objects.get(key="a")
    assert admission.requeue(entry.queue_id, entry.token, reason="lease lapsed")
    assert state("a") == EntryState.ADMITTED  # admitted again: its second start
    submit("p", key="b")
    assert state("b") == EntryState.WAITING
    assert Pool.objects.get(name="p").admissions == 2


def test_rates__a_retry_counts_as_a_new_start(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="2/m")
    submit("p", key="a")
    settle("a")
    submit("p", key="a-retry", attempt=1)
    submit("p", key="b")
    assert admitted("a-retry", "b") == ["a-retry"]


def test_rates__cancelled_waiting_entries_do_not_count(
    recorder: RecordingBridge, admission_path: str
) -> None:
    make_pool("p", 1, rate="2/m")
    submit("p", key="a")
    submit("p", key="cancelled")
    admission.cancel("cancelled")
    submit("p", key="b")
    settle("a")
    assert state("b") == EntryState.ADMITTED  # the second start in the window
    submit("p", key="c")
    settle("b")
    assert state("c") == EntryState.WAITING


def test_rates__changing_the_rates_resets_the_windows(recorder: RecordingBridge) -> None:
    make_pool("p", rates.UNLIMITED_SLOTS, rate="1/m")
    submit("p", key="a")
    submit("p", key="b")
    assert state("b") == EntryState.WAITING
    before = RateMark.objects.get(pool__name="p").at
    pool_crud.update_pool("p", rate="1/h")
    assert state("b") == EntryState.ADMITTED  # a new, empty window (a's start forgotten)
    (mark,) = RateMark.objects.filter(pool__name="p")
    assert mark.at > before  # b's
    pool_crud.update_pool("p", rate="")
    submit("p", key="c")
    assert state("c") == EntryState.ADMITTED


def test_rates__rate_only_pool_from_settings(recorder: RecordingBridge, settings: Any) -> None:
    settings.POOLS = {
        **settings.POOLS,
        "DEFINITIONS": {
            "api": {"rate": ["10/s", "100000/d"]},
            "both": {"slots": 4, "rate": "100/m"},
        },
    }
    settings_sync.sync()
    api = Pool.objects.get(name="api")
    assert (api.slots, api.rate) == (rates.UNLIMITED_SLOTS, "10/s,100000/d")
    both = Pool.objects.get(name="both")
    assert (both.slots, both.rate) == (4, "100/m")
    submit("api", key="a")
    assert RateMark.objects.filter(pool=api).count() == 2  # one mark per rate
    # A changed rate on sync resets the windows.
    settings.POOLS = {
        **settings.POOLS,
        "DEFINITIONS": {"api": {"rate": "5/s"}, "both": {"slots": 4}},
    }
    settings_sync.sync()
    assert Pool.objects.get(name="api").rate == "5/s"
    assert not RateMark.objects.filter(pool=api).exists()
    assert Pool.objects.get(name="both").rate == ""


def test_rates__per_key_pools_take_their_template_rate(
    recorder: RecordingBridge,
    settings: Any,
) -> None:
    settings.POOLS = {**settings.POOLS, "TEMPLATES": {"tenant:{tenant_id}": {"rate": "2/m"}}}
    pool = per_key.ensure_pool("tenant:7", "tenant:{tenant_id}")
    assert (pool.slots, pool.rate) == (rates.UNLIMITED_SLOTS, "2/m")
    for key in "abc":
        submit("tenant:7", key=key)
    assert admitted("a", "b", "c") == ["a", "b"]
    settings.POOLS = {
        **settings.POOLS,
        "TEMPLATES": {"tenant:{tenant_id}": {"slots": 3, "rate": "10/s"}},
    }
    pool = per_key.ensure_pool("tenant:8", "tenant:{tenant_id}")
    assert (pool.slots, pool.rate) == (3, "10/s")


def test_rates__task_rate_lives_on_the_task_pool_with_max_running(
    recorder: RecordingBridge,
) -> None:
    from pools.celery import caps

    spec = PoolSpec.build(None, rate="2/m").with_task_cap("tests.rated")
    assert spec.demand == {"task-cap:tests.rated": 1}
    caps.ensure_caps(spec, again=True)
    pool = Pool.objects.get(name="task-cap:tests.rated")
    assert (pool.slots, pool.rate) == (rates.UNLIMITED_SLOTS, "2/m")
    # max_running and rate compose on the same pool (and a change updates it).
    spec = PoolSpec.build("other", max_running=3, rate=["1/s", "2/m"]).with_task_cap("tests.rated")
    assert spec.demand == {"other": 1, "task-cap:tests.rated": 1}
    caps.ensure_caps(spec)
    pool.refresh_from_db()
    assert (pool.slots, pool.rate) == (3, "1/s,2/m")
    make_pool("other", 10)
    for key in "abc":
        admission.enqueue(Submission(key=key, task_name="tests.rated", spec=spec))
    assert admitted("a", "b", "c") == ["a"]  # 1/s binds
    assert explain.explain_key("b").blocked_by == "rate_limited"


@pytest.mark.postgres
def test_rates__concurrent_submits_never_exceed_the_window(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """Six threads (six connections) submit 30 entries at once: exactly 7 start."""
    import threading

    from django.db import connection

    make_pool("p", rates.UNLIMITED_SLOTS, rate="7/m")
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def burst(n: int) -> None:
        try:
            barrier.wait()
            for i in range(5):
                submit("p", key=f"t{n}-{i}")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=burst, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert QueueEntry.objects.filter(state=EntryState.ADMITTED).count() == 7
    assert QueueEntry.objects.filter(state=EntryState.WAITING).count() == 23
    assert Pool.objects.get(name="p").admissions == 7
    assert RateMark.objects.filter(pool__name="p").count() == 7
    age("p", 60)
    assert len(admission.admit(["p"])) == 7


def test_rates__calls_held_by_their_task_rate_do_not_block_the_named_pool(
    recorder: RecordingBridge, admission_path: str
) -> None:
    """Gates are ordered (run cap, task pool, named pools): a call waiting for its task's
    rate is not in the named pool's line yet, so other tasks' calls pass it there."""
    from pools.celery import caps

    make_pool("wh", 5)
    spec = PoolSpec.build("wh", rate="1/m").with_task_cap("tests.rated")
    caps.ensure_caps(spec, again=True)
    for key in ("r1", "r2"):
        admission.enqueue(Submission(key=key, task_name="tests.rated", spec=spec))
    submit("wh", key="other")
    assert admitted("r1", "r2", "other") == ["r1", "other"]
    assert explain.explain_key("r2").blocked_by == "rate_limited"
    age("task-cap:tests.rated", 60)
    assert [a.key for a in admission.admit(["task-cap:tests.rated", "wh"])] == ["r2"]


@pytest.mark.postgres
def test_rates__the_stored_functions_decide_rated_pools_themselves(
    recorder: RecordingBridge, settings: Any
) -> None:
    """Fast path: a rated pool's single-pool heads are admitted (or held back, with a
    wake-up) by the stored functions, never handed to the Python pass (which costs a
    second pass per call: the figures are in docs/benchmarks.md, rate limits)."""
    from unittest import mock

    from pools.pg import fastpath

    settings.POOLS = {**settings.POOLS, "SQL_FAST_PATH": True}
    make_pool("p", 2, rate="3/m")
    replies: list[fastpath.Reply] = []

    def spying(real: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> fastpath.Reply:
            reply: fastpath.Reply = real(*args, **kwargs)
            replies.append(reply)
            return reply

        return spy

    with (
        mock.patch.object(fastpath, "call", spying(fastpath.call)),
        mock.patch.object(fastpath, "call_procedure", spying(fastpath.call_procedure)),
    ):
        for key in "abcde":
            submit("p", key=key)
        settle("a")
        settle("b")
    assert admitted(*"abcde") == ["c"]  # 2 slots; the third start of the minute
    assert replies and not any(r.fallbacks for r in replies)
    assert sum(len(r.of("admitted")) for r in replies) == 3
    held_back = [r.wake["p"] for r in replies if "p" in r.wake]
    assert held_back, "no wake-up for the head held back by the rate"
    mark = max(RateMark.objects.filter(pool__name="p").values_list("at", flat=True))
    assert abs((held_back[-1] - (mark + timedelta(minutes=1))).total_seconds()) < 1
