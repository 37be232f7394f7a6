"""Schema changes: keep consumers exact through migrations the WAL does not carry as rows.

PostgreSQL decodes DDL as nothing but a new ``Relation`` message, and several
migrations (a volatile default, a type change that rewrites, ``DROP`` and
``CREATE`` under one name) change existing rows without a row change in the
WAL. When the publisher meets a new version of a table in the stream, in
commit order, it is compared with the table's *recorded state* and with the
catalog, and the change is classified: carried in the schema (a fast
default, an earlier name as an alias), a truncate before a recreated
table's first change, or a heal (an incremental re-snapshot of the table).

**The baseline.** The reference is the shape consumers were given, never
the catalog at the moment the stream first meets a table (which may already
be past a migration: it would be absorbed, its rewritten values lost). It is
recorded by the initial snapshot, from the catalog *inside* its exported
snapshot (so as of the slot's consistent point, stamped with it); by every
incremental snapshot, from the catalog when it plans the table, stamped with
the WAL position read just before (recorded once the table is read, unless
the stream recorded a later state meanwhile); and at start, from the catalog
and stamped with the slot's confirmed position, for any captured table that
has none (:meth:`SchemaChanges.baseline_missing`). A migration at any moment
after that point is then compared at the table's next ``Relation``, even
when the catalog is already past that version (a later migration committed
before the stream reached it): pgoutput sends columns in ``attnum`` order,
so where no column came and went since, each is placed by its position
(``classify._placed``); where one may have, the table heals.

The rooms, one concern each:

* ``state``: the recorded state of a table and the catalog's facts (data);
* ``classify``: what changed between them and what cdcd does (pure);
* ``catalog``: reading the catalog, fast defaults, the same-shape rewrite proof;
* ``record``: states and heal requests in the signal table, log lines, metrics;
* ``idle``: the periodic catalog check for tables migrated and never written again;
* ``tracker``: :class:`SchemaChanges`, what the publisher and snapshots ask.
"""

from cdcd.pipeline.schema_changes.catalog import avro_default
from cdcd.pipeline.schema_changes.classify import SchemaChange, classify
from cdcd.pipeline.schema_changes.state import CatalogColumn, CatalogTable, ColumnState, TableState
from cdcd.pipeline.schema_changes.tracker import SchemaChanges

__all__ = [
    "CatalogColumn",
    "CatalogTable",
    "ColumnState",
    "SchemaChange",
    "SchemaChanges",
    "TableState",
    "avro_default",
    "classify",
]
