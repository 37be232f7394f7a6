"""What the startup plan's steps say when ``cdcd check`` runs them dry.

The publication as ``ensure_publication`` will find it (each table with the
words ``run`` would refuse it with, or what ``run`` will do to it), and the
snapshot signal table (there, created by ``run`` and why, or out of reach).
The steps themselves are in :mod:`cdcd.pipeline.startup`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdcd.config.model import CdcdConfig
from cdcd.naming import table_topic
from cdcd.snapshot.store import SignalTable, SignalTableUnavailable
from cdcd.source.publication import describe_columns, describe_filter
from cdcd.source.publication_plan import (
    BROKEN,
    HARMLESS,
    MISSING,
    REFUSE,
    SET_FULL,
    WAYS_OUT,
    PublicationPlan,
    TableVerdict,
    all_tables_refusal_error,
    alter_target,
    missing_tables_error,
    refusal_error,
)

if TYPE_CHECKING:
    from cdcd.pipeline.startup import Startup

__all__ = ["describe_publication", "describe_signal_table"]


def describe_publication(s: Startup, plan: PublicationPlan) -> None:
    """The publication and each captured table, as ``ensure_publication`` will find them."""
    label = f"publication {plan.name}"
    if plan.exists:
        kind = ", FOR ALL TABLES" if plan.all_tables else ""
        owner = ", cdcd's own (membership follows postgres.tables)" if plan.owned else ""
        publishes = f", publishes {plan.publishes or 'neither updates nor deletes'}"
        s.report(True, f"{label}: {plan.member_count} tables{kind}{owner}{publishes}")
        # A table cdcd refuses to publish (no replica identity) is not added: its own FAIL line says so.
        addable = [v for v in plan.add if v.action != REFUSE]
        if addable and plan.create_allowed:
            listed = ", ".join(v.name for v in addable)
            s.report(True, f"{label}: {listed} will be added (create_publication: true)")
        lacking = plan.lacking_error()
        if lacking is not None:
            s.report(False, str(lacking))
        if plan.drop:
            listed = ", ".join(f"{schema}.{table}" for schema, table in plan.drop)
            s.report(True, f"{label}: {listed} no longer in postgres.tables, will be dropped from it")
    elif plan.all_tables_gaps:
        s.report(False, str(all_tables_refusal_error(plan.name, plan.all_tables_gaps)), config=True)
    elif plan.create_allowed:
        what = "" if plan.configured else " FOR ALL TABLES"
        s.report(True, f"{label}: absent, will be created{what} (create_publication: true)")
    else:
        s.report(False, str(plan.absent_error()))
    _publication_settings(s, plan)
    for verdict in plan.tables:
        if (verdict.schema, verdict.table) == s.signal_pair:
            continue  # cdcd never captures its own signal table, even FOR ALL TABLES
        ok, line, config = _table_line(plan, verdict)
        s.report(ok, line, config)
        if verdict.relation is not None and verdict.relation.kind == "p":
            s.report(True, _partition_line(s.config, verdict))


def _publication_settings(s: Startup, plan: PublicationPlan) -> None:
    """Origin, the validation problems and the drift, as ``run`` will meet them."""
    if s.config.postgres.origin == "none":
        s.report(
            True,
            "origin: none, changes applied by replication (a subscription's, with a "
            "replication origin) are not captured",
        )
    else:
        s.report(True, "origin: any, every change is captured")
    for problem in plan.problems:
        s.report(False, str(problem), config=True)
    if not plan.drift:
        return
    if plan.reconcile:
        for drift in plan.drift:
            s.report(True, f"{drift.describe(plan.name)}; `cdcd run` changes it (cdcd's own publication)")
        return
    error = plan.drift_error()
    if error is not None:
        s.report(False, str(error))


def _partition_line(config: CdcdConfig, verdict: TableVerdict) -> str:
    """Where a partitioned table's changes go (publish_via_partition_root)."""
    relation = verdict.relation
    count = len(relation.partitions) if relation else 0
    if config.postgres.publish_via_partition_root:
        topic = table_topic(config.kafka.topic_prefix, verdict.schema, verdict.table)
        return (
            f"partitioned table {verdict.name}: its {count} partitions publish to its own "
            f"topic {topic} (publish_via_partition_root: true)"
        )
    return (
        f"partitioned table {verdict.name}: each partition gets its own topic "
        f"(publish_via_partition_root: false; {count} partitions)"
    )


