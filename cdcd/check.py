"""``cdcd check`` and ``cdcd schemas``: the environment as cdcd will find it.

Each check yields ``(ok, line)``; a line names the object and, on failure,
what to change. Secrets never appear: DSNs are printed redacted.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from typing import Any, NamedTuple

from psycopg2.extensions import make_dsn, parse_dsn

from cdcd.config.model import CdcdConfig, redact_dsn
from cdcd.envelope.schemas import envelope_schema, key_schema
from cdcd.errors import CdcdError, ConfigError
from cdcd.naming import format_table, table_topic
from cdcd.observability.http import parse_listen
from cdcd.pipeline.resync import check_slot
from cdcd.snapshot.daemons import failing_jobs, neighbours, sharing_report
from cdcd.snapshot.rows import published_relation, published_units
from cdcd.snapshot.store import SignalTable, SignalTableUnavailable
from cdcd.source.catalog import PgCatalog
from cdcd.source.database import (
    BROKEN,
    HARMLESS,
    MISSING,
    REFUSE,
    SET_FULL,
    WAYS_OUT,
    PublicationPlan,
    SlotInfo,
    SlotLostError,
    SourceDatabase,
    TableVerdict,
    all_tables_refusal_error,
    alter_target,
    missing_tables_error,
    refusal_error,
)
from cdcd.source.publication import describe_columns, describe_filter
from cdcd.source.slot_holder import SlotHolder, slot_holder, slot_in_use
from cdcd.source.synchronous import sync_status
from cdcd.source.versions import (
    has_messages,
    max_protocol,
    require_failover,
    require_protocol,
    version_text,
)


class CheckResult(NamedTuple):
    """One line of ``cdcd check``.

    ``config`` marks a failure that a change to the configuration (or to the
    objects it names) must fix: ``check`` then exits 2, as ``run`` would.
    """

    ok: bool
    line: str
    config: bool = False


def _signal_pair(config: CdcdConfig, db: SourceDatabase) -> list[tuple[str, str]]:
    """cdcd's signal table, which a table pattern never captures."""
    try:
        table = SignalTable(db, config.snapshot.signal_table)
    except CdcdError:
        return []  # a bad name: _signal_table_checks says so
    return [(table.schema, table.table)]


def _captured_tables(config: CdcdConfig, db: SourceDatabase) -> list[tuple[str, str]]:
    if config.postgres.table_names:
        tables = db.resolve_tables(config.postgres, exclude=_signal_pair(config, db))
        if db.publication_exists(config.postgres.publication):
            # A partitioned table published per leaf is captured as its leaves.
            tables = published_units(db, config.postgres.publication, tables)
        return tables
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
            yield from _daemon_checks(config, db)
            yield from _synchronous_checks(config, db)
    yield from _kafka_checks(config)
    yield from _metrics_checks(config)


def _postgres_checks(config: CdcdConfig, db: SourceDatabase) -> Iterator[CheckResult]:
    pg = config.postgres
    try:
        db.require_logical()
        yield CheckResult(True, "wal_level: logical")
    except CdcdError as exc:
        yield CheckResult(False, f"wal_level: {exc}")
    yield _protocol_check(pg.protocol_version, db.server_version)
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
    try:
        signals: SignalTable | None = SignalTable(db, config.snapshot.signal_table)
    except CdcdError:
        signals = None  # a bad name: _signal_table_checks says so
    try:
        check_slot(db, signals, pg.slot)
    except SlotLostError as exc:
        # What `run` refuses: an invalidated slot, or a missing one cdcd used.
        yield CheckResult(False, f"slot {pg.slot}: {exc}")
        yield from _publication_checks(config, db)
        yield from _failover_checks(config, db)
        return
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
                kind = ", failover" if slot.failover else ""
                if pg.failover and not slot.failover:
                    kind = ", not a failover slot yet (`cdcd run` makes it one)"
                yield CheckResult(
                    True,
                    f"slot {pg.slot}: pgoutput{kind}, confirmed {slot.confirmed_flush_lsn}, "
                    "inactive",
                )
        except CdcdError as exc:
            yield CheckResult(False, f"slot {pg.slot}: {exc}")
    yield from _publication_checks(config, db)
    yield from _failover_checks(config, db)


# -- failover (PostgreSQL 17+) ----------------------------------------------------------


