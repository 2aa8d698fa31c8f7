"""docs/quickstart.md runs as written, once per database it offers (its tabs).

A reader (:mod:`tests.tutorial.reader`) installs the wheel in a fresh virtualenv with the
extras the page names, makes the page's project, writes its files, runs its commands, starts
its two workers and beat, and types its Python session (whose printed values the page shows
and the reader compares). Then the test checks what the page says happened: every call ran,
the pool never ran more than its slots allow, beat sent the sweep, and the admin shows the
pages the page names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tutorial import pages
from tests.tutorial.conftest import PROJECT
from tests.tutorial.reader import Isolation, StepFailed, reading

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
STEPS = pages.read(PAGE)

#: What the page's run left, read in its project once every call has ended: the exports'
#: states, workers and the most that ran at once, the pool, and the admin pages it names.
OUTCOME = """
import json, time
import pools
from django.contrib.auth import get_user_model
from django.test import Client
from pools.models import TERMINAL_STATES, QueueEntry

deadline = time.monotonic() + 60
while True:
    rows = list(QueueEntry.objects.filter(task_name="inventory.tasks.export").values(
        "state", "started_at", "finished_at", "worker"))
    pool = pools.snapshot("warehouse")
    done = rows and all(r["state"] in TERMINAL_STATES for r in rows) and pool.held == 0
    if done or time.monotonic() > deadline:
        break
    time.sleep(0.2)
edges = sorted(
    [(r["started_at"], 1) for r in rows if r["started_at"]]
    + [(r["finished_at"], -1) for r in rows if r["finished_at"]]
)
running = most = 0
for _, step in edges:
    running += step
    most = max(most, running)
user = get_user_model().objects.create_superuser("reader", "reader@example.com", "-")
client = Client(HTTP_HOST="localhost")
client.force_login(user)
index = client.get("/admin/")
pool_list = client.get("/admin/pools/pool/")
print(json.dumps({
    "states": sorted(str(r["state"]) for r in rows),
    "unstarted": sum(1 for r in rows if not r["started_at"] or not r["finished_at"]),
    "most_at_once": most,
    "workers": sorted({r["worker"].split("@")[0] for r in rows}),
    "pool": [pool.slots, pool.held, pool.waiting],
    "admin_index": [index.status_code, index.content.decode()],
    "admin_pools": [pool_list.status_code, pool_list.content.decode()],
}))
"""


def database_for(variant: str, request: pytest.FixtureRequest) -> None:
    """The service a variant's database needs (SQLite needs none)."""
    if variant == "postgres":
        request.getfixturevalue("pg_database")
    elif variant != "sqlite":
        pytest.fail(f"{PAGE}: variant {variant!r}: the test knows postgres and sqlite only")


@pytest.mark.parametrize("variant", pages.variants(STEPS))
def test_quickstart__runs_as_written(
    variant: str,
    wheel: Path,
    tmp_path: Path,
    isolation: Isolation,
    redis_db: int,
    request: pytest.FixtureRequest,
):
    database_for(variant, request)
    with reading(tmp_path, wheel, PROJECT, isolation) as reader:
        try:
            reader.follow(pages.for_variant(STEPS, variant))
            printed = reader.python(OUTCOME, what="the outcome")
            outcome = json.loads(printed.strip().splitlines()[-1])
        except StepFailed as exc:
            pytest.fail(f"{exc}\n{reader.report()}", pytrace=False)
        exited = reader.exited()
        errors = reader.errors()
        beat = [s for s in reader.started if " beat" in s.command]
        report = reader.report()

    assert reader.installed, f"{PAGE} never installs {PROJECT}"
    assert not exited, f"stopped before the end: {[s.command for s in exited]}\n{report}"
    assert not errors, "\n".join(errors) + "\n" + report
    # The page's eight exports all ran, and never more than two at once (2 slots each of 4).
    assert outcome["states"] == ["succeeded"] * 8, report
    assert outcome["unstarted"] == 0
    assert outcome["most_at_once"] == 2, report
    assert outcome["pool"] == [4, 0, 0]
    # Beat sent the sweep the page says it sends.
    assert beat and "pools.sweep" in beat[0].text(), report
    # The admin has the pages the page names, and the pool.
    status, index = outcome["admin_index"]
    assert status == 200
    for title in ("Resource pools", "Queue entries", "Pool events"):
        assert title in index, f"the admin index has no {title!r}"
    status, pool_list = outcome["admin_pools"]
    assert status == 200 and "warehouse" in pool_list
