"""The Spark side of cdcd (SPEC §8): read the topics, decode the envelopes, mirror the tables.

Modules:

* :mod:`cdcd.spark.source` -- ``cdcd-kafka``, a Spark 4 Python data source
  reading Kafka with confluent-kafka (batch and streaming), for Spark
  installations without the JVM Kafka connector;
* :mod:`cdcd.spark.reader` -- the public entry points: :func:`read_raw` and
  :func:`read_changes` pick Spark's own Kafka source when its jars are on the
  classpath and the bundled one otherwise;
* :mod:`cdcd.spark.mirror` -- the Delta Lake mirrors (deltalake) and the Spark job
  applying each micro-batch;
* :mod:`cdcd.spark.dataframes` -- Spark types, the decoding ``mapInArrow``
  job, the per-schema header summary;
* :mod:`cdcd.spark.cli` -- ``cdcd mirror``.

Pure code (pyarrow and fastavro; no Spark session, no Kafka, no files),
used by the modules above and tested without a JVM:

* :mod:`cdcd.spark.layout` -- table layouts, types, and the resolution of
  a writer's rows to a reader's (defaults, renames, exact conversions);
* :mod:`cdcd.spark.decode` -- vectorised Avro decoding of Kafka rows, each
  with its writer schema, into typed Arrow columns;
* :mod:`cdcd.spark.apply` -- what a batch of changes does to a table.

Wire headers and writer schemas (``<prefix>._schemas`` or the registry) come
from :mod:`cdcd.consumer`, shared with ``cdcd demo``. Nothing here imports
pyspark at package import time.
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
