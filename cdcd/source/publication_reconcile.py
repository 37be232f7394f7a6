"""Publication reconciliation: making the publication what the plan decided.

One concern, and the only place cdcd changes the publication or a table:
:meth:`PublicationReconciler.ensure_publication` plans
(:mod:`cdcd.source.publication_planner`), raises what the plan refuses, and
otherwise runs the plan's statements -- create, comment, replica identities,
add, drop, set -- in one transaction, so a failure leaves the database as it
was. Each lock waits :data:`~cdcd.source.publication_planner.DDL_LOCK_TIMEOUT`
at most: queued behind a long transaction, the DDL would block the
application's queries on the table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg2
import psycopg2.errors

from cdcd.config.model import PostgresConfig
from cdcd.errors import DefiniteError, TransientError
from cdcd.source.catalog import RelIdentity
from cdcd.source.connection import first_line, quote_ident
from cdcd.source.publication import describe_columns, describe_filter, target_sql
from cdcd.source.publication_plan import (
    BROKEN,
    OWNED_PUBLICATION_COMMENT,
    SET_FULL,
    PublicationPlan,
    TableVerdict,
    listing,
)
from cdcd.source.publication_planner import DDL_LOCK_TIMEOUT, PublicationPlanner

log = logging.getLogger("cdcd.source")


def _targets(verdicts: Iterable[TableVerdict]) -> str:
    """The table list of ``FOR TABLE`` / ``SET TABLE`` / ``ADD TABLE``: existing tables only."""
    return ", ".join(target_sql(v.relation.sql_name, v.spec) for v in verdicts if v.relation)


@dataclass(frozen=True, slots=True)
class _Step:
    """One statement of ``ensure_publication``'s transaction."""

    sql: str
    params: Any = None
    table: RelIdentity | None = None  # the table an ALTER TABLE changes


def _privilege_error(
    publication: str, table: RelIdentity | None, exc: psycopg2.Error
) -> DefiniteError:
    if table is None:
        return DefiniteError(
            f"not allowed to create or alter publication {publication}: {first_line(exc)}",
            hint="create the publication as the table owner or a superuser",
        )
    return DefiniteError(
        f"not allowed to set REPLICA IDENTITY FULL on table {table.name} "
        f"(replica_identity: full): {first_line(exc)}",
        hint=f"run ALTER TABLE {table.sql_name} REPLICA IDENTITY FULL as its owner "
        f"{table.owner}, or let cdcd's role act as the owner (GRANT {table.owner} TO <cdcd role>)",
    )


