"""Database models: pools, queue entries, their per-pool demand rows and the event log.

Rows are changed only by the service modules (:mod:`pools.core.admission`,
:mod:`pools.core.leases`, the pool services such as :mod:`pools.core.pool_crud`); never
``update(state=...)`` elsewhere. The states and kinds the rows store (``EntryState``,
``EventKind``, ...) are pure values in :mod:`pools.states`; the queries in
:mod:`pools.querysets`.
"""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Case, F, Q, Value, When
from django.utils.translation import gettext_lazy as _

# The choices of pool fields are defined with the field table; named here as before.
from pools.pool_fields import OverflowPolicy, PausedPolicy, Strategy
from pools.pool_names import POOL_NAME_RE
from pools.querysets import DemandQuerySet, QueueEntryQuerySet
from pools.rates_text import validate_field as validate_rate
from pools.states import (
    DELAYED,
    DEMAND_STATES,
    FAIR_STATES,
    TERMINAL_STATES,
    UNFINISHED_STATES,
    ConcurrencyPolicy,
    EntryState,
    EventKind,
    Origin,
)


class Pool(models.Model):
    """A named capacity of ``slots`` shared by every task that names it, on every worker."""

    name = models.CharField(
        _("name"),
        max_length=100,
        unique=True,
        validators=[RegexValidator(POOL_NAME_RE, _("Use letters, digits and '_ . : -'."))],
        help_text=_("Unique name tasks use in @pooled(...)."),
    )
    slots = models.PositiveIntegerField(
        _("slots"), validators=[MinValueValidator(1)], help_text=_("Capacity of the pool.")
    )
    max_queued = models.PositiveIntegerField(
        _("max queued"),
        null=True,
        blank=True,
        help_text=_("Backlog limit: waiting entries allowed; empty means unlimited."),
    )
    paused = models.BooleanField(
        _("paused"),
        default=False,
        help_text=_("A paused pool admits nothing; entries keep their place."),
    )
    description = models.TextField(_("description"), blank=True)
    #: A capacity change waiting for the entries queued before it to drain
    #: (see docs/reference/pool-policies.md):
    #: ``slots`` stays in effect until then.
    pending_slots = models.PositiveIntegerField(
        _("pending slots"),
        null=True,
        blank=True,
        editable=False,
        help_text=_("New capacity, in effect once the entries queued before the change drain."),
    )
    overflow = models.CharField(
        _("overflow policy"),
        max_length=12,
        choices=OverflowPolicy.choices,
        default=OverflowPolicy.REJECT,
        db_default=OverflowPolicy.REJECT,
        help_text=_("What a submit does when the backlog is at max_queued."),
    )
    paused_policy = models.CharField(
        _("paused policy"),
        max_length=8,
        choices=PausedPolicy.choices,
        default=PausedPolicy.QUEUE,
        db_default=PausedPolicy.QUEUE,
        help_text=_("What a submit does while the pool is paused."),
    )
    strategy = models.CharField(
        _("strategy"),
        max_length=8,
        choices=Strategy.choices,
        default=Strategy.PRIORITY,
        db_default=Strategy.PRIORITY,
        help_text=_("The order in which waiting entries are admitted."),
    )
    aging_seconds = models.PositiveIntegerField(
        _("aging seconds"),
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text=_(
            "Strategy 'priority' only: a waiting entry gains one priority level per this many "
            "seconds waited. Empty means no aging."
        ),
    )
    #: Strategy ``fair``: the highest round of an admitted entry (under this row's lock).
    fair_round = models.BigIntegerField(_("fair round"), default=0, db_default=0, editable=False)
    #: Daily spend cap in slot-seconds per UTC day (:mod:`pools.core.spendcap`).
    spend_cap = models.FloatField(
        _("daily spend cap"),
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text=_(
            "Slot-seconds this pool may spend per UTC day; once spent it admits nothing "
            "until the next day. Empty means no cap."
        ),
    )
    #: The UTC day ``spent_today`` counts (a later day starts from zero).
    spend_day = models.DateField(_("spend day"), null=True, blank=True, editable=False)
    spent_today = models.FloatField(
        _("slot-seconds spent"), default=0, db_default=0, editable=False
    )
    #: Rate limits on admissions (:mod:`pools.core.rates`), stored as ``"10/s,100000/d"``.
    rate = models.CharField(
        _("rate"),
        max_length=200,
        blank=True,
        default="",
        db_default="",
        validators=[validate_rate],
        help_text=_(
            "Starts allowed per sliding window across every worker: N/s, N/m, N/h or N/d, "
            "several separated by commas (10/s,100000/d). Empty means no rate limit."
        ),
    )
    #: End of a backoff (:mod:`pools.core.backoffs`): a timed pause asked by a task body
    #: (``raise pools.Backoff(seconds)``). Set only while ``paused`` is true; the first
    #: admission pass at or after it resumes the pool. Empty: no backoff.
    backoff_until = models.DateTimeField(
        _("backoff until"),
        null=True,
        blank=True,
        editable=False,
        help_text=_("A task backed off (e.g. HTTP 429): the pool admits nothing until then."),
    )
    #: Backoffs asked of this pool so far (the ``pools_backoffs_total`` metric).
    backoffs = models.PositiveBigIntegerField(
        _("backoffs"), default=0, db_default=0, editable=False
    )
    #: Removed from POOLS['DEFINITIONS'] while it still held or queued work: deleted once empty.
    retiring = models.BooleanField(_("retiring"), default=False, db_default=False, editable=False)
    #: Slots held by this pool's admitted and running entries: changed only under this
    #: row's lock, by admission (+) and settle / requeue (-); the sweep checks it against
    #: the holders (:func:`pools.core.sweeps.check_held`).
    held = models.PositiveIntegerField(
        _("held"),
        default=0,
        editable=False,
        help_text=_("Slots held by admitted and running entries (kept by admission)."),
    )
    #: Admissions made in this pool so far (under its row lock): the source of
    #: :attr:`QueueEntry.admission_seq`.
    admissions = models.PositiveBigIntegerField(_("admissions"), default=0, editable=False)
    #: Confirmed starts of rated entries in this pool so far (under its row lock): start
    #: number ``k`` writes its time into slot ``k mod N`` of each rate's ring of starts
    #: (:mod:`pools.core.starts`).
    starts = models.PositiveBigIntegerField(
        _("rated starts"), default=0, db_default=0, editable=False
    )
    #: When the first delayed entry (``not_before`` ahead) of this pool is due, or earlier:
    #: admission passes look for due entries only once it has passed (no query otherwise).
    next_due_at = models.DateTimeField(_("next due at"), null=True, blank=True, editable=False)
    defined_in_settings = models.BooleanField(
        _("defined in settings"),
        default=False,
        editable=False,
        help_text=_("Created or updated from POOLS['DEFINITIONS'] by 'pools sync'."),
    )
    #: The ``POOLS["TEMPLATES"]`` pattern a per-key pool was created from on first use
    #: (empty for other pools); such a pool is deleted when idle (``TEMPLATE_IDLE_SECONDS``).
    template = models.CharField(
        _("template"), max_length=100, blank=True, default="", db_default="", editable=False
    )
    created_at = models.DateTimeField(_("created"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated"), auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = _("resource pool")
        verbose_name_plural = _("resource pools")
        constraints = [
            models.CheckConstraint(condition=Q(slots__gte=1), name="pools_pool_slots_positive")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.slots} slots)"


class PoolOverride(models.Model):
    """Limit values set at runtime (REST API, admin) for one per-key pool, by pool name.

    Kept in its own row so that they outlive the pool: the sweep retires an idle per-key
    pool and the next use creates it again with these values (:mod:`pools.core.overrides`).
    ``values`` holds only the overridden fields (``slots``, ``rate``, ``max_queued``), as
    stored on the pool; a field left out takes the template's value.
    """

    pool = models.CharField(_("pool"), max_length=100, unique=True)
    #: The ``POOLS["TEMPLATES"]`` pattern of the pool (for the record).
    template = models.CharField(_("template"), max_length=100, blank=True, default="")
    values = models.JSONField(_("values"), default=dict, encoder=DjangoJSONEncoder)
    #: Who set them last (admin, REST API).
    actor = models.CharField(_("actor"), max_length=150, blank=True, default="")
    updated_at = models.DateTimeField(_("updated"), auto_now=True)

    class Meta:
        ordering = ["pool"]
        verbose_name = _("per-key override")
        verbose_name_plural = _("per-key overrides")

    def __str__(self) -> str:
        return f"{self.pool}: {self.values}"


class QueueEntry(models.Model):
    """One submission of one pooled task: its place in line and, once admitted, its claim."""

    queue_id = models.BigAutoField(primary_key=True)
    key = models.CharField(_("key"), max_length=255, help_text=_("Celery task id."))
    task_name = models.CharField(_("task"), max_length=255)
    args = models.JSONField(_("args"), default=list, encoder=DjangoJSONEncoder)
    kwargs = models.JSONField(_("kwargs"), default=dict, encoder=DjangoJSONEncoder)
    #: Celery publish options held until admission (queue, link, chord, headers, ...).
    options = models.JSONField(_("options"), default=dict, encoder=DjangoJSONEncoder)
    #: ``{pool name: slots}``; mirrored row by row in :class:`Demand`.
    demand = models.JSONField(_("demand"), default=dict)
    state = models.CharField(
        _("state"), max_length=12, choices=EntryState.choices, default=EntryState.WAITING
    )
    priority = models.IntegerField(_("priority"), default=0)
    enqueued_at = models.DateTimeField(_("enqueued at"))
    not_before = models.DateTimeField(_("not before"), null=True, blank=True)
    deadline = models.DateTimeField(_("deadline"), null=True, blank=True)
    #: Fencing token: bumped by every admission; deliveries and renewals must carry it.
    token = models.PositiveBigIntegerField(_("fencing token"), default=0)
    lease_expires_at = models.DateTimeField(_("lease expires at"), null=True, blank=True)
    worker = models.CharField(_("worker"), max_length=255, blank=True)
    origin = models.CharField(
        _("origin"), max_length=10, choices=Origin.choices, default=Origin.CODE
    )
    root_id = models.CharField(_("workflow root id"), max_length=255, blank=True)
    parent_id = models.CharField(_("parent id"), max_length=255, blank=True)
    attempt = models.PositiveIntegerField(_("attempt"), default=0, help_text=_("Celery retries."))
    reason = models.CharField(_("reason"), max_length=255, blank=True)
    admitted_at = models.DateTimeField(_("admitted at"), null=True, blank=True)
    #: The order of its (last) admission in its first pool by name: that pool's
    #: ``admissions`` count after it. ``admitted_at`` is the admitting call's clock, read
    #: before it waited for the lock, so it does not order admissions of concurrent calls.
    admission_seq = models.PositiveBigIntegerField(_("admission order"), null=True, blank=True)
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    # The fields below have database defaults (db_default): the fast-path functions insert
    # entries without naming them.
    #: Times its task body backed off (``raise pools.Backoff``); past ``MAX_BACKOFFS`` it fails.
    backoffs = models.PositiveIntegerField(_("backoffs"), default=0, db_default=0)
    #: "Same job" for concurrency policies: the periodic task's name for beat fires, else
    #: the task name plus its optional job key; empty when the entry has no job policy.
    job = models.CharField(_("job"), max_length=255, blank=True, default="", db_default="")
    concurrency_policy = models.CharField(
        _("concurrency policy"),
        max_length=8,
        choices=ConcurrencyPolicy.choices,
        default=ConcurrencyPolicy.ALLOW,
        db_default=ConcurrencyPolicy.ALLOW,
    )
    #: Set for a submit with an idempotency key while the entry is unfinished.
    #: NULL, not "", when there is none: a unique index then ignores it on every database.
    idempotency_key = models.CharField(  # noqa: DJ001
        _("idempotency key"), max_length=255, null=True, blank=True
    )
    #: Node affinity: the worker (Celery hostname) that alone may run this entry.
    pinned_worker = models.CharField(
        _("pinned worker"), max_length=255, blank=True, default="", db_default=""
    )
    #: Who the entry is fair to in pools with strategy ``fair`` (a tenant id, say).
    fairness_key = models.CharField(
        _("fairness key"), max_length=255, blank=True, default="", db_default=""
    )
    #: A debounced entry's key (docs/howto/debounce.md): a later call with this key while
    #: the entry waits collapses into it. NULL when the entry is not debounced.
    debounce_key = models.CharField(  # noqa: DJ001
        _("debounce key"), max_length=255, null=True, blank=True
    )
    #: ``idempotency_key`` while the entry is waiting, admitted or running, else NULL: a
    #: stored generated column with a plain unique index (NULLs never collide), so the
    #: database itself refuses a second unfinished entry with the same key, on PostgreSQL,
    #: SQLite and MariaDB alike (MariaDB has no partial indexes). Computed by the database
    #: on every insert and update: no code path has to remember to clear it.
    idempotency_active = models.GeneratedField(
        expression=Case(
            When(state__in=UNFINISHED_STATES, then=F("idempotency_key")),
            default=Value(None),
            output_field=models.CharField(max_length=255, null=True),
        ),
        output_field=models.CharField(max_length=255, null=True),
        db_persist=True,
        verbose_name=_("active idempotency key"),
    )

    objects = QueueEntryQuerySet.as_manager()

    class Meta:
        verbose_name = _("queue entry")
        verbose_name_plural = _("queue entries")
        permissions = [
            ("cancel_queueentry", _("Can cancel queue entries")),
            ("start_job", _("Can start a periodic task now (manual start)")),
        ]
        # Every state change of an entry is a new row version with an entry in each index
        # whose condition it meets: partial indexes keep that (and the WAL) small. No index
        # names ``state``, so a change that moves no indexed column (start, which keeps a
        # lease that has most of its time left) is a HOT update with no index entry at all;
        # the table keeps free space on each page for those (fillfactor 80, set by the initial migration).
        # Each index serves range queries on its column that imply its condition.
        indexes = [
            models.Index(fields=["key"], name="pools_entry_key"),  # no LIKE twin: = only
            # A lease is set exactly while the entry holds its slots (lapsed-lease sweep).
            models.Index(
                fields=["lease_expires_at"],
                name="pools_entry_lease",
                condition=models.Q(lease_expires_at__isnull=False),
            ),
            # Unfinished entries with a deadline (expiry sweep).
            models.Index(
                fields=["deadline"],
                name="pools_entry_deadline",
                condition=models.Q(deadline__isnull=False, finished_at__isnull=True),
            ),
            # Finished entries (retention, history).
            models.Index(
                fields=["finished_at"],
                name="pools_entry_finished",
                condition=models.Q(finished_at__isnull=False),
            ),
            models.Index(
                fields=["root_id"], name="pools_entry_root", condition=models.Q(root_id__gt="")
            ),
            # Unfinished entries of a job (concurrency policies, superseded retries,
            # periodic task changes): entries without a job are not in it.
            models.Index(
                fields=["job"],
                name="pools_entry_job",
                condition=models.Q(job__gt="", finished_at__isnull=True),
            ),
            # Waiting debounced entries by key (a debounced call looks for the one to join).
            models.Index(
                fields=["debounce_key"],
                name="pools_entry_debounce",
                condition=models.Q(debounce_key__isnull=False, finished_at__isnull=True),
            ),
        ]
        constraints = [
            # One unfinished entry per idempotency key (see ``idempotency_active``).
            models.UniqueConstraint(
                fields=["idempotency_active"], name="pools_entry_idempotency_active"
            ),
        ]

    def __str__(self) -> str:
        return f"#{self.queue_id} {self.task_name} [{self.state}]"

    @property
    def is_terminal(self) -> bool:
        """True once the entry can no longer change state."""
        return self.state in TERMINAL_STATES


class Demand(models.Model):
    """One pool named by one entry, with its place in that pool's line.

    The head of a pool is the first row of ``(pool, state='waiting')`` in
    ``(line_round, line_at, entry)`` order: one index range scan, whatever the queue length.
    The two columns are set when the row joins the line, by the pool's strategy
    (:mod:`pools.core.strategies`): ``(-priority, enqueued_at)`` for ``priority``.
    A row whose entry is not due yet (``not_before`` ahead) is ``delayed`` with its due
    time as ``enqueued_at``: out of line until an admission pass finds it due.
    Held slots of a pool are the sum of ``slots`` over its rows in held states.
    """

    # Both foreign keys are served by the indexes below (their leading columns).
    entry = models.ForeignKey(
        QueueEntry, on_delete=models.CASCADE, related_name="demands", db_index=False
    )
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="demands", db_index=False)
    slots = models.PositiveIntegerField()
    state = models.CharField(max_length=12, choices=DEMAND_STATES, default=EntryState.WAITING)
    priority = models.IntegerField(default=0)
    #: When the entry joined the line: its enqueue time, or its due time (``not_before``).
    enqueued_at = models.DateTimeField()
    #: The place in line, first column: ``-priority`` (strategy ``priority``), the round
    #: (``fair``), minus the enqueue time in microseconds (``lifo``), else 0.
    line_round = models.BigIntegerField(default=0, db_default=0)
    #: The place in line, second column: ``enqueued_at``, moved ``priority * aging_seconds``
    #: earlier under aging. Filled from ``priority`` / ``enqueued_at`` when left unset.
    line_at = models.DateTimeField()
    #: The entry's fairness key in a pool with strategy ``fair`` (NULL in other pools).
    fairness_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001

    objects = DemandQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["entry", "pool"], name="pools_demand_unique")
        ]
        indexes = [
            models.Index(
                fields=["pool", "state", "line_round", "line_at", "entry"],
                name="pools_demand_line",
            ),
            # Strategy ``fair``: a key's latest round in a pool (its next entry's round).
            models.Index(
                fields=["pool", "fairness_key", "line_round"],
                name="pools_demand_fair_key",
                condition=models.Q(fairness_key__isnull=False, state__in=FAIR_STATES),
            ),
            # Delayed rows by due time: the next one to join the line, per pool.
            models.Index(
                fields=["pool", "enqueued_at"],
                name="pools_demand_delayed",
                condition=models.Q(state=DELAYED),
            ),
        ]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        # Rows made without a strategy's place (tests, bulk loads) get the priority order.
        # Read from __dict__: a deferred field of a loaded row is absent (no query here).
        values = self.__dict__
        if "line_at" in values and values["line_at"] is None and values.get("enqueued_at"):
            self.line_at = values["enqueued_at"]
            if "line_round" not in kwargs and "priority" in values:
                self.line_round = -int(values["priority"] or 0)

    def __str__(self) -> str:
        return f"{self.slots} of {self.pool_id} for entry {self.entry_id}"


