"""System checks of the Celery side: pools.W002 (no beat: no sweep), pools.W003 (no DB reuse),
pools.W004 (no project app), pools.W005 (transport package missing), pools.W006 (prefetch)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.conf import settings
from django.core.checks import run_checks
from django.test import override_settings

from pools.checks import check_celery_integration

_state: Any = importlib.import_module("celery._state")


def _ids() -> list[str]:
    return [message.id or "" for message in check_celery_integration()]


@pytest.fixture
def make_app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``make_app(conf)`` -> a Celery app made current for the test (as ``proj/celery.py`` does)."""
    made: list[Celery] = []

    def make(conf: dict[str, Any] | None = None, *, namespace: str | None = None) -> Celery:
        app = Celery("project", set_as_current=False)
        if conf is not None:
            app.config_from_object(conf, namespace=namespace)
        monkeypatch.setattr(_state._tls, "current_app", app)
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


@pytest.fixture
def no_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Celery app was ever created in this process."""
    monkeypatch.setattr(_state._tls, "current_app", None)
    monkeypatch.setattr(_state, "default_app", None)


# --------------------------------------------------------------------------- pools.W002


def test_w002__fires_without_django_celery_beat_and_says_what_breaks(make_app: Any) -> None:
    make_app({"CELERY_DB_REUSE_MAX": 1000}, namespace="CELERY")
    apps_ = [a for a in settings.INSTALLED_APPS if a != "django_celery_beat"]
    with override_settings(INSTALLED_APPS=apps_):
        (warning,) = check_celery_integration()
    assert warning.id == "pools.W002"
    assert "never scheduled" in warning.msg and "lease lapses" in warning.msg
    assert warning.hint is not None and "'django_celery_beat' to INSTALLED_APPS" in warning.hint


def test_w002__silent_when_django_celery_beat_is_installed(make_app: Any) -> None:
    make_app({"CELERY_DB_REUSE_MAX": 1000}, namespace="CELERY")
    assert "django_celery_beat" in settings.INSTALLED_APPS
    assert _ids() == []


def test_w002__silent_when_the_app_schedules_the_sweep_itself(make_app: Any) -> None:
    schedule = {"sweep": {"task": "pools.sweep", "schedule": 5.0}}
    make_app({"CELERY_DB_REUSE_MAX": 1000, "CELERY_BEAT_SCHEDULE": schedule}, namespace="CELERY")
    apps_ = [a for a in settings.INSTALLED_APPS if a != "django_celery_beat"]
    with override_settings(INSTALLED_APPS=apps_):
        assert _ids() == []


# --------------------------------------------------------------------------- pools.W003


def test_w003__fires_when_the_app_has_no_db_reuse_max_and_names_the_app(make_app: Any) -> None:
    make_app({})
    (warning,) = check_celery_integration()
    assert warning.id == "pools.W003"
    assert "the Celery app 'project'" in warning.msg
    assert "before and after every task" in warning.msg
    assert warning.hint is not None and "CELERY_DB_REUSE_MAX = 1000" in warning.hint


def test_w003__silent_when_set_through_the_django_settings_namespace(make_app: Any) -> None:
    make_app({"CELERY_DB_REUSE_MAX": 1000}, namespace="CELERY")
    assert _ids() == []


def test_w003__fires_for_a_lowercase_conf_key_the_django_fixup_never_reads(
    make_app: Any,
) -> None:
    app = make_app({})
    app.conf.db_reuse_max = 1000
    assert _ids() == ["pools.W003"]


def test_w003__the_app_wins_over_the_settings(make_app: Any) -> None:
    make_app({})
    with override_settings(CELERY_DB_REUSE_MAX=1000):
        assert _ids() == ["pools.W003"]


def test_w003__without_an_app_reads_the_settings(no_app: None) -> None:
    with override_settings(CELERY_DB_REUSE_MAX=None):
        (warning,) = check_celery_integration()
    assert warning.id == "pools.W003" and "(the Django settings)" in warning.msg
    with override_settings(CELERY_DB_REUSE_MAX=500):
        assert _ids() == []
    assert _state.default_app is None  # the check made no app up


def test_w003__silent_on_the_postgresql_fast_path(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers start and settle on pools' own connection there, which Celery never closes."""
    from pools.core import engine as engine_module
    from pools.core.engines.orm import ORM
    from pools.pg.engine import POSTGRESQL

    make_app({})
    monkeypatch.setattr(engine_module, "configured", lambda: POSTGRESQL)
    assert _ids() == []
    monkeypatch.setattr(engine_module, "configured", lambda: ORM)
    assert _ids() == ["pools.W003"]


