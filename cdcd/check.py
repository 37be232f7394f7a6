"""``cdcd check`` and ``cdcd schemas``: the environment as ``cdcd run`` will find it.

``check`` runs the daemon's own startup plan (``cdcd.pipeline.startup``) dry:
every step ``run`` takes before streaming gives its line, and a refusal
gives the very error ``run`` would exit with. After some steps it adds
advice that ``run`` does not act on: failover readiness, other daemons and
failing snapshot jobs, synchronous replication. Printing is
``cdcd.tools.check``'s. Secrets never appear: DSNs are printed redacted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from cdcd.config.model import CdcdConfig
from cdcd.envelope.schemas import envelope_schema, key_schema
from cdcd.errors import CdcdError, TransientError
from cdcd.naming import format_table
from cdcd.pipeline.failover_readiness import dsn_servers, failover_readiness, server_dsn
from cdcd.pipeline.parts import real_parts
from cdcd.pipeline.startup import (
    STARTUP_PLAN,
    Finding,
    Startup,
    Step,
    dry_run,
    refusal_line,
)
from cdcd.snapshot.daemons import failing_jobs, neighbours, sharing_report
from cdcd.snapshot.rows import published_relation
from cdcd.snapshot.store import SignalTable, SignalTableUnavailable
from cdcd.source.catalog import PgCatalog
from cdcd.source.synchronous import sync_status

__all__ = ["Finding", "dsn_servers", "run_checks", "server_dsn", "table_schemas"]


def _startup(config: CdcdConfig) -> Startup:
    """The plan's context, dry, with the very factories the daemon connects with."""
    parts = real_parts(config)
    return Startup(config, dry_run=True, connect=parts.database, check_broker=parts.check_broker)


def _refusal(startup: Startup) -> Callable[[Step, CdcdError], Finding]:
    def line(step: Step, exc: CdcdError) -> Finding:
        if isinstance(exc, TransientError):
            # What run retries at start, then gives up on (exit 1) with this hint.
            from cdcd.daemon import STARTUP_RETRY_S, startup_hint

            said = refusal_line(step, startup, TransientError(getattr(exc, "message", exc)))
            return Finding(
                False,
                f"{said.line} (at start for {STARTUP_RETRY_S:.0f} s, then exits 1); "
                f"{startup_hint(exc)}",
            )
        return refusal_line(step, startup, exc)

    return line


def _failover_advice(startup: Startup) -> Iterator[Finding]:
    return failover_readiness(startup.config, startup.database)


#: Advice added after a step of the plan (with a connection): what ``run`` does not act on.
ADVICE: dict[str, tuple[Callable[[Startup], Iterator[Finding]], ...]] = {
    "failover": (_failover_advice,),
    "slot": (lambda s: _daemon_advice(s), lambda s: _synchronous_advice(s)),
}


def run_checks(config: CdcdConfig) -> Iterator[Finding]:
    """The lines of ``cdcd check``: the startup plan run dry, with advice after its steps."""
    startup = _startup(config)
    try:
        for step, findings in dry_run(startup, _refusal(startup), STARTUP_PLAN):
            yield from findings
            if startup.db is None:
                continue
            for advice in ADVICE.get(step.name, ()):
                try:
                    yield from advice(startup)
                except CdcdError as exc:
                    yield Finding(False, f"{step.name}: {exc}")
    finally:
        if startup.db is not None:
            startup.db.close()


def _daemon_advice(startup: Startup) -> Iterator[Finding]:
    """Other daemons (slots) on this database (cdcd.snapshot.daemons).

    A publication shared with a daemon of other tables is the plan's refusal
    (its ``shared publication`` step): only the other lines are added here.
    """
    config, db = startup.config, startup.database
    pg = config.postgres
    signals = startup.signal_table
    if signals is not None and signals.exists():
        for job_id, tables, error in failing_jobs(signals, pg.slot):
            yield Finding(
                False,
                f"snapshot: job {job_id} of {', '.join(tables) or '?'} keeps failing ({error}); "
                "the daemon retries it: fix the cause, or set its status to 'cancelled' in "
                f"{signals.name} to give up",
            )
    others = neighbours(db, signals, pg.slot)
    if not others:
        yield Finding(True, f"daemons: no other logical slot on database {db.database}")
        return
    captured = [format_table(s, t) for s, t in startup.captured_tables()]
    for ok, line in sharing_report(others, pg.slot, pg.publication, captured):
        if ok:
            yield Finding(ok, line)


