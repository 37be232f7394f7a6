"""Publication planning: what the publication is, and what cdcd would make of it.

One concern, read-only: :meth:`PublicationPlanner.plan_publication` reads the
publication and the captured tables from the catalog, checks
``postgres.tables`` against PostgreSQL's rules (replica identities, row
filters, column lists, options) and returns a
:class:`~cdcd.source.publication_plan.PublicationPlan` -- changing nothing, so
``cdcd check`` runs exactly what ``cdcd run`` decides. Carrying a plan out is
:mod:`cdcd.source.publication_reconcile`'s; the SQL text of filters and
targets is :mod:`cdcd.source.publication`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2
import psycopg2.extensions

from cdcd.config.model import PostgresConfig
from cdcd.errors import ConfigError
from cdcd.naming import format_table
from cdcd.source.catalog import RelIdentity, TableCatalog
from cdcd.source.connection import query_failure
from cdcd.source.publication import (
    Drift,
    FilterProbe,
    RelState,
    TableSpec,
    describe_columns,
    describe_filter,
    expression_problem,
    probe_filters,
    publication_options,
    read_rel_states,
    require_publication_features,
    resolve_tables,
    spec_of,
    table_columns,
)
from cdcd.source.publication_plan import (
    BROKEN,
    HARMLESS,
    KEEP,
    MISSING,
    OWNED_PUBLICATION_COMMENT,
    REFUSE,
    SET_FULL,
    PublicationPlan,
    TableVerdict,
    describe_publishes,
)
from cdcd.source.versions import GENERATED_COLUMNS_SINCE, ROW_FILTER_SINCE, VIA_ROOT_SINCE

#: How long cdcd's publication and replica identity DDL may wait for a table
#: lock. Queued behind a long transaction, it would block every application
#: query on the table queued behind it; a timeout is retried as transient.
DDL_LOCK_TIMEOUT = "5s"


class PublicationPlanner(TableCatalog):
    """The metadata connection's questions about the publication; see the module docstring."""

    def publication_exists(self, name: str) -> bool:
        return bool(self.query("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)))

    def publication_tables(self, name: str) -> list[tuple[str, str]]:
        rows = self.query(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s "
            "ORDER BY 1, 2",
            (name,),
        )
        return [(str(s), str(t)) for s, t in rows]

    def resolve_tables(
        self, pg: PostgresConfig, exclude: Iterable[tuple[str, str]] = ()
    ) -> list[tuple[str, str]]:
        """``postgres.tables`` with its patterns expanded (:func:`cdcd.source.publication.resolve_tables`)."""
        return resolve_tables(self.query, pg, exclude)

    def plan_publication(
        self, pg: PostgresConfig, *, exclude: Iterable[tuple[str, str]] = ()
    ) -> PublicationPlan:
        """What ``ensure_publication`` will do, or refuse, for ``pg``; changes nothing.

        A table without a usable replica identity in a publication that
        publishes updates or deletes makes the *application's* UPDATE and
        DELETE on it fail, so cdcd never puts one there: it refuses (a
        configuration error) unless the table's entry opts in to
        ``replica_identity: full``, which cdcd then sets. Row filters and
        column lists are checked against PostgreSQL's rules the same way
        (docs/publication.md), and compared with the publication's.
        ``exclude``: tables a pattern never matches (cdcd's signal table).
        """
        version = self.server_version
        require_publication_features(version, pg)
        name = pg.publication
        via_root = "pubviaroot" if version >= VIA_ROOT_SINCE else "NULL"
        gencols = "pubgencols::text" if version >= GENERATED_COLUMNS_SINCE else "NULL"
        rows = self.query(
            f"SELECT oid, puballtables, pubupdate, pubdelete, "
            f"obj_description(oid, 'pg_publication'), {via_root}, {gencols} "
            "FROM pg_publication WHERE pubname = %s",
            (name,),
        )
        exists = bool(rows)
        if rows:
            oid, all_tables, update, delete, comment, viaroot, pubgencols = rows[0]
            publishes = describe_publishes(bool(update), bool(delete))
        else:
            # CREATE PUBLICATION publishes every kind of change by default.
            oid, all_tables, comment, publishes = None, False, None, describe_publishes(True, True)
            viaroot = pubgencols = None
        owned = comment == OWNED_PUBLICATION_COMMENT
        # An empty list captures every table of the publication, as omitting it does.
        configured = bool(pg.table_names)
        wanted = self.resolve_tables(pg, exclude) if configured else []
        if not configured:
            wanted = self.publication_tables(name) if exists else []
        identity = self.identities(wanted)
        present = [identity[t] for t in wanted if t in identity]
        if not exists:
            members: set[tuple[str, str]] = set()
        elif all_tables or not configured:
            members = {(r.schema, r.table) for r in present}
        else:
            members = self._members(int(oid), present)
        verdicts = []
        for schema, table in wanted:
            relation = identity.get((schema, table))
            spec = spec_of(pg, schema, table) if configured else TableSpec()
            if relation is None:
                action = MISSING
            elif not relation.gap():
                action = KEEP
            elif configured and pg.table_config(format_table(schema, table)).replica_identity == "full":
                action = SET_FULL
            elif not publishes:
                action = HARMLESS
            elif (schema, table) in members:
                action = BROKEN
            else:
                action = REFUSE
            verdicts.append(TableVerdict(schema, table, action, relation, spec))
        add: tuple[TableVerdict, ...] = ()
        stale: tuple[tuple[str, str], ...] = ()
        if exists and configured and not all_tables:
            add = tuple(v for v in verdicts if v.relation and (v.schema, v.table) not in members)
            explicit = self.query(
                "SELECT n.nspname, c.relname FROM pg_publication_rel r "
                "JOIN pg_class c ON c.oid = r.prrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE r.prpubid = %s ORDER BY 1, 2",
                (oid,),
            )
            keep = set(wanted)
            stale = tuple((str(s), str(t)) for s, t in explicit if (s, t) not in keep)
        gaps: tuple[RelIdentity, ...] = ()
        if not exists and pg.create_publication and not configured:
            gaps = tuple(self.tables_without_identity())
        states: dict[tuple[str, str], RelState] = {}
        if exists and not all_tables and version >= ROW_FILTER_SINCE:
            states = read_rel_states(self.query, int(oid))
        problems, drift = self._check_specs(
            pg, name, verdicts, members, states, publishes, bool(all_tables), exists, owned
        )
        if exists:
            drift += self._option_drift(pg, present, viaroot, pubgencols, owned)
        return PublicationPlan(
            name=name,
            exists=exists,
            create_allowed=pg.create_publication,
            owned=owned,
            all_tables=bool(all_tables),
            publishes=publishes,
            configured=configured,
            tables=tuple(verdicts),
            add=add,
            stale=stale,
            all_tables_gaps=gaps,
            member_count=len(self.publication_tables(name)) if exists else 0,
            drift=tuple(drift),
            problems=tuple(problems),
            options=tuple(publication_options(version, pg)),
        )

    def _option_drift(
        self,
        pg: PostgresConfig,
        present: list[RelIdentity],
        viaroot: bool | None,
        pubgencols: str | None,
        owned: bool,
    ) -> list[Drift]:
        """Options the publication has otherwise than configured.

        On a publication cdcd does not own, only those that change what cdcd
        captures count: the partition root setting with a partitioned table
        captured, generated columns with a table that has one.
        """
        out = []
        if viaroot is not None and bool(viaroot) != pg.publish_via_partition_root and (
            owned or any(r.kind == "p" for r in present)
        ):
            out.append(
                Drift(
                    None,
                    "publish_via_partition_root",
                    str(bool(viaroot)).lower(),
                    str(pg.publish_via_partition_root).lower(),
                )
            )
        if pubgencols is not None:
            was = "stored" if pubgencols == "s" else "none"
            becomes = "stored" if pg.publish_generated_columns else "none"
            generated = owned or bool(
                self.scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = ANY(%s::oid[]) "
                    "AND attgenerated = 's' AND NOT attisdropped)",
                    ([r.oid for r in present],),
                )
            )
            if was != becomes and generated:
                out.append(Drift(None, "publish_generated_columns", was, becomes))
        return out

    def _check_specs(
        self,
        pg: PostgresConfig,
        publication: str,
        verdicts: list[TableVerdict],
        members: set[tuple[str, str]],
        states: dict[tuple[str, str], RelState],
        publishes: str,
        all_tables: bool,
        exists: bool,
        owned: bool,
    ) -> tuple[list[ConfigError], list[Drift]]:
        """Each table's filter and column list against PostgreSQL's rules, and the publication's.

        On a publication cdcd owns, ``postgres.tables`` is the whole truth: an
        entry without ``where`` means no filter. On one an operator made, only
        what an entry sets is compared, so a hand-made filter or column list
        is taken as it is (snapshots and schemas read them from the catalog).
        """
        problems: list[ConfigError] = []
        drift: list[Drift] = []
        specified = [v for v in verdicts if v.relation and (v.spec.where or v.spec.columns)]
        if all_tables and specified:
            listed = ", ".join(v.name for v in specified)
            problems.append(
                ConfigError(
                    f"publication {publication} is FOR ALL TABLES, which cannot carry the row "
                    f"filters and column lists postgres.tables sets for {listed}",
                    hint="remove where/columns, or use a publication FOR TABLE "
                    "(create_publication: true creates one)",
                )
            )
            return problems, drift
        for verdict in specified:
            relation = verdict.relation
            if relation and relation.kind == "p" and not pg.publish_via_partition_root:
                # PostgreSQL would refuse it at CREATE PUBLICATION: each
                # partition is then published as itself, with its own settings.
                problems.append(
                    ConfigError(
                        f"postgres.tables: {verdict.name} is a partitioned table and "
                        "postgres.publish_via_partition_root is false: PostgreSQL takes no row "
                        "filter or column list for it then (each partition is published as "
                        "itself)",
                        hint="set publish_via_partition_root: true, or move where/columns to "
                        "entries for its partitions",
                    )
                )
                continue
            problem = self._columns_problem(verdict, publishes)
            if problem is not None:
                problems.append(problem)
            if verdict.spec.where is not None:
                syntax = expression_problem(verdict.spec.where)
                if syntax is not None:
                    problems.append(
                        ConfigError(
                            f"postgres.tables: the where of {verdict.name} is not valid: {syntax}",
                            hint="write one SQL boolean expression over the table's columns",
                        )
                    )
        if problems:
            return problems, drift
        # Filters as PostgreSQL reads them: configured ones, and the publication's.
        # With postgres.tables omitted the publication is taken as it is.
        compared = (
            [v for v in verdicts if v.relation and (v.schema, v.table) in members]
            if exists and pg.table_names
            else []
        )
        items: list[tuple[str, str]] = []
        slots: dict[tuple[str, str, str], int] = {}
        for verdict in verdicts:
            relation = verdict.relation
            if relation is None:
                continue
            texts = [("configured", verdict.spec.where)]
            state = states.get((verdict.schema, verdict.table))
            if verdict in compared and state is not None:
                texts.append(("current", state.where))
            for which, text in texts:
                if text is not None:
                    slots[(verdict.schema, verdict.table, which)] = len(items)
                    items.append((relation.sql_name, text))
        probes = self._probe(items) if items else []
        for verdict in verdicts:
            relation = verdict.relation
            key = (verdict.schema, verdict.table)
            if relation is None or verdict.spec.where is None:
                continue
            probe = probes[slots[(*key, "configured")]]
            if probe.error is not None:
                problems.append(
                    ConfigError(
                        f"postgres.tables: the where of {verdict.name} is not valid for it: "
                        f"{probe.error}",
                        hint="write one SQL boolean expression over the table's columns "
                        "(immutable built-in functions and operators only)",
                    )
                )
                continue
            outside = verdict.outside_identity(probe.columns, publishes)
            if outside:
                one = len(outside) == 1
                problems.append(
                    ConfigError(
                        f"postgres.tables: the where of {verdict.name} uses "
                        f"{'column' if one else 'columns'} {', '.join(outside)}, which "
                        f"{'is' if one else 'are'} not part of its replica identity "
                        f"({relation.describe()}); PostgreSQL's rule: a row filter of a "
                        f"publication that publishes updates or deletes ({publication} "
                        f"publishes {publishes}) may use only replica identity columns, else "
                        "the application's UPDATE and DELETE on the table fail",
                        hint="filter on replica identity columns only; or set "
                        "replica_identity: full on the entry (ALTER TABLE … REPLICA IDENTITY "
                        "FULL); or publish only inserts (a publication WITH (publish = "
                        "'insert, truncate') and create_publication: false)",
                    )
                )
        if problems:
            return problems, drift
        for verdict in compared:
            key = (verdict.schema, verdict.table)
            state = states.get(key, RelState(None, None))
            spec = verdict.spec
            configured = probes[slots[(*key, "configured")]] if spec.where is not None else None
            current = probes[slots[(*key, "current")]] if state.where is not None else None
            if (owned or spec.where is not None) and (
                (configured is None) != (current is None)
                or configured is not None
                and current is not None
                and configured.definition != current.definition
            ):
                drift.append(
                    Drift(
                        verdict.name,
                        "row filter",
                        describe_filter(state.where),
                        describe_filter(spec.where),
                    )
                )
            if (owned or spec.columns is not None) and (
                (spec.columns is None) != (state.columns is None)
                or spec.columns is not None
                and state.columns is not None
                and set(spec.columns) != set(state.columns)
            ):
                drift.append(
                    Drift(
                        verdict.name,
                        "column list",
                        describe_columns(state.columns),
                        describe_columns(spec.columns),
                    )
                )
        return problems, drift

    def _columns_problem(self, verdict: TableVerdict, publishes: str) -> ConfigError | None:
        """A column list naming a column the table lacks, or leaving out its replica identity."""
        relation, columns = verdict.relation, verdict.spec.columns
        if relation is None or columns is None:
            return None
        have = table_columns(self.query, relation.oid)
        names = [n for n, _ in have]
        unknown = [c for c in columns if c not in names]
        if unknown:
            one = len(unknown) == 1
            return ConfigError(
                f"postgres.tables: {verdict.name} has no {'column' if one else 'columns'} "
                f"{', '.join(unknown)} (its columns: {', '.join(names)})",
                hint="fix the columns of its entry",
            )
        identity = verdict.identity_columns(publishes, [n for n, g in have if not g])
        omitted = [c for c in identity if c not in columns]
        if omitted:
            one = len(omitted) == 1
            return ConfigError(
                f"postgres.tables: the column list of {verdict.name} omits "
                f"{', '.join(omitted)}, {'a' if one else ''} replica identity "
                f"column{'' if one else 's'} ({relation.describe()}); PostgreSQL's rule: the "
                "column list must include the replica identity (cdcd keys its messages by it)",
                hint=f"add {', '.join(omitted)} to its columns",
            )
        return None

    def _probe(self, items: list[tuple[str, str]]) -> list[FilterProbe]:
        """:func:`cdcd.source.publication.probe_filters` in a transaction rolled back."""
        try:
            with self.ddl_transaction() as cur:
                return probe_filters(cur, items)
        except psycopg2.Error as exc:
            raise query_failure(exc, "CREATE TEMP VIEW", "read a row filter", self._user) from exc

    @contextmanager
    def ddl_transaction(self) -> Iterator[Any]:
        """A cursor in a transaction whose locks wait :data:`DDL_LOCK_TIMEOUT` at most.

        Rolled back on leaving unless the caller committed it: probes leave
        nothing behind, a failed reconciliation leaves the database as it was.
        """
        with self.conn.cursor() as cur:
            try:
                cur.execute("BEGIN")
                cur.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
                yield cur
            finally:
                if self.conn.info.transaction_status in (
                    psycopg2.extensions.TRANSACTION_STATUS_INTRANS,
                    psycopg2.extensions.TRANSACTION_STATUS_INERROR,
                ):
                    cur.execute("ROLLBACK")

    def _members(self, publication: int, relations: list[RelIdentity]) -> set[tuple[str, str]]:
        """Which of ``relations`` the publication includes: listed, by schema, or by an ancestor."""
        by_schema = (
            " OR a.relnamespace IN (SELECT pnnspid FROM pg_publication_namespace "
            "WHERE pnpubid = %(pub)s)"
            if self.server_version >= 150000
            else ""
        )
        rows = self.query(
            "SELECT w.relid FROM unnest(%(oids)s::oid[]) AS w(relid) WHERE EXISTS ("
            # pg_partition_ancestors has no rows for a table that is not a partition.
            "SELECT 1 FROM (SELECT w.relid UNION SELECT relid FROM pg_partition_ancestors(w.relid)) "
            "AS p(relid) JOIN pg_class a ON a.oid = p.relid WHERE p.relid IN (SELECT prrelid FROM pg_publication_rel WHERE prpubid = %(pub)s)"
            f"{by_schema})",
            {"pub": publication, "oids": [r.oid for r in relations]},
        )
        found = {int(r[0]) for r in rows}
        return {(r.schema, r.table) for r in relations if r.oid in found}
