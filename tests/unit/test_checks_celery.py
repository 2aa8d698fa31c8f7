"""System checks of the Celery side: pools.W002 (no beat: no sweep), pools.W003 (no DB reuse)."""

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
