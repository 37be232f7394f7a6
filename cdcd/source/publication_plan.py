"""The publication plan: what cdcd will do with the publication, or why it refuses.

One concern, and no I/O: the value :meth:`PublicationPlanner.plan_publication
<cdcd.source.publication_planner.PublicationPlanner.plan_publication>` computes
from the catalog and that both ``cdcd run`` (which then carries it out,
:mod:`cdcd.source.publication_reconcile`) and ``cdcd check`` (which prints it)
read -- so the two can never decide differently. A table without a usable
replica identity in a publication that publishes updates or deletes makes the
application's UPDATE and DELETE on it fail: each verdict says what cdcd does
about that, and :meth:`PublicationPlan.error` is the one refusal both report.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdcd.errors import CdcdError, ConfigError, DefiniteError
from cdcd.source.catalog import RelIdentity
from cdcd.source.connection import quote_ident
from cdcd.source.publication import Drift, TableSpec, target_sql

#: The comment that marks a publication as cdcd's own. Only such a publication
#: follows ``postgres.tables`` when tables are removed: one an operator made may
#: serve other subscribers.
OWNED_PUBLICATION_COMMENT = "managed by cdcd: membership follows postgres.tables"

#: Tables named in one message before "and N more".
_LISTED = 5


def listing(items: list[str]) -> str:
    """``a, b, c, d, e and 3 more``: the first few of ``items``, so that one line stays short."""
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return ", ".join(items[:_LISTED]) + more

# What cdcd does with one captured table (TableVerdict.action).
KEEP = "keep"  # it has a usable replica identity
MISSING = "missing"  # it does not exist: a configuration error
SET_FULL = "set_full"  # no identity, replica_identity: full: cdcd sets REPLICA IDENTITY FULL
HARMLESS = "harmless"  # no identity, but the publication publishes neither updates nor deletes
REFUSE = "refuse"  # no identity and cdcd would publish it: the application's writes would fail
BROKEN = "broken"  # no identity and already published: the application's writes fail now

#: The three ways out for a table without a replica identity.
WAYS_OUT = (
    "add a primary key; or ALTER TABLE {table} REPLICA IDENTITY FULL (or USING INDEX), or set "
    "replica_identity: full on its postgres.tables entry to let cdcd do it; or publish only "
    "inserts for it (a publication WITH (publish = 'insert, truncate') and "
    "create_publication: false)"
)


@dataclass(frozen=True, slots=True)
class TableVerdict:
    """What cdcd does with one captured table; run and check both read it."""

    schema: str
    table: str
    action: str  # KEEP, MISSING, SET_FULL, HARMLESS, REFUSE or BROKEN
    relation: RelIdentity | None  # None: the table does not exist
    spec: TableSpec = TableSpec()  # its row filter and column list in postgres.tables

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def detail(self) -> str:
        """The identity, or why there is none."""
        if self.relation is None:
            return "does not exist"
        return self.relation.gap() or self.relation.describe()

    def identity_columns(self, publishes: str, all_columns: list[str]) -> tuple[str, ...]:
        """The columns a filter may read and a column list must keep.

        REPLICA IDENTITY FULL (set, or opted in to): every column, but
        PostgreSQL holds a column list to that only when updates or deletes
        are published.
        """
        relation = self.relation
        if relation is None:
            return ()
        if relation.identity == "f" or self.action == SET_FULL:
            return tuple(all_columns) if publishes else ()
        return relation.columns

    def outside_identity(self, used: tuple[str, ...], publishes: str) -> list[str]:
        """The columns of ``used`` (a row filter's) that PostgreSQL's identity rule forbids."""
        relation = self.relation
        if not publishes or relation is None:
            return []
        if relation.identity == "f" or self.action == SET_FULL:
            return []
        if relation.kind == "p" and not relation.columns:
            return []  # each partition's identity decides; PostgreSQL checks the leaves
        return [c for c in used if c not in relation.columns]


@dataclass(frozen=True, slots=True)
class PublicationPlan:
    """The publication as it is, and what ``ensure_publication`` will do to it.

    Computed without changing anything, so ``cdcd check`` reports exactly what
    ``cdcd run`` will do or refuse.
    """

    name: str
    exists: bool
    create_allowed: bool  # postgres.create_publication
    owned: bool  # carries OWNED_PUBLICATION_COMMENT
    all_tables: bool
    publishes: str  # "updates and deletes", "updates", "deletes" or "" (neither)
    configured: bool  # postgres.tables is set
    tables: tuple[TableVerdict, ...]  # configured tables, or the publication's
    add: tuple[TableVerdict, ...]  # not yet in the publication
    stale: tuple[tuple[str, str], ...]  # in the publication, no longer configured
    all_tables_gaps: tuple[RelIdentity, ...]  # FOR ALL TABLES would publish these without identity
    member_count: int
    #: Where the publication differs from the configuration (filters, column
    #: lists, options): reconciled if cdcd owns it, a definite error if not.
    drift: tuple[Drift, ...] = ()
    #: postgres.tables asks what PostgreSQL cannot or must not do (exit 2).
    problems: tuple[ConfigError, ...] = ()
    #: WITH options CREATE PUBLICATION gets (only those the server has).
    options: tuple[str, ...] = ()

    @property
    def reconcile(self) -> bool:
        """Whether ``ensure_publication`` makes a drift good: only on a publication cdcd owns."""
        return self.owned and self.create_allowed

    @property
    def table_drift(self) -> tuple[Drift, ...]:
        return tuple(d for d in self.drift if d.table is not None)

    @property
    def option_drift(self) -> tuple[Drift, ...]:
        return tuple(d for d in self.drift if d.table is None)

    @property
    def create(self) -> bool:
        return not self.exists and self.create_allowed

    @property
    def drop(self) -> tuple[tuple[str, str], ...]:
        """Only a publication cdcd owns follows postgres.tables when tables are removed."""
        return self.stale if self.owned and not self.all_tables and self.configured else ()

    def verdict(self, schema: str, table: str) -> TableVerdict | None:
        for verdict in self.tables:
            if (verdict.schema, verdict.table) == (schema, table):
                return verdict
        return None

    def of(self, action: str) -> list[TableVerdict]:
        return [v for v in self.tables if v.action == action]

    def error(self) -> CdcdError | None:
        """What stops ``cdcd run`` before it changes anything; None: nothing."""
        missing = self.of(MISSING)
        if missing:
            return missing_tables_error([v.name for v in missing])
        if self.problems:
            return self.problems[0]
        refused = self.of(REFUSE)
        if refused:
            return refusal_error(self.name, self.publishes, refused)
        if self.all_tables_gaps:
            return all_tables_refusal_error(self.name, self.all_tables_gaps)
        return self.absent_error() or self.lacking_error() or self.drift_error()

    def drift_error(self) -> DefiniteError | None:
        """A publication cdcd does not own that differs from postgres.tables: run refuses it."""
        if not self.drift or self.reconcile:
            return None
        name = quote_ident(self.name)
        fixes = []
        for drift in self.table_drift:
            verdict = next(v for v in self.tables if v.name == drift.table)
            sql = verdict.relation.sql_name if verdict.relation else str(drift.table)
            target = target_sql(sql, verdict.spec).replace("\n", "")
            fix = f"ALTER PUBLICATION {name} DROP TABLE {sql}; ALTER PUBLICATION {name} ADD TABLE {target}"
            if fix not in fixes:
                fixes.append(fix)
        for drift in self.option_drift:
            fixes.append(f"ALTER PUBLICATION {name} SET ({drift.what} = {drift.becomes})")
        return DefiniteError(
            "; ".join(d.describe(None if i else self.name) for i, d in enumerate(self.drift)),
            hint=f"make them agree ({'; '.join(fixes)}) or change postgres to match; cdcd "
            "changes only a publication it created (create_publication: true)",
        )

    def absent_error(self) -> DefiniteError | None:
        if self.exists or self.create_allowed:
            return None
        return DefiniteError(
            f"publication {self.name} does not exist",
            hint=f"CREATE PUBLICATION {quote_ident(self.name)} FOR ALL TABLES (or FOR TABLE …), "
            "or set postgres.create_publication: true",
        )

    def lacking_error(self) -> DefiniteError | None:
        if not self.add or self.create_allowed:
            return None
        return DefiniteError(
            f"publication {self.name} lacks {', '.join(v.name for v in self.add)}",
            hint=f"ALTER PUBLICATION {quote_ident(self.name)} ADD TABLE …, "
            "or set postgres.create_publication: true",
        )


def missing_tables_error(names: list[str]) -> ConfigError:
    one = len(names) == 1
    return ConfigError(
        f"{'table' if one else 'tables'} {', '.join(names)} {'does' if one else 'do'} not exist",
        hint=f"create {'it' if one else 'them'} or remove {'it' if one else 'them'} "
        "from postgres.tables",
    )


def refusal_error(publication: str, publishes: str, refused: list[TableVerdict]) -> ConfigError:
    """The one line that refuses tables whose UPDATE/DELETE publishing them would break."""
    one = len(refused) == 1
    listed = ", ".join(f"{v.name} ({v.detail})" for v in refused)
    it = "it" if one else "them"
    table = alter_target(refused[0]) if one else "<table>"
    return ConfigError(
        f"{'table' if one else 'tables'} {listed} {'has' if one else 'have'} no replica "
        f"identity: in publication {publication}, which publishes {publishes}, the application's "
        f"UPDATE and DELETE on {it} would fail, so cdcd refuses to publish {it}",
        hint=WAYS_OUT.format(table=table),
    )


def alter_target(verdict: TableVerdict) -> str:
    """The table to name in ``ALTER TABLE … REPLICA IDENTITY FULL``: a partition, not its parent."""
    lacking = verdict.relation.lacking() if verdict.relation else ()
    return lacking[0].sql_name if len(lacking) == 1 else "<table>"


def all_tables_refusal_error(publication: str, gaps: tuple[RelIdentity, ...]) -> ConfigError:
    listed = listing([f"{r.name} ({r.gap()})" for r in gaps])
    return ConfigError(
        f"publication {publication} would be created FOR ALL TABLES (postgres.tables is "
        f"omitted) and {len(gaps)} table{'s' if len(gaps) != 1 else ''} in the database "
        f"{'have' if len(gaps) != 1 else 'has'} no replica identity: {listed}; the "
        "application's UPDATE and DELETE on them would fail, so cdcd refuses to create it",
        hint="list the tables to capture in postgres.tables; or give each a primary key or "
        "ALTER TABLE <table> REPLICA IDENTITY FULL (or USING INDEX); or create the publication "
        "yourself WITH (publish = 'insert, truncate') and set create_publication: false",
    )


def describe_publishes(update: bool, delete: bool) -> str:
    """``updates and deletes``, ``updates``, ``deletes`` or ``""``: what PublicationPlan.publishes says."""
    return " and ".join(w for w, on in (("updates", update), ("deletes", delete)) if on)
