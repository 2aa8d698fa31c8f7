"""Celery's own integration suite, run plain and with every task pooled (``make test-peer``).

:mod:`tests.peer.run` fetches ``t/integration`` from the sdist of the installed Celery
version, runs ``test_canvas.py`` and ``test_tasks.py`` against an external prefork
worker on Redis once with plain Celery and once with every task pooled through
``POOLS["TASKS"]`` (a 4-slot and a 1-slot pool), and prints the differences.
"""
