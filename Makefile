# django-celery-pools — developer entry points. `make demo` and `make test` do all the set-up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-8)

.PHONY: install demo screenshots dist test test-quick test-rates test-lowest test-sqlite test-postgres test-quickstart test-upgrade test-mariadb test-rabbitmq test-chaos test-browser test-peer peer-full browsers mysql-client pgbouncer test-pgbouncer lint docs services clean

$(STAMP): pyproject.toml | mysql-client
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,lint,docs,release,demo,browser,peer,mysql]" \
		--group bench
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python example_project/run_demo.py

services:
	@bash scripts/services.sh

lint: install
	$(BIN)/ruff check pools pools_admin tests example_project
	$(BIN)/ruff format --check pools pools_admin
	$(BIN)/mypy pools pools_admin tests
	PYTHONPATH=. DJANGO_SETTINGS_MODULE=tests.settings $(BIN)/django-admin makemigrations --check --dry-run pools

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir .site

# The release archives (docs/howto/releasing.md): the sdist, the wheel built from it, both
# from the files git would commit (not what earlier builds left in the tree), then twine's
# check and the content test on those very files in dist/.
dist: install
	rm -rf dist
	$(BIN)/python -m tests.support.distribution dist
	$(BIN)/twine check --strict dist/*
	POOLS_DIST_DIR=dist POOLS_TEST_DB=sqlite $(BIN)/pytest -q -p no:cacheprovider \
		tests/unit/test_wheel.py

# The inner loop: lint, then the unit tests and the SQLite integration tests, stopping at the
# first failure (no servers, no workers; ~5 min). `make test` is the whole suite.
test-quick: install lint
	POOLS_TEST_DB=sqlite $(BIN)/pytest -q -x -m "not postgres" tests/unit tests/integration

test-sqlite: install
	POOLS_TEST_DB=sqlite $(BIN)/pytest -q -m "not postgres" tests/unit tests/integration \
		tests/acceptance/test_demo.py

# Real PostgreSQL + real Celery prefork workers on Redis (db 14/15 keep clear of other data).
test-postgres: install services
	POOLS_TEST_DB=postgres CELERY_BROKER_URL=redis://127.0.0.1:6379/14 \
	CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/15 \
	$(BIN)/pytest -q tests/integration tests/acceptance --ignore tests/acceptance/test_demo.py \
		--ignore tests/acceptance/test_rates_workers.py

# Rate limits with real workers, checked exactly on the bodies' own start times: a start
# is confirmed 100 ms ahead of its window's end for the hand-off to the body's first line,
# which a pool process kept off the CPU longer than that can outlast (docs/howto/
# rate-limits.md). `make test` runs it after the parallel streams, with chaos (~2 min).
test-rates: install services
	POOLS_TEST_DB=postgres CELERY_BROKER_URL=redis://127.0.0.1:6379/14 \
	CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/15 \
	$(BIN)/pytest -q -s tests/acceptance/test_rates_workers.py

# docs/quickstart.md and the README's install block as a new user meets them (tests/tutorial):
# the wheel (built as make dist builds it) in a fresh venv with the extras the page names, a
# new project from startproject, the page's marked blocks in order (settings, check, migrate,
# pools list, two real workers and beat, its Python session compared with what the page
# shows), once on PostgreSQL (database $(QUICKSTART_PG), created and dropped) and once on
# SQLite; Redis db $(QUICKSTART_REDIS). ~2.5 min.
QUICKSTART_PG ?= t33_quickstart
QUICKSTART_REDIS ?= 1
test-quickstart: install services
	POOLS_QUICKSTART_PG_NAME=$(QUICKSTART_PG) POOLS_QUICKSTART_REDIS_DB=$(QUICKSTART_REDIS) \
	$(BIN)/pytest -q -p no:cacheprovider tests/tutorial

# The lowest versions pyproject.toml declares (kept equal to its floors by
# tests/unit/test_lowest_versions.py), in a venv of their own; .venv has the newest.
LOWEST := .venv-lowest
LOWEST_PINS := celery[redis]==5.5.0 django==5.2.0 djangorestframework==3.15.0 \
	django-celery-beat==2.8.0
LOWEST_STAMP := $(LOWEST)/.installed-$(shell cat pyproject.toml Makefile | md5sum | cut -c1-8)

$(LOWEST_STAMP): pyproject.toml Makefile
	test -x $(LOWEST)/bin/python || $(PY) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -q --upgrade pip
	$(LOWEST)/bin/python -m pip install -q -e ".[test]" $(foreach p,$(LOWEST_PINS),"$(p)")
	touch $(LOWEST_STAMP)

# The acceptance subset on the lowest declared versions, real prefork workers on Redis
# (db 2/3; the peer suite has 0 and 8): every way a body ends (hard time limit, signals to
# pool processes and to the process group, rate_limit/ETA/prefetch holding a message),
# SIGKILL recovery, the gate's basics. ~5 min (the priority test waits ~70 s on Celery
# 5.5.0's Redis result backend, 8 s on 5.7).
LOWEST_ACCEPTANCE := tests/acceptance/test_ends.py tests/acceptance/test_gate_workers.py \
	tests/acceptance/test_worker_gate.py tests/acceptance/test_shutdown.py \
	"tests/acceptance/test_faults.py::test_faults__killed_pool_process_is_requeued_without_waiting_for_the_lease" \
	"tests/acceptance/test_faults.py::test_faults__sigkilled_worker_claims_return_through_the_beat_sweep"
test-lowest: $(LOWEST_STAMP) services
	POOLS_TEST_DB=postgres CELERY_BROKER_URL=redis://127.0.0.1:6379/2 \
	CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/3 \
	$(LOWEST)/bin/pytest -q -p no:cacheprovider $(LOWEST_ACCEPTANCE)

# The acceptance tests in which the broker takes part, again with RabbitMQ as the broker
# (guest/guest; results on Redis): how a message is published, routed, held, acknowledged,
# redelivered and purged — every way a body ends (prefetch and QoS, ETA, rate_limit), faults
# and restarts, warm shutdown, canvas, routing to a node, a broker partition, the drop-in
# comparison with plain Celery. Left to the Redis tiers: what only the database decides
# (budgets, caps, rates, job policies, default pools, refusals at beat, result values), the
# database-side partition tests, calls inside a caller's transaction, the typed-argument
# matrix (serializers are the broker's business only as bytes). ~5 min.
RABBITMQ_TESTS := tests/acceptance/test_canvas.py tests/acceptance/test_ends.py \
	tests/acceptance/test_faults.py tests/acceptance/test_gate_workers.py \
	tests/acceptance/test_node_affinity.py tests/acceptance/test_partition.py \
	tests/acceptance/test_shutdown.py tests/acceptance/test_terminate_nodes.py \
	tests/acceptance/test_transparency.py tests/acceptance/test_worker_gate.py
RABBITMQ_SKIP := \
	--deselect tests/acceptance/test_partition.py::test_partition__db_black_holed_mid_body_fences_before_the_lease_end \
	--deselect tests/acceptance/test_partition.py::test_partition__sabotage_without_the_watchdog_the_body_outlives_its_lease \
	--deselect tests/acceptance/test_partition.py::test_partition__sigstopped_body_is_stopped_when_it_resumes
RABBITMQ_RESULTS ?= redis://127.0.0.1:6379/15
test-rabbitmq: install services
	POOLS_TEST_DB=postgres CELERY_BROKER_URL=amqp://guest:guest@127.0.0.1:5672// \
	CELERY_RESULT_BACKEND=$(RABBITMQ_RESULTS) \
	$(BIN)/pytest -q $(RABBITMQ_TESTS) $(RABBITMQ_SKIP)

# A rolling deploy from the previous release (its tree from git history) to this one, with
# calls in flight, and its sabotage twin, on PostgreSQL (~1.5 min; database pools_upgrade)
# and on MariaDB, the ORM path (~1 min; database mdb_upgrade); Redis db 10/11.
# Figures: python -m tests.upgrade.run [--database mysql].
test-upgrade: install services
	@bash scripts/services.sh mariadb
	POOLS_TEST_DB=postgres CELERY_BROKER_URL=redis://127.0.0.1:6379/10 \
	CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/11 \
	$(BIN)/pytest -q tests/upgrade

# Chaos: 2,000 pooled tasks through 3 pools on 3 prefork workers + beat while 20 faults hit
# (SIGKILL, SIGSTOP past the lease, PostgreSQL restart, Redis restart, cancel bursts); then
# 400 with typed arguments among them under process faults only (~1 min more); it
# restarts the servers, so it runs alone (~4 min). Soak: python -m tests.chaos.run --help.
test-chaos: install services
	POOLS_TEST_DB=postgres $(BIN)/pytest -q -s tests/chaos
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# mysqlclient (the `mysql` extra) compiles against the MariaDB/MySQL client library:
# pkg-config and libmariadb-dev(-compat) are installed with apt when missing; still
# missing afterwards is an error (install your platform's MySQL client headers).
MYSQL_PC := pkg-config --exists mysqlclient || pkg-config --exists libmariadb
mysql-client:
	@($(MYSQL_PC)) 2>/dev/null || ( command -v apt-get >/dev/null && \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
		-y -qq pkg-config libmariadb-dev libmariadb-dev-compat ) || true
	@($(MYSQL_PC)) 2>/dev/null || (echo "the MySQL client library is missing: apt-get install \
		pkg-config libmariadb-dev libmariadb-dev-compat (or your platform's MySQL client \
		headers) so that pip can build mysqlclient" && exit 1)

# MariaDB/MySQL (127.0.0.1:3306, root; POOLS_MYSQL_* to change) on the ORM path, with real
# Celery prefork workers on Redis (db 12/13): the admission and locking integration tests,
# the 8-process contention proof (600 entries, to stay near 3 min) with its sabotage
# self-test, calls inside a caller's transaction (no pool row locked until its commit; the
# acceptance run's sabotage twins stay in tests/acceptance), and the core acceptance tests
# (priority order, never oversubscribed, SIGKILL recovery, canvas, duplicate deliveries).
# ~3.5 min.
MARIADB_ACCEPTANCE := tests/acceptance/test_gate_workers.py tests/acceptance/test_canvas.py \
	"tests/acceptance/test_faults.py::test_faults__sigkilled_worker_claims_return_through_the_beat_sweep" \
	tests/acceptance/test_worker_gate.py \
	"tests/acceptance/test_enqueue_in_transaction.py::test_in_transaction__other_calls_and_settles_go_on_then_commit_admits" \
	"tests/acceptance/test_enqueue_in_transaction.py::test_in_transaction__rollback_leaves_no_entry_and_no_message"
test-mariadb: install
	@bash scripts/services.sh mariadb
	POOLS_TEST_DB=mysql CELERY_BROKER_URL=redis://127.0.0.1:6379/12 \
	CELERY_RESULT_BACKEND=redis://127.0.0.1:6379/13 POOLS_CONTENTION_ENTRIES=600 \
	$(BIN)/pytest -q tests/integration/core/test_admission.py tests/integration/core/test_leases.py \
		tests/integration/core/test_locking_mysql.py tests/integration/schema/test_schema_mysql.py \
		tests/integration/checks/test_checks_mysql.py \
		tests/integration/core/test_unavailable_reasons.py tests/integration/core/test_contention.py \
		tests/integration/core/test_enqueue_in_transaction.py tests/integration/celery/test_fanout.py \
		tests/integration/core/test_debounce.py tests/integration/core/test_per_key_overrides.py \
		tests/unit/test_service_requirement.py \
		$(MARIADB_ACCEPTANCE)

# Debian's PgBouncer (1.18 on Debian 12) for the transaction-pooler tier. Installed with apt
# when missing; still missing afterwards is an error, not a skip.
PGBOUNCER := $(shell command -v pgbouncer || echo /usr/sbin/pgbouncer)
pgbouncer:
	@test -x $(PGBOUNCER) || ($(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq pgbouncer)
	@test -x $(PGBOUNCER) || (echo "pgbouncer is missing: apt-get install pgbouncer" && exit 1)

# The core acceptance tests with real workers, every database connection (tests and workers)
# through a PgBouncer of our own in transaction mode (scripts/pgbouncer/, port
# PGBOUNCER_PORT, in front of 127.0.0.1:5432) and Django's settings for it
# (OPTIONS prepare_threshold=None, DISABLE_SERVER_SIDE_CURSORS); Redis db 10/11. ~3 min.
PGBOUNCER_PORT ?= 6433
PGBOUNCER_REDIS ?= redis://127.0.0.1:6379
PGBOUNCER_TESTS := tests/acceptance/test_pgbouncer.py tests/acceptance/test_gate_workers.py \
	tests/acceptance/test_worker_gate.py tests/acceptance/test_enqueue_in_transaction.py \
	tests/acceptance/test_typed_arguments.py \
	"tests/acceptance/test_faults.py::test_faults__sigkilled_worker_claims_return_through_the_beat_sweep" \
	tests/integration/core/test_enqueue_in_transaction.py
test-pgbouncer: install services pgbouncer
	POOLS_PGBOUNCER_PORT=$(PGBOUNCER_PORT) bash scripts/pgbouncer/start.sh
	POOLS_TEST_DB=postgres POOLS_PG_PORT=$(PGBOUNCER_PORT) POOLS_PG_POOLER=transaction \
	CELERY_BROKER_URL=$(PGBOUNCER_REDIS)/10 CELERY_RESULT_BACKEND=$(PGBOUNCER_REDIS)/11 \
	$(BIN)/pytest -q $(PGBOUNCER_TESTS); status=$$?; \
	POOLS_PGBOUNCER_PORT=$(PGBOUNCER_PORT) bash scripts/pgbouncer/stop.sh; exit $$status

# Debian's Chromium for the browser tests (Playwright never downloads a browser here).
# Installed with apt when missing; still missing afterwards is an error, not a skip.
browsers:
	@test -x /usr/bin/chromium || ($(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver)
	@test -x /usr/bin/chromium || (echo "chromium is missing: apt-get install chromium" && exit 1)

# The docs' screenshots (docs/img/: the card, a run panel, a pool page, an entry's "why"),
# taken from the running demo (SQLite + embedded transport in a temporary directory, no
# servers) with headless Chromium once its trickle shows contention; ~1.5 min.
screenshots: install browsers
	$(BIN)/python -m tests.browser.demo_screenshots

# Headless Chromium against the admin: real PostgreSQL, Redis and Celery workers (~1 min).
BROWSER_BROKER ?= redis://127.0.0.1:6379/14
BROWSER_RESULTS ?= redis://127.0.0.1:6379/15
test-browser: install services browsers
	POOLS_TEST_DB=postgres CELERY_BROKER_URL=$(BROWSER_BROKER) \
	CELERY_RESULT_BACKEND=$(BROWSER_RESULTS) \
	$(BIN)/pytest -q tests/browser

# Celery's own integration suite, plain and with every task pooled (4-slot and 1-slot
# pool), on an external prefork worker; the bounded subset (~10 min). Any difference fails.
test-peer: install services
	$(BIN)/python -m tests.peer.run --subset

# The whole comparison (test_canvas.py + test_tasks.py, ~1 h); results in docs/peer-suite.md.
peer-full: install services
	$(BIN)/python -m tests.peer.run

# The whole suite: lint and docs, then the tiers in two streams side by side (each with its
# own PostgreSQL test database and Redis databases), then chaos alone; every tier runs even
# after one fails, and the summary names the failed ones (scripts/test_streams.sh; ~45 min
# here; TEST_STREAMS=1 runs them one after the other).
test: browsers pgbouncer lint docs
	@bash scripts/test_streams.sh

clean:
	rm -rf $(VENV) $(LOWEST) .site .pytest_cache
