"""The example project serves the API schema and a Swagger UI whose files are all local."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import json, re
from django.contrib.staticfiles import finders
from django.test import Client
c = Client(HTTP_HOST="localhost")
docs = c.get("/api/docs/")
html = docs.content.decode()
assets = re.findall(r'(?:src|href)="([^"]+)"', html)
out = {
    "docs": docs.status_code,
    "schema": c.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"],
    "remote": re.findall(r"https?://[^\\"' ]+", html),
    "assets": assets,
    "missing": [a for a in assets if not finders.find(a.removeprefix("/static/"))],
}
print("PROBE" + json.dumps(out))
"""


def test_example_project__serves_schema_and_swagger_ui_without_cdn(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", PROBE],
        cwd=ROOT / "example_project",
        env={"EXAMPLE_VAR_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.split("PROBE", 1)[1])
    assert out["docs"] == 200
    assert "/api/pools/{name}/queue/{key}/cancel" in out["schema"]
    assert out["remote"] == [], "the UI page loads something from the internet"
    assert out["assets"] and out["missing"] == []