def dsn_servers(dsn: str) -> list[tuple[str, str]]:
    """The ``(host, port)`` pairs a (multi-host) DSN lists, as libpq pairs them."""
    params = parse_dsn(dsn)
    hosts = (params.get("host") or params.get("hostaddr") or "").split(",")
    ports = (params.get("port") or "").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    return [(host, port or "5432") for host, port in zip(hosts, ports, strict=False)]


def _server_dsn(dsn: str, index: int) -> str:
    """The DSN narrowed to its ``index``-th server, whatever role that server has."""
    params = parse_dsn(dsn)
    for key in ("host", "hostaddr", "port"):
        values = (params.get(key) or "").split(",")
        if len(values) > 1:
            params[key] = values[index]
    params["target_session_attrs"] = "any"
    return str(make_dsn(**params))


def _identity(db: SourceDatabase) -> tuple[Any, ...]:
    """What tells two connections to one server from connections to two servers."""
    rows = db.query("SELECT pg_postmaster_start_time(), current_setting('port')")
    return tuple(rows[0])


def _names(setting: str) -> list[str]:
    """Slot names of a list setting; slot names are [a-z0-9_], so quotes only wrap them."""
    return [name.strip().replace('"', "") for name in setting.split(",") if name.strip()]


def _failover_checks(config: CdcdConfig, db: SourceDatabase) -> Iterator[CheckResult]:
    """With ``postgres.failover``: is the slot going to survive a promotion, and if not, why.

    On the primary: ``synchronized_standby_slots`` and the standbys' physical
    slots. On each other server of the DSN (and for each standby
    ``pg_stat_replication`` shows): what PostgreSQL 17 needs to synchronize
    the slot there (docs/failover.md).
    """
    pg = config.postgres
    if not pg.failover:
        return
    try:
        require_failover(db.server_version, pg.failover)
    except CdcdError as exc:
        yield CheckResult(False, f"failover: {exc}")
        return
    servers = dsn_servers(pg.dsn)
    attrs = parse_dsn(pg.dsn).get("target_session_attrs", "any")
    if len(servers) < 2:
        yield CheckResult(
            False,
            "failover: postgres.dsn names one server, so after a promotion cdcd cannot reach the "
            "new primary; list the standbys too, with target_session_attrs=read-write "
            "(host=primary,standby port=5432,5432 ... target_session_attrs=read-write)",
        )
    elif attrs not in ("read-write", "primary"):
        yield CheckResult(
            False,
            f"failover: postgres.dsn lists {len(servers)} servers with target_session_attrs="
            f"{attrs}: libpq may connect to a standby, where cdcd cannot stream; add "
            "target_session_attrs=read-write",
        )
    here = f"{db.conn.info.host}:{db.conn.info.port}"
    if len(servers) >= 2 and attrs in ("read-write", "primary"):
        yield CheckResult(
            True,
            f"failover: postgres.dsn lists {len(servers)} servers (target_session_attrs={attrs}); "
            f"the primary now: {here}",
        )
    physical = {
        str(name): (bool(active), reason)
        for name, active, reason in db.query(
            "SELECT slot_name, active, coalesce(invalidation_reason, wal_status) "
            "FROM pg_replication_slots WHERE slot_type = 'physical'"
        )
    }
    standby_slots = _names(db.setting("synchronized_standby_slots"))
    if not standby_slots:
        named = ", ".join(sorted(physical)) or "<the standby's slot>"
        yield CheckResult(
            False,
            f"failover: synchronized_standby_slots is empty on the primary ({here}): cdcd may be "
            "sent changes a standby has not received, and after its promotion the slot would be "
            "ahead of its data; set it to the physical slots of the standbys that may be "
            f"promoted: ALTER SYSTEM SET synchronized_standby_slots = '{named}'; "
            "SELECT pg_reload_conf()",
        )
    for name in standby_slots:
        state = physical.get(name)
        if state is None:
            yield CheckResult(
                False,
                f"failover: synchronized_standby_slots names {name}, which is no physical slot "
                f"on the primary ({here}): the primary holds back every change for cdcd until "
                "it exists; create it for the standby (its primary_slot_name) or remove the name",
            )
        elif state[1] == "lost" or (state[1] or "").endswith("removed"):
            yield CheckResult(
                False,
                f"failover: standby slot {name} is invalidated ({state[1]}): the primary holds "
                "back every change for cdcd; rebuild that standby, or remove the name from "
                "synchronized_standby_slots",
            )
        elif not state[0]:
            yield CheckResult(
                False,
                f"failover: standby slot {name} is not in use (its standby is down or not "
                "streaming): the primary holds back every change for cdcd until that standby "
                "confirms it; start the standby, or remove the name from "
                "synchronized_standby_slots",
            )
        else:
            yield CheckResult(True, f"failover: standby slot {name} is in use and waited for")
    if not physical:
        yield CheckResult(
            False,
            f"failover: no physical replication slot on the primary ({here}): a standby "
            "synchronizes failover slots only while it streams through one; "
            "SELECT pg_create_physical_replication_slot('<name>') and set primary_slot_name "
            "on the standby",
        )
    primary_slot = db.slot_info(pg.slot)
    checked: set[str] = set()
    for index, (host, port) in enumerate(servers if len(servers) > 1 else ()):
        where = f"{host}:{port}"
        if where == here:
            continue
        yield from _standby_checks(
            config, _server_dsn(pg.dsn, index), where, physical, standby_slots, primary_slot,
            checked, _identity(db),
        )
    for app, address, slot in db.query(
        "SELECT r.application_name, host(r.client_addr), s.slot_name FROM pg_stat_replication r "
        "LEFT JOIN pg_replication_slots s ON s.active_pid = r.pid "
        "WHERE s.slot_type IS DISTINCT FROM 'logical'"
    ):
        if slot is not None and slot in checked:
            continue
        who = f"standby {app or '(no application_name)'} at {address or 'a local socket'}"
        if slot is None:
            yield CheckResult(
                False,
                f"failover: {who} streams from the primary without a physical slot: it cannot "
                "synchronize the slot; create one and set its primary_slot_name",
            )
        else:
            yield CheckResult(
                False,
                f"failover: {who} (slot {slot}) is not in postgres.dsn's host list: its settings "
                "are unchecked and cdcd cannot follow a promotion to it; add it to host= "
                "(and port=)",
            )


