"""What snapshots need of the publisher, so that snapshot does not import the pipeline.

The pipeline builds snapshot objects and hands them its
``cdcd.pipeline.publisher.Publisher``, which satisfies :class:`SnapshotPublisher`
structurally (mypy checks it where the pipeline passes it); the dependency
points from the pipeline down to snapshot only, like the publisher's own
``Producer`` protocol for the Kafka sink.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from cdcd.ack.tracker import TxnTicket
from cdcd.decode.relations import TableVersion
from cdcd.envelope.encoder import TableEncoder
from cdcd.envelope.rowcode import Message
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import LogicalMessage
from cdcd.source.database import SourceDatabase

__all__ = ["KeyRecorder", "SchemaBaselines", "SnapshotPublisher"]

#: Told ``(xid, key)`` for each change of a watched table; key None: a truncate.
KeyRecorder = Callable[[int, bytes | None], None]


class SnapshotPublisher(Protocol):
    """The publisher methods the initial and incremental snapshots call."""

    def snapshot_encoder(self, table: TableVersion) -> TableEncoder | None:
        """The encoder of a snapshot table version (creates its topic); None if not captured."""
        ...

    def snapshot_messages(self, topic: str, messages: Sequence[Message], lsn: Lsn) -> TxnTicket:
        """Produce encoded initial-snapshot reads (``rows.encode_reads``) in a ticket sealed at ``lsn``."""
        ...

    def snapshot_copy_in_transaction(
        self, encoder: TableEncoder, data: bytes, skip: set[bytes] | None
    ) -> tuple[TxnTicket, int]:
        """Publish a chunk of COPY text inside the current (high watermark) transaction."""
        ...

    def snapshot_truncate(self, encoder: TableEncoder) -> None:
        """Publish a truncate (op=t) of the table inside the current (low watermark) transaction."""
        ...

    def on_watermark(self, handler: Callable[[LogicalMessage], None] | None) -> None:
        """Route ``cdcd.naming.WATERMARK_PREFIX`` messages to ``handler`` (None: drop them)."""
        ...

    def watch(self, relation_id: int, record: KeyRecorder) -> None:
        """Report ``(xid, key)`` of every change to ``relation_id`` until :meth:`unwatch`."""
        ...

    def unwatch(self) -> None:
        """Stop reporting changes of the watched table."""
        ...

    @property
    def begun(self) -> int:
        """How many transactions the publisher began so far."""
        ...

    def published_before(self, begun: int) -> list[int]:
        """xids of the (latest remembered) transactions published before the ``begun``-th."""
        ...


class SchemaBaselines(Protocol):
    """What snapshots tell schema-change tracking (``cdcd.pipeline.schema_changes.SchemaChanges``).

    A snapshot gives consumers a table's shape: that shape, not the catalog
    when the stream first meets the table, is the reference a later
    migration is compared with.
    """

    def read_baseline(self, db: SourceDatabase, version: TableVersion, lsn: Lsn) -> object:
        """The state of ``version`` as ``db`` sees the catalog, placed at ``lsn``."""
        ...

    def record_baseline(self, table: str, baseline: object) -> None:
        """Record what :meth:`read_baseline` returned (unless the stream recorded a later state)."""
        ...

    def hand_over(self, table: str, reason: str) -> None:
        """Request an incremental snapshot of a table the initial snapshot could not read."""
        ...

    def catalog_check(self, include: Callable[[str, str], bool]) -> None:
        """Called from the main loop: compare idle tables with the catalog when due."""
        ...
