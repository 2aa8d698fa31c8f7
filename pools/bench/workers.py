"""The benchmark's own ``celery worker`` subprocesses, their queues and their memory.

Each worker runs the project's Celery app (``-A <app>``) with ``--include pools.bench.tasks``
and consumes only the benchmark's queues, so the project's own workers and tasks are not
touched. A *held queue* is one no worker consumes until :meth:`Fleet.consume` tells some
workers to (``add_consumer``): a backlog of plain Celery messages is published there first,
then released at once, like a paused pool.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from django.conf import settings

from pools.celery import processes

#: The queue pooled deliveries of the benchmark go to (always consumed by the main workers).
POOLED_QUEUE = "pools-bench"
#: Plain Celery backlogs (W1 baseline) and the recipe (W5), held until released.
PLAIN_QUEUE = "pools-bench-plain"
RECIPE_QUEUE = "pools-bench-recipe"
#: Plain Celery's pickup floor (W2): consumed by the 1x1 floor worker when released.
FLOOR_QUEUE = "pools-bench-floor"
#: Memory workers: one runs only plain tasks, the other only pooled ones.
MEM_PLAIN_QUEUE = "pools-bench-mem-plain"
MEM_POOLED_QUEUE = "pools-bench-mem"
#: A queue nobody publishes to (a worker needs at least one).
IDLE_QUEUE = "pools-bench-idle"

ERROR_LINE = re.compile(r"(: (ERROR|CRITICAL)/|^Traceback)")

#: One benchmark worker: a :class:`pools.celery.processes.Process` (node name, log, pids, RSS).
Worker = processes.Process


def error_lines(worker: Worker) -> list[str]:
    """Lines ``worker`` logged at ERROR/CRITICAL level, and tracebacks."""
    return worker.log_lines(ERROR_LINE)


class Fleet:
    """Starts, watches and stops the benchmark's workers."""

    def __init__(
        self,
        app: Any,
        app_path: str,
        log_dir: Path,
        run_id: str,
        *,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.app_path = app_path
        self.log_dir = log_dir
        self.run_id = run_id
        self.extra_args = list(extra_args)
        self.workers: list[Worker] = []

    def main_pids(self) -> list[int]:
        """Process ids of the workers' main processes (their pool processes are children)."""
        return [worker.proc.pid for worker in self.workers]

    def start(self, label: str, concurrency: int, queues: list[str]) -> Worker:
        """Start one worker (returns at once; see :meth:`wait_ready`)."""
        node = f"{label}-{self.run_id}"
        worker = processes.start_worker(
            self.app_path,
            node=node,
            log=self.log_dir / f"{node}.log",
            concurrency=concurrency,
            queues=queues,
            include=["pools.bench.tasks"],
            loglevel="warning",
            heartbeat=False,
            extra_args=self.extra_args,
            env=_worker_env(),
            cwd=_app_root(self.app_path),  # in a session of its own: Ctrl-C reaches only us
        )
        self.workers.append(worker)
        return worker

    def wait_ready(self, workers: list[Worker], timeout: float = 90.0) -> None:
        """Wait until each worker answers a ping; raise with its log if it died."""
        # At WARNING level a worker never logs "ready.": the ping alone says it consumes.
        processes.wait_ready(workers, timeout=timeout, marker=None, ping=self.app)

    def check_alive(self) -> None:
        """Raise if a worker's main process has exited (its first error line is quoted)."""
        for worker in self.workers:
            if not worker.alive():
                errors = error_lines(worker)
                last = f": {errors[0]}" if errors else ""
                raise RuntimeError(
                    f"worker {worker.name} exited with status {worker.proc.returncode}{last} "
                    f"(log: {worker.log})"
                )

    def consume(self, queue: str, workers: list[Worker]) -> None:
        """Make ``workers`` start consuming ``queue`` (releases a held backlog)."""
        self._control("add_consumer", queue, workers)

    def stop_consuming(self, queue: str, workers: list[Worker]) -> None:
        """Make ``workers`` stop consuming ``queue``."""
        self._control("cancel_consumer", queue, workers)

    def _control(self, command: str, queue: str, workers: list[Worker]) -> None:
        names = [w.name for w in workers]
        replies = getattr(self.app.control, command)(
            queue, destination=names, reply=True, timeout=5.0
        )
        answered = {name for reply in replies or [] for name in reply}
        if set(names) - answered:
            raise RuntimeError(f"{command} {queue}: no reply from {sorted(set(names) - answered)}")

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL whatever is left of each process group."""
        processes.stop(self.workers, timeout)


def _app_root(app_path: str) -> str:
    """The directory the Celery app's top package is imported from (else the current one).

    ``celery -A`` imports the app with the current directory first on ``sys.path``: run from
    a repository root whose ``example_project/`` folder holds ``manage.py`` and the package
    ``example_project``, the folder would shadow the package. The workers start where the
    package lives, as they would from the directory of ``manage.py``.
    """
    top = sys.modules.get(app_path.split(":")[0].split(".")[0])
    location = getattr(top, "__file__", None)
    if not location:
        return os.getcwd()
    path = Path(location).resolve()
    return str(path.parent.parent if path.name == "__init__.py" else path.parent)


def settings_module() -> str:
    """The settings module in use (``override_settings`` hides it: then the environment's)."""
    return str(settings.SETTINGS_MODULE or os.environ.get("DJANGO_SETTINGS_MODULE") or "")


def _worker_env() -> dict[str, str]:
    """This process's environment, with the settings module and import path it runs with."""
    from pools.bench.tasks import WAKEUPS_ENV

    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = settings_module()
    env[WAKEUPS_ENV] = POOLED_QUEUE  # timed wake-ups of the bench pools: to a bench queue
    # The directory of manage.py (sys.path[0]) is where the project package lives.
    paths = [p for p in (sys.path[0], os.getcwd()) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return env