def _standby_checks(
    config: CdcdConfig,
    dsn: str,
    where: str,
    physical: dict[str, tuple[bool, str | None]],
    standby_slots: list[str],
    primary_slot: SlotInfo | None,
    checked: set[str],
    primary: tuple[Any, ...],
) -> Iterator[CheckResult]:
    """What one other server of the DSN lacks to keep a synchronized copy of the slot."""
    pg = config.postgres
    label = f"failover: standby {where}"
    try:
        sdb = SourceDatabase(dsn, timeout_s=pg.connect_timeout_s)
    except CdcdError as exc:
        yield CheckResult(False, f"{label}: cannot connect ({exc}), so its settings are unchecked")
        return
    with sdb:
        if not sdb.scalar("SELECT pg_is_in_recovery()"):
            if _identity(sdb) == primary:
                return  # the primary under another name (a socket, an alias)
            yield CheckResult(
                False,
                f"{label}: is not a standby but a primary too (a split brain?); cdcd connects to "
                "whichever libpq finds first",
            )
            return
        problems: list[str] = []
        settings = dict(
            sdb.query(
                "SELECT name, setting FROM pg_settings WHERE name IN ('sync_replication_slots', "
                "'hot_standby_feedback', 'primary_slot_name', 'wal_level', "
                "'synchronized_standby_slots')"
            )
        )
        if settings.get("sync_replication_slots") != "on":
            problems.append(
                "sync_replication_slots is off, so the slot is not synchronized to it: "
                "ALTER SYSTEM SET sync_replication_slots = on; SELECT pg_reload_conf()"
            )
        if settings.get("hot_standby_feedback") != "on":
            problems.append(
                "hot_standby_feedback is off, so the primary may remove catalog rows the "
                "synchronized slot needs (and slot synchronization does not run): "
                "ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf()"
            )
        if settings.get("wal_level") != "logical":
            problems.append(
                f"wal_level is {settings.get('wal_level')}: a standby keeps logical slots only "
                "with wal_level = logical (restart needed)"
            )
        own = settings.get("primary_slot_name") or ""
        if not own:
            problems.append(
                "primary_slot_name is not set, so it streams without a physical slot and cannot "
                "synchronize the slot: create a physical slot on the primary and set "
                "primary_slot_name to it"
            )
        else:
            checked.add(own)
            if own not in physical:
                problems.append(
                    f"its primary_slot_name {own} is no physical slot on the primary: "
                    f"SELECT pg_create_physical_replication_slot('{own}') on the primary"
                )
            elif own not in standby_slots:
                problems.append(
                    f"its slot {own} is not in the primary's synchronized_standby_slots, so "
                    "cdcd may be sent changes it has not received: add it there"
                )
        try:
            conninfo = str(sdb.scalar("SELECT current_setting('primary_conninfo')") or "")
            if not parse_dsn(conninfo).get("dbname"):
                problems.append(
                    "primary_conninfo names no dbname, which the slot sync worker needs: add "
                    "dbname=<a database> to primary_conninfo"
                )
        except CdcdError as exc:
            problems.append(
                f"cannot read primary_conninfo ({exc}); grant pg_read_all_settings to cdcd's "
                "user to have it checked"
            )
        stale = _names(settings.get("synchronized_standby_slots") or "")
        present = {
            str(r[0]) for r in sdb.query("SELECT slot_name FROM pg_replication_slots")
        }
        missing = [name for name in stale if name not in present]
        if missing:
            problems.append(
                f"its own synchronized_standby_slots names {', '.join(missing)}, which do not "
                "exist on it (copied with the primary's configuration?): once promoted it would "
                "hold back every change for cdcd; ALTER SYSTEM RESET synchronized_standby_slots "
                "on it (set it again for its own standbys after a promotion)"
            )
        for problem in problems:
            yield CheckResult(False, f"{label}: {problem}")
        synced = sdb.slot_info(pg.slot)
        if synced is None:
            if primary_slot is not None and primary_slot.failover:
                yield CheckResult(
                    False,
                    f"{label}: slot {pg.slot} is not synchronized to it (yet); a promotion now "
                    "would lose it",
                )
            elif not problems:
                yield CheckResult(
                    True, f"{label}: ready to synchronize slot {pg.slot} once it is a failover slot"
                )
        elif synced.invalidated:
            yield CheckResult(
                False,
                f"{label}: its synchronized copy of slot {pg.slot} is invalidated; a promotion "
                "would need 'cdcd resync'",
            )
        elif synced.temporary:
            yield CheckResult(
                False,
                f"{label}: its copy of slot {pg.slot} is still temporary (the standby has not "
                "caught up with the slot's position yet): a promotion now would drop it",
            )
        elif not problems:
            yield CheckResult(
                True,
                f"{label}: slot {pg.slot} synchronized (confirmed {synced.confirmed_flush_lsn})",
            )


