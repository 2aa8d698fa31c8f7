"""The one rule by which the PostgreSQL engine hands work to the ORM engine, and the
choice of engine (``pools.core.engine``): no database needed."""

from __future__ import annotations

from django.test import override_settings

from pools.core import engine as engine_module
from pools.core.engines.orm import ORM
from pools.core.records import Submission
from pools.pg.engine import POSTGRESQL, Handoff, handed_to_orm
from pools.pg.fastpath import Reply, Row
from pools.specs import PoolSpec


def submit(**fields: object) -> Submission:
    return Submission(key="k", task_name="t", spec=PoolSpec(demand={"p": 1}), **fields)  # type: ignore[arg-type]


def test_handed_to_orm__a_plain_submit_stays_on_the_function():
    assert handed_to_orm(sub=submit()) == Handoff()


def test_handed_to_orm__a_submit_that_is_not_plain_or_budgeted_is_the_orm_engines_call():
    assert handed_to_orm(sub=submit(job="nightly")).call
    assert handed_to_orm(sub=submit(idempotency_key="order-1")).call
    assert handed_to_orm(sub=submit(pinned_worker="w1@host")).call
    assert handed_to_orm(sub=submit(debounce=5.0, debounce_key="tenant-7")).call
    assert handed_to_orm(sub=submit(), budgeted=True).call


def test_handed_to_orm__a_policy_refusal_hands_the_whole_call_over():
    reply = Reply([Row(kind="refused", pool="p", reason="policy")])
    assert handed_to_orm(reply=reply) == Handoff(call=True)


def test_handed_to_orm__other_refusals_are_the_functions_own():
    for reason in ("unknown", "capacity", "full"):
        reply = Reply([Row(kind="refused", pool="p", reason=reason, limit=1)])
        assert handed_to_orm(reply=reply) == Handoff(), reason


def test_handed_to_orm__fallback_rows_hand_over_the_pass_of_their_pools():
    reply = Reply(
        [
            Row(kind="enqueued", entry=1),
            Row(kind="fallback", pool="a"),
            Row(kind="admitted", entry=1, pool="b"),
            Row(kind="fallback", pool="c"),
        ]
    )
    assert handed_to_orm(reply=reply) == Handoff(pools=frozenset({"a", "c"}))
    assert handed_to_orm(reply=Reply([Row(kind="settled", entry=1)])) == Handoff()


def test_engine__sqlite_gets_the_orm_engine_whatever_the_setting():
    with override_settings(POOLS={"SQL_FAST_PATH": True}):
        assert engine_module.engine() is ORM
    assert not ORM.own_worker_connection and POSTGRESQL.own_worker_connection


def test_engine__chosen_once_per_connection_and_again_after_a_settings_change(monkeypatch):
    engine_module.engine()  # chosen and kept
    monkeypatch.setattr(engine_module, "choose", lambda: (POSTGRESQL, True))
    assert engine_module.engine() is ORM  # kept: not chosen again per call
    with override_settings(POOLS={"SQL_FAST_PATH": True}):
        assert engine_module.engine() is POSTGRESQL  # settings reloaded: chosen again
