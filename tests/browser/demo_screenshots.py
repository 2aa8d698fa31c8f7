"""``make screenshots``: the docs' screenshots, taken from the running demo.

Starts ``example_project/run_demo.py`` (SQLite and the embedded transport, in a temporary
directory), waits until the demo's trickle shows contention (slots held and entries
waiting), then drives headless Chromium through Playwright: the Resource pools card, the
run panel of a workflow run in progress, the warehouse pool's page and the "why" of an
entry waiting behind the head of its line. Writes them to ``docs/img/`` and stops the demo.

    .venv/bin/python -m tests.browser.demo_screenshots [--out docs/img]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tests.browser.chromium import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "example_project" / "run_demo.py"
USERNAME = PASSWORD = "demo"
#: The demo's start (migrate, worker, server, burst) and the wait for contention.
START_TIMEOUT = 180.0
CONTENTION_TIMEOUT = 120.0
#: The pool page's shortest window is 1 minute: let the demo fill most of it.
POOL_PAGE_AFTER = 50.0
#: Blockers worth showing on the "why" page, best first.
WHY = ("head_of_line", "rate_limited", "other_pool", "run_cap")

T = TypeVar("T")


class ScreenshotError(RuntimeError):
    """The demo did not get to the state a screenshot needs."""


@contextmanager
def running_demo(var_dir: Path) -> Iterator[str]:
    """The demo, serving; yields the admin URL once it has printed its addresses."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"}
        and k != "DJANGO_SETTINGS_MODULE"
    }
    env["EXAMPLE_VAR_DIR"] = str(var_dir)
    log = (var_dir / "demo.out").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(DEMO)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        yield _wait(
            lambda: _printed(var_dir / "demo.out", proc),
            START_TIMEOUT,
            "the demo to print its addresses",
        )
    finally:
        proc.send_signal(signal.SIGTERM)  # the demo stops its worker and server
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _printed(out: Path, proc: subprocess.Popen[bytes]) -> str | None:
    if proc.poll() is not None:
        raise ScreenshotError(f"the demo exited with {proc.returncode}:\n{out.read_text()}")
    text = out.read_text(errors="replace")
    if "Trickle:" not in text:
        return None
    match = re.search(r"^Admin: +(http://\S+/admin/)", text, re.M)
    return match[1] if match else None


def _wait(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise ScreenshotError(f"gave up waiting {timeout:.0f} s for {what}")


def _json(page: Any, path: str) -> Any:
    response = page.request.get(path)
    if not response.ok:
        raise ScreenshotError(f"GET {path}: {response.status}")
    body = response.json()
    return body["results"] if isinstance(body, dict) and "results" in body else body


def _contended(page: Any) -> bool:
    """Slots held and entries waiting in the named pools and in a run cap."""
    pools = _json(page, "/api/pools/")
    named = [p for p in pools if not p["name"].startswith(("run-cap:", "task-cap:"))]
    caps = [p for p in pools if p["name"].startswith("run-cap:")]
    return (
        sum(p["held"] for p in named) > 0
        and sum(p["counts"]["waiting"] for p in named) >= 3
        and any(p["held"] and p["counts"]["waiting"] for p in caps)
    )


def _live_run(page: Any) -> str | None:
    """The root id of a workflow run with tasks held and waiting."""
    for p in _json(page, "/api/pools/"):
        if p["name"].startswith("run-cap:") and p["held"] and p["counts"]["waiting"]:
            return str(p["name"].removeprefix("run-cap:"))
    return None


def _interesting_entry(page: Any) -> int | None:
    """The queue id of a warehouse entry waiting for an interesting reason."""
    waiting = _json(page, "/api/pools/warehouse/")["waiting"]
    for reason in WHY:
        for w in waiting:
            if w.get("blocked_by") == reason:
                return int(w["queue_id"])
    return None


def _card_contended(page: Any) -> bool:
    """The admin index, loaded afresh, whose card shows slots held and entries waiting."""
    page.goto("/admin/")
    page.wait_for_selector('#pools-card li.pools-row[data-pool="warehouse"]')
    rows: list[list[int]] = page.locator("#pools-card li.pools-row").evaluate_all(
        "rows => rows.map(r => [Number(r.dataset.held), Number(r.dataset.waiting)])"
    )
    return sum(h for h, _ in rows) > 0 and sum(w for _, w in rows) > 0


def _why_page(page: Any) -> bool:
    """An entry's page whose "why" still names an interesting blocker once loaded."""
    queue_id = _interesting_entry(page)
    if queue_id is None:
        return False
    page.goto(f"/admin/pools/queueentry/{queue_id}/change/")
    page.wait_for_selector("#pools-why")
    shown = page.locator("#pools-why [data-blocked-by]").evaluate_all(
        "rows => rows.map(r => r.dataset.blockedBy)"
    )
    return any(reason in WHY for reason in shown)


def take(out_dir: Path) -> list[Path]:
    """Run the demo and take the screenshots; returns the files written."""
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        raise ScreenshotError(f"Chromium is missing at {CHROMIUM} (run 'make browsers')")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="pools-demo-") as tmp, running_demo(Path(tmp)) as url:
        started = time.monotonic()  # the demo's trickle has just begun
        site = url.removesuffix("/admin/")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            context = browser.new_context(
                base_url=site,
                viewport={"width": 1280, "height": 900},
                color_scheme="light",
                device_scale_factor=1,
            )
            context.set_default_timeout(20_000)
            page = context.new_page()
            page.goto("/admin/login/?next=/admin/")
            page.fill("#id_username", USERNAME)
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_selector("#pools-card")

            def shot(name: str, target: Any, **kwargs: Any) -> None:
                path = out_dir / f"{name}.png"
                target.screenshot(path=str(path), **kwargs)
                written.append(path)
                print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")

            _wait(lambda: _contended(page), CONTENTION_TIMEOUT, "contention in the pools")
            _wait(lambda: _card_contended(page), CONTENTION_TIMEOUT, "contention on the card")
            shot("card", page.locator("#pools-card"))

            root = _wait(lambda: _live_run(page), CONTENTION_TIMEOUT, "a run in progress")
            page.goto(f"/admin/pools/queueentry/run/{root}/")
            page.wait_for_selector('figure[data-timeline-pool="warehouse"] svg')
            shot("run-panel", page, full_page=True)

            _wait(lambda: _why_page(page), CONTENTION_TIMEOUT, "an entry waiting behind a head")
            content = page.locator("#content").bounding_box()
            why = page.locator("#pools-why").bounding_box()
            assert content is not None and why is not None  # both are on the page
            clip = {
                "x": content["x"],
                "y": content["y"],
                "width": content["width"],
                "height": why["y"] + why["height"] - content["y"] + 12,
            }
            shot("entry-why", page, clip=clip)  # the title and "Where it stands"

            time.sleep(max(0.0, started + POOL_PAGE_AFTER - time.monotonic()))
            page.goto("/admin/pools/pool/occupancy/warehouse/?window=1m")
            page.wait_for_selector('figure[data-timeline-pool="warehouse"] svg')
            shot("pool-page", page, full_page=True)
            browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args(argv)
    try:
        take(args.out.resolve())
    except ScreenshotError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
