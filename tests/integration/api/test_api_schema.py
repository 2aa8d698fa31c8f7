"""The OpenAPI schema of the REST API, and the REST reference checked against it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.test import Client
from drf_spectacular.generators import SchemaGenerator

REST_DOC = Path(__file__).resolve().parents[3] / "docs" / "reference" / "rest.md"
PREFIX = "/api/"


def schema_answers() -> set[tuple[str, str, str]]:
    """(METHOD, path relative to the mount, status) of every documented answer."""
    gen = SchemaGenerator()
    paths = gen.get_schema(request=None, public=True)["paths"]
    out = set()
    for path, ops in paths.items():
        if not path.startswith(PREFIX) or path == f"{PREFIX}schema/":
            continue
        rel = re.sub(r"\{(\w+)\}", r"<\1>", path[len(PREFIX) :])
        for method, op in ops.items():
            out |= {(method.upper(), rel, str(code)) for code in op["responses"]}
    return out


def doc_answers() -> set[tuple[str, str, str]]:
    """(METHOD, path, status) from the '### `METHOD path`' sections of docs/reference/rest.md."""
    out = set()
    current = None
    for line in REST_DOC.read_text().splitlines():
        heading = re.match(r"^#{2,3} `(GET|POST|PATCH|PUT|DELETE) ([^`]+)`", line)
        if heading:
            current = (heading.group(1), heading.group(2))
        elif line.startswith("## "):
            current = None
        elif current and (row := re.match(r"^\| (\d{3}) \|", line)):
            out.add((*current, row.group(1)))
    return out


def test_schema__lists_every_error_answer_with_a_body() -> None:
    paths = SchemaGenerator().get_schema(request=None, public=True)["paths"]
    cancel = paths[f"{PREFIX}pools/{{name}}/queue/{{key}}/cancel"]["post"]["responses"]
    assert set(cancel) == {"200", "400", "401", "403", "404", "409", "415", "503"}
    for code in ("404", "409", "503"):
        assert "application/json" in cancel[code]["content"], code
    start = paths[f"{PREFIX}jobs/{{name}}/start"]["post"]["responses"]
    assert {"202", "404", "409", "503"} <= set(start)


def test_rest_reference__matches_the_schema() -> None:
    documented, generated = doc_answers(), schema_answers()
    assert generated, "the schema lists no endpoint"
    missing = sorted(generated - documented)
    extra = sorted(documented - generated)
    assert not missing, f"in the schema but not in docs/reference/rest.md: {missing}"
    assert not extra, f"in docs/reference/rest.md but not in the schema: {extra}"


@pytest.mark.django_db
def test_schema__served_as_openapi_3(admin_client: Client) -> None:
    response = admin_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    assert response.json()["openapi"].startswith("3.")
