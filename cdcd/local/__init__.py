"""Throwaway infrastructure: a local PostgreSQL cluster and a local Kafka-compatible broker.

Shared by the test suite, ``cdcd demo`` and ``cdcd bench`` so that all three
start PostgreSQL and the broker the same way, with the same settings and the
same cleanup guarantees (only what was started here is ever stopped).
"""

from cdcd.local.broker import BrokerSetupError, LocalBroker, find_tansu
from cdcd.local.postgres import (
    DEFAULT_SETTINGS,
    LocalPostgres,
    PostgresSetupError,
    find_bindir,
    free_port,
)

__all__ = [
    "DEFAULT_SETTINGS",
    "BrokerSetupError",
    "LocalBroker",
    "LocalPostgres",
    "PostgresSetupError",
    "find_bindir",
    "find_tansu",
    "free_port",
]