class RateMark(models.Model):
    """One slot of a pool's ring of admission times, or of start times, for one of its rates.

    Admission number ``k`` of the pool writes its (database clock) time into slot
    ``k mod N`` of each rate ``N/W`` (``rate_index`` ``i``); written and read only under the
    pool's row lock by :mod:`pools.core.windows` (see :mod:`pools.core.rates`). Rated start
    number ``k`` (:attr:`Pool.starts`) writes its time into slot ``k mod N`` of the ring of
    starts, ``rate_index`` ``START_INDEX + i`` (:mod:`pools.core.starts`).
    """

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="rate_marks")
    #: The rate's place in ``Pool.rate`` (0-based); plus ``rates.START_INDEX`` for its
    #: ring of starts.
    rate_index = models.PositiveSmallIntegerField()
    #: ``admission number mod N``.
    slot = models.PositiveIntegerField()
    #: When that admission happened, by the database's clock.
    at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["pool", "rate_index", "slot"], name="pools_ratemark_slot"
            )
        ]

    def __str__(self) -> str:
        return f"{self.pool_id}#{self.rate_index}[{self.slot}] {self.at.isoformat()}"


class OwedWork(models.Model):
    """Work a call left to the holder of its pool's row lock (PostgreSQL): a release of
    ``slots``, or with 0 slots an admission pass, while ``pending``.

    A settle or an enqueue that finds the pool locked does not wait: it ends its entry, or
    puts it in line, and leaves the rest here (``pools_owe`` in ``pools/pg/sql/schema.sql``);
    the next call that holds the lock takes it (subtracts the slots from :attr:`Pool.held`
    and admits for everyone: ``pools_admit``, :func:`pools.core.held.apply_owed`), and every
    holder looks for such work again after it commits
    (docs/concepts/admission.md#contention). Each pool has at most 16 rows (``slot``), which
    calls update in place and take without waiting for each other (``SKIP LOCKED``): no
    row is inserted or deleted per call. No foreign-key constraint: a write must not take a
    key-share lock on the pool's row while another call holds it.
    """

    pool = models.ForeignKey(
        Pool, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+"
    )
    slot = models.PositiveSmallIntegerField()
    slots = models.PositiveIntegerField(default=0)
    pending = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["pool", "slot"], name="pools_owedwork_pool_slot"),
        ]

    def __str__(self) -> str:
        return f"{self.pool_id}/{self.slot}: {self.slots} owed" if self.pending else "nothing owed"