def _protocol_check(protocol_version: int, server_version: int) -> CheckResult:
    """``postgres.protocol_version`` against what the server speaks (``run`` refuses more)."""
    try:
        require_protocol(server_version, protocol_version)
    except CdcdError as exc:
        return CheckResult(False, f"protocol_version: {exc}")
    line = (
        f"protocol_version: {protocol_version} (PostgreSQL {version_text(server_version)} "
        f"speaks pgoutput protocol {max_protocol(server_version)} at most)"
    )
    if not has_messages(server_version):
        line += (
            "; pgoutput sends no logical messages before 14: heartbeats and snapshot "
            "watermarks are recognised by transaction id"
        )
    return CheckResult(True, line)


def _publication_checks(config: CdcdConfig, db: SourceDatabase) -> Iterator[CheckResult]:
    """The publication and each captured table, as ``plan_publication`` decides for ``run``."""
    pg = config.postgres
    try:
        plan = db.plan_publication(pg, exclude=_signal_pair(config, db))
    except CdcdError as exc:
        # A setting the server lacks, a pattern that matches nothing: run exits 2 on it too.
        yield CheckResult(False, str(exc), config=isinstance(exc, ConfigError))
        return
    label = f"publication {plan.name}"
    if plan.exists:
        kind = ", FOR ALL TABLES" if plan.all_tables else ""
        owner = ", cdcd's own (membership follows postgres.tables)" if plan.owned else ""
        publishes = f", publishes {plan.publishes or 'neither updates nor deletes'}"
        yield CheckResult(True, f"{label}: {plan.member_count} tables{kind}{owner}{publishes}")
        # A table cdcd refuses to publish (no replica identity) is not added: its own FAIL line says so.
        addable = [v for v in plan.add if v.action != REFUSE]
        if addable and plan.create_allowed:
            listed = ", ".join(v.name for v in addable)
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
    yield from _publication_settings(config, plan, db.server_version)
    signal = set(_signal_pair(config, db))
    for verdict in plan.tables:
        if (verdict.schema, verdict.table) in signal:
            continue  # cdcd never captures its own signal table, even FOR ALL TABLES
        yield _table_check(plan, verdict)
        if verdict.relation is not None and verdict.relation.kind == "p":
            yield _partition_check(config, verdict)


