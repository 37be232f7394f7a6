"""A stand-in for :class:`cdcd.sink.KafkaSink` that only records what is produced.

For tests that drive a ``Publisher`` alone and look at the bytes it hands
the producer (no broker, no faults: ``tests.support.fault_sink`` injects
those). Delivery callbacks run only when the test calls :meth:`deliver`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: One produced message: topic, key, value, headers and the delivery callback.
Sent = tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]], Callable[[Any, Any], None]]


class RecordingSink:
    """``produce`` records into :attr:`sent`; with ``direct``, ``produce_direct``
    (the publisher's fast path) records into :attr:`direct`, or raises ``raises``."""

    def __init__(self, direct: bool = False, raises: BaseException | None = None) -> None:
        self.sent: list[Sent] = []
        self.direct: list[Sent] = []
        self._raises = raises
        self._delivered = 0
        if direct:
            # Only then: the publisher looks the fast path up with getattr.
            self.produce_direct = self._produce_direct

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Callable[[Any, Any], None],
    ) -> None:
        self.sent.append((topic, key, value, headers, on_delivery))

    def _produce_direct(self, *args: Any) -> None:
        topic, value, key, partition, on_delivery, callback, timestamp, headers = args
        assert (partition, callback, timestamp) == (-1, None, 0)
        if self._raises is not None:
            raise self._raises
        self.direct.append((topic, key, value, headers, on_delivery))

    def deliver(self) -> None:
        """A successful delivery report for every message of :attr:`sent` not yet reported."""
        pending, self._delivered = self.sent[self._delivered :], len(self.sent)
        for message in pending:
            message[4](None, None)
