"""@pooled placements: below/above @app.task, bind=True, class-based, shared_task order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery, Task, shared_task

from pools import pooled
from pools.celery.decorators import spec_of
from pools.exceptions import PoolConfigurationError
from pools.specs import PoolSpec


def spec(task: object) -> PoolSpec:
    """The spec ``@pooled`` attached to ``task`` (which must have one)."""
    found = spec_of(task)
    assert found is not None, f"{task!r} is not pooled"
    return found


@pytest.fixture
def app() -> Celery:
    app = Celery("unit", set_as_current=False)
    app.conf.task_always_eager = False
    return app


def test_below_app_task__spec_visible_and_signature_kept(app: Celery) -> None:
    @app.task
    @pooled("warehouse", slots=2, priority=10)
    def export(day: str, *, full: bool = False) -> str:
        return day

    assert spec(export).demand == {"warehouse": 2}
    assert spec(export).priority == 10
    # Celery's argument check still sees the real signature (functools.wraps).
    with pytest.raises(TypeError):
        export.apply_async(args=(), kwargs={"nope": 1})


def test_below_app_task_bind__gets_self(app: Celery) -> None:
    @app.task(bind=True)
    @pooled("warehouse")
    def bound(self: Task, x: int) -> tuple[str, int]:
        return (self.name, x)

    assert spec(bound).demand == {"warehouse": 1}
    assert bound(3) == (bound.name, 3)  # a direct call runs the body in place


def test_above_app_task__wraps_the_task(app: Celery) -> None:
    @pooled({"a": 1, "b": 2})
    @app.task
    def multi(x: int) -> int:
        return x * 2

    assert spec(multi).demand == {"a": 1, "b": 2}
    assert multi(2) == 4


def test_above_lazy_app_task__applies_when_evaluated() -> None:
    lazy = Celery("lazy", set_as_current=False)

    @pooled("p")
    @lazy.task
    def later(x: int) -> int:
        return x

    lazy.finalize()
    assert spec(lazy.tasks[later.name]).demand == {"p": 1}


def test_class_based_task(app: Celery) -> None:
    @pooled("warehouse", slots=1)
    class Export(Task):
        name = "unit.export"

        def run(self, x: int) -> int:
            return x + 1

    task = app.register_task(Export())
    assert spec(task).demand == {"warehouse": 1}
    assert task(1) == 2


def test_above_shared_task__fails_loudly_with_the_fix() -> None:
    with pytest.raises(PoolConfigurationError, match="below @shared_task"):

        @pooled("warehouse")
        @shared_task
        def wrong_order() -> None:
            pass


def test_twice__rejected(app: Celery) -> None:
    with pytest.raises(PoolConfigurationError, match="twice"):

        @pooled("a")
        @pooled("b")
        def f() -> None:
            pass


def test_bad_arguments__rejected_at_decoration() -> None:
    with pytest.raises(PoolConfigurationError, match="positive integer"):
        pooled("warehouse", slots=0)


@pytest.fixture
def gated_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every entry into the worker-side gate (instead of checking a claim)."""
    from pools.celery import worker

    calls: list[str] = []

    def run_gated(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    monkeypatch.setattr(worker, "run_gated", run_gated)
    return calls


def test_gate_task__autoretry_class_task_runs_through_the_gate(
    app: Celery, gated_calls: list[str]
) -> None:
    # Celery's autoretry_for wraps ``run`` on the instance; gating by name (POOLS["TASKS"])
    # must gate that wrapper too, or the body would run without a claim.
    from pools.celery.decorators import gate_task
    from pools.specs import PoolSpec

    class Flaky(Task):
        name = "unit.flaky_class"
        autoretry_for = (ValueError,)

        def run(self) -> str:
            return "ran"

    task = app.register_task(Flaky())
    gate_task(task, PoolSpec.build("warehouse"))
    assert spec(task).demand == {"warehouse": 1}
    assert task.run() == "ran"
    assert len(gated_calls) == 1, "the body went through the gate exactly once"


def test_gate_task__autoretry_function_task_runs_through_the_gate(
    app: Celery, gated_calls: list[str]
) -> None:
    from pools.celery.decorators import gate_task
    from pools.specs import PoolSpec

    @app.task(autoretry_for=(ValueError,))
    def flaky() -> str:
        return "ran"

    gate_task(flaky, PoolSpec.build("warehouse"))
    assert flaky.run() == "ran"
    assert len(gated_calls) == 1, "the body went through the gate exactly once"


def test_below_app_task__autoretry_is_gated_once(app: Celery, gated_calls: list[str]) -> None:
    @app.task(autoretry_for=(ValueError,))
    @pooled("warehouse")
    def flaky() -> str:
        return "ran"

    assert flaky.run() == "ran"
    assert gated_calls == ["flaky"], "gated once, inside Celery's autoretry wrapper"


# Finalizing a fresh app registers every @shared_task, including this file's same-named ones.
@pytest.mark.filterwarnings("ignore::celery.exceptions.DuplicateTaskNameWarning")
def test_spec_for__finds_a_shared_task_by_name_before_the_app_is_finalized() -> None:
    """send_task("name") from a process whose app is not finalized yet is still gated."""
    from pools.celery import task_specs
    from tests.testapp import tasks  # noqa: F401  (registers the @shared_task tasks)

    fresh = Celery("unfinalized", set_as_current=False)
    assert not fresh.finalized  # type: ignore[attr-defined]  # not in celery-types
    spec = task_specs.spec_for(fresh, "tests.testapp.tasks.record")
    assert spec is not None and spec.demand == {"warehouse": 1}
