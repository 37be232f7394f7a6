"""Which Kafka producer class the sink builds: the compiled one on librdkafka, or confluent-kafka's.

``cdcd.sink._rdkafka`` (``_rdkafka.c``) is a producer straight on librdkafka
that serves delivery reports in C: a run of successful reports for one
transaction reaches Python as a single ``TxnTicket.on_delivered(count)``
instead of a ``Message`` and a call per message (about 1 µs of CPU per
message less, ``tests/bench/bench_kafka_floor.py``). It has the interface of
``confluent_kafka.Producer`` that :class:`~cdcd.sink.producer.KafkaSink`
uses, and it runs the very librdkafka confluent-kafka loaded (opened by path,
never linked), so the configuration, protocol behaviour and version are the
same either way.

It is optional like the other compiled modules (``cdcd.protocol.native``):
not built (no compiler or no ``rdkafka.h``), stale, ``CDCD_PURE_PYTHON=1``, or
a librdkafka that cannot be opened all mean confluent-kafka's ``Producer``,
which is also the reference the compiled one is tested against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from cdcd.protocol.native import STATUS, load_native

log = logging.getLogger(__name__)

MODULE = "cdcd.sink._rdkafka"

#: The oldest librdkafka the compiled producer accepts (every function it uses exists since).
MIN_LIBRDKAFKA = 0x02000000

ProducerFactory = Callable[[dict[str, Any]], Any]

_factory: ProducerFactory | None = None


def loaded_librdkafka() -> Path | None:
    """The librdkafka file confluent-kafka's extension loaded, from this process's memory map.

    It is the bundled ``confluent_kafka.libs/librdkafka-<hash>.so.1`` of the
    wheels, or the system's library for a source build: either way the one
    the reference producer runs.
    """
    import confluent_kafka.cimpl  # noqa: F401  # maps the library, if not yet

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(None, 5)  # address, perms, offset, device, inode, path
        if len(fields) == 6 and "/librdkafka" in fields[5] and ".so" in fields[5]:
            return Path(fields[5].strip())
    return None


def producer_factory() -> ProducerFactory:
    """The producer class for :class:`~cdcd.sink.producer.KafkaSink`; decided once per process."""
    global _factory
    if _factory is None:
        _factory = _choose()
        log.debug("Kafka producer: %s", STATUS.get(MODULE, "confluent-kafka's"))
    return _factory


def _choose() -> ProducerFactory:
    module = load_native(MODULE)
    if module is None:
        return Producer
    library = loaded_librdkafka()
    if library is None:
        STATUS[MODULE] = "pure (confluent-kafka's librdkafka not found in the process)"
        return Producer
    try:
        version = module.load(str(library), KafkaError, KafkaException, Message)
    except OSError as exc:
        STATUS[MODULE] = f"pure ({exc})"
        log.warning("the compiled Kafka producer is not used: %s", exc)
        return Producer
    if version < MIN_LIBRDKAFKA or version != confluent_kafka.libversion()[1]:
        STATUS[MODULE] = f"pure (librdkafka {version:#x} is not usable)"
        return Producer
    factory: ProducerFactory = module.Producer
    return factory
