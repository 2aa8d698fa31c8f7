"""The gate's installation (``pools.celery.gate``) and the bridge's two paths."""

from __future__ import annotations

from pathlib import Path

from celery.app import base as celery_base
from celery.app import control
from django.utils.module_loading import import_string

from pools import conf
from pools.celery import bridge, gate, originals, sending
from tests.support import imports

ROOT = Path(__file__).resolve().parents[2]


def test_install__wraps_send_task_and_revoke_once_and_keeps_celerys_own() -> None:
    gate.install()  # PoolsConfig.ready ran it already: a second call changes nothing
    gate.install()
    assert celery_base.Celery.send_task is sending.gated_send_task
    assert control.Control.revoke is gate._revoke
    assert originals.kept()
    assert originals._original_send_task is not sending.gated_send_task
    assert originals._original_revoke is not gate._revoke


def test_publisher__default_and_the_0_1_0_path_name_the_same_bridge() -> None:
    default = conf.PoolsSettings.__dataclass_fields__["PUBLISHER"].default
    assert default == "pools.celery.bridge.bridge"
    assert import_string(str(default)) is bridge.bridge
    assert import_string("pools.celery.gate.bridge") is bridge.bridge
    assert isinstance(bridge.bridge, bridge.CeleryBridge)


def test_send_side__imported_only_by_the_installation_and_the_batch() -> None:
    """The worker side asks ``default_pool``, never the send side (no cycle through it);
    the batch of :mod:`pools.celery.fanout` collects the send side's submissions."""
    edges = imports.edges(ROOT, ["pools", "pools_admin"])
    importers = {a for a, b in edges if b == "pools.celery.sending"}
    assert importers == {"pools.celery.gate", "pools.celery.fanout"}
    assert {a for a, b in edges if b == "pools.celery.gate"} == {"pools.apps"}
