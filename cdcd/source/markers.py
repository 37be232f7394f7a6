"""Heartbeats and snapshot watermarks where pgoutput sends no logical messages (12, 13).

PostgreSQL 14 gave pgoutput its ``messages`` option; on 12 and 13 a
``pg_logical_emit_message`` is decoded but never sent to a pgoutput client.
What *is* sent is the transaction around a transactional message: pgoutput
before 15 sends Begin and Commit for every decoded transaction of the
database, even one with nothing to publish (skipping empty transactions came
in 15), and the message is a decoded change. So cdcd still writes the same
transactional message, learns the transaction's id in the same transaction
(``txid_current()``) and registers it here *before* the transaction commits;
when the stream's Begin carries that id, the publisher treats the
transaction as the message it stands for (:meth:`MarkerTransactions.take`).
Nothing is created in the source database and nothing joins the publication.

Ordering: the message of a transaction is delivered at that transaction's
Commit, in commit order, and so is its Begin. A marker recognised at Begin
therefore sits at the same place among other transactions' changes as the
message would, and the transaction holds no published change before it:
what ``cdcd.snapshot.incremental`` argues of watermark messages holds of
watermark transactions unchanged.

Heartbeats there are transactional too (a non-transactional message has no
transaction to recognise): one xid per ``heartbeat.interval_s``.
"""

from __future__ import annotations

import threading
from typing import Any

from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import LogicalMessage

__all__ = ["MarkerTransactions"]

#: pgoutput sends 32-bit xids; txid_current() adds the epoch above them.
_XID_MASK = 0xFFFFFFFF
#: LogicalMessage flags of a transactional message.
_TRANSACTIONAL = 1
#: Registered markers kept at most. Each is taken when its transaction is
#: streamed; only transactions that never are (their session ended) stay, so
#: the oldest go first.
_LIMIT = 10_000


class MarkerTransactions:
    """Transaction ids that stand for logical messages; written by any thread, taken by the main one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[str, bytes]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def write(self, cursor: Any, prefix: str, content: str) -> None:
        """Emit a transactional message in the cursor's open transaction and register its xid.

        The caller commits afterwards: registered before the commit, the
        marker is known before the stream can carry it.
        """
        cursor.execute(
            "SELECT pg_logical_emit_message(true, %s, %s), txid_current()", (prefix, content)
        )
        row = cursor.fetchone()
        self.expect(int(row[1]), prefix, content.encode())

    def expect(self, xid: int, prefix: str, content: bytes) -> None:
        """Register transaction ``xid`` (64-bit or 32-bit) as the message ``prefix``/``content``."""
        with self._lock:
            if len(self._pending) >= _LIMIT:
                del self._pending[next(iter(self._pending))]
            self._pending[xid & _XID_MASK] = (prefix, content)

    def take(self, xid: int, commit_lsn: Lsn) -> LogicalMessage | None:
        """The message transaction ``xid`` stands for (once), or None for any other transaction."""
        if not self._pending:
            return None
        with self._lock:
            found = self._pending.pop(xid & _XID_MASK, None)
        if found is None:
            return None
        return LogicalMessage(None, _TRANSACTIONAL, commit_lsn, found[0], found[1])