class PoolEvent(models.Model):
    """Append-only log of lifecycle events (the order of ``id`` is the order they happened)."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField(_("at"), db_index=True)
    kind = models.CharField(_("kind"), max_length=12, choices=EventKind.choices)
    pool = models.CharField(_("pool"), max_length=100, blank=True)
    entry_id = models.BigIntegerField(_("entry"), null=True, blank=True)
    key = models.CharField(_("key"), max_length=255, blank=True)
    token = models.PositiveBigIntegerField(_("token"), null=True, blank=True)
    detail = models.JSONField(_("detail"), default=dict, encoder=DjangoJSONEncoder)
    #: Who made the change, for changes made in the admin or the REST API (the username);
    #: empty for the engine's own transitions, settings sync and code.
    actor = models.CharField(_("actor"), max_length=150, blank=True, default="", db_default="")

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["pool"], name="pools_event_pool"),  # no LIKE twin
            # The events API and the admin list filter by entry key or actor, newest first:
            # partial, since most rows (the engine's own, settings sync) have neither.
            models.Index(fields=["key", "-id"], name="pools_event_key", condition=Q(key__gt="")),
            models.Index(
                fields=["actor", "-id"], name="pools_event_actor", condition=Q(actor__gt="")
            ),
        ]
        verbose_name = _("pool event")
        verbose_name_plural = _("pool events")

    def __str__(self) -> str:
        return f"{self.at:%H:%M:%S} {self.kind} {self.pool} #{self.entry_id}"


class WorkerNode(models.Model):
    """A worker (Celery hostname) and when it was last seen alive."""

    hostname = models.CharField(_("hostname"), max_length=255, unique=True)
    pid = models.PositiveIntegerField(_("pid"), null=True, blank=True)
    started_at = models.DateTimeField(_("started at"))
    last_seen = models.DateTimeField(_("last seen"), db_index=True)

    class Meta:
        ordering = ["hostname"]
        verbose_name = _("worker node")
        verbose_name_plural = _("worker nodes")

    def __str__(self) -> str:
        return self.hostname


class RunBudget(models.Model):
    """The budget of one run (a workflow: every entry sharing a ``root_id``) and its spend.

    Changed only by :mod:`pools.core.budgets`, under this row's lock (``SELECT ... FOR
    UPDATE``), which every enqueue of the run takes before its pool locks: once a charge
    has marked the run exhausted, no entry of the run waits or joins a line.
    """

    #: The run's id: the ``root_id`` Celery gives every task of the workflow.
    root_id = models.CharField(_("run (root id)"), max_length=255, unique=True)
    max_seconds = models.FloatField(_("task seconds budget"), null=True, blank=True)
    max_cost = models.FloatField(_("cost budget"), null=True, blank=True)
    max_tokens = models.PositiveBigIntegerField(_("tokens budget"), null=True, blank=True)
    seconds = models.FloatField(_("task seconds spent"), default=0)
    cost = models.FloatField(_("cost spent"), default=0)
    tokens = models.PositiveBigIntegerField(_("tokens spent"), default=0)
    #: The budget that stopped the run (``seconds``, ``cost`` or ``tokens``); empty while open.
    exhausted_by = models.CharField(_("stopped by"), max_length=8, blank=True, default="")
    exhausted_at = models.DateTimeField(_("stopped at"), null=True, blank=True)
    created_at = models.DateTimeField(_("created"))

    class Meta:
        verbose_name = _("run budget")
        verbose_name_plural = _("run budgets")

    def __str__(self) -> str:
        state = f"stopped by {self.exhausted_by}" if self.exhausted_by else "open"
        return f"run {self.root_id} ({state})"


class Charge(models.Model):
    """What one attempt of one entry spent: one row per (entry, fencing token).

    ``cost`` and ``tokens`` add up the attempt's ``pools.charge()`` calls; ``seconds`` is
    the attempt's task time, set once when the worker settles it.
    """

    run = models.ForeignKey(RunBudget, on_delete=models.CASCADE, related_name="charges")
    entry_id = models.BigIntegerField(_("entry"))
    token = models.PositiveBigIntegerField(_("fencing token"))
    key = models.CharField(_("key"), max_length=255, blank=True)
    task_name = models.CharField(_("task"), max_length=255, blank=True)
    seconds = models.FloatField(_("task seconds"), default=0)
    cost = models.FloatField(_("cost"), default=0)
    tokens = models.PositiveBigIntegerField(_("tokens"), default=0)
    at = models.DateTimeField(_("last charged at"))

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["entry_id", "token"], name="pools_charge_attempt")
        ]
        verbose_name = _("charge")
        verbose_name_plural = _("charges")

    def __str__(self) -> str:
        return f"#{self.entry_id}:{self.token} {self.seconds:g}s {self.cost:g} {self.tokens}t"
