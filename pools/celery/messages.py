"""Held messages: a pooled call is kept as the exact message Celery built for it.

When a pooled task is called, Celery's own ``send_task`` runs in the caller as usual —
routing, ``eta``/``expires`` headers, ``reply_to``, the publish signals, the app's
serializer and compression — up to the broker ``publish``. :class:`CapturingProducer`
stands in for the producer there: it serializes the body with the serializer Celery
asked for and hands the whole message (:class:`HeldMessage`) to the gate, which puts
it in line instead of on the broker. Whatever the app's serializer accepts (JSON with
bytes, pickle, msgpack, yaml, kombu-registered types) is held unchanged; whatever it
refuses fails in the caller, as plain Celery would.

At admission :func:`publish` sends those bytes with the claim header added; nothing
is re-serialized and no publish signal runs a second time.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from kombu import Queue
from kombu.compression import compress, decompress
from kombu.serialization import dumps as serialize
from kombu.serialization import loads as deserialize
from kombu.serialization import prepare_accept_content
from kombu.serialization import registry as kombu_registry  # type: ignore[attr-defined]
from kombu.utils import json as kombu_json

#: Message header carrying ``"<entry id>:<token>"`` on admitted messages.
CLAIM_HEADER = "pools_claim"
#: Header of an admitted message whose run has a budget: the run id (the worker measures
#: the attempt's task seconds and charges them when it settles).
BUDGET_HEADER = "pools_budget"
#: Header of a message admitted in a pool with a rate: its start confirms its place in the
#: pool's window of starts (:func:`pools.core.leases.start_rated`).
RATED_HEADER = "pools_rated"
#: Internal ``send_task`` option marking a publish made by the gate itself.
ADMITTED_OPTION = "_pools_admitted"
#: Internal ``send_task`` option naming the origin of a submission (e.g. ungated delivery).
ORIGIN_OPTION = "_pools_origin"
#: The documented ``apply_async`` option for per-call pool overrides.
CALL_OPTION = "pool_options"
#: Header of a held message naming its job: when the task succeeds, the worker supersedes
#: the job's queued retries.
JOB_HEADER = "pools_job"
#: Header of an admitted debounced entry's message: the task ids of the earlier calls it
#: collapsed; the worker stores the run's result under each (docs/howto/debounce.md).
DEBOUNCED_HEADER = "pools_debounced"
#: Key of the held message inside ``QueueEntry.options``.
OPTION_KEY = "message"
#: Format version of the stored form.
VERSION = 1


def _pack(value: Any) -> str:
    """Base64 of kombu's JSON (which types datetimes, bytes, UUIDs, decimals).

    Headers may hold any character, and PostgreSQL's ``jsonb`` refuses NUL: the
    envelope is stored as one opaque string rather than as JSON the database reads.
    """
    return base64.b64encode(kombu_json.dumps(value).encode()).decode("ascii")


def _unpack(value: str) -> Any:
    """The inverse of :func:`_pack`."""
    return kombu_json.loads(base64.b64decode(value).decode())


@dataclass(frozen=True, kw_only=True)
class HeldMessage:
    """A task message exactly as Celery would have published it."""

    #: Serialized (and compressed, if configured) body.
    body: bytes
    content_type: str
    content_encoding: str
    #: Message headers (protocol 2: ``id``, ``task``, ``eta``, ``expires``, ``retries``, ...).
    headers: dict[str, Any]
    #: Message properties (``correlation_id``, ``reply_to``, ``priority``, ...).
    properties: dict[str, Any]
    exchange: str
    routing_key: str
    delivery_mode: Any = None
    #: Names of the queues to declare before publishing.
    declare: list[str] = field(default_factory=list)
    retry: bool | None = None
    retry_policy: dict[str, Any] | None = None

    @property
    def task_id(self) -> str:
        return str(self.headers["id"])

    @property
    def task_name(self) -> str:
        return str(self.headers["task"])

    def header_time(self, name: str) -> datetime | None:
        """``eta`` or ``expires`` as an aware datetime, or None."""
        return parse_time(self.headers.get(name))

    def to_json(self) -> dict[str, Any]:
        """The stored form (plain JSON with base64 strings)."""
        return {
            "v": VERSION,
            "task": self.task_name,
            "body": base64.b64encode(self.body).decode("ascii"),
            "content_type": self.content_type,
            "content_encoding": self.content_encoding,
            "envelope": _pack(
                {
                    "headers": self.headers,
                    "properties": self.properties,
                    "retry_policy": self.retry_policy,
                }
            ),
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "delivery_mode": self.delivery_mode,
            "declare": self.declare,
            "retry": self.retry,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HeldMessage:
        """Rebuild a message from :meth:`to_json`'s form."""
        envelope = _unpack(data["envelope"])
        return cls(
            body=base64.b64decode(data["body"]),
            content_type=data["content_type"],
            content_encoding=data["content_encoding"],
            headers=envelope["headers"],
            properties=envelope["properties"],
            exchange=data["exchange"],
            routing_key=data["routing_key"],
            delivery_mode=data.get("delivery_mode"),
            declare=list(data.get("declare") or ()),
            retry=data.get("retry"),
            retry_policy=envelope.get("retry_policy"),
        )

    def decode(self, accept: Any = None) -> tuple[Any, Any, dict[str, Any]]:
        """The body as ``(args, kwargs, embed)``: embed holds callbacks, errbacks, chain, chord."""
        body = self.body
        compression = self.headers.get("compression")
        if compression:
            body = decompress(body, compression)
        if accept is not None:  # names ("json") or content types, as Celery's setting
            accept = prepare_accept_content(accept)
        args, kwargs, embed = deserialize(
            body, self.content_type, self.content_encoding, accept=accept
        )
        return args, kwargs, embed or {}


