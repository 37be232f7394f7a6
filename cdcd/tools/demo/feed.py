"""The demo's consumer: the table topics read back from Kafka, in commit order, and counted.

What the demo prints comes from here, not from the daemon: proof that the
messages are readable by any consumer.
"""


from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cdcd.config.model import CdcdConfig
from cdcd.tail import TopicReader

#: Messages wait this long before being printed, so that messages fetched from
#: different partitions can be put back in commit order.
REORDER_HOLD_S = 0.4

@dataclass(frozen=True)
class DecodedChange:
    """One change message as a consumer sees it, decoded."""

    table: str
    op: str
    key: Mapping[str, Any] | None
    envelope: Mapping[str, Any]
    lsn: int
    seq: int


class ChangeFeed:
    """Reads the table topics (:class:`cdcd.tail.TopicReader`) and hands out changes in commit order.

    Topics appear when cdcd first publishes to them; the reader looks them up
    every second and reads each new one from the beginning. Decoded changes
    wait ``REORDER_HOLD_S`` in a heap ordered by (``cdcd.lsn``, ``cdcd.seq``):
    Kafka orders per partition only, and a reader should see a transaction's
    changes together, in order.
    """

    def __init__(self, config: CdcdConfig) -> None:
        # Writer schemas: read from <prefix>._schemas as any consumer would.
        self._reader = TopicReader(config, None, from_end=False)
        self._heap: list[tuple[int, int, int, float, DecodedChange]] = []
        self._arrivals = itertools.count()
        self.received = 0
        self.tombstones = 0
        #: Envelopes decoded so far, by (schema.table, op).
        self.counts: Counter[tuple[str, str]] = Counter()

    @property
    def topics(self) -> list[str]:
        """Table topics read so far."""
        return self._reader.topics

    @property
    def pending(self) -> int:
        """Decoded changes waiting in the reorder buffer."""
        return len(self._heap)

    def poll(self, timeout_s: float) -> None:
        """Fetch what arrived within ``timeout_s`` (batch-wise) into the reorder buffer."""
        for change in self._reader.poll(timeout_s):
            if change.envelope is None:
                self.tombstones += 1  # a delete's tombstone, for log compaction
                continue
            decoded = DecodedChange(
                table=change.table,
                op=change.envelope["op"],
                key=change.key,
                envelope=change.envelope,
                lsn=change.lsn,
                seq=change.seq,
            )
            self.received += 1
            self.counts[decoded.table, decoded.op] += 1
            heapq.heappush(
                self._heap, (change.lsn, change.seq, next(self._arrivals), time.monotonic(), decoded)
            )

    def ready(self, hold_s: float = REORDER_HOLD_S) -> list[DecodedChange]:
        """Changes that waited at least ``hold_s``, in (lsn, seq) order."""
        out: list[DecodedChange] = []
        cutoff = time.monotonic() - hold_s
        while self._heap and self._heap[0][3] <= cutoff:
            out.append(heapq.heappop(self._heap)[4])
        return out

    def close(self) -> None:
        """Leave the broker (before it is stopped, so librdkafka does not complain)."""
        self._reader.close()


# ---------------------------------------------------------------------------- demo

def covers(have: Counter[tuple[str, str]], want: Counter[tuple[str, str]]) -> bool:
    """Whether ``have`` holds at least ``want`` of every (table, op)."""
    return all(have[key] >= count for key, count in want.items())


def by_op(counts: Counter[tuple[str, str]]) -> str:
    """``c 3, d 1, u 2``: totals per op, zeros left out."""
    by_op: Counter[str] = Counter()
    for (_, op), count in counts.items():
        by_op[op] += count
    return ", ".join(f"{op} {n}" for op, n in sorted(by_op.items()) if n)


def count_mismatches(
    written: Mapping[tuple[str, str], int],
    published: Mapping[tuple[str, str], int],
    decoded: Mapping[tuple[str, str], int],
) -> list[str]:
    """What disagrees, one line per (table, op); empty when all is well.

    Per (table, op), cdcd must publish at least what the writer committed
    (more when someone else writes too, e.g. from psql), and the consumer
    must decode exactly what cdcd published. Totals alone would let a
    missing insert hide behind a surplus update.
    """
    problems = []
    for table, op in sorted({*written, *published, *decoded}):
        w = written.get((table, op), 0)
        p = published.get((table, op), 0)
        d = decoded.get((table, op), 0)
        if p < w or d != p:
            problems.append(f"{table} {op}: written {w}, published {p}, decoded {d}")
    return problems
