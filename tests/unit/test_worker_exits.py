"""Which ``SystemExit`` in a pooled body means "a signal is ending this pool process"."""

from __future__ import annotations

import pytest

from pools.celery import received, worker


def test_worker_exits__billiards_terminate_handler_is_a_signal(monkeypatch) -> None:
    monkeypatch.setattr(worker.billiard_common, "terminate_handler_fired", lambda: True)
    assert worker._terminated_by_signal(SystemExit(-241))


def test_worker_exits__a_bodys_own_sys_exit_is_not(monkeypatch) -> None:
    monkeypatch.setattr(worker.billiard_common, "terminate_handler_fired", lambda: False)
    assert not worker._terminated_by_signal(SystemExit(1))
    assert not worker._terminated_by_signal(SystemExit(None))


@pytest.mark.parametrize(("code", "expected"), [(-241, True), (-253, True), (0, False), (1, False)])
def test_worker_exits__older_billiard_is_read_from_the_exit_code(
    monkeypatch, code: int, expected: bool
) -> None:
    """billiard without ``terminate_handler_fired`` exits with ``-(256 - signum)``."""
    monkeypatch.delattr(worker.billiard_common, "terminate_handler_fired", raising=False)
    assert worker._terminated_by_signal(SystemExit(code)) is expected


def test_received__a_gone_process_is_not_alive_and_this_one_is() -> None:
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not received._alive(child.pid)
    assert received._alive(os.getpid())
    assert not received._alive(None)
