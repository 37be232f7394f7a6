"""The Spark side of cdcd (SPEC §8): read the topics, decode the envelopes, mirror the tables.

Modules:

* :mod:`cdcd.spark.source` -- ``cdcd-kafka``, a Spark 4 Python data source
  reading Kafka with confluent-kafka (batch and streaming), for Spark
  installations without the JVM Kafka connector;
* :mod:`cdcd.spark.decode` -- writer-schema resolution and vectorised Avro
  decoding (``mapInArrow``) into typed columns;
* :mod:`cdcd.spark.reader` -- the public entry points: :func:`read_raw` and
  :func:`read_changes` pick Spark's own Kafka source when its jars are on the
  classpath and the bundled one otherwise;
* :mod:`cdcd.spark.mirror` -- applying change batches to Parquet mirrors;
* :mod:`cdcd.spark.cli` -- ``cdcd mirror``.

Nothing here imports pyspark at package import time: the mirror's apply logic
is plain pyarrow and usable (and tested) without a JVM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["read_changes", "read_raw", "register_source"]

if TYPE_CHECKING:
    from cdcd.spark.reader import read_changes, read_raw, register_source


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cdcd.spark import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'cdcd.spark' has no attribute {name!r}")
