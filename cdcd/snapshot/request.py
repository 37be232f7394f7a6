"""``cdcd snapshot -c FILE --table schema.table``: request an incremental snapshot.

The command only inserts a request into the signal table (creating the table
if needed) after checking that each table exists and is captured; the
running daemon picks it up within a few seconds and reports progress in its
log, its metrics and the request's row. Requests made while no daemon runs
wait for the next start.
"""

from __future__ import annotations

from cdcd.config.model import CdcdConfig
from cdcd.errors import ConfigError, DefiniteError
from cdcd.naming import format_table, split_table
from cdcd.snapshot.rows import published_leaves, published_units
from cdcd.snapshot.store import SignalTable
from cdcd.source.database import SourceDatabase

__all__ = ["request_snapshot"]


def request_snapshot(config: CdcdConfig, tables: list[str]) -> tuple[str, SignalTable]:
    """Validate ``tables`` and insert one request for them; returns its id and the table."""
    pg = config.postgres
    names: list[str] = []
    for name in tables:
        try:
            schema, table = split_table(name)
        except DefiniteError as exc:
            raise ConfigError(f"--table {name!r} is not schema.table") from exc
        names.append(format_table(schema, table))
    with SourceDatabase(pg.dsn.get_secret_value(), timeout_s=pg.connect_timeout_s) as db:
        exists = db.publication_exists(pg.publication)
        captured = set(db.resolve_tables(pg)) if pg.table_names else None
        if captured is not None and exists:
            # A partitioned table published per leaf is captured as its leaves too.
            captured |= set(published_units(db, pg.publication, sorted(captured)))
        signals = SignalTable(db, config.snapshot.signal_table)
        published = set(db.publication_tables(pg.publication)) if exists else None
        for name in names:
            schema, table = split_table(name)
            if not db.table_exists(schema, table):
                raise DefiniteError(f"table {name} does not exist", hint="check --table")
            if captured is not None and (schema, table) not in captured:
                raise DefiniteError(
                    f"table {name} is not captured", hint="add it to postgres.tables first"
                )
            if (
                published is not None
                and (schema, table) not in published
                # A partitioned table published per leaf: its leaves are snapshotted.
                and not published_leaves(db, pg.publication, schema, table)
            ):
                raise DefiniteError(
                    f"table {name} is not in publication {pg.publication}",
                    hint=f"ALTER PUBLICATION {pg.publication} ADD TABLE {name} (or restart cdcd "
                    "after adding it to postgres.tables)",
                )
        signals.ensure()
        # Addressed to this configuration's slot: another daemon sharing the table leaves it alone.
        return signals.request(names, slot=pg.slot), signals