def test_checks__registered_with_django(make_app: Any) -> None:
    make_app({})
    assert "pools.W003" in {message.id for message in run_checks()}


def test_checks__the_test_project_is_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test project's app (tests/celery_app.py), current as in a worker of the project;
    # other tests import the example project, whose app would otherwise be current.
    from tests.celery_app import app

    monkeypatch.setattr(_state._tls, "current_app", app)
    assert _ids() == []
    assert _app_ids() == []


# --------------------------------------------------------------------------- pools.W004-W006


def _app_ids() -> list[str]:
    from pools.celery.checks import check_celery_app

    return [message.id or "" for message in check_celery_app()]


def test_w004__fires_when_no_celery_app_was_loaded_with_django(no_app: None) -> None:
    from pools.celery.checks import check_celery_app

    (warning,) = check_celery_app()
    assert warning.id == "pools.W004"
    assert "Celery's default app" in warning.msg and "CELERY_* settings" in warning.msg
    assert warning.hint is not None and "from .celery import app as celery_app" in warning.hint
    assert _state.default_app is None  # the check made no app up


def test_w004__silent_with_the_projects_app(make_app: Any) -> None:
    make_app({"CELERY_WORKER_PREFETCH_MULTIPLIER": 1}, namespace="CELERY")
    assert _app_ids() == []


def test_w005__fires_for_a_broker_whose_transport_package_is_missing(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from pools.celery import checks as celery_checks

    real = importlib.util.find_spec
    monkeypatch.setattr(
        celery_checks.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "redis" else real(name, *a),
    )
    make_app(
        {
            "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
            "CELERY_RESULT_BACKEND": "rpc://",
            "CELERY_WORKER_PREFETCH_MULTIPLIER": 1,
        },
        namespace="CELERY",
    )
    (warning,) = check_celery_app_messages()
    assert warning.id == "pools.W005"
    assert "broker_url redis://..." in warning.msg and "'redis'" in warning.msg
    assert warning.hint == "pip install 'django-celery-pools[redis]'."


def test_w005__silent_when_the_package_is_installed_or_the_scheme_needs_none(
    make_app: Any,
) -> None:
    make_app(
        {
            "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
            "CELERY_RESULT_BACKEND": "django-db",
            "CELERY_WORKER_PREFETCH_MULTIPLIER": 1,
        },
        namespace="CELERY",
    )
    assert _app_ids() == []  # redis is installed here (the test extra has it)
    make_app({"CELERY_BROKER_URL": "amqp://guest@localhost//"}, namespace="CELERY")
    assert "pools.W005" not in _app_ids()


@pytest.mark.parametrize("multiplier", [4, 0])
def test_w006__fires_when_workers_prefetch_more_than_one_message(
    make_app: Any, multiplier: int
) -> None:
    make_app({"CELERY_WORKER_PREFETCH_MULTIPLIER": multiplier}, namespace="CELERY")
    (warning,) = check_celery_app_messages()
    assert warning.id == "pools.W006"
    assert f"worker_prefetch_multiplier {multiplier}" in warning.msg
    assert warning.hint is not None and "CELERY_WORKER_PREFETCH_MULTIPLIER = 1" in warning.hint


def test_w006__silent_when_celerys_default_is_changed_to_one_or_prefetch_is_off(
    make_app: Any,
) -> None:
    make_app({}, namespace="CELERY")  # Celery's default multiplier is 4
    assert _app_ids() == ["pools.W006"]
    make_app({"CELERY_WORKER_PREFETCH_MULTIPLIER": 1}, namespace="CELERY")
    assert _app_ids() == []
    make_app({"CELERY_WORKER_DISABLE_PREFETCH": True}, namespace="CELERY")
    assert _app_ids() == []


def test_w004_w006__registered_with_django(make_app: Any) -> None:
    make_app({"CELERY_DB_REUSE_MAX": 1000}, namespace="CELERY")
    assert "pools.W006" in {message.id for message in run_checks()}


def check_celery_app_messages() -> list[Any]:
    from pools.celery.checks import check_celery_app

    return check_celery_app()
