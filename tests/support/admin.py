"""Helpers of the admin tests: the apps they need, reading the card's numbers from its HTML."""

from __future__ import annotations

import re

from django.conf import settings

#: Apps a transactional admin test flushes (and recreates permissions of): every app with
#: models in the admin index (the index lists them all, e.g. DRF's tokens).
ADMIN_APPS = [app for app in settings.INSTALLED_APPS if app != "django.contrib.staticfiles"]

_ROW = re.compile(
    r'data-pool="(?P<name>[^"]+)" data-slots="(?P<slots>\d+)" '
    r'data-held="(?P<held>\d+)" data-waiting="(?P<waiting>\d+)"'
)


def card_rows(html: str) -> dict[str, dict[str, int]]:
    """``{pool: {"slots", "held", "waiting"}}`` as the card renders them."""
    return {
        m["name"]: {"slots": int(m["slots"]), "held": int(m["held"]), "waiting": int(m["waiting"])}
        for m in _ROW.finditer(html)
    }


def card_row(html: str, pool: str) -> str:
    """The HTML of one pool's row of the card."""
    start = html.index(f'data-pool="{pool}"')
    end = html.find('<li class="pools-row', start)
    return html[start : end if end != -1 else html.index("</ul>", start)]
