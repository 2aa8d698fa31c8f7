"""Headless Chromium (Debian's ``chromium``) driven by Playwright, against pytest-django's live server.

``make browsers`` installs the browser with apt; Playwright's own browser downloads are
never used (``executable_path`` points at the system Chromium). A missing browser or
Playwright skips these tests locally and fails them under CI. Screenshots go to
``test-artifacts/browser/`` (the docs' own are taken from the demo by ``make screenshots``,
:mod:`tests.browser.demo_screenshots`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User

from tests.acceptance.conftest import celery_workers  # noqa: F401  (real workers, reused)
from tests.browser.chromium import CHROMIUM, CHROMIUM_ARGS
from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
PASSWORD = "browser-pw"


def _missing(what: str) -> None:
    message = f"browser tests need {what} (run 'make browsers')"
    if IN_CI:
        pytest.fail(f"{message}; CI=true: a missing browser is a failure")
    pytest.skip(message)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the session."""
    if not os.path.exists(CHROMIUM):
        _missing(f"Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the 'playwright' package (pip install -e '.[browser]')")
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls
    # are still synchronous, so Django's async-safety guard has to be told.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as p:
            chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield chromium
            chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page_factory(browser: Any, live_server: Any) -> Iterator[Any]:
    """``page_factory(color_scheme="light")`` -> a fresh page of a fresh browser context."""
    contexts: list[Any] = []

    def make(color_scheme: str = "light", width: int = 1280, height: int = 900) -> Any:
        context = browser.new_context(
            base_url=live_server.url,
            viewport={"width": width, "height": height},
            color_scheme=color_scheme,
            device_scale_factor=1,
        )
        context.set_default_timeout(15_000)
        contexts.append(context)
        return context.new_page()

    yield make
    for context in contexts:
        context.close()


@pytest.fixture
def admin_user(transactional_db: None) -> User:
    """A superuser the browser logs in as."""
    return User.objects.create_superuser("operator", "op@example.com", PASSWORD)


def login(page: Any, user: User) -> None:
    """Log into the admin through its login form."""
    page.goto("/admin/login/?next=/admin/")
    page.fill("#id_username", user.username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#pools-card")


def screenshot(page: Any, name: str, **kwargs: Any) -> Path:
    """Save a screenshot under test-artifacts/browser/."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), **kwargs)
    return path
