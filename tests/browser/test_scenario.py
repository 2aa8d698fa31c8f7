"""The operator's scenario end to end: real workers, real PostgreSQL and Redis, a real browser.

Log into the admin, see the card's numbers match ``GET /api/pools/``, cancel a waiting
entry from the card and see it gone there and in the API, then open the run panel of a
running chord and read its timeline. Screenshots of the card and the run panel are
kept as artifacts.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

from celery import chain, chord
from django.contrib.auth.models import User

from pools.models import QueueEntry
from pools.states import EntryState
from tests.acceptance.conftest import WORKER_TEST_MARKS, wait_for
from tests.browser.conftest import login, screenshot
from tests.browser.tasks import collect, slow_add

pytestmark = WORKER_TEST_MARKS

#: How long each header task holds its warehouse slot: long enough for the checks of
#: one wave to see a steady state, short enough for a quick test.
HOLD = 12.0


def _card(page: Any) -> dict[str, dict[str, int]]:
    rows = page.locator("#pools-card li.pools-row")
    return {
        rows.nth(i).get_attribute("data-pool"): {
            "held": int(rows.nth(i).get_attribute("data-held")),
            "waiting": int(rows.nth(i).get_attribute("data-waiting")),
            "slots": int(rows.nth(i).get_attribute("data-slots")),
        }
        for i in range(rows.count())
    }


def _api(page: Any, path: str) -> Any:
    response = page.request.get(path)
    assert response.ok, f"GET {path}: {response.status}"
    return response.json()


def _api_numbers(page: Any) -> dict[str, dict[str, int]]:
    body = _api(page, "/api/pools/")
    pools = body["results"] if isinstance(body, dict) and "results" in body else body
    return {
        p["name"]: {"held": p["held"], "waiting": p["counts"]["waiting"], "slots": p["slots"]}
        for p in pools
    }


def test_operator_scenario__card_matches_api_cancel_from_card_run_panel_timeline(
    celery_workers: Any, page_factory: Any, admin_user: User
) -> None:
    celery_workers(count=1, concurrency=4)
    # A workflow run: a first task, then a chord of four header tasks on the warehouse
    # (2 slots: two waves) and a body on partner-api; all share the first task's root id.
    root = f"run-{uuid.uuid4().hex[:8]}"
    header_keys = [f"{root}-h{i}" for i in range(4)]
    result = chain(
        slow_add.si(0, 0, 0.2).set(task_id=root),
        chord(
            [slow_add.si(i, i, HOLD).set(task_id=k) for i, k in enumerate(header_keys)], collect.s()
        ),
    ).apply_async()
    wait_for(
        lambda: (
            QueueEntry.objects.filter(key__in=header_keys, state=EntryState.RUNNING).count() == 2
        ),
        30,
        "the first wave of the chord (2 of 4) to run",
    )
    victim = slow_add.apply_async((100, 0, 0.0), pool_options={"priority": -1})  # type: ignore[call-arg]  # celery-types: no **options

    page = page_factory()
    login(page, admin_user)

    # 1. The card's numbers are the API's (read back to back; retried across a change).
    def same() -> bool:
        page.reload()
        page.wait_for_selector('#pools-card li[data-pool="warehouse"]')
        return _card(page) == _api_numbers(page)

    wait_for(same, 15, "the card and GET /api/pools/ to agree", interval=0.5)
    card = _card(page)
    assert card["warehouse"] == {"held": 2, "waiting": 3, "slots": 2}
    screenshot(page.locator("#pools-card"), "card")

    # 2. Cancel the waiting victim from the card: gone from the card and from the API.
    row = page.locator(f'#pools-card li.pools-entry[data-key="{victim.id}"]')
    assert row.count() == 1
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button").click()
    page.locator(f'#pools-card li.pools-entry[data-key="{victim.id}"]').wait_for(state="detached")
    assert "Cancelled" in page.locator("#pools-card [data-pools-message]").inner_text()
    assert QueueEntry.objects.get(key=victim.id).state == EntryState.CANCELLED
    detail = _api(page, "/api/pools/warehouse/")
    assert victim.id not in [w["key"] for w in detail["waiting"]]
    assert _api(page, f"/api/entries/{victim.id}/")["state"] == "cancelled"

    # 3. The run panel of the running chord, reached from the card: entry -> whole run.
    wait_for(
        lambda: (
            QueueEntry.objects.filter(key__in=header_keys, state=EntryState.SUCCEEDED).count() == 2
            and QueueEntry.objects.filter(key__in=header_keys, state=EntryState.RUNNING).count()
            == 2
        ),
        HOLD + 20,
        "the second wave of the chord to run",
    )
    time.sleep(HOLD / 3)  # into the second wave, so its bars have some length
    entry = QueueEntry.objects.get(key=header_keys[-1])
    page.goto(f"/admin/pools/queueentry/{entry.queue_id}/panel/")
    page.click("text=whole run")
    assert page.url.endswith(f"/admin/pools/queueentry/run/{root}/")
    page.click("text=fit the run")
    page.wait_for_selector('figure[data-timeline-pool="warehouse"] svg')
    states = Counter(
        page.locator("#in-progress ~ table tr[data-state]").evaluate_all(
            "rows => rows.map(r => r.dataset.state)"
        )
    )
    assert states["running"] == 2
    bars = page.locator('figure[data-timeline-pool="warehouse"] a.tl-bar.is-mine')
    spans = bars.evaluate_all(
        "bars => bars.map(b => [b.dataset.lane, b.dataset.start, b.dataset.end, "
        "b.querySelector('title').textContent])"
    )
    assert len(spans) == 5  # the first task and the first wave finished, two running
    for _lane, _start, _end, title in spans:
        assert "tests.browser.tasks.slow_add" in title
    finished = [s for s in spans if s[2]]
    running = [s for s in spans if not s[2]]
    assert len(finished) == 3 and len(running) == 2
    assert {s[0] for s in running} == {"0", "1"}  # two slot rows, one holder each
    assert {key for key in [root, *header_keys] if any(f"[{key}]" in s[3] for s in spans)} == {
        root,
        *header_keys,
    }
    screenshot(page, "run-panel", full_page=True)

    assert result.get(timeout=HOLD * 2 + 30) == sum(2 * i for i in range(4))
    assert QueueEntry.objects.filter(root_id=root).count() == 6  # root, header and body