class PublicationReconciler(PublicationPlanner):
    """The metadata connection's one writer of the publication; see the module docstring."""

    def ensure_publication(
        self, pg: PostgresConfig, *, exclude: Iterable[tuple[str, str]] = ()
    ) -> PublicationPlan:
        """Make the publication what ``plan_publication`` decided, or raise what it refuses.

        Creates it (marked as cdcd's own) if allowed, with the configured row
        filters, column lists and options; sets the replica identities opted
        in to; adds configured tables it lacks; on a publication cdcd owns,
        drops the tables no longer configured and makes a drifted filter,
        column list or option what the configuration says -- all in one
        transaction, so a failure leaves the database as it was.
        """
        plan = self.plan_publication(pg, exclude=exclude)
        error = plan.error()
        if error is not None:
            raise error
        name = quote_ident(plan.name)
        steps: list[_Step] = []
        set_full = [r for v in plan.of(SET_FULL) if v.relation for r in v.relation.lacking()]
        for relation in set_full:
            steps.append(_Step(f"ALTER TABLE {relation.sql_name} REPLICA IDENTITY FULL", table=relation))
        if plan.create:
            targets = _targets(plan.tables)
            options = f" WITH ({', '.join(plan.options)})" if plan.options else ""
            steps.append(
                _Step(
                    f"CREATE PUBLICATION {name} "
                    + (f"FOR TABLE {targets}" if plan.configured else "FOR ALL TABLES")
                    + options
                )
            )
            comment = (OWNED_PUBLICATION_COMMENT,)
            steps.append(_Step(f"COMMENT ON PUBLICATION {name} IS %s", comment))
        # A drifted filter or column list: the whole table list set anew
        # (PostgreSQL 15+'s SET TABLE), which also adds and drops.
        reset = plan.reconcile and bool(plan.table_drift)
        if reset:
            targets = _targets(plan.tables)
            steps.append(_Step(f"ALTER PUBLICATION {name} SET TABLE {targets}"))
        if plan.reconcile and plan.option_drift:
            options = ", ".join(f"{d.what} = {d.becomes}" for d in plan.option_drift)
            steps.append(_Step(f"ALTER PUBLICATION {name} SET ({options})"))
        if plan.add and not reset:
            targets = _targets(plan.add)
            steps.append(_Step(f"ALTER PUBLICATION {name} ADD TABLE {targets}"))
        if plan.drop and not reset:
            targets = ", ".join(f"{quote_ident(s)}.{quote_ident(t)}" for s, t in plan.drop)
            steps.append(_Step(f"ALTER PUBLICATION {name} DROP TABLE {targets}"))
        if plan.stale and not plan.drop:
            log.debug(
                "publication %s is not cdcd's own: keeping %s in it although not configured",
                plan.name,
                ", ".join(f"{s}.{t}" for s, t in plan.stale),
            )
        broken = plan.of(BROKEN)
        if broken:
            listed = listing([f"{v.name} ({v.detail})" for v in broken])
            log.warning(
                "publication %s publishes %s and already includes tables without replica "
                "identity: %s; the application's UPDATE and DELETE on them fail until each "
                "gets a primary key or REPLICA IDENTITY FULL, or leaves the publication",
                plan.name,
                plan.publishes,
                listed,
            )
        if steps:
            self._transaction(plan.name, steps)
        for relation in set_full:
            log.info(
                "set REPLICA IDENTITY FULL on table %s (replica_identity: full)",
                relation.name,
                extra={"table": relation.name},
            )
        if plan.create:
            what = ", ".join(v.name for v in plan.tables) if plan.configured else "ALL TABLES"
            log.info(
                "created publication %s FOR %s%s",
                plan.name,
                what,
                f" WITH ({', '.join(plan.options)})" if plan.options else "",
            )
            for verdict in plan.tables:
                if verdict.spec.where is not None or verdict.spec.columns is not None:
                    log.info(
                        "publication %s: %s with row filter %s, columns %s",
                        plan.name,
                        verdict.name,
                        describe_filter(verdict.spec.where),
                        describe_columns(verdict.spec.columns),
                        extra={"table": verdict.name},
                    )
        if plan.reconcile:
            for drift in plan.drift:
                log.info(
                    "publication %s: %s %s was %s, now %s (as postgres%s says)",
                    plan.name,
                    drift.table or "option",
                    drift.what,
                    drift.was,
                    drift.becomes,
                    ".tables" if drift.table else f".{drift.what}",
                    extra={"table": drift.table} if drift.table else {},
                )
        for verdict in plan.add:
            log.info(
                "added table %s to publication %s",
                verdict.name,
                plan.name,
                extra={"table": verdict.name},
            )
        for schema, table in plan.drop:
            log.info(
                "dropped table %s.%s from publication %s: no longer in postgres.tables",
                schema,
                table,
                plan.name,
                extra={"table": f"{schema}.{table}"},
            )
        return plan

    def _transaction(self, publication: str, steps: list[_Step]) -> None:
        """Run ``steps`` in one transaction: all of them happen, or none."""
        try:
            with self.ddl_transaction() as cur:
                for step in steps:
                    try:
                        cur.execute(step.sql, step.params)
                    except psycopg2.errors.InsufficientPrivilege as exc:
                        raise _privilege_error(publication, step.table, exc) from exc
                    except psycopg2.errors.LockNotAvailable as exc:
                        raise TransientError(
                            f"no lock within {DDL_LOCK_TIMEOUT} for {step.sql.split(' %s')[0]!r}: "
                            "a long transaction holds the table; retrying"
                        ) from exc
                    except psycopg2.OperationalError:
                        raise
                    except psycopg2.Error as exc:
                        raise DefiniteError(
                            f"cannot run {step.sql.split(' %s')[0]!r}: {first_line(exc)}",
                            hint=f"fix it by hand, then restart cdcd (publication {publication})",
                        ) from exc
                cur.execute("COMMIT")
        except psycopg2.OperationalError as exc:
            raise TransientError(f"PostgreSQL connection lost: {first_line(exc)}") from exc