def _publication_settings(
    config: CdcdConfig, plan: PublicationPlan, version: int
) -> Iterator[CheckResult]:
    """Origin, the validation problems and the drift, as ``run`` will meet them."""
    pg = config.postgres
    if pg.origin == "none":
        yield CheckResult(
            True,
            "origin: none, changes applied by replication (a subscription's, with a "
            "replication origin) are not captured",
        )
    else:
        yield CheckResult(True, "origin: any, every change is captured")
    for problem in plan.problems:
        yield CheckResult(False, str(problem), config=True)
    if not plan.drift:
        return
    if plan.reconcile:
        for drift in plan.drift:
            yield CheckResult(
                True,
                f"{drift.describe(plan.name)}; `cdcd run` changes it (cdcd's own publication)",
            )
        return
    error = plan.drift_error()
    if error is not None:
        yield CheckResult(False, str(error))


def _partition_check(config: CdcdConfig, verdict: TableVerdict) -> CheckResult:
    """Where a partitioned table's changes go (publish_via_partition_root)."""
    relation = verdict.relation
    count = len(relation.partitions) if relation else 0
    if config.postgres.publish_via_partition_root:
        topic = table_topic(config.kafka.topic_prefix, verdict.schema, verdict.table)
        return CheckResult(
            True,
            f"partitioned table {verdict.name}: its {count} partitions publish to its own "
            f"topic {topic} (publish_via_partition_root: true)",
        )
    return CheckResult(
        True,
        f"partitioned table {verdict.name}: each partition gets its own topic "
        f"(publish_via_partition_root: false; {count} partitions)",
    )


def _table_check(plan: PublicationPlan, verdict: TableVerdict) -> CheckResult:
    """One table's line: the same text ``run`` refuses it with, or what ``run`` will do."""
    line = f"table {verdict.name}: {verdict.detail}"
    if verdict.spec.where is not None or verdict.spec.columns is not None:
        line += (
            f"; row filter {describe_filter(verdict.spec.where)}, "
            f"columns {describe_columns(verdict.spec.columns)}"
        )
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


def _daemon_checks(config: CdcdConfig, db: SourceDatabase) -> Iterator[CheckResult]:
    """Other daemons (slots) on this database, and conflicts with them (cdcd.snapshot.daemons)."""
    pg = config.postgres
    try:
        signals: SignalTable | None = SignalTable(db, config.snapshot.signal_table)
    except CdcdError:
        signals = None
    if signals is not None and signals.exists():
        for job_id, tables, error in failing_jobs(signals, pg.slot):
            yield CheckResult(
                False,
                f"snapshot: job {job_id} of {', '.join(tables) or '?'} keeps failing ({error}); "
                "the daemon retries it: fix the cause, or set its status to 'cancelled' in "
                f"{signals.name} to give up",
            )
    others = neighbours(db, signals, pg.slot)
    if not others:
        yield CheckResult(True, f"daemons: no other logical slot on database {db.database}")
        return
    captured = [format_table(s, t) for s, t in _captured_tables(config, db)]
    for ok, line in sharing_report(others, pg.slot, pg.publication, captured):
        yield CheckResult(ok, line, config=not ok)


