"""``cdcd check`` and ``cdcd schemas``: the environment as cdcd will find it.

Each check yields ``(ok, line)``; a line names the object and, on failure,
what to change. Secrets never appear: DSNs are printed redacted.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from typing import Any, NamedTuple

from cdcd.config.model import CdcdConfig, redact_dsn
from cdcd.decode.relations import RelationCache
from cdcd.envelope.schemas import envelope_schema, key_schema
from cdcd.errors import CdcdError, ConfigError
from cdcd.naming import split_table, table_topic
from cdcd.observability.http import parse_listen
from cdcd.snapshot.store import SignalTable, SignalTableUnavailable
from cdcd.source.catalog import PgCatalog, column_dimensions
from cdcd.source.database import (
    BROKEN,
    HARMLESS,
    MISSING,
    REFUSE,
    SET_FULL,
    WAYS_OUT,
    PublicationPlan,
    SourceDatabase,
    TableVerdict,
    all_tables_refusal_error,
    alter_target,
    missing_tables_error,
    refusal_error,
    relation_from_catalog,
)
from cdcd.source.slot_holder import SlotHolder, slot_holder, slot_in_use


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
        # A malformed DSN is a configuration mistake (run exits 2 on it too).
        yield CheckResult(False, f"postgres: {exc}", config=isinstance(exc, ConfigError))
        db = None
    if db is not None:
        with db:
            yield CheckResult(
                True, f"postgres: connected to {db.database} ({where}), server {db.server_version}"
            )
            yield from _postgres_checks(config, db)
            yield from _signal_table_checks(config, db)
    yield from _kafka_checks(config)
    yield from _metrics_checks(config)


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
            if slot.active_pid:
                yield _slot_in_use(pg.slot, slot_holder(db, slot.active_pid))
            else:
                yield CheckResult(
                    True, f"slot {pg.slot}: pgoutput, confirmed {slot.confirmed_flush_lsn}, inactive"
                )
        except CdcdError as exc:
            yield CheckResult(False, f"slot {pg.slot}: {exc}")
    yield from _publication_checks(config, db)


def _publication_checks(config: CdcdConfig, db: SourceDatabase) -> Iterator[CheckResult]:
    """The publication and each captured table, as ``plan_publication`` decides for ``run``."""
    pg = config.postgres
    plan = db.plan_publication(pg)
    label = f"publication {plan.name}"
    if plan.exists:
        kind = ", FOR ALL TABLES" if plan.all_tables else ""
        owner = ", cdcd's own (membership follows postgres.tables)" if plan.owned else ""
        publishes = f", publishes {plan.publishes or 'neither updates nor deletes'}"
        yield CheckResult(True, f"{label}: {plan.member_count} tables{kind}{owner}{publishes}")
        if plan.add and plan.create_allowed:
            listed = ", ".join(v.name for v in plan.add)
            yield CheckResult(True, f"{label}: {listed} will be added (create_publication: true)")
        lacking = plan.lacking_error()
        if lacking is not None:
            yield CheckResult(False, str(lacking))
        if plan.drop:
            listed = ", ".join(f"{s}.{t}" for s, t in plan.drop)
            yield CheckResult(
                True, f"{label}: {listed} no longer in postgres.tables, will be dropped from it"
            )
    elif plan.all_tables_gaps:
        yield CheckResult(
            False, str(all_tables_refusal_error(plan.name, plan.all_tables_gaps)), config=True
        )
    elif plan.create_allowed:
        what = "" if plan.configured else " FOR ALL TABLES"
        yield CheckResult(
            True, f"{label}: absent, will be created{what} (create_publication: true)"
        )
    else:
        yield CheckResult(False, str(plan.absent_error()))
    for schema, table in _captured_tables(config, db):
        verdict = plan.verdict(schema, table)
        if verdict is None:
            continue
        yield _table_check(plan, verdict)


def _table_check(plan: PublicationPlan, verdict: TableVerdict) -> CheckResult:
    """One table's line: the same text ``run`` refuses it with, or what ``run`` will do."""
    line = f"table {verdict.name}: {verdict.detail}"
    if verdict.action == MISSING:
        return CheckResult(False, str(missing_tables_error([verdict.name])), config=True)
    if verdict.action == REFUSE:
        refusal = refusal_error(plan.name, plan.publishes, [verdict])
        return CheckResult(False, str(refusal), config=True)
    if verdict.action == SET_FULL:
        return CheckResult(
            True, f"{line}; will be set to REPLICA IDENTITY FULL (replica_identity: full)"
        )
    if verdict.action == HARMLESS:
        return CheckResult(
            True,
            f"{line}; harmless: publication {plan.name} publishes neither updates nor deletes",
        )
    if verdict.action == BROKEN:
        # run does not refuse a table it finds already published (it changes
        # nothing there), but the application's writes on it fail now.
        return CheckResult(
            False,
            f"{line}; publication {plan.name} already includes it and publishes "
            f"{plan.publishes}, so the application's UPDATE and DELETE on it fail now; "
            + WAYS_OUT.format(table=alter_target(verdict)),
        )
    return CheckResult(True, line)


