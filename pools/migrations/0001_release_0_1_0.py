"""The schema of django-celery-pools 0.1.0: tables, indexes and, on PostgreSQL, the stored
functions of the fast path.

One migration for the first release. It replaces the migrations the project had before
0.1.0 (``replaces``): a database that applied all of them is treated as having applied
this one, and gets nothing more. So it builds exactly what they built: the columns of
each table are listed in the order those migrations added them, and on PostgreSQL it sets
``fillfactor`` 80 on the entry table (room on each page for a start's HOT update: "HOT
starts" in docs/benchmarks.md) and runs ``pools/pg/sql/<BASELINE>``, the stored functions
as of 0.1.0 (tests/integration/test_schema_catalog.py and test_schema_sqlite.py compare
the two), frozen as ``baseline-0.1.0.sql`` when the SQL first changed after 0.1.0
(docs/howto/sql-changes.md).
"""

import re

import django.core.serializers.json
import django.core.validators
import django.db.models.deletion
from django.db import migrations, models

import pools.core.rates
from pools.pg import sqlfile

#: The file of ``pools/pg/sql/`` this migration runs on PostgreSQL (pinned by checksum in
#: tests/unit/test_sql_versions.py).
BASELINE = "baseline-0.1.0.sql"


class Migration(migrations.Migration):
    initial = True

    replaces = [
        ("pools", "0001_initial"),
        ("pools", "0002_sql_fast_path"),
        ("pools", "0003_slimmer_indexes"),
        ("pools", "0004_delayed_entries_out_of_line"),
        ("pools", "0005_entry_permissions"),
        ("pools", "0006_sql_functions_v3"),
        ("pools", "0007_lean_hot_path"),
        ("pools", "0008_entry_indexes_without_state"),
        ("pools", "0009_admission_order"),
        ("pools", "0010_policies_schema"),
        ("pools", "0011_admission_policies"),
        ("pools", "0012_idempotency"),
        ("pools", "0013_audit_actor_and_template_pools"),
        ("pools", "0014_pool_strategies"),
        ("pools", "0015_budgets"),
        ("pools", "0016_spend_cap"),
        ("pools", "0017_pool_rates"),
        ("pools", "0018_fastpath_rates"),
    ]

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="PoolEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("at", models.DateTimeField(db_index=True, verbose_name="at")),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("enqueued", "enqueued"),
                            ("admitted", "admitted"),
                            ("started", "started"),
                            ("settled", "settled"),
                            ("requeued", "requeued"),
                            ("expired", "expired"),
                            ("cancelled", "cancelled"),
                            ("rejected", "rejected"),
                            ("dropped", "dropped"),
                            ("superseded", "superseded"),
                            ("skipped", "skipped delivery"),
                            ("capacity", "capacity changed"),
                            ("pool_created", "pool created"),
                            ("pool_deleted", "pool deleted"),
                            ("terminate", "termination requested"),
                        ],
                        max_length=12,
                        verbose_name="kind",
                    ),
                ),
                ("pool", models.CharField(blank=True, max_length=100, verbose_name="pool")),
                ("entry_id", models.BigIntegerField(blank=True, null=True, verbose_name="entry")),
                ("key", models.CharField(blank=True, max_length=255, verbose_name="key")),
                (
                    "token",
                    models.PositiveBigIntegerField(blank=True, null=True, verbose_name="token"),
                ),
                (
                    "detail",
                    models.JSONField(
                        default=dict,
                        encoder=django.core.serializers.json.DjangoJSONEncoder,
                        verbose_name="detail",
                    ),
                ),
                (
                    "actor",
                    models.CharField(
                        blank=True, db_default="", default="", max_length=150, verbose_name="actor"
                    ),
                ),
            ],
            options={
                "verbose_name": "pool event",
                "verbose_name_plural": "pool events",
                "ordering": ["id"],
                "indexes": [models.Index(fields=["pool"], name="pools_event_pool")],
            },
        ),
        migrations.CreateModel(
            name="WorkerNode",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "hostname",
                    models.CharField(max_length=255, unique=True, verbose_name="hostname"),
                ),
                ("pid", models.PositiveIntegerField(blank=True, null=True, verbose_name="pid")),
                ("started_at", models.DateTimeField(verbose_name="started at")),
                ("last_seen", models.DateTimeField(db_index=True, verbose_name="last seen")),
            ],
            options={
                "verbose_name": "worker node",
                "verbose_name_plural": "worker nodes",
                "ordering": ["hostname"],
            },
        ),
        migrations.CreateModel(
            name="Pool",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "name",
                    models.CharField(
                        help_text="Unique name tasks use in @pooled(...).",
                        max_length=100,
                        unique=True,
                        validators=[
                            django.core.validators.RegexValidator(
                                re.compile("^[A-Za-z0-9][A-Za-z0-9_.:\\-]{0,99}$"),
                                "Use letters, digits and '_ . : -'.",
                            )
                        ],
                        verbose_name="name",
                    ),
                ),
                (
                    "slots",
                    models.PositiveIntegerField(
                        help_text="Capacity of the pool.",
                        validators=[django.core.validators.MinValueValidator(1)],
                        verbose_name="slots",
                    ),
                ),
                (
                    "max_queued",
                    models.PositiveIntegerField(
                        blank=True,
                        help_text="Backlog limit: waiting entries allowed; empty means unlimited.",
                        null=True,
                        verbose_name="max queued",
                    ),
                ),
                (
                    "paused",
                    models.BooleanField(
                        default=False,
                        help_text="A paused pool admits nothing; entries keep their place.",
                        verbose_name="paused",
                    ),
                ),
                ("description", models.TextField(blank=True, verbose_name="description")),
                (
                    "defined_in_settings",
                    models.BooleanField(
                        default=False,
                        editable=False,
                        help_text="Created or updated from POOLS['DEFINITIONS'] by 'pools sync'.",
                        verbose_name="defined in settings",
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True, verbose_name="created")),
                ("updated_at", models.DateTimeField(auto_now=True, verbose_name="updated")),
                (
                    "next_due_at",
                    models.DateTimeField(
                        blank=True, editable=False, null=True, verbose_name="next due at"
                    ),
                ),
                (
                    "held",
                    models.PositiveIntegerField(
                        default=0,
                        editable=False,
                        help_text="Slots held by admitted and running entries (kept by admission).",
                        verbose_name="held",
                    ),
                ),
                (
                    "admissions",
                    models.PositiveBigIntegerField(
                        default=0, editable=False, verbose_name="admissions"
                    ),
                ),
                (
                    "overflow",
                    models.CharField(
                        choices=[
                            ("reject", "reject the new entry"),
                            ("drop_oldest", "drop the oldest waiting entry"),
                            ("drop_newest", "drop the newest waiting entry"),
                        ],
                        db_default="reject",
                        default="reject",
                        help_text="What a submit does when the backlog is at max_queued.",
                        max_length=12,
                        verbose_name="overflow policy",
                    ),
                ),
                (
                    "paused_policy",
                    models.CharField(
                        choices=[("queue", "queue it"), ("reject", "reject it")],
                        db_default="queue",
                        default="queue",
                        help_text="What a submit does while the pool is paused.",
                        max_length=8,
                        verbose_name="paused policy",
                    ),
                ),
                (
                    "pending_slots",
                    models.PositiveIntegerField(
                        blank=True,
                        editable=False,
                        help_text="New capacity, in effect once the entries queued before the change drain.",
                        null=True,
                        verbose_name="pending slots",
                    ),
                ),
                (
                    "retiring",
                    models.BooleanField(
                        db_default=False, default=False, editable=False, verbose_name="retiring"
                    ),
                ),
                (
                    "template",
                    models.CharField(
                        blank=True,
                        db_default="",
                        default="",
                        editable=False,
                        max_length=100,
                        verbose_name="template",
                    ),
                ),
                (
                    "strategy",
                    models.CharField(
                        choices=[
                            ("priority", "priority, then first come first served"),
                            ("fifo", "first come first served"),
                            ("lifo", "last come first served"),
                            ("fair", "round robin across fairness keys"),
                        ],
                        db_default="priority",
                        default="priority",
                        help_text="The order in which waiting entries are admitted.",
                        max_length=8,
                        verbose_name="strategy",
                    ),
                ),
                (
                    "aging_seconds",
                    models.PositiveIntegerField(
                        blank=True,
                        help_text="Strategy 'priority' only: a waiting entry gains one priority level per this many seconds waited. Empty means no aging.",
                        null=True,
                        validators=[django.core.validators.MinValueValidator(1)],
                        verbose_name="aging seconds",
                    ),
                ),
                (
                    "fair_round",
                    models.BigIntegerField(
                        db_default=0, default=0, editable=False, verbose_name="fair round"
                    ),
                ),
                (
                    "spend_cap",
                    models.FloatField(
                        blank=True,
                        help_text="Slot-seconds this pool may spend per UTC day; once spent it admits nothing until the next day. Empty means no cap.",
                        null=True,
                        validators=[django.core.validators.MinValueValidator(0)],
                        verbose_name="daily spend cap",
                    ),
                ),
                (
                    "spend_day",
                    models.DateField(
                        blank=True, editable=False, null=True, verbose_name="spend day"
                    ),
                ),
                (
                    "spent_today",
                    models.FloatField(
                        db_default=0, default=0, editable=False, verbose_name="slot-seconds spent"
                    ),
                ),
                (
                    "rate",
                    models.CharField(
                        blank=True,
                        db_default="",
                        default="",
                        help_text="Starts allowed per sliding window across every worker: N/s, N/m, N/h or N/d, several separated by commas (10/s,100000/d). Empty means no rate limit.",
                        max_length=200,
                        validators=[pools.core.rates.validate_field],
                        verbose_name="rate",
                    ),
                ),
            ],
            options={
                "verbose_name": "resource pool",
                "verbose_name_plural": "resource pools",
                "ordering": ["name"],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("slots__gte", 1)), name="pools_pool_slots_positive"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="QueueEntry",
            fields=[
                ("queue_id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "key",
                    models.CharField(
                        help_text="Celery task id.", max_length=255, verbose_name="key"
                    ),
                ),
                ("task_name", models.CharField(max_length=255, verbose_name="task")),
                (
                    "args",
                    models.JSONField(
                        default=list,
                        encoder=django.core.serializers.json.DjangoJSONEncoder,
                        verbose_name="args",
                    ),
                ),
                (
                    "kwargs",
                    models.JSONField(
                        default=dict,
                        encoder=django.core.serializers.json.DjangoJSONEncoder,
                        verbose_name="kwargs",
                    ),
                ),
                (
                    "options",
                    models.JSONField(
                        default=dict,
                        encoder=django.core.serializers.json.DjangoJSONEncoder,
                        verbose_name="options",
                    ),
                ),
                ("demand", models.JSONField(default=dict, verbose_name="demand")),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("waiting", "waiting"),
                            ("admitted", "admitted"),
                            ("running", "running"),
                            ("succeeded", "succeeded"),
                            ("failed", "failed"),
                            ("cancelled", "cancelled"),
                            ("expired", "expired"),
                            ("rejected", "rejected"),
                            ("superseded", "superseded"),
                            ("retried", "retried"),
                        ],
                        default="waiting",
                        max_length=12,
                        verbose_name="state",
                    ),
                ),
                ("priority", models.IntegerField(default=0, verbose_name="priority")),
                ("enqueued_at", models.DateTimeField(verbose_name="enqueued at")),
                (
                    "not_before",
                    models.DateTimeField(blank=True, null=True, verbose_name="not before"),
                ),
                ("deadline", models.DateTimeField(blank=True, null=True, verbose_name="deadline")),
                ("token", models.PositiveBigIntegerField(default=0, verbose_name="fencing token")),
                (
                    "lease_expires_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="lease expires at"),
                ),
                ("worker", models.CharField(blank=True, max_length=255, verbose_name="worker")),
                (
                    "origin",
                    models.CharField(
                        choices=[
                            ("code", "code"),
                            ("beat", "beat fire"),
                            ("manual", "manual start"),
                            ("api", "REST API"),
                            ("ungated", "message without a claim"),
                        ],
                        default="code",
                        max_length=10,
                        verbose_name="origin",
                    ),
                ),
                (
                    "root_id",
                    models.CharField(blank=True, max_length=255, verbose_name="workflow root id"),
                ),
                (
                    "parent_id",
                    models.CharField(blank=True, max_length=255, verbose_name="parent id"),
                ),
                (
                    "attempt",
                    models.PositiveIntegerField(
                        default=0, help_text="Celery retries.", verbose_name="attempt"
                    ),
                ),
                ("reason", models.CharField(blank=True, max_length=255, verbose_name="reason")),
                (
                    "admitted_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="admitted at"),
                ),
                (
                    "started_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="started at"),
                ),
                (
                    "finished_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="finished at"),
                ),
                (
                    "admission_seq",
                    models.PositiveBigIntegerField(
                        blank=True, null=True, verbose_name="admission order"
                    ),
                ),
                (
                    "concurrency_policy",
                    models.CharField(
                        choices=[
                            ("allow", "allow"),
                            ("forbid", "forbid"),
                            ("replace", "replace"),
                            ("skip", "skip"),
                        ],
                        db_default="allow",
                        default="allow",
                        max_length=8,
                        verbose_name="concurrency policy",
                    ),
                ),
                (
                    "idempotency_key",
                    models.CharField(
                        blank=True, max_length=255, null=True, verbose_name="idempotency key"
                    ),
                ),
                (
                    "job",
                    models.CharField(
                        blank=True, db_default="", default="", max_length=255, verbose_name="job"
                    ),
                ),
                (
                    "pinned_worker",
                    models.CharField(
                        blank=True,
                        db_default="",
                        default="",
                        max_length=255,
                        verbose_name="pinned worker",
                    ),
                ),
                (
                    "idempotency_active",
                    models.GeneratedField(
                        db_persist=True,
                        expression=models.Case(
                            models.When(
                                state__in=("waiting", "admitted", "running"),
                                then=models.F("idempotency_key"),
                            ),
                            default=models.Value(None),
                            output_field=models.CharField(max_length=255, null=True),
                        ),
                        output_field=models.CharField(max_length=255, null=True),
                        verbose_name="active idempotency key",
                    ),
                ),
                (
                    "fairness_key",
                    models.CharField(
                        blank=True,
                        db_default="",
                        default="",
                        max_length=255,
                        verbose_name="fairness key",
                    ),
                ),
            ],
            options={
                "verbose_name": "queue entry",
                "verbose_name_plural": "queue entries",
                "permissions": [
                    ("cancel_queueentry", "Can cancel queue entries"),
                    ("start_job", "Can start a periodic task now (manual start)"),
                ],
                "indexes": [
                    models.Index(fields=["key"], name="pools_entry_key"),
                    models.Index(
                        condition=models.Q(("lease_expires_at__isnull", False)),
                        fields=["lease_expires_at"],
                        name="pools_entry_lease",
                    ),
                    models.Index(
                        condition=models.Q(
                            ("deadline__isnull", False), ("finished_at__isnull", True)
                        ),
                        fields=["deadline"],
                        name="pools_entry_deadline",
                    ),
                    models.Index(
                        condition=models.Q(("finished_at__isnull", False)),
                        fields=["finished_at"],
                        name="pools_entry_finished",
                    ),
                    models.Index(
                        condition=models.Q(("root_id__gt", "")),
                        fields=["root_id"],
                        name="pools_entry_root",
                    ),
                    models.Index(
                        condition=models.Q(("finished_at__isnull", True), ("job__gt", "")),
                        fields=["job"],
                        name="pools_entry_job",
                    ),
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("idempotency_active",), name="pools_entry_idempotency_active"
                    )
                ],
            },
        ),
        sqlfile.set_fillfactor("pools_queueentry", 80),
        migrations.CreateModel(
            name="Demand",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("slots", models.PositiveIntegerField()),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("waiting", "waiting"),
                            ("admitted", "admitted"),
                            ("running", "running"),
                            ("succeeded", "succeeded"),
                            ("failed", "failed"),
                            ("cancelled", "cancelled"),
                            ("expired", "expired"),
                            ("rejected", "rejected"),
                            ("superseded", "superseded"),
                            ("retried", "retried"),
                            ("delayed", "delayed (not yet due)"),
                        ],
                        default="waiting",
                        max_length=12,
                    ),
                ),
                ("priority", models.IntegerField(default=0)),
                ("enqueued_at", models.DateTimeField()),
                (
                    "pool",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="demands",
                        to="pools.pool",
                    ),
                ),
                (
                    "entry",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="demands",
                        to="pools.queueentry",
                    ),
                ),
                ("fairness_key", models.CharField(blank=True, max_length=255, null=True)),
                ("line_round", models.BigIntegerField(db_default=0, default=0)),
                ("line_at", models.DateTimeField()),
            ],
            options={
                "indexes": [
                    models.Index(
                        fields=["pool", "state", "line_round", "line_at", "entry"],
                        name="pools_demand_line",
                    ),
                    models.Index(
                        condition=models.Q(
                            ("fairness_key__isnull", False),
                            (
                                "state__in",
                                (
                                    "waiting",
                                    "admitted",
                                    "running",
                                    "succeeded",
                                    "failed",
                                    "retried",
                                ),
                            ),
                        ),
                        fields=["pool", "fairness_key", "line_round"],
                        name="pools_demand_fair_key",
                    ),
                    models.Index(
                        condition=models.Q(("state", "delayed")),
                        fields=["pool", "enqueued_at"],
                        name="pools_demand_delayed",
                    ),
                ],
                "constraints": [
                    models.UniqueConstraint(fields=("entry", "pool"), name="pools_demand_unique")
                ],
            },
        ),
        migrations.CreateModel(
            name="RunBudget",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "root_id",
                    models.CharField(max_length=255, unique=True, verbose_name="run (root id)"),
                ),
                (
                    "max_seconds",
                    models.FloatField(blank=True, null=True, verbose_name="task seconds budget"),
                ),
                ("max_cost", models.FloatField(blank=True, null=True, verbose_name="cost budget")),
                (
                    "max_tokens",
                    models.PositiveBigIntegerField(
                        blank=True, null=True, verbose_name="tokens budget"
                    ),
                ),
                ("seconds", models.FloatField(default=0, verbose_name="task seconds spent")),
                ("cost", models.FloatField(default=0, verbose_name="cost spent")),
                ("tokens", models.PositiveBigIntegerField(default=0, verbose_name="tokens spent")),
                (
                    "exhausted_by",
                    models.CharField(
                        blank=True, default="", max_length=8, verbose_name="stopped by"
                    ),
                ),
                (
                    "exhausted_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="stopped at"),
                ),
                ("created_at", models.DateTimeField(verbose_name="created")),
            ],
            options={
                "verbose_name": "run budget",
                "verbose_name_plural": "run budgets",
            },
        ),
        migrations.CreateModel(
            name="Charge",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("entry_id", models.BigIntegerField(verbose_name="entry")),
                ("token", models.PositiveBigIntegerField(verbose_name="fencing token")),
                ("key", models.CharField(blank=True, max_length=255, verbose_name="key")),
                ("task_name", models.CharField(blank=True, max_length=255, verbose_name="task")),
                ("seconds", models.FloatField(default=0, verbose_name="task seconds")),
                ("cost", models.FloatField(default=0, verbose_name="cost")),
                ("tokens", models.PositiveBigIntegerField(default=0, verbose_name="tokens")),
                ("at", models.DateTimeField(verbose_name="last charged at")),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="charges",
                        to="pools.runbudget",
                    ),
                ),
            ],
            options={
                "verbose_name": "charge",
                "verbose_name_plural": "charges",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("entry_id", "token"), name="pools_charge_attempt"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="RateMark",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("rate_index", models.PositiveSmallIntegerField()),
                ("slot", models.PositiveIntegerField()),
                ("at", models.DateTimeField()),
                (
                    "pool",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="rate_marks",
                        to="pools.pool",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("pool", "rate_index", "slot"), name="pools_ratemark_slot"
                    )
                ],
            },
        ),
        sqlfile.run(BASELINE),
    ]
