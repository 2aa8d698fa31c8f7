"""The engines of :mod:`pools.core.engine` that work on every database."""
