"""``manage.py pools bench``: pools side by side with plain Celery and the Redis-lock recipe.

The benchmark runs against the project's own database and Celery broker. It starts its own
``celery worker`` subprocesses (which import :mod:`pools.bench.tasks`), creates its own pools
(names start with ``bench-``), runs the workloads, prints a table, writes ``bench.json`` and PNG
plots, and removes everything it created. See ``docs/benchmarks.md``.

The benchmark runs from a checkout of the repository (``make install``): the wheel leaves
this package out, and ``manage.py pools bench`` then says how to get it.

Modules:

* :mod:`pools.bench.tasks` — the tasks the workers run (pooled and plain);
  :mod:`pools.bench.bodies` — the body they share with the recipe;
* :mod:`pools.bench.recipe` — the common recipe: a Redis counting semaphore with a TTL taken in
  the task body, ``self.retry(countdown=0.05)`` when it is full;
* :mod:`pools.bench.workers` — worker subprocesses, held queues, RSS;
* :mod:`pools.bench.backlog` — bench pools, backlogs written in bulk, pause/release, clean-up;
* :mod:`pools.bench.stats` — pure counting: percentiles, gaps, inversions, concurrency;
* :mod:`pools.bench.workloads` — W1-W4; :mod:`pools.bench.comparison` — W5;
  :mod:`pools.bench.memory` — worker RSS;
* :mod:`pools.bench.report` — table, JSON, plots; :mod:`pools.bench.runner` — the whole run.
"""
