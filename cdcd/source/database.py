"""The metadata connection: every question cdcd asks PostgreSQL outside the stream.

:class:`SourceDatabase` is one plain (non-replication) connection composed of
rooms with one concern each, so a reader opens only the one they need:

* :mod:`cdcd.source.connection` -- connecting, the session's bounds, running
  a statement, and sorting failures into retry or stop (:class:`MetadataConnection`,
  the base of every room);
* :mod:`cdcd.source.catalog` -- tables: keys, replica identities, the Relation
  pgoutput would send (:class:`~cdcd.source.catalog.TableCatalog`);
* :mod:`cdcd.source.publication_planner` and
  :mod:`cdcd.source.publication_reconcile` -- what the publication should be,
  and making it so;
* :mod:`cdcd.source.slots` -- the replication slot's lifecycle.

The rooms share the one session (a class each over :class:`MetadataConnection`,
joined here by inheritance) because their statements must run on the same
bounded connection, one after the other. This module adds only the heartbeat.
"""

from __future__ import annotations

from cdcd.naming import HEARTBEAT_PREFIX
from cdcd.protocol.lsn import Lsn
from cdcd.source.markers import MarkerTransactions
from cdcd.source.publication_reconcile import PublicationReconciler
from cdcd.source.slots import SlotLifecycle

__all__ = ["SourceDatabase"]


class SourceDatabase(PublicationReconciler, SlotLifecycle):
    """A plain (non-replication) connection to the source database, with every room's methods.

    ``bounded`` (the default): the session's ``lock_timeout`` and
    ``statement_timeout`` are :data:`~cdcd.source.connection.METADATA_LOCK_TIMEOUT`
    and :data:`~cdcd.source.connection.METADATA_STATEMENT_TIMEOUT`. A
    connection that reads whole tables (the initial snapshot's) passes
    ``bounded=False``.
    """

    def emit_heartbeat(
        self, prefix: str = HEARTBEAT_PREFIX, markers: MarkerTransactions | None = None
    ) -> Lsn:
        """A logical message: WAL in this database, so the slot moves.

        Non-transactional where pgoutput sends messages. With ``markers``
        (PostgreSQL 12 and 13, :mod:`cdcd.source.markers`) a transactional one,
        its transaction registered as the heartbeat: after the commit, which
        is safe only because the caller is the thread that reads the stream.
        """
        if markers is None:
            return Lsn.parse(
                self.scalar("SELECT pg_logical_emit_message(false, %s, '')::text", (prefix,))
            )
        rows = self.query(
            "SELECT pg_logical_emit_message(true, %s, '')::text, txid_current()", (prefix,)
        )
        markers.expect(int(rows[0][1]), prefix, b"")
        return Lsn.parse(rows[0][0])