def _table_line(plan: PublicationPlan, verdict: TableVerdict) -> tuple[bool, str, bool]:
    """One table's line: the same text ``run`` refuses it with, or what ``run`` will do."""
    line = f"table {verdict.name}: {verdict.detail}"
    if verdict.spec.where is not None or verdict.spec.columns is not None:
        line += (
            f"; row filter {describe_filter(verdict.spec.where)}, "
            f"columns {describe_columns(verdict.spec.columns)}"
        )
    if verdict.action == MISSING:
        return False, str(missing_tables_error([verdict.name])), True
    if verdict.action == REFUSE:
        return False, str(refusal_error(plan.name, plan.publishes, [verdict])), True
    if verdict.action == SET_FULL:
        return True, f"{line}; will be set to REPLICA IDENTITY FULL (replica_identity: full)", False
    if verdict.action == HARMLESS:
        return (
            True,
            f"{line}; harmless: publication {plan.name} publishes neither updates nor deletes",
            False,
        )
    if verdict.action == BROKEN:
        # run does not refuse a table it finds already published (it changes
        # nothing there), but the application's writes on it fail now.
        return (
            False,
            f"{line}; publication {plan.name} already includes it and publishes "
            f"{plan.publishes}, so the application's UPDATE and DELETE on it fail now; "
            + WAYS_OUT.format(table=alter_target(verdict)),
            False,
        )
    return True, line, False


def describe_signal_table(s: Startup, table: SignalTable) -> None:
    """The signal table: there, created by ``run`` (when, why), or out of reach."""
    pg, snap = s.config.postgres, s.config.snapshot
    db = s.database
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
            s.report(False, f"{label}: {exc}; {run_hits}")
            return
        missing = table.missing_privileges()
        if missing:
            s.report(
                False,
                f"{label}: exists, but this user lacks {', '.join(missing)} on it; "
                f"`cdcd run` exits 3 when it reads it; GRANT SELECT, INSERT, UPDATE ON "
                f"{table.sql} TO {db.scalar('SELECT current_user')}",
            )
            return
        s.report(True, f"{label}: exists, pending requests: {table.pending()}")
        return
    obstacle = table.cannot_create()
    if initial:
        if obstacle is None:
            s.report(
                True,
                f"{label}: absent; `cdcd run` creates it before it creates slot {pg.slot}, "
                f"to record the initial snapshot (snapshot.mode {snap.mode})",
            )
        # else: the initial snapshot step refuses, with run's words
        return
    if s.config.schema_changes.resnapshot == "auto":
        if obstacle is None:
            s.report(
                True,
                f"{label}: absent; `cdcd run` creates it at startup to record table shapes "
                "and heal migrations that rewrite rows (schema_changes.resnapshot auto, "
                "docs/schema-changes.md)",
            )
        else:
            s.report(
                False,
                f"{label}: absent and cannot be created ({obstacle}); `cdcd run` streams, but "
                "tracks schema changes in memory only and does not heal migrations that "
                "rewrite rows; create it as a user allowed to and grant SELECT, INSERT, UPDATE "
                "(docs/snapshots.md), or set schema_changes.resnapshot never",
            )
        return
    if obstacle is None:
        s.report(
            True,
            f"{label}: absent, not needed to stream; `cdcd snapshot` creates it when you "
            "request an incremental snapshot",
        )
    else:
        s.report(
            True,
            f"{label}: absent, not needed to stream; this user cannot create it ({obstacle}), "
            "so incremental snapshots (`cdcd snapshot`) need it created by a user allowed to "
            "(docs/snapshots.md)",
        )
