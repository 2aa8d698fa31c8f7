"""The admin's pool form refuses with the pool field table's messages, before the services
are called (a value the services refuse never reaches them)."""

from __future__ import annotations

import html
import re

import pytest
from django.test import Client
from django.urls import reverse

from pools.models import Pool
from tests.support.admin import ADMIN_APPS
from tests.support.factories import make_pool

pytestmark = pytest.mark.django_db(transaction=True, available_apps=ADMIN_APPS)

#: The pool form's fields, as it shows them for a new pool of one slot.
FORM = {
    "slots": "1",
    "max_queued": "",
    "description": "",
    "overflow": "reject",
    "paused_policy": "queue",
    "strategy": "priority",
    "aging_seconds": "",
    "spend_cap": "",
    "rate": "",
}


def _errors(content: bytes) -> list[str]:
    found = re.findall(r'<ul class="errorlist[^"]*"[^>]*>(.*?)</ul>', content.decode(), re.S)
    return [html.unescape(re.sub(r"<[^>]+>", "", e)).strip() for e in found]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slots": "0"}, "slots must be a positive integer, got 0."),
        ({"max_queued": "0"}, "max_queued must be a positive integer, got 0."),
        ({"aging_seconds": "0"}, "aging_seconds must be a positive integer, got 0."),
        ({"spend_cap": "0"}, "spend_cap must be a positive number of slot-seconds per UTC day"),
        ({"rate": "1/y"}, "rate: '1/y' is not a rate; use N/s, N/m, N/h or N/d"),
        (
            {"strategy": "lifo", "aging_seconds": "5"},
            "aging_seconds applies to strategy 'priority' only",
        ),
    ],
)
def test_change_form__refuses_with_the_table_message(
    admin_client: Client, change: dict[str, str], message: str
) -> None:
    make_pool("wh", 1)
    pool = Pool.objects.get(name="wh")
    response = admin_client.post(
        reverse("admin:pools_pool_change", args=[pool.pk]), {**FORM, **change}
    )
    assert response.status_code == 200  # the form again, with the error
    errors = _errors(response.content)
    assert len(errors) == 1 and message in errors[0], errors
    assert Pool.objects.get(name="wh").slots == 1


def test_add_form__refuses_a_reserved_name_and_saves_the_rate_as_stored(
    admin_client: Client,
) -> None:
    add = reverse("admin:pools_pool_add")
    response = admin_client.post(add, {**FORM, "name": "task-cap:x"})
    assert response.status_code == 200
    assert "reserved for workflow caps" in _errors(response.content)[0]
    assert not Pool.objects.filter(name="task-cap:x").exists()
    admin_client.post(add, {**FORM, "name": "fresh", "rate": " 10/s , 5/m"}, follow=True)
    assert Pool.objects.get(name="fresh").rate == "10/s,5/m"
