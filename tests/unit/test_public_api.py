"""The public API in ``pools``: real signatures and types, and import-safe.

mypy checks this file too (``make lint``): the ``assert_type`` calls below fail type
checking if ``pools.pooled`` / ``pools.snapshot`` fall back to ``Any``-typed wrappers.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, assert_type

import pytest

import pools
from pools.celery import decorators, worker
from pools.core import admission, snapshots
from pools.specs import PoolSpec, with_arguments_of

if TYPE_CHECKING:
    from pools.core.leases import Claim
    from pools.core.snapshots import PoolSnapshot
    from pools.models import QueueEntry


def _params(func: Callable[..., object]) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(func).parameters.values()]


def test_pooled__has_the_decorator_parameters_and_return_type() -> None:
    assert _params(pools.pooled) == _params(decorators.pooled)
    assert inspect.signature(pools.pooled).return_annotation == "Callable[[T], T]"


def test_pooled__one_parameter_list_for_the_three_places() -> None:
    """``pools.pooled``, the decorator and ``PoolSpec.build`` cannot drift: the two
    functions declare no parameter of their own (``*args, **options`` only) and show
    build's, with their own return type."""
    build = inspect.signature(PoolSpec.build)
    for func in (pools.pooled, decorators.pooled):
        assert inspect.signature(func).parameters == build.parameters
        code = func.__wrapped__.__code__  # type: ignore[attr-defined]
        assert (code.co_argcount, code.co_kwonlyargcount) == (0, 0)
        assert code.co_flags & inspect.CO_VARARGS and code.co_flags & inspect.CO_VARKEYWORDS


def test_pooled__passes_every_option_to_the_spec_and_refuses_unknown_ones() -> None:
    def job(*args: object) -> str:
        return "key"

    options: dict[str, Any] = {
        "priority": 3,
        "queue_timeout": 60.0,
        "concurrency_policy": "forbid",
        "job_key": job,
        "idempotency_key": job,
        "max_running": 2,
        "fairness_key": "tenant",
        "rate": "5/s",
        "max_backoffs": 3,
    }
    # Debounce excludes a policy other than allow and an idempotency key: its own call.
    debounced: dict[str, Any] = {"debounce": 2.5, "debounce_key": job, "rate": "5/s"}
    assert set(options) | set(debounced) | {"pools", "slots"} == set(
        inspect.signature(PoolSpec.build).parameters
    )

    def body() -> None:
        pass

    wrapped = pools.pooled("typed-pool", 2, **options)(body)
    assert decorators.spec_of(wrapped) == PoolSpec.build("typed-pool", 2, **options)
    wrapped = pools.pooled("typed-pool", 2, **debounced)(body)
    assert decorators.spec_of(wrapped) == PoolSpec.build("typed-pool", 2, **debounced)
    spec = decorators.spec_of(wrapped)
    assert spec is not None and spec.debounce == 2.5
    with pytest.raises(TypeError, match=r"^pooled\(\) got an unexpected keyword argument 'prio'"):
        pools.pooled("typed-pool", prio=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^pooled\(\) too many positional arguments"):
        decorators.pooled("typed-pool", 1, 2)  # type: ignore[call-arg]


def test_with_arguments_of__a_new_option_is_one_edit_of_the_source() -> None:
    """Sabotage twin: a parameter added to the source appears on the decorated function
    (signature and accepted calls); one it lacks is refused in the function's name."""

    def source(pools: str | None = None, *, priority: int = 0, new_option: int = 1) -> object:
        return None

    @with_arguments_of(source)
    def wrapper(*args: Any, **options: Any) -> str:
        return repr((args, options))

    assert list(inspect.signature(wrapper).parameters) == ["pools", "priority", "new_option"]
    assert inspect.signature(wrapper).return_annotation == "str"
    assert wrapper("p", new_option=2) == "(('p',), {'new_option': 2})"
    with pytest.raises(TypeError, match=r"^wrapper\(\) got an unexpected keyword argument 'nope'"):
        wrapper(nope=1)  # type: ignore[call-arg]


def test_snapshot_cancel_current_claim__annotated_with_their_real_types() -> None:
    assert inspect.signature(pools.snapshot).return_annotation == "PoolSnapshot"
    assert inspect.signature(pools.cancel).return_annotation == "QueueEntry"
    assert inspect.signature(pools.current_claim).return_annotation == "Claim | None"
    # Each parameter of the public function exists, with the same default, on the engine's.
    for public, engine in (
        (pools.snapshot, snapshots.snapshot),
        (pools.cancel, admission.cancel),
        (pools.current_claim, worker.current_claim),
    ):
        real = inspect.signature(engine).parameters
        for name, kind, default in _params(public):
            assert name in real and (real[name].kind, real[name].default) == (kind, default)


def test_pooled__decorates_a_function_and_keeps_its_type() -> None:
    def body(x: int) -> int:
        return x + 1

    wrapped: Callable[[int], int] = pools.pooled("typed-pool", slots=2)(body)
    assert wrapped(1) == 2


def _typed_uses(body: Callable[[int], str]) -> None:  # never called: for mypy only
    # assert_type fails type checking on Any, unlike an annotated assignment.
    assert_type(pools.snapshot("p"), PoolSnapshot)
    assert_type(pools.cancel("key", terminate=True), QueueEntry)
    assert_type(pools.current_claim(), Claim | None)
    assert_type(pools.pooled("p", 2, priority=1, queue_timeout=None)(body), Callable[[int], str])


def test_import_pools__touches_neither_models_nor_celery() -> None:
    code = (
        "import sys, pools; "
        "bad = [m for m in ('pools.models', 'celery', 'rest_framework', 'django.db.models.base')"
        " if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_budget_functions__exported_with_their_engines_parameters() -> None:
    from pools.celery import budgets as celery_budgets
    from pools.celery import caps
    from pools.core import budgets as core_budgets

    assert {"BudgetExceeded", "charge", "limit_run", "run_spend"} <= set(pools.__all__)
    assert _params(pools.charge) == _params(celery_budgets.charge)
    assert _params(pools.limit_run) == _params(caps.limit_run)
    assert _params(pools.run_spend) == _params(core_budgets.spend)
    assert issubclass(pools.BudgetExceeded, pools.PoolRefused)


def test_charge__outside_a_pooled_body_charges_nothing() -> None:
    assert pools.charge(cost=1) is None