def _synchronous_checks(config: CdcdConfig, db: SourceDatabase) -> Iterator[CheckResult]:
    """Whether cdcd is a synchronous standby, by which entry, and the caveats (docs/synchronous.md)."""
    pg = config.postgres
    app = pg.replication_application_name
    label = "synchronous"
    try:
        status = sync_status(db, pg.slot, app)
    except CdcdError as exc:
        yield CheckResult(False, f"{label}: cannot read synchronous_standby_names: {exc}")
        return
    state = status.sync_state or "not streaming now"
    if status.entry is None:
        named = f"'{status.setting}'" if status.setting else "empty"
        yield CheckResult(
            True,
            f"{label}: no (synchronous_standby_names is {named}, which does not name "
            f"application_name {app!r}); pg_stat_replication.sync_state: {state}",
        )
        return
    assert status.names is not None
    rule = f"{status.names.method} {status.names.count} of {len(status.names.names)}"
    if status.entry == "*":
        yield CheckResult(
            False,
            f"{label}: synchronous_standby_names = '{status.setting}' matches cdcd only through "
            f"'*' ({rule}), so application commits may wait for Kafka by accident ('*' matches "
            "every walsender, logical ones included); list the physical standbys by name, or "
            f"name cdcd ({app!r}) if it is meant",
        )
    else:
        spelled = "" if status.entry == app else f" (as {status.entry!r})"
        yield CheckResult(
            True,
            f"{label}: yes, synchronous_standby_names = '{status.setting}' names "
            f"application_name {app!r}{spelled} ({rule}); pg_stat_replication.sync_state: {state}",
        )
    yield CheckResult(
        True,
        f"{label} caveat: synchronous_standby_names is server-wide but cdcd decodes one database "
        f"({db.database}): commits in every database wait until cdcd has read past them",
    )
    yield CheckResult(
        True,
        f"{label} caveat: a transaction that locks a catalog table exclusively (LOCK pg_class, "
        "CLUSTER pg_class, TRUNCATE of a user catalog table) deadlocks with cdcd's decoding "
        "and its commit never returns",
    )
    if pg.protocol_version >= 3:
        yield CheckResult(
            True,
            f"{label} caveat: protocol_version {pg.protocol_version} decodes two-phase "
            "transactions at PREPARE, and cdcd confirms nothing past a prepared transaction "
            "until its COMMIT PREPARED is delivered, so PREPARE TRANSACTION waits until then; "
            "prepare with synchronous_commit = local, or use protocol_version 2",
        )
    try:
        signals = SignalTable(db, config.snapshot.signal_table)
        unfinished = signals.exists() and signals.unfinished_initial(pg.slot) is not None
    except (CdcdError, SignalTableUnavailable):
        unfinished = False  # reported by the signal table checks
    if unfinished:
        yield CheckResult(
            True,
            f"{label} caveat: the initial snapshot of slot {pg.slot} has not finished; cdcd "
            "streams, and PostgreSQL counts it as a synchronous standby, only once it has: "
            "until then commits wait if cdcd is needed (alone in the list), or other standbys "
            "answer for it",
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
    if config.schema_changes.resnapshot == "auto":
        if obstacle is None:
            yield CheckResult(
                True,
                (
                    f"{label}: absent; `cdcd run` creates it at startup to record table shapes "
                    "and heal migrations that rewrite rows (schema_changes.resnapshot auto, "
                    "docs/schema-changes.md)"
                ),
            )
        else:
            yield CheckResult(
                False,
                (
                    f"{label}: absent and cannot be created ({obstacle}); `cdcd run` streams, but "
                    "tracks schema changes in memory only and does not heal migrations that "
                    "rewrite rows; create it as a user allowed to and grant SELECT, INSERT, UPDATE "
                    "(docs/snapshots.md), or set schema_changes.resnapshot never"
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
            from cdcd.envelope.wire import registry_client

            client = registry_client(url, config.schema_registry.config)
            subjects = client.get_subjects()
            yield CheckResult(True, f"schema registry: reachable, {len(subjects)} subjects")
        except Exception as exc:  # noqa: BLE001 - any client failure is a failed check, reported
            yield CheckResult(False, f"schema registry: unreachable ({type(exc).__name__}: {exc})")


def table_schemas(config: CdcdConfig) -> list[dict[str, Any]]:
    """The key and value schemas each captured table gets now."""
    pg = config.postgres
    with SourceDatabase(pg.dsn, timeout_s=pg.connect_timeout_s) as db:
        tables = _captured_tables(config, db)
        relations = db.relation_cache(PgCatalog(db.conn))
        out = []
        for schema, table in tables:
            name = format_table(schema, table)
            # What the stream will carry: the publication's columns (or the
            # configured list, before cdcd created its publication).
            relation, _ = published_relation(
                db, schema, table, pg.publication, pg.table_config(name).columns
            )
            version, _ = relations.on_relation(relation)
            topic = config.table_topic(schema, table)
            out.append(
                {
                    "table": name,
                    "topic": topic,
                    "key": key_schema(topic, version),
                    "value": envelope_schema(topic, version),
                }
            )
        return out
