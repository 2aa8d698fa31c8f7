"""Bad input to the Python API: a ``PoolError`` subclass with an actionable message, and
nothing written (no entry, no demand row, no event). One test per case; the module runs on
SQLite and on PostgreSQL (``POOLS_TEST_DB``), through the real gate (``delay`` /
``apply_async``) where the case can come from a call.
"""

from __future__ import annotations

from typing import Any

import pytest
from kombu.exceptions import EncodeError

import pools
from pools.celery.decorators import pooled
from pools.core import admission
from pools.core.records import Submission
from pools.exceptions import (
    DemandExceedsCapacity,
    EntryNotFound,
    MessageTooLarge,
    PoolConfigurationError,
    PoolError,
    UnknownPool,
    UnserializableArguments,
)
from pools.models import Demand, PoolEvent, QueueEntry
from pools.specs import PoolSpec
from tests.celery_app import app
from tests.conftest import POOL_APPS
from tests.support.factories import make_pool
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=POOL_APPS)


@app.task(name="tests.bad_input.wide")
@pooled("warehouse", slots=3)
def wide() -> None:
    """Asks for 3 slots of ``warehouse`` (more than the 1 the tests give it)."""


@app.task(name="tests.bad_input.nowhere")
@pooled("nowhere-pool")
def nowhere() -> None:
    """Names a pool nobody created."""


def counts() -> tuple[int, int, int]:
    return QueueEntry.objects.count(), Demand.objects.count(), PoolEvent.objects.count()


@pytest.fixture
def nothing_written(recorder):
    """Asserts, after the test, that the tables hold what they held before it."""
    make_pool("warehouse", 1)
    before = counts()
    yield
    assert counts() == before, "a refused call wrote rows"
    assert not recorder.admissions, "a refused call admitted something"


def raises(kind: type[PoolError], call: Any, *needles: str) -> PoolError:
    with pytest.raises(kind) as info:
        call()
    assert isinstance(info.value, PoolError)
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    return info.value


# --------------------------------------------------------------------------- pools


def test_unknown_pool__delay_raises_unknown_pool(nothing_written):
    raises(UnknownPool, nowhere.delay, "'nowhere-pool' does not exist", "pools sync")


def test_unknown_pool__enqueue_of_a_spec_raises_unknown_pool(nothing_written):
    sub = Submission(key="k", task_name="t", spec=PoolSpec.build({"warehouse": 1, "zz": 1}))
    raises(UnknownPool, lambda: admission.enqueue(sub), "'zz' does not exist")


def test_demand_larger_than_capacity__raises_with_both_numbers(nothing_written):
    exc = raises(
        DemandExceedsCapacity,
        wide.delay,
        "asks for 3 slot(s) of pool 'warehouse', which has only 1",
        "Lower the task's slots or raise the pool's capacity",
    )
    assert exc.code == "demand_exceeds_capacity"


# --------------------------------------------------------------------------- slots


@pytest.mark.parametrize("slots", ["2", 1.5, True, None], ids=["str", "float", "bool", "none"])
def test_non_integer_slots__decorator_refuses(nothing_written, slots):
    raises(
        PoolConfigurationError,
        lambda: pooled("warehouse", slots=slots),
        "must be a positive integer",
        repr(slots),
    )


@pytest.mark.parametrize("slots", [0, -1])
def test_non_positive_slots__decorator_refuses(nothing_written, slots):
    raises(
        PoolConfigurationError,
        lambda: pooled({"warehouse": slots}),
        "slots for pool 'warehouse' must be a positive integer",
    )


@pytest.mark.parametrize("slots", ["1", 0, -3, 2.0])
def test_bad_slots__a_spec_made_by_hand_never_reaches_admission(nothing_written, slots):
    raises(
        PoolConfigurationError,
        lambda: admission.enqueue(
            Submission(key="k", task_name="t", spec=PoolSpec(demand={"warehouse": slots}))
        ),
        "must be a positive integer",
    )


@pytest.mark.parametrize("slots", ["1", 0])
def test_bad_slots__pools_tasks_declaration_refuses(nothing_written, settings, slots):
    settings.POOLS = {**settings.POOLS, "TASKS": {add.name: {"pools": {"warehouse": slots}}}}
    raises(
        PoolConfigurationError,
        lambda: PoolSpec.from_dict({"pools": {"warehouse": slots}}),
        "must be a positive integer",
    )


