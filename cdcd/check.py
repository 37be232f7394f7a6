"""``cdcd check`` and ``cdcd schemas``: the environment as cdcd will find it.

Each check yields ``(ok, line)``; a line names the object and, on failure,
what to change. Secrets never appear: DSNs are printed redacted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from cdcd.config.model import CdcdConfig, redact_dsn
from cdcd.decode.relations import RelationCache
from cdcd.envelope.schemas import envelope_schema, key_schema
from cdcd.errors import CdcdError
from cdcd.sink.topics import table_topic
from cdcd.source.catalog import PgCatalog, column_dimensions
from cdcd.source.database import SourceDatabase, relation_from_catalog, split_table


class CheckResult(NamedTuple):
    """One line of ``cdcd check``.

    ``config`` marks a failure that a change to the configuration (or to the
    objects it names) must fix: ``check`` then exits 2, as ``run`` would.
    """

    ok: bool
    line: str
    config: bool = False


def _captured_tables(config: CdcdConfig, db: SourceDatabase) -> list[tuple[str, str]]:
    if config.postgres.table_names:
        return [split_table(t) for t in config.postgres.table_names]
    if db.publication_exists(config.postgres.publication):
        # cdcd never publishes its own signal table, even FOR ALL TABLES.
        signal = config.snapshot.signal_table.rsplit(".", 1)[-1]
        return [
            (schema, table)
            for schema, table in db.publication_tables(config.postgres.publication)
            if table != signal
        ]
    return []


def run_checks(config: CdcdConfig) -> Iterator[CheckResult]:
    pg = config.postgres
    where = redact_dsn(pg.dsn)
    try:
        db = SourceDatabase(pg.dsn, timeout_s=pg.connect_timeout_s)
    except CdcdError as exc:
        yield CheckResult(False, f"postgres: {exc}")
        db = None
    if db is not None:
        with db:
            yield CheckResult(
                True, f"postgres: connected to {db.database} ({where}), server {db.server_version}"
            )
            yield from _postgres_checks(config, db)
    yield from _kafka_checks(config)


def _postgres_checks(config: CdcdConfig, db: SourceDatabase) -> Iterator[CheckResult]:
    pg = config.postgres
    try:
        db.require_logical()
        yield CheckResult(True, "wal_level: logical")
    except CdcdError as exc:
        yield CheckResult(False, f"wal_level: {exc}")
    timeout = db.wal_sender_timeout_s()
    if timeout and pg.status_interval_s >= timeout / 2:
        yield CheckResult(
            False,
            (
                f"status_interval_s: {pg.status_interval_s} is not below wal_sender_timeout/2 "
                f"({timeout / 2:.1f} s); lower postgres.status_interval_s"
            ),
        )
    else:
        yield CheckResult(True, f"status_interval_s: {pg.status_interval_s} < wal_sender_timeout/2")
    slot = db.slot_info(pg.slot)
    if slot is None:
        if pg.create_slot:
            yield CheckResult(True, f"slot {pg.slot}: absent, will be created (create_slot: true)")
        else:
            yield CheckResult(
                False, f"slot {pg.slot}: does not exist; set postgres.create_slot: true"
            )
    else:
        try:
            db.verify_slot(slot, two_phase=pg.protocol_version >= 3)
            state = f"active (pid {slot.active_pid})" if slot.active_pid else "inactive"
            yield CheckResult(
                True, f"slot {pg.slot}: pgoutput, confirmed {slot.confirmed_flush_lsn}, {state}"
            )
        except CdcdError as exc:
            yield CheckResult(False, f"slot {pg.slot}: {exc}")
    if db.publication_exists(pg.publication):
        tables = db.publication_tables(pg.publication)
        yield CheckResult(True, f"publication {pg.publication}: {len(tables)} tables")
    elif pg.create_publication:
        yield CheckResult(
            True,
            f"publication {pg.publication}: absent, will be created (create_publication: true)",
        )
    else:
        yield CheckResult(
            False,
            (
                f"publication {pg.publication}: does not exist; create it or set "
                "postgres.create_publication: true"
            ),
        )
    for schema, table in _captured_tables(config, db):
        name = f"{schema}.{table}"
        if not db.table_exists(schema, table):
            yield CheckResult(
                False, f"table {name}: does not exist; remove it from postgres.tables"
            )
            continue
        identity = db.table_identity(schema, table)
        if identity.replica_identity == "f":
            yield CheckResult(True, f"table {name}: replica identity FULL")
        elif identity.replica_identity == "i":
            yield CheckResult(True, f"table {name}: replica identity USING INDEX")
        elif identity.replica_identity == "n":
            yield CheckResult(
                False,
                (
                    f"table {name}: replica identity NOTHING, updates and deletes will fail; "
                    f"ALTER TABLE {name} REPLICA IDENTITY DEFAULT (with a primary key) or FULL"
                ),
            )
        elif identity.primary_key:
            yield CheckResult(
                True, f"table {name}: primary key ({', '.join(identity.primary_key)})"
            )
        else:
            yield CheckResult(
                False,
                (
                    f"table {name}: no primary key, updates and deletes will fail; add one or "
                    f"ALTER TABLE {name} REPLICA IDENTITY FULL"
                ),
            )


def _kafka_checks(config: CdcdConfig) -> Iterator[CheckResult]:
    from cdcd.sink.topics import check_broker

    try:
        description = check_broker(
            config.kafka.bootstrap_servers, dict(config.kafka.producer), timeout_s=10.0
        )
        yield CheckResult(True, f"kafka: {description}")
    except CdcdError as exc:
        yield CheckResult(False, f"kafka: {exc}")
    url = config.schema_registry.url
    if url:
        try:
            from confluent_kafka.schema_registry import SchemaRegistryClient

            client = SchemaRegistryClient.new_client({"url": url, **config.schema_registry.config})
            subjects = client.get_subjects()
            yield CheckResult(True, f"schema registry: reachable, {len(subjects)} subjects")
        except Exception as exc:  # noqa: BLE001 - any client failure is a failed check, reported
            yield CheckResult(False, f"schema registry: unreachable ({type(exc).__name__}: {exc})")


def table_schemas(config: CdcdConfig) -> list[dict[str, Any]]:
    """The key and value schemas each captured table gets now."""
    pg = config.postgres
    with SourceDatabase(pg.dsn, timeout_s=pg.connect_timeout_s) as db:
        tables = _captured_tables(config, db)
        relations = RelationCache(
            PgCatalog(db.conn),
            key_lookup=db.primary_key,
            dimensions_lookup=lambda relid: column_dimensions(db.conn, relid),
        )
        out = []
        for schema, table in tables:
            version, _ = relations.on_relation(relation_from_catalog(db, schema, table))
            topic = table_topic(config.kafka.topic_prefix, schema, table)
            out.append(
                {
                    "table": f"{schema}.{table}",
                    "topic": topic,
                    "key": key_schema(topic, version),
                    "value": envelope_schema(topic, version),
                }
            )
        return out
