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
* :mod:`cdcd.spark.apply` -- what a batch of changes does to a table's rows
  (one run of one identity: :mod:`cdcd.spark.apply_runs`; the row tables and
  results: :mod:`cdcd.spark.rows`; a table's state and one batch of one
  table: :mod:`cdcd.spark.tablestate`); :mod:`cdcd.spark.history` -- what it
  does to the table's history;
* :mod:`cdcd.spark.mirror` -- ``cdcd mirror``'s Delta tables: the entry
  point and map of its rooms (the Spark job :mod:`cdcd.spark.job`, the
  executors' bulk writes :mod:`cdcd.spark.bulk`, the store
  :mod:`cdcd.spark.store` and :mod:`cdcd.spark.history_store`, Delta
  plumbing :mod:`cdcd.spark.deltaio`, fault points :mod:`cdcd.spark.faults`);
  :mod:`cdcd.spark.autocdc` -- ``apply_changes`` for your own pipelines.

Wire headers and writer schemas (``<prefix>._schemas`` or the registry) come
from :mod:`cdcd.consumer`, shared with ``cdcd demo``. Nothing here imports
pyspark at package import time.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

# Spark starts Python workers (the bundled Kafka source, decoding) with
# PYSPARK_PYTHON, read when a session starts: this interpreter, which has
# cdcd, unless the user chose another. A session started before this import
# keeps its own; :func:`cdcd.spark.reader.register_source` warns about one
# whose workers would run another interpreter.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

__all__ = ["apply_changes", "read_changes", "read_mirror", "read_raw", "register_source"]

if TYPE_CHECKING:
    from cdcd.spark.autocdc import apply_changes
    from cdcd.spark.mirror import read_mirror
    from cdcd.spark.reader import read_changes, read_raw, register_source

_HOMES = {
    "read_changes": "cdcd.spark.reader",
    "read_raw": "cdcd.spark.reader",
    "register_source": "cdcd.spark.reader",
    "read_mirror": "cdcd.spark.mirror",
    "apply_changes": "cdcd.spark.autocdc",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        import importlib

        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'cdcd.spark' has no attribute {name!r}")
