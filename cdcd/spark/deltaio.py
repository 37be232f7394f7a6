"""Delta table plumbing shared by the mirror's rooms: where tables live, reading them
safely, and the SQL fragments delta-rs predicates are built from.

Nothing here knows what a batch is: locations (:func:`table_uri`), whole-table
reads that do not abort the interpreter at exit (:func:`read_all`), identifier
quoting and row-version conditions for MERGE predicates, and the file pruning
by min/max statistics that lets a batch read only the files holding its keys
(:func:`candidate_files`).
"""

from __future__ import annotations

import bisect
import gc
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from cdcd.spark.rows import META_LSN, META_SEQ, Version
from cdcd.spark.tablestate import table_dir_name

if TYPE_CHECKING:
    from deltalake import DeltaTable

#: The on-disk format of the mirror's commits (tables and history tables).
FORMAT = 2
#: delta-rs splits written data into files of about this size: small enough
#: that a MERGE of a few keys rewrites little, large enough for scans.
TARGET_FILE_SIZE_BYTES = 32 * 1024 * 1024
#: Text statistics this long may be truncated prefixes (writers cut them).
STATS_PREFIX = 32


def is_local(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


def local_path(root: str) -> str:
    return root[len("file://") :] if root.startswith("file://") else root


def table_uri(root: str, schema: str, table: str) -> str:
    """Where the Delta table of ``schema.table`` lives under the output ``root``."""
    return f"{root.rstrip('/')}/{table_dir_name(schema, table)}"


def read_all(table: DeltaTable, columns: list[str] | None = None) -> pa.Table:
    """Every row of a Delta table version.

    The pyarrow dataset is dropped (and collected) before returning: left for
    the interpreter's exit, its threads can outlive Arrow's and abort the
    process (``terminate called without an active exception``).
    """
    dataset = table.to_pyarrow_dataset(filesystem=arrow_filesystem(table.table_uri))
    data = dataset.to_table(columns=columns)
    del dataset
    gc.collect()
    return data


def arrow_filesystem(uri: str) -> pafs.FileSystem | None:
    """Arrow's own filesystem for a local table; None (deltalake's) for an object store.

    An Arrow I/O thread still finishing a scan after ``to_table`` returned may
    drop the last reference to the dataset's filesystem. deltalake's is a
    Python object: released while the interpreter exits, it needs the GIL, the
    thread is killed holding C++ frames and the process aborts (``terminate
    called without an active exception``, about one ``read_mirror`` script in
    forty). Arrow's local filesystem needs no GIL.
    """
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        return None
    return pafs.SubTreeFileSystem(unquote(parsed.path), pafs.LocalFileSystem())


# ----------------------------------------------------------------------------- predicates


def sql_ident(name: str) -> str:
    """``name`` as a SQL identifier for delta-rs predicates (DataFusion's quoting)."""
    return '"' + name.replace('"', '""') + '"'


def older_sql(alias: str, version: Version) -> str:
    lsn, seq = f"{alias}.{sql_ident(META_LSN)}", f"{alias}.{sql_ident(META_SEQ)}"
    return f"({lsn} < {version[0]} OR ({lsn} = {version[0]} AND {seq} < {version[1]}))"


def sql_literal(value: Any) -> str | None:
    """``value`` as a SQL literal of its own type; None for types not spelled here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return None


def range_condition(alias: str, name: str, values: pa.ChunkedArray | pa.Array) -> str | None:
    """``alias.name BETWEEN min AND max`` of ``values`` (integers and text only); None otherwise."""
    kind = values.type
    if not (
        pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
    ):
        return None
    bounds = pc.min_max(values)
    low, high = sql_literal(bounds["min"].as_py()), sql_literal(bounds["max"].as_py())
    if low is None or high is None:
        return None
    column = f"{alias}.{sql_ident(name)}"
    return f"{column} >= {low} AND {column} <= {high}"


def candidate_files(delta: DeltaTable, wanted: Mapping[str, pa.Array]) -> set[str] | None:
    """Data files whose min/max statistics admit some wanted value of every column.

    None: the log has no usable statistics (read every file).
    """
    actions = pa.table(delta.get_add_actions(flatten=True))
    columns = set(actions.column_names)
    if not all(f"min.{n}" in columns and f"max.{n}" in columns for n in wanted):
        return None
    keep = [True] * actions.num_rows
    for name, values in wanted.items():
        ordered = sorted(v for v in values.to_pylist() if v is not None)
        lows = actions.column(f"min.{name}").to_pylist()
        highs = actions.column(f"max.{name}").to_pylist()
        for i, (low, high) in enumerate(zip(lows, highs, strict=True)):
            if not keep[i] or low is None or high is None:
                continue  # no statistics: the file stays a candidate
            try:
                at = bisect.bisect_left(ordered, low)
                if isinstance(high, str | bytes) and len(high) >= STATS_PREFIX:
                    keep[i] = at < len(ordered)  # maybe a truncated maximum: no upper bound
                else:
                    keep[i] = at < len(ordered) and ordered[at] <= high
            except TypeError:  # values not comparable with the statistics' type
                return None
    paths = actions.column("path").to_pylist()
    return {os.path.basename(p) for p, k in zip(paths, keep, strict=True) if k}


def pruned_dataset(delta: DeltaTable, wanted: Mapping[str, pa.Array] | None) -> ds.Dataset | None:
    """The table's data files that may hold a ``wanted`` value of every column
    (:func:`candidate_files`; all of them without ``wanted``), as a plain Parquet
    dataset; None when no file can.

    Plain: pyarrow's own filter pushdown on delta-rs's dataset trips over the
    ``string_view`` columns delta-rs's MERGE writes, so callers filter batches."""
    dataset = delta.to_pyarrow_dataset()
    fragments = list(dataset.get_fragments())
    if wanted:
        candidates = candidate_files(delta, wanted)
        if candidates is not None:
            fragments = [f for f in fragments if os.path.basename(f.path) in candidates]
    if not fragments:
        return None
    file_format = fragments[0].format
    return ds.FileSystemDataset(
        [file_format.make_fragment(f.path, f.filesystem) for f in fragments],
        schema=dataset.schema,
        format=file_format,
        filesystem=fragments[0].filesystem,
    )


def older_mask(lsn: Any, seq: Any, version: Version) -> Any:
    return pc.or_(
        pc.less(lsn, version[0]), pc.and_(pc.equal(lsn, version[0]), pc.less(seq, version[1]))
    )


def since_version(
    table: pa.Table | None, version: Version | None, lsn: str, seq: str
) -> pa.Table | None:
    if table is None or version is None or not table.num_rows:
        return table
    return table.filter(pc.invert(older_mask(table.column(lsn), table.column(seq), version)))


def commit_adds(
    uri: str,
    schema: pa.Schema,
    actions: pa.Table,
    *,
    create: bool,
    storage_options: Mapping[str, str],
    commit_properties: Any,
    removes: Sequence[tuple[str, int]] = (),
    version: int | None = None,
    overwrite: bool = False,
) -> None:
    """Commit data files already in the table's directory (``actions``: one row per
    file, :func:`cdcd.spark.bulk.write_files`) as one transaction: the table's first
    version (``create``), an append to it, an append that also removes the data files
    ``removes`` ((path, size)) of the table ``version`` that was read, or an
    ``overwrite`` of every row."""
    import json
    import time

    from deltalake import Schema
    from deltalake.transaction import AddAction, create_table_with_add_actions

    adds = [
        AddAction(
            row["path"],
            row["size"],
            json.loads(row["partition_values"]),
            row["modification_time"],
            True,
            row["stats"] or "",
        )
        for row in actions.to_pylist()
    ]
    if create:
        create_table_with_add_actions(
            uri,
            Schema.from_arrow(schema),
            adds,
            mode="error",
            storage_options=dict(storage_options),
            commit_properties=commit_properties,
        )
        return
    from deltalake import DeltaTable
    from deltalake.transaction import RemoveAction

    now_ms = int(time.time() * 1000)
    changed: list[AddAction | RemoveAction] = [
        *adds,
        *(RemoveAction(path, True, now_ms, size, {}) for path, size in removes),
    ]
    DeltaTable(
        uri, version=version, storage_options=dict(storage_options)
    ).create_write_transaction(
        changed,
        mode="overwrite" if overwrite else "append",
        schema=schema,
        commit_properties=commit_properties,
    )
