"""The benchmark's own failure: a run that cannot give a figure says why."""

from __future__ import annotations


class BenchError(RuntimeError):
    """A workload could not be measured (a body failed, a worker died, a timeout)."""
