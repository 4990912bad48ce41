"""Runnable experiments and reports built on eqmoe (each a ``python -m experiments.NAME`` CLI)."""
