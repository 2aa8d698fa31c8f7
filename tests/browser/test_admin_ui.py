"""The card and the run panel in a real browser, on admissions recorded instead of published.

Fast (no workers): refresh without reload, cancel with confirmation and the pool's
refusal, keyboard focus, dark mode. The end-to-end scenario with real workers is in
``test_scenario.py``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import User

from pools.core import admission, leases
from pools.models import QueueEntry
from pools.states import EntryState
from tests.browser.conftest import login, screenshot
from tests.support.bridge import RecordingBridge
from tests.support.factories import make_pool, submit

pytestmark = pytest.mark.django_db(transaction=True)


def _card_numbers(page: Any, pool: str) -> dict[str, int]:
    row = page.locator(f'#pools-card li.pools-row[data-pool="{pool}"]')
    return {
        "held": int(row.get_attribute("data-held")),
        "waiting": int(row.get_attribute("data-waiting")),
    }


@pytest.fixture
def queue(recorder: RecordingBridge) -> RecordingBridge:
    make_pool("warehouse", 3)
    make_pool("partner-api", 1)
    for i in range(3):
        submit("warehouse", key=f"hold-{i}", root_id="run-a" if i else "")
    adm = recorder.admissions[0]
    leases.start(adm.entry_id, adm.token, worker="w1@host")
    for i, prio in enumerate([10, 5, 5, 0]):
        submit("warehouse", key=f"wait-{i}", priority=prio, queue_timeout=900)
    submit("partner-api", key="api-0")
    submit("partner-api", key="api-1", priority=2)
    return recorder


def test_card__refreshes_in_place_and_cancels_after_confirmation(
    page_factory: Any, admin_user: User, queue: RecordingBridge
) -> None:
    page = page_factory()
    login(page, admin_user)
    assert _card_numbers(page, "warehouse") == {"held": 3, "waiting": 4}
    page.evaluate("window.__notReloaded = true")
    # New work shows up without a reload.
    submit("warehouse", key="late", priority=1)
    page.wait_for_selector(
        '#pools-card li[data-pool="warehouse"][data-waiting="5"]', timeout=12_000
    )
    assert page.evaluate("window.__notReloaded") is True

    # Dismissing the confirmation cancels nothing.
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.click('#pools-card li[data-key="wait-0"] button')
    page.wait_for_timeout(300)
    assert QueueEntry.objects.get(key="wait-0").state == EntryState.WAITING

    # Accepting it cancels the entry; the card says so and drops it.
    messages: list[str] = []

    def accept(dialog: Any) -> None:
        messages.append(dialog.message)
        dialog.accept()

    page.once("dialog", accept)
    page.click('#pools-card li[data-key="wait-0"] button')
    page.wait_for_selector('#pools-card li[data-pool="warehouse"][data-waiting="4"]')
    assert "Cancel" in messages[0] and "warehouse" in messages[0]
    status = page.locator("#pools-card [data-pools-message]")
    assert re.match(r"Cancelled \S+ #\d+ \(wait-0\)\.", status.inner_text())
    assert page.locator('#pools-card li[data-key="wait-0"]').count() == 0
    assert QueueEntry.objects.get(key="wait-0").state == EntryState.CANCELLED
    assert page.evaluate("window.__notReloaded") is True
    screenshot(page, "card-after-cancel", full_page=True)


def test_card__shows_the_pools_refusal(
    page_factory: Any, admin_user: User, queue: RecordingBridge
) -> None:
    page = page_factory()
    login(page, admin_user)
    # partner-api's head (api-1) is admitted after the card was drawn: cancel is refused.
    holder = next(a for a in queue.admissions if a.key == "api-0")
    assert admission.settle(holder.entry_id, holder.token, "succeeded")
    assert QueueEntry.objects.get(key="api-1").state == EntryState.ADMITTED
    page.once("dialog", lambda dialog: dialog.accept())
    page.click('#pools-card li[data-key="api-1"] button')
    status = page.locator("#pools-card .pools-card-status.is-warning")
    status.wait_for()
    assert (
        "api-1" in status.inner_text()
        and "only waiting entries can be cancelled" in status.inner_text()
    )


def test_card_and_panel__keyboard_and_dark_mode(
    page_factory: Any, admin_user: User, queue: RecordingBridge
) -> None:
    page = page_factory(color_scheme="dark")
    login(page, admin_user)
    # Dark mode: the card uses the admin's variables (dark body, light text).
    bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    fg = page.evaluate(
        "getComputedStyle(document.querySelector('#pools-card .pools-nums strong')).color"
    )
    assert bg == "rgb(18, 18, 18)" and fg == "rgb(238, 238, 238)"
    # Tab reaches the card's controls, and a focused control is visibly outlined.
    page.focus("#pools-card a.pools-name")
    for _ in range(6):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.tagName") == "BUTTON":
            break
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert page.evaluate("document.activeElement.closest('#pools-card') !== null")
    assert outline == "solid"
    screenshot(page, "card-dark", full_page=True)

    # The run panel: timeline bars are links reachable with Tab, Enter follows them.
    page.goto("/admin/pools/queueentry/run/hold-0/")
    bars = page.locator("svg.pools-svg a.tl-bar")
    assert bars.count() >= 3
    bars.first.focus()
    assert page.evaluate("document.activeElement.classList.contains('tl-bar')")
    stroke = page.evaluate(
        "getComputedStyle(document.activeElement.querySelector('.tl-held')).strokeWidth"
    )
    assert stroke == "3px"
    screenshot(page, "run-panel-dark", full_page=True)
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"/admin/pools/queueentry/\d+/panel/"))

    # A pool page draws its holders in the colour its legend gives "held" (it once drew
    # them in the run panel's grey for other work).
    page.goto("/admin/pools/pool/occupancy/warehouse/")
    page.wait_for_selector('figure[data-timeline-pool="warehouse"] a.tl-bar')
    legend, bar, opacity = page.evaluate(
        "[getComputedStyle(document.querySelector('.pools-legend .sw-mine')).backgroundColor,"
        " getComputedStyle(document.querySelector('a.tl-bar .tl-held')).fill,"
        " getComputedStyle(document.querySelector('a.tl-bar .tl-held')).opacity]"
    )
    assert (bar, opacity) == (legend, "1"), (bar, opacity, legend)
