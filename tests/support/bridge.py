"""A bridge that records admissions instead of publishing them (integration tests)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from pools.core.records import Admission, Finished


class RecordingBridge:
    """Collects what the core would hand to Celery."""

    def __init__(self) -> None:
        self.admissions: list[Admission] = []
        self.finished: list[Finished] = []
        self.terminated: list[str] = []
        self.wakes: list[tuple[list[str], datetime]] = []

    def publish(self, admissions: Sequence[Admission]) -> None:
        self.admissions.extend(admissions)

    def report_finished(self, finished: Sequence[Finished]) -> None:
        self.finished.extend(finished)

    def wake_at(self, pools: Iterable[str], when: datetime) -> None:
        self.wakes.append((list(pools), when))

    def terminate(self, key: str) -> None:
        self.terminated.append(key)

    def keys(self) -> list[str]:
        return [a.key for a in self.admissions]

    def reset(self) -> None:
        self.admissions.clear()
        self.finished.clear()
        self.terminated.clear()
        self.wakes.clear()


recorder = RecordingBridge()