def copy_for(message: HeldMessage, task_id: str, args: Any, kwargs: Any = None) -> HeldMessage:
    """The same call under another task id with other arguments (bulk copies, benchmarks)."""
    _, old_kwargs, embed = message.decode()
    serializer = kombu_registry.type_to_name[message.content_type]
    body: Any
    _, encoding, body = serialize(
        (list(args), old_kwargs if kwargs is None else kwargs, embed), serializer=serializer
    )
    if isinstance(body, str):
        body = body.encode(encoding)
    headers = dict(message.headers)
    if headers.get("compression"):
        body, headers["compression"] = compress(body, headers["compression"])
    if headers.get("root_id") == headers.get("id"):
        headers["root_id"] = task_id
    headers.update(id=task_id, argsrepr=repr(tuple(args)))
    properties = {**message.properties, "correlation_id": task_id}
    return replace(message, body=body, headers=headers, properties=properties)


def held_in(options: Mapping[str, Any] | None) -> HeldMessage | None:
    """The held message stored in an entry's ``options`` (None for entries from before it)."""
    data = (options or {}).get(OPTION_KEY)
    return HeldMessage.from_json(data) if isinstance(data, Mapping) else None


def parse_time(value: Any) -> datetime | None:
    """An ISO 8601 header value (or datetime) as an aware UTC datetime."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class CapturingProducer:
    """A kombu ``Producer`` whose ``publish`` hands the message to ``on_message``.

    Every other attribute (``connection``, ``channel``, ...) is the real producer's, so
    result backends that prepare a reply queue in the caller (``rpc://``) work as usual.
    """

    def __init__(self, real: Any, on_message: Callable[[HeldMessage], None]) -> None:
        self._real = real
        self._on_message = on_message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def publish(
        self,
        body: Any,
        routing_key: str | None = None,
        delivery_mode: Any = None,
        mandatory: bool = False,
        immediate: bool = False,
        priority: int | None = None,
        content_type: str | None = None,
        content_encoding: str | None = None,
        serializer: str | None = None,
        headers: dict[str, Any] | None = None,
        compression: str | None = None,
        exchange: Any = None,
        retry: bool | None = None,
        retry_policy: dict[str, Any] | None = None,
        declare: Any = None,
        expiration: float | None = None,
        timeout: float | None = None,
        confirm_timeout: float | None = None,
        **properties: Any,
    ) -> None:
        headers = dict(headers or {})
        payload: Any
        if content_type:
            payload = (
                body if isinstance(body, bytes) else str(body).encode(content_encoding or "utf-8")
            )
            content_encoding = content_encoding or "binary"
        else:
            # The app's serializer: an unserializable argument raises here, in the caller.
            content_type, content_encoding, payload = serialize(
                body, serializer=serializer or self._real.serializer
            )
        compression = compression if compression is not None else self._real.compression
        if compression:
            payload, headers["compression"] = compress(payload, compression)
        if priority is not None:
            properties["priority"] = priority
        if expiration is not None:
            properties["expiration"] = expiration
        if timeout is not None:
            properties["timeout"] = timeout
        if confirm_timeout is not None:
            properties["confirm_timeout"] = confirm_timeout
        self._on_message(
            HeldMessage(
                body=payload if isinstance(payload, bytes) else payload.encode(content_encoding),
                content_type=content_type,
                content_encoding=content_encoding,
                headers=headers,
                properties=properties,
                exchange=getattr(exchange, "name", exchange) or "",
                routing_key=routing_key or "",
                delivery_mode=delivery_mode,
                declare=[q.name for q in declare or () if isinstance(q, Queue)],
                retry=retry,
                retry_policy=retry_policy,
            )
        )


def publish(
    producer: Any,
    message: HeldMessage,
    *,
    extra_headers: Mapping[str, Any],
    queues: Any,
    now: datetime,
) -> None:
    """Publish a held message (bytes as captured) with ``extra_headers`` added.

    A broker TTL (``expiration``, from ``expires``) counts from now, so it is recomputed
    from the ``expires`` header; ``queues`` (the app's ``amqp.queues``) resolves the
    queues to declare.
    """
    properties = dict(message.properties)
    timeout = properties.pop("timeout", None)
    confirm_timeout = properties.pop("confirm_timeout", None)
    if "expiration" in properties:
        expires = message.header_time("expires")
        if expires is not None:
            properties["expiration"] = max((expires - now).total_seconds(), 0.0)
    declare = []
    for name in message.declare:
        try:
            declare.append(queues[name])
        except KeyError:  # an unknown queue with task_create_missing_queues off
            continue
    producer.publish(
        message.body,
        exchange=message.exchange,
        routing_key=message.routing_key,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        compression=None,  # the body is stored compressed, with its header
        headers={**message.headers, **extra_headers},
        delivery_mode=message.delivery_mode,
        declare=declare,
        retry=bool(message.retry),
        retry_policy=message.retry_policy,
        timeout=timeout,
        confirm_timeout=confirm_timeout,
        **properties,
    )


def parse_claim(value: Any) -> tuple[int, int] | None:
    """Parse a ``"<entry id>:<token>"`` header; None if absent or malformed."""
    if not isinstance(value, str) or ":" not in value:
        return None
    entry, _, token = value.partition(":")
    try:
        return int(entry), int(token)
    except ValueError:
        return None


def claim_of(request: Any) -> tuple[int, int] | None:
    """The ``(entry id, token)`` a delivery carries, from its headers or request attributes."""
    if request is None:
        return None
    raw = (getattr(request, "headers", None) or {}).get(CLAIM_HEADER) or getattr(
        request, "pools_claim", None
    )
    return parse_claim(raw)


def rated_of(request: Any) -> bool:
    """True if a delivery was admitted in a pool with a rate (:data:`RATED_HEADER`)."""
    if request is None:
        return False
    raw = (getattr(request, "headers", None) or {}).get(RATED_HEADER) or getattr(
        request, RATED_HEADER, None
    )
    return bool(raw)