# --------------------------------------------------------------------------- names


BAD_NAMES = ["", "bad name", "a/b", "-leading-dash", "x" * 101, "naïve", 42]


@pytest.mark.parametrize("name", BAD_NAMES, ids=lambda n: repr(n)[:20])
def test_bad_pool_name__decorator_refuses(nothing_written, name):
    raises(
        PoolConfigurationError,
        lambda: pooled(name),
        "Invalid pool name" if isinstance(name, str) else "expects a pool name",
    )


@pytest.mark.parametrize("name", BAD_NAMES[:-1], ids=lambda n: repr(n)[:20])
def test_bad_pool_name__a_spec_made_by_hand_never_reaches_admission(nothing_written, name):
    raises(
        PoolConfigurationError,
        lambda: admission.enqueue(
            Submission(key="k", task_name="t", spec=PoolSpec(demand={name: 1}))
        ),
        "Invalid pool name",
        "letters, digits and '_ . : -'",
    )


def test_empty_demand__refused(nothing_written):
    raises(PoolConfigurationError, lambda: PoolSpec(demand={}), "non-empty {pool: slots}")


# --------------------------------------------------------------------------- call options


@pytest.mark.parametrize(
    "options,needle",
    [
        ({"priority": "high"}, "priority must be an integer"),
        ({"queue_timeout": -1}, "queue_timeout must be a positive number"),
        ({"slots": 2}, "Unknown pool_options key(s) ['slots']"),
        ("fast", "pool_options must be a dict"),
    ],
    ids=["priority", "queue_timeout", "unknown-key", "not-a-dict"],
)
def test_bad_pool_options__apply_async_refuses(nothing_written, options, needle):
    raises(PoolConfigurationError, lambda: add.apply_async((1, 2), pool_options=options), needle)  # type: ignore[call-arg]


# --------------------------------------------------------------------------- arguments


def test_unserialisable_arguments__raise_a_pool_error_that_is_still_encode_error(
    nothing_written,
):
    exc = raises(
        UnserializableArguments,
        lambda: add.delay(object(), 1),  # type: ignore[arg-type]
        "cannot be serialized",
        "not JSON serializable",
        "Pass plain data",
    )
    assert isinstance(exc, EncodeError)  # what plain Celery raises: handlers keep working
    assert exc.code == "unserializable_arguments"


def test_oversized_arguments__raise_message_too_large(nothing_written, settings, recorder):
    settings.POOLS = {**settings.POOLS, "MAX_MESSAGE_BYTES": 1000}
    exc = raises(
        MessageTooLarge,
        lambda: add.delay("x" * 2000, 1),  # type: ignore[arg-type]
        "above POOLS['MAX_MESSAGE_BYTES'] (1000)",
        "Pass a reference",
    )
    assert isinstance(exc, MessageTooLarge)
    assert exc.size > 2000 and exc.limit == 1000
    add.delay("x" * 100, 1)  # type: ignore[arg-type]  # the control: a call under the limit is held
    assert QueueEntry.objects.count() == 1
    # Only the refusal is under test: forget the control's rows.
    QueueEntry.objects.all().delete()
    PoolEvent.objects.all().delete()
    recorder.admissions.clear()


def test_oversized_arguments__default_limit_is_one_mebibyte(nothing_written):
    raises(MessageTooLarge, lambda: add.delay("x" * (1 << 20), 1), "(1048576)")  # type: ignore[arg-type]


def test_max_message_bytes__setting_must_be_a_positive_integer(settings):
    from pools import conf

    for bad in (0, -1, 1.5, "1MB", True):
        settings.POOLS = {"MAX_MESSAGE_BYTES": bad}
        with pytest.raises(PoolConfigurationError, match="positive integer"):
            conf.get()


# --------------------------------------------------------------------------- other calls


def test_cancel_unknown_key__raises_entry_not_found(nothing_written):
    raises(EntryNotFound, lambda: pools.cancel("no-such-key"), "No queue entry with key")


def test_snapshot_unknown_pool__raises_unknown_pool(nothing_written):
    raises(UnknownPool, lambda: pools.snapshot("no-such-pool"), "'no-such-pool' does not exist")
