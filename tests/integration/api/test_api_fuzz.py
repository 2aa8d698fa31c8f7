"""Fuzz the REST API from its OpenAPI schema (schemathesis), in-process over WSGI.

Bounded and reproducible: ``EXAMPLES`` generated cases per operation and mode, Hypothesis
derandomized (the same cases on every run), no example database. Each operation is fuzzed
with schema-valid data (positive) and schema-violating data (negative), with random path
parameters and with the names of existing rows (so the handlers run past their 404s), as
a superuser (token authentication) and as an anonymous client. Every answer must be:

- no 500 (``not_a_server_error``),
- a status the schema documents for the operation (``status_code_conformance``),
- of the documented content type, with a body matching the documented schema,
- for every error (4xx/5xx), a JSON object with a ``detail`` or per-field messages.

The failures of every operation are collected and reported together.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from django.contrib.auth.models import User
from django.core.wsgi import get_wsgi_application
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, Phase, given, settings
from rest_framework.authtoken.models import Token
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.api import API_APPS
from tests.support.factories import make_pool, submit
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True, available_apps=API_APPS)

#: Generated cases per operation, mode and path-parameter choice (bounded: ``make test``).
EXAMPLES = 8
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
#: Path parameters naming rows the fixture creates.
KNOWN = {"name": "wh", "key": "w"}


def error_is_json(response: Any) -> None:
    """Every 4xx/5xx answer is a JSON object that says what went wrong."""
    if response.status_code < 400:
        return
    content_type = (response.headers.get("content-type") or [""])[0]
    assert content_type.startswith("application/json"), f"{response.status_code}: {content_type}"
    body = json.loads(response.content)
    assert isinstance(body, dict) and body, f"{response.status_code} body {body!r}"
    assert "detail" in body or all(
        isinstance(v, list) and v and all(isinstance(m, str) for m in v) for v in body.values()
    ), f"{response.status_code} body {body!r}"


def api_schema() -> Any:
    """The generated OpenAPI document, loaded by schemathesis, calling the app over WSGI."""
    document = SchemaGenerator().get_schema(request=None, public=True)
    document["paths"] = {
        p: ops
        for p, ops in document["paths"].items()
        if p.startswith("/api/") and p != "/api/schema/"
    }
    schema = schemathesis.openapi.from_dict(document)
    schema.app = get_wsgi_application()
    return schema


@pytest.fixture
def rows(recorder, settings):
    """Rows for the known names: a pool with a holder and a waiting entry, a job."""
    settings.ALLOWED_HOSTS = ["localhost"]  # schemathesis's WSGI client's host
    make_pool("wh", 1, max_queued=20)
    submit("wh", key="run")
    submit("wh", key="w")
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.HOURS)
    for name in ("wh", "w"):
        PeriodicTask.objects.create(
            name=name, task=add.name, interval=every, args=json.dumps([1, 2]), enabled=False
        )
    return recorder


def fuzz(headers: dict[str, str]) -> list[str]:
    """Run every operation's cases; the failures, one line each (with the case to replay)."""
    failures: list[str] = []
    for result in api_schema().get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for path_parameters in (None, KNOWN):
                params = (
                    {k: v for k, v in path_parameters.items() if f"{{{k}}}" in operation.path}
                    if path_parameters
                    else None
                )
                strategy = operation.as_strategy(
                    generation_mode=mode, path_parameters=params or None
                )

                @settings(
                    max_examples=EXAMPLES,
                    derandomize=True,
                    database=None,
                    deadline=None,
                    phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=strategy)
                def run(case: Any) -> None:
                    # A made-up Host is Django's ALLOWED_HOSTS refusal (an HTML 400 before
                    # any view), not the API's answer: the fuzz keeps the test client's.
                    if case.headers:
                        case.headers = {
                            k: v for k, v in case.headers.items() if k.lower() != "host"
                        }
                    response = case.call(headers=headers)
                    case.validate_response(response, checks=CHECKS)
                    error_is_json(response)

                try:
                    run()
                except Exception as exc:  # collected, reported below
                    first = str(exc).strip().splitlines()[:12]
                    failures.append(
                        f"{operation.label} [{mode}, paths={params}]: " + " | ".join(first)
                    )
                    print(failures[-1], "\n", exc)  # the whole report in the captured output
    return failures


def test_fuzz__superuser_gets_no_500_and_only_documented_json_answers(rows):
    user = User.objects.create_superuser("root", password="pw")
    token = Token.objects.create(user=user)
    failures = fuzz({"Authorization": f"Token {token.key}"})
    assert not failures, "\n".join(failures)


def test_fuzz__anonymous_gets_only_documented_json_refusals(rows):
    failures = fuzz({})
    assert not failures, "\n".join(failures)
