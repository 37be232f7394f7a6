"""Throwaway infrastructure: a local PostgreSQL cluster and a local Kafka-compatible broker.

Shared by the test suite, ``cdcd demo`` and ``cdcd bench`` so that all three
start PostgreSQL and the broker the same way, with the same settings and the
same cleanup guarantees (only what was started here is ever stopped).

``postgres`` (one cluster: create, start, stop, clients), ``binaries``
(which server build runs, as which user), ``databases`` (dropping a database
with what blocks it), ``broker`` (tansu), ``process`` (what both servers
share: their lifetime, ``/proc``), ``keep`` (``cdcd local up|down``) and
``workload`` (the ``orders`` table every figure and test uses).
"""

from cdcd.tools.local.broker import BrokerSetupError, LocalBroker, find_tansu
from cdcd.tools.local.postgres import (
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
