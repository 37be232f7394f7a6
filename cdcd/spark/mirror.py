"""Delta Lake mirrors of the captured tables: the entry point, and how the rooms fit.

Readers start here: :func:`read_mirror` (a table as PostgreSQL shows it, at
a Delta version, a time or a commit LSN). The work is done in rooms of one
concern each:

- :mod:`cdcd.spark.job` -- the ``foreachBatch`` job (:class:`MirrorJob`);
- :mod:`cdcd.spark.bulk` -- large changes written by the executors;
- :mod:`cdcd.spark.store` -- the Delta tables and their commits (:class:`MirrorStore`);
- :mod:`cdcd.spark.history_store` -- the history tables' commits;
- :mod:`cdcd.spark.deltaio` -- locations, safe reads, predicates;
- :mod:`cdcd.spark.faults` -- the crash tests' fault points;
- :mod:`cdcd.spark.apply` / :mod:`cdcd.spark.tablestate` -- what a batch does
  to a table (pure), :mod:`cdcd.spark.history` -- what it does to its history,
  :mod:`cdcd.spark.decode` -- decoding (no Delta, no Spark).

The tables are written through ``deltalake`` (delta-rs: no JVM jars).

One Delta table per captured table
----------------------------------
``DIR/<schema>.<table>/`` (``DIR`` a local path or an object-store URI) is a
Delta table holding the table's columns, by PostgreSQL name, and two
metadata columns, ``_cdcd_lsn`` and ``_cdcd_seq``: the version of the
change that wrote the row (:func:`read_mirror` leaves them out).

A batch costs what it changes
-----------------------------
For each table the batch touches, only the stored rows of the touched keys
are read (a filter on the key, which skips the files whose min/max
statistics exclude them), the pure apply step computes their new state, and
one MERGE by key writes the difference: delete, update, insert. delta-rs
prunes the target files by the source's key range, so a batch of recent keys
rewrites the few files holding them. A truncate adds a "not matched by
source" delete of the rows older than it to the same MERGE. Keyless tables
(matched on whole rows) are read whole when a batch updates or deletes in
them, and merged on the row version, which identifies a row.

Atomic progress
---------------
The MERGE commit carries everything the next batch needs: a Delta
transaction identifier (``txn``: app id ``cdcd-mirror-<Spark query id>``,
version = the Spark batch id), so a batch Spark replays after a crash is
recognised table by table and skipped; and, in the commit's metadata
(``cdcd.mirror``), the table's state (reader schema, last truncate,
per-partition high-water marks) with the versions of two side tables,
``_cdcd_pending`` (held-back key-change creates) and ``_cdcd_recent_deletes``
(rows deleted by the last two batches), written before the commit and read
at exactly those versions. Directories starting with ``_`` are not part of
the table for Delta readers, nor removed by VACUUM. A crash before the
commit leaves unreferenced files only.

Large changes
-------------
A batch that brings a table many new rows (an initial build and each later
batch of it, a table's snapshot) is not collected: each Spark task proves
its keys are not stored yet, writes its share as data files into the
table's directory (and the rows' open versions into its history table's)
and returns their add actions; the driver commits them in one transaction
with the same ``txn`` and metadata (:mod:`cdcd.spark.bulk`).

Identity: each change is matched by the key of its Kafka message (or the
whole row for a null key); a batch that changes a table's key reads the
stored rows once and writes the table back in the commit that records the
new key. History tables (``--history``, :mod:`cdcd.spark.history`) are
committed before their table, each commit with the batch's ``txn``.

Schema changes: a new column without a default is added by Delta schema
evolution within the MERGE; anything else (a default for existing rows, a
rename, a drop, a type change, a table recreated with other columns)
rewrites the table once, streamed in record batches, in its own commit.

Schema, table and column names are PostgreSQL's; ``/`` and ``%`` in them are
written ``%2F`` and ``%25`` in directory names, and a leading ``.`` as
``%2E``.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from datetime import datetime

import pyarrow as pa

from cdcd.errors import ConfigError, DefiniteError
from cdcd.spark.deltaio import is_local, read_all, table_uri
from cdcd.spark.history import HISTORY_COLUMNS, valid_at
from cdcd.spark.history_store import HISTORY_DIR
from cdcd.spark.job import BatchReport, HistoryOptions, MirrorJob
from cdcd.spark.rows import META_LSN, META_SEQ
from cdcd.spark.store import MirrorStore

__all__ = [
    "BatchReport",
    "HistoryOptions",
    "MirrorJob",
    "MirrorStore",
    "is_local",
    "lsn_value",
    "read_mirror",
    "table_uri",
]

# The row versions' column names (SPEC §8; :func:`read_mirror` drops them).
assert (META_LSN, META_SEQ) == ("_cdcd_lsn", "_cdcd_seq")


def read_mirror(
    uri: str,
    *,
    storage_options: Mapping[str, str] | None = None,
    version: int | None = None,
    timestamp: str | datetime | None = None,
    as_of_lsn: int | str | None = None,
) -> pa.Table:
    """A mirrored table as PostgreSQL shows it: its columns, without the row versions.

    ``version`` / ``timestamp`` (a datetime or RFC 3339 text): the table as
    that Delta version, or the newest one at that time, held it (time travel,
    back to what ``--vacuum`` kept). ``as_of_lsn`` (a commit LSN, as a number
    or ``X/XXXXXXXX``): the table as PostgreSQL held it when the transaction
    with that commit LSN committed, from the table's history table (``cdcd
    mirror --history``); with ``version``/``timestamp``, from that version of
    the history.
    """
    from deltalake import DeltaTable

    options = dict(storage_options or {})
    target = f"{uri.rstrip('/')}/{HISTORY_DIR}" if as_of_lsn is not None else uri
    if as_of_lsn is not None and not DeltaTable.is_deltatable(target, storage_options=options):
        raise DefiniteError(
            f"{uri} has no history table", hint="run cdcd mirror with --history for it"
        )
    table = DeltaTable(target, version=version, storage_options=options)
    if timestamp is not None:
        table.load_as_version(timestamp)
    data = read_all(table)
    del table  # see read_all
    gc.collect()
    if as_of_lsn is not None:
        lsn = lsn_value(as_of_lsn)
        data = valid_at(data, lsn)
        hidden = [name for name, _ in HISTORY_COLUMNS]
    else:
        hidden = [META_LSN, META_SEQ]
    return data.drop_columns([c for c in hidden if c in data.column_names])


def lsn_value(lsn: int | str) -> int:
    """A commit LSN as the bigint the history tables hold (``X/XXXXXXXX`` text too)."""
    if isinstance(lsn, int):
        return lsn
    high, sep, low = lsn.partition("/")
    try:
        return (int(high, 16) << 32) | int(low, 16) if sep else int(lsn)
    except ValueError:
        raise ConfigError(f"{lsn!r} is not an LSN (X/XXXXXXXX or a number)") from None
