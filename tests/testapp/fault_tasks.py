"""Pooled tasks for the fault-tolerance acceptance tests (leases, retries, results)."""