def _slot_in_use(slot: str, holder: SlotHolder) -> CheckResult:
    """What ``run`` hits on a slot another backend streams from (``slot_in_use``)."""
    from cdcd.daemon import STARTUP_RETRY_S

    error = slot_in_use(slot, holder)
    return CheckResult(
        False,
        f"{error.message} (at start for {STARTUP_RETRY_S:.0f} s, then exits 1); {error.hint}",
    )


def _signal_table_checks(config: CdcdConfig, db: SourceDatabase) -> Iterator[CheckResult]:
    """The snapshot signal table: there, created by ``run`` (when, why), or out of reach."""
    pg, snap = config.postgres, config.snapshot
    try:
        table = SignalTable(db, snap.signal_table)
    except CdcdError as exc:
        yield CheckResult(False, f"signal table {snap.signal_table}: {exc}", config=True)
        return
    label = f"signal table {table.name}"
    # run creates it only for the crash-safe initial snapshot of a slot it creates.
    initial = pg.create_slot and snap.mode != "never" and db.slot_info(pg.slot) is None
    if table.exists():
        try:
            table.check_layout()
        except SignalTableUnavailable as exc:
            run_hits = (
                "`cdcd run` refuses to create the slot with an initial snapshot (exit 3)"
                if initial
                else "`cdcd run` streams without incremental snapshots"
            )
            yield CheckResult(False, f"{label}: {exc}; {run_hits}")
            return
        missing = table.missing_privileges()
        if missing:
            yield CheckResult(
                False,
                (
                    f"{label}: exists, but this user lacks {', '.join(missing)} on it; "
                    f"`cdcd run` exits 3 when it reads it; GRANT SELECT, INSERT, UPDATE ON "
                    f"{table.sql} TO {db.scalar('SELECT current_user')}"
                ),
            )
            return
        yield CheckResult(True, f"{label}: exists, pending requests: {table.pending()}")
        return
    obstacle = table.cannot_create()
    if initial:
        if obstacle is None:
            yield CheckResult(
                True,
                (
                    f"{label}: absent; `cdcd run` creates it before it creates slot {pg.slot}, "
                    f"to record the initial snapshot (snapshot.mode {snap.mode})"
                ),
            )
        else:
            yield CheckResult(
                False,
                (
                    f"{label}: absent and cannot be created ({obstacle}); `cdcd run` needs it for "
                    f"the initial snapshot (snapshot.mode {snap.mode}) and exits 3 before creating "
                    "the slot; create it as a user allowed to and grant SELECT, INSERT, UPDATE "
                    "(docs/snapshots.md), or set snapshot.mode never"
                ),
            )
        return
    if obstacle is None:
        yield CheckResult(
            True,
            (
                f"{label}: absent, not needed to stream; `cdcd snapshot` creates it when you "
                "request an incremental snapshot"
            ),
        )
    else:
        yield CheckResult(
            True,
            (
                f"{label}: absent, not needed to stream; this user cannot create it ({obstacle}), "
                "so incremental snapshots (`cdcd snapshot`) need it created by a user allowed to "
                "(docs/snapshots.md)"
            ),
        )


def _metrics_checks(config: CdcdConfig) -> Iterator[CheckResult]:
    """``metrics.listen`` must be bindable, or ``run`` stops at start."""
    listen = config.metrics.listen
    try:
        problem = bind_problem(listen)
    except ConfigError as exc:
        yield CheckResult(False, f"metrics.listen: {exc}", config=True)
        return
    if problem is None:
        yield CheckResult(True, f"metrics.listen {listen}: free")
    else:
        yield CheckResult(
            False,
            f"metrics.listen {listen}: cannot listen there ({problem}); choose a free local "
            "address for metrics.listen",
            config=True,
        )


def bind_problem(listen: str) -> str | None:
    """Why ``listen`` cannot be bound now, or None; binds like the server does, then lets go."""
    host, port = parse_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"{host}: {exc.strerror or exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As the HTTP server: reuse a port in TIME_WAIT, accept IPv4 on [::].
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and address[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{exc.strerror}: another process listens there (a cdcd already running?)"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"{exc.strerror}: {host} is not an address of this host"
            return exc.strerror or str(exc)
    return None


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
