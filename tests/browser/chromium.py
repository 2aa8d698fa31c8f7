"""Where the browser tests and ``make screenshots`` find Chromium, and how they launch it.

Debian's ``chromium`` (``make browsers``); Playwright's own browser downloads are never
used. Imports neither Django nor Playwright.
"""

from __future__ import annotations

import os

CHROMIUM = os.environ.get("POOLS_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