def _synchronous_advice(startup: Startup) -> Iterator[Finding]:
    """Whether cdcd is a synchronous standby, by which entry, and the caveats (docs/synchronous.md)."""
    config, db = startup.config, startup.database
    pg = config.postgres
    app = pg.replication_application_name
    label = "synchronous"
    try:
        status = sync_status(db, pg.slot, app)
    except CdcdError as exc:
        yield Finding(False, f"{label}: cannot read synchronous_standby_names: {exc}")
        return
    state = status.sync_state or "not streaming now"
    if status.entry is None:
        named = f"'{status.setting}'" if status.setting else "empty"
        yield Finding(
            True,
            f"{label}: no (synchronous_standby_names is {named}, which does not name "
            f"application_name {app!r}); pg_stat_replication.sync_state: {state}",
        )
        return
    assert status.names is not None
    rule = f"{status.names.method} {status.names.count} of {len(status.names.names)}"
    if status.entry == "*":
        yield Finding(
            False,
            f"{label}: synchronous_standby_names = '{status.setting}' matches cdcd only through "
            f"'*' ({rule}), so application commits may wait for Kafka by accident ('*' matches "
            "every walsender, logical ones included); list the physical standbys by name, or "
            f"name cdcd ({app!r}) if it is meant",
        )
    else:
        spelled = "" if status.entry == app else f" (as {status.entry!r})"
        yield Finding(
            True,
            f"{label}: yes, synchronous_standby_names = '{status.setting}' names "
            f"application_name {app!r}{spelled} ({rule}); pg_stat_replication.sync_state: {state}",
        )
    yield Finding(
        True,
        f"{label} caveat: synchronous_standby_names is server-wide but cdcd decodes one database "
        f"({db.database}): commits in every database wait until cdcd has read past them",
    )
    yield Finding(
        True,
        f"{label} caveat: a transaction that locks a catalog table exclusively (LOCK pg_class, "
        "CLUSTER pg_class, TRUNCATE of a user catalog table) deadlocks with cdcd's decoding "
        "and its commit never returns",
    )
    if pg.protocol_version >= 3:
        yield Finding(
            True,
            f"{label} caveat: protocol_version {pg.protocol_version} decodes two-phase "
            "transactions at PREPARE, and cdcd confirms nothing past a prepared transaction "
            "until its COMMIT PREPARED is delivered, so PREPARE TRANSACTION waits until then; "
            "prepare with synchronous_commit = local, or use protocol_version 2",
        )
    signals = startup.signal_table
    try:
        unfinished = (
            signals is not None
            and signals.exists()
            and signals.unfinished_initial(pg.slot) is not None
        )
    except (CdcdError, SignalTableUnavailable):
        unfinished = False  # reported by the signal table checks
    if unfinished:
        yield Finding(
            True,
            f"{label} caveat: the initial snapshot of slot {pg.slot} has not finished; cdcd "
            "streams, and PostgreSQL counts it as a synchronous standby, only once it has: "
            "until then commits wait if cdcd is needed (alone in the list), or other standbys "
            "answer for it",
        )


def table_schemas(config: CdcdConfig) -> list[dict[str, Any]]:
    """The key and value schemas each captured table gets now."""
    pg = config.postgres
    startup = _startup(config)
    with startup.connect() as db:
        startup.db = db
        try:
            startup.signal_table = SignalTable(db, config.snapshot.signal_table)
        except CdcdError:
            pass  # a bad name: nothing of the database is excluded then
        tables = startup.captured_tables()
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
