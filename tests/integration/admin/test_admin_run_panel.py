"""The run panel (per workflow run and per entry), a pool's occupancy page and the timeline."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from pytest_django import DjangoAssertNumQueries

from pools.core import admission, budgets, leases
from pools.models import QueueEntry
from pools_admin import runs, timeline
from pools_admin.timeline import Hold
from tests.support.admin import ADMIN_APPS
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

ROOT = "root-1"


def _finish(rec: RecordingBridge, key: str, outcome: str = "succeeded") -> None:
    adm = next(a for a in rec.admissions if a.key == key)
    assert admission.settle(adm.entry_id, adm.token, outcome)


@pytest.fixture
def run(recorder: RecordingBridge) -> RecordingBridge:
    """A run of five tasks on ``wh`` (2 slots) and ``api`` (1): done, running, waiting."""
    make_pool("wh", 2)
    make_pool("api", 1)
    submit("wh", key=ROOT)  # the root itself (root_id empty, as Celery leaves it)
    submit("wh", key="child-1", root_id=ROOT, parent_id=ROOT)
    _finish(recorder, ROOT)
    adm = next(a for a in recorder.admissions if a.key == "child-1")
    leases.start(adm.entry_id, adm.token, worker="w1@host")
    submit("wh", key="other-1", priority=5)  # another run's work holds the other slot
    submit({"wh": 1, "api": 1}, key="child-2", root_id=ROOT, priority=1)
    submit("wh", key="child-3", root_id=ROOT, not_before=timezone.now() + timedelta(hours=1))
    return recorder


def test_run_panel__lists_every_task_with_state_pools_position_and_why(
    admin_client: Client, run: RecordingBridge
) -> None:
    response = admin_client.get(reverse("admin:pools_queueentry_run", args=[ROOT]))
    assert response.status_code == 200
    html = response.content.decode()
    # Inside the admin's look: breadcrumbs and the admin base template.
    assert '<div class="breadcrumbs">' in html and 'id="site-name"' in html
    ids = {
        k: QueueEntry.objects.get(key=k).queue_id for k in (ROOT, "child-1", "child-2", "child-3")
    }
    active = html[html.index('id="in-progress"') : html.index('id="occupancy"')]
    finished = html[html.index('id="finished"') :]
    assert f'data-queue-id="{ids["child-1"]}" data-state="running"' in active
    assert f'data-queue-id="{ids["child-2"]}" data-state="waiting"' in active
    assert f'data-queue-id="{ids["child-3"]}" data-state="waiting"' in active
    assert f'data-queue-id="{ids[ROOT]}" data-state="succeeded"' in finished
    # Position and why: child-2 is first in line of wh, which is full.
    row2 = active[active.index(f'data-queue-id="{ids["child-2"]}"') :]
    row2 = row2[: row2.index("</tr>")]
    assert "api\N{MULTIPLICATION SIGN}1, wh\N{MULTIPLICATION SIGN}1" in row2
    assert 'data-pool="wh" data-blocked-by="pool_full"' in row2
    assert "<strong>#1</strong> in wh" in row2
    # api has a free slot: admissible there, but waits for wh.
    assert 'data-pool="api" data-blocked-by="other_pool"' in row2
    # A delayed task is not in line.
    row3 = active[active.index(f'data-queue-id="{ids["child-3"]}"') :]
    assert 'data-blocked-by="not_before"' in row3[: row3.index("</tr>")]
    # The running task: held slots, worker, lease expiry.
    row1 = active[active.index(f'data-queue-id="{ids["child-1"]}"') :]
    row1 = row1[: row1.index("</tr>")]
    assert "w1@host" in row1 and '<td class="num">1</td>' in row1
    assert re.search(r"<time [^>]*>in \d+ s</time>", row1)  # lease expiry
    assert "succeeded" in finished


def test_run_panel__timelines_of_its_pools_with_titles(
    admin_client: Client, run: RecordingBridge
) -> None:
    html = admin_client.get(reverse("admin:pools_queueentry_run", args=[ROOT])).content.decode()
    assert 'data-timeline-pool="api"' in html and 'data-timeline-pool="wh"' in html
    wh = html[html.index('data-timeline-pool="wh"') :]
    wh = wh[: wh.index("</figure>")]
    assert "<svg" in wh and 'viewBox="0 0 880' in wh
    # Three holders of wh in the window: the finished root, running child-1, other-1.
    titles = re.findall(r"<title>([^<]+)</title>", wh)
    assert len(titles) == 3
    assert any(f"[{ROOT}]" in t and "released" in t for t in titles)
    assert any("[child-1]" in t and "still held" in t and "w1@host" in t for t in titles)
    # The run's own work is highlighted, other work is not.
    assert wh.count('class="tl-bar is-mine') == 2
    # Real links (keyboard reachable) to each holder's panel.
    assert (
        len(re.findall(r'<a class="tl-bar[^"]*"\s+href="/admin/pools/queueentry/\d+/panel/"', wh))
        == 3
    )


def test_run_panel__window_is_selectable(admin_client: Client, run: RecordingBridge) -> None:
    url = reverse("admin:pools_queueentry_run", args=[ROOT])
    html = admin_client.get(url + "?window=1h").content.decode()
    assert '<a href="?window=1h" aria-current="true">1h</a>' in html
    html = admin_client.get(url + "?window=bogus").content.decode()
    assert '<a href="?window=run" aria-current="true">fit the run</a>' in html


def test_run_panel__a_short_run_fills_the_window_by_default(
    admin_client: Client, run: RecordingBridge
) -> None:
    html = admin_client.get(reverse("admin:pools_queueentry_run", args=[ROOT])).content.decode()
    assert '<a href="?window=run" aria-current="true">fit the run</a>' in html
    first = QueueEntry.objects.get(key=ROOT).admitted_at
    assert first is not None
    panel = runs.load(ROOT, now=first + timedelta(minutes=5))
    assert panel.window == runs.FIT
    for tl in panel.timelines:  # from just before the run's first admission to now, live
        assert first - runs.MIN_FIT < tl.start <= first and tl.end == panel.now and tl.live
    assert 'class="tl-now"' in html


def test_run_panel__a_finished_run_ends_at_its_last_release(
    admin_client: Client, recorder: RecordingBridge
) -> None:
    make_pool("wh", 2)
    submit("wh", key=ROOT)
    submit("wh", key="child-1", root_id=ROOT)
    _finish(recorder, ROOT)
    _finish(recorder, "child-1")
    last = QueueEntry.objects.get(key="child-1").finished_at
    assert last is not None
    later = timezone.now() + timedelta(hours=2)
    panel = runs.load(ROOT, now=later)
    (tl,) = panel.timelines
    assert panel.window == runs.FIT
    assert last < tl.end < last + runs.MIN_FIT and not tl.live
    assert len(tl.bars) == 2
    assert runs.load(ROOT, window="15m", now=later).timelines[0].bars == []  # long gone


def test_run_panel__a_run_going_on_for_long_shows_its_recent_activity(
    run: RecordingBridge,
) -> None:
    later = timezone.now() + timedelta(hours=1)  # child-2 still waits an hour on
    panel = runs.load(ROOT, now=later)
    assert panel.window == timeline.DEFAULT_WINDOW
    assert panel.timelines[0].start == later - timeline.WINDOWS[timeline.DEFAULT_WINDOW]
    assert runs.load(ROOT, window="run", now=later).timelines[0].start < panel.timelines[0].start


def test_run_panel__bounded_queries_whatever_the_run_size(
    admin_client: Client,
    run: RecordingBridge,
    django_assert_max_num_queries: DjangoAssertNumQueries,
) -> None:
    url = reverse("admin:pools_queueentry_run", args=[ROOT])
    admin_client.get(url)
    with django_assert_max_num_queries(30) as ctx:
        admin_client.get(url)
    few = len(ctx.captured_queries)
    for i in range(25):
        submit("wh", key=f"more-{i}", root_id=ROOT, priority=i % 3)
    with django_assert_max_num_queries(few) as ctx:
        html = admin_client.get(url).content.decode()
    assert html.count('data-state="waiting"') == 27
    assert len(ctx.captured_queries) == few


def test_run_panel__budget_shows_the_spend_and_which_budget_stopped_the_run(
    admin_client: Client, recorder: RecordingBridge
) -> None:
    make_pool("wh", 1)
    budgets.open_run("budgeted", {"cost": 10, "seconds": 600})
    submit("wh", key="b-root", root_id="budgeted")
    submit("wh", key="b-child", root_id="budgeted", parent_id="b-root")
    url = reverse("admin:pools_queueentry_run", args=["budgeted"])
    root = QueueEntry.objects.get(key="b-root")
    budgets.charge(root.queue_id, root.token, cost=4, tokens=120)
    html = admin_client.get(url).content.decode()
    section = html.split('id="run-budget"')[1].split("</section>")[0]
    assert 'data-stopped-by=""' in html and "Stopped by" not in section
    spent = dict(
        re.findall(r'<tr data-budget="(\w+)".*?<td class="num" data-spent>([^<]+)<', section, re.S)
    )
    # Tokens have no limit but are spent: shown as unlimited.
    assert spent == {"seconds": "0", "cost": "4", "tokens": "120"}
    assert "40% of the cost budget" in section and "unlimited" in section
    budgets.charge(root.queue_id, root.token, cost=6.25)
    html = admin_client.get(url).content.decode()
    section = html.split('id="run-budget"')[1].split("</section>")[0]
    assert 'data-stopped-by="cost"' in html
    assert "Stopped by the <strong>cost</strong> budget" in section
    assert re.search(r'<tr data-budget="cost" class="is-stopped">', section)
    assert "10.25" in section and "1 attempt charged" in section
    # The rejected child is listed with its reason.
    assert QueueEntry.objects.get(key="b-child").reason == "budget"


def test_run_panel__run_without_budget_has_no_budget_section(
    admin_client: Client, run: RecordingBridge
) -> None:
    html = admin_client.get(reverse("admin:pools_queueentry_run", args=[ROOT])).content.decode()
    assert 'id="run-budget"' not in html


def test_entry_panel__focuses_the_entry_in_its_run(
    admin_client: Client, run: RecordingBridge
) -> None:
    entry = QueueEntry.objects.get(key="child-2")
    response = admin_client.get(reverse("admin:pools_queueentry_panel", args=[entry.queue_id]))
    assert response.status_code == 200
    html = response.content.decode()
    assert f'class="is-focus" data-queue-id="{entry.queue_id}"' in html
    assert f"{ROOT}" in html and "whole run" in html
    alone = QueueEntry.objects.get(key="other-1")
    html = admin_client.get(
        reverse("admin:pools_queueentry_panel", args=[alone.queue_id])
    ).content.decode()
    assert html.count('data-state="') == 1  # not part of a workflow: itself only


def test_run_panel__unknown_run_is_404_and_needs_permission(
    admin_client: Client, run: RecordingBridge, client: Client
) -> None:
    assert admin_client.get(reverse("admin:pools_queueentry_run", args=["nope"])).status_code == 404
    assert (
        admin_client.get(reverse("admin:pools_queueentry_panel", args=[999999])).status_code == 404
    )
    anonymous = client.get(reverse("admin:pools_queueentry_run", args=[ROOT]))
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]


def test_pool_page__timeline_and_recent_terminal_entries(
    admin_client: Client, run: RecordingBridge
) -> None:
    response = admin_client.get(reverse("admin:pools_pool_occupancy", args=["wh"]))
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-timeline-pool="wh"' in html
    recent = html[html.index('id="recent"') :]
    assert recent.count("<tr data-queue-id=") == 1 and "succeeded" in recent


# --------------------------------------------------------------------------- lanes


def _hold(i: int, start: int, end: int | None, slots: int = 1) -> Hold:
    t0 = timezone.now().replace(microsecond=0) - timedelta(minutes=10)
    return Hold(
        queue_id=i,
        key=f"k{i}",
        task_name="t.task",
        slots=slots,
        state="succeeded" if end is not None else "running",
        start=t0 + timedelta(seconds=start),
        started=None,
        end=t0 + timedelta(seconds=end) if end is not None else None,
    )


def test_timeline__overlapping_holders_never_share_a_lane() -> None:
    import random

    rng = random.Random(7)
    capacity = 4
    holds: list[Hold] = []
    # A schedule that never holds more than the capacity: a slot-by-slot simulation.
    busy_until = [0] * capacity
    i = 0
    for _ in range(300):
        lane = rng.randrange(capacity)
        start = busy_until[lane] + rng.randrange(0, 5)
        length = rng.randrange(1, 40)
        busy_until[lane] = start + length
        i += 1
        holds.append(_hold(i, start, start + length))
    now = max(h.end for h in holds if h.end) + timedelta(seconds=1)
    line = timeline.layout("p", capacity, holds, start=now - timedelta(hours=1), end=now)
    assert timeline.overlaps(line.bars) == []
    assert line.lanes == capacity
    assert len(line.bars) == len(holds)


def test_timeline__multi_slot_holder_takes_distinct_lanes() -> None:
    holds = [_hold(1, 0, 100, slots=2), _hold(2, 10, 50), _hold(3, 60, None)]
    now = timezone.now()
    line = timeline.layout("p", 3, holds, start=now - timedelta(minutes=15), end=now)
    lanes: dict[int, list[int]] = {}
    for bar in line.bars:
        lanes.setdefault(bar.hold.queue_id, []).append(bar.lane)
    assert sorted(lanes[1]) == [0, 1] and lanes[2] == [2] and lanes[3] == [2]
    assert timeline.overlaps(line.bars) == []
    assert [b.ongoing for b in line.bars if b.hold.queue_id == 3] == [True]


def test_timeline__more_overlap_than_capacity_gets_flagged_lanes() -> None:
    holds = [_hold(1, 0, 100), _hold(2, 10, 90)]
    now = timezone.now()
    line = timeline.layout("p", 1, holds, start=now - timedelta(minutes=15), end=now)
    assert line.lanes == 2
    assert [b.over for b in sorted(line.bars, key=lambda b: b.lane)] == [False, True]
    assert timeline.overlaps(line.bars) == []


def test_timeline__sabotaged_layout_is_caught_by_the_overlap_check() -> None:
    """The check above can fail: two overlapping holds forced onto one lane are reported."""
    holds = [_hold(1, 0, 100), _hold(2, 10, 90)]
    now = timezone.now()
    line = timeline.layout("p", 2, holds, start=now - timedelta(minutes=15), end=now)
    forced = [timeline.Bar(**{**bar.__dict__, "lane": 0}) for bar in line.bars]
    assert len(timeline.overlaps(forced)) == 1
