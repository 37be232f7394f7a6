"""Observability: Prometheus metrics, health endpoints, systemd notification, logs.

Submodules are imported explicitly (``cdcd.observability.metrics`` …) rather
than re-exported here, so that importing one of them (for instance ``systemd``
from a tiny test) does not create the daemon's metric registry as a side effect.
"""
