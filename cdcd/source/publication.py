"""What ``postgres.tables`` asks of the publication beyond membership (docs/publication.md).

Row filters (``where``) and column lists (``columns``, both PostgreSQL 15+),
``publish_via_partition_root`` and ``publish_generated_columns`` (18+);
table patterns (``public.*``) expanded against the catalog; and the drift
between what the configuration asks and what the publication has.

Filters are compared as PostgreSQL deparses them, never as written: the
configured expression and the publication's (``pg_get_expr`` of
``pg_publication_rel.prqual``) each become the WHERE of a temporary view in
a transaction that is rolled back, and the two view definitions are
compared. The same view's column dependencies (``pg_depend``) name the
columns the filter reads, for PostgreSQL's replica identity rule; creating
it is PostgreSQL's own check that the expression is valid for the table.
Nothing is left behind, and the table is only share-locked (AccessShareLock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cdcd.config.model import PostgresConfig
from cdcd.errors import ConfigError
from cdcd.naming import format_table, matches_table, parse_table, table_globs
from cdcd.source.connection import quote_ident
from cdcd.source.versions import (
    GENERATED_COLUMNS_SINCE,
    ORIGIN_SINCE,
    ROW_FILTER_SINCE,
    VIA_ROOT_SINCE,
    version_text,
)

#: The one statement of a filter probe; ``{expr}`` closes on its own line so
#: that a trailing ``--`` comment in the expression cannot swallow it.
_PROBE_VIEW = "CREATE TEMP VIEW cdcd_filter_probe_{n} AS SELECT 1 FROM {table} WHERE ({expr}\n)"

Query = Callable[[str, Any], list[tuple[Any, ...]]]


@dataclass(frozen=True, slots=True)
class TableSpec:
    """What ``postgres.tables`` asks of one table's publication entry."""

    where: str | None = None
    columns: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class RelState:
    """One table's entry in an existing publication (``pg_publication_rel``)."""

    where: str | None  # pg_get_expr of prqual; None: no filter
    columns: tuple[str, ...] | None  # prattrs as names, in table order; None: every column


@dataclass(frozen=True, slots=True)
class Drift:
    """One difference between the publication and the configuration."""

    table: str | None  # schema.table; None for a publication option
    what: str  # "row filter", "column list", or the option's name
    was: str
    becomes: str

    def describe(self, publication: str | None) -> str:
        """``publication cdcd: public.orders has row filter (region = 'us'), postgres.tables says (region = 'eu')``.

        Without ``publication``, the part after it (for the second difference of one line).
        """
        if self.table is None:
            where = f"publication {publication}" if publication else "the publication"
            return f"{where} has {self.what} = {self.was}, postgres.{self.what} says {self.becomes}"
        was = self.was if self.was.startswith("no ") else f"{self.what} {self.was}"
        said = f"{self.table} has {was}, postgres.tables says {self.becomes}"
        return f"publication {publication}: {said}" if publication else said


def spec_of(pg: PostgresConfig, schema: str, table: str) -> TableSpec:
    """The filter and column list ``postgres.tables`` sets for ``schema.table``."""
    entry = pg.table_config(format_table(schema, table))
    return TableSpec(entry.where, tuple(entry.columns) if entry.columns else None)


def describe_filter(where: str | None) -> str:
    return "no row filter" if where is None else f"({_strip_parens(where)})"


def describe_columns(columns: tuple[str, ...] | None) -> str:
    return "no column list" if columns is None else f"({', '.join(columns)})"


def _strip_parens(text: str) -> str:
    """pg_get_expr wraps a filter in one pair of parentheses; drop it for display."""
    text = text.strip()
    if text.startswith("(") and text.endswith(")") and _balanced(text[1:-1]):
        return text[1:-1]
    return text


def _balanced(text: str) -> bool:
    depth = 0
    for ch in _code_chars(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _code_chars(text: str) -> Iterable[str]:
    """The characters of ``text`` outside string literals, quoted identifiers and
    dollar quotes (inside ones come out as spaces)."""
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "'\"":
            # E'...' takes backslash escapes; a doubled quote is one quote either way.
            escapes = ch == "'" and i > 0 and text[i - 1] in "eE"
            i += 1
            while i < n:
                if escapes and text[i] == "\\":
                    i += 2
                    continue
                if text[i] == ch:
                    if i + 1 < n and text[i + 1] == ch:
                        i += 2
                        continue
                    break
                i += 1
            i += 1
            yield " "
            continue
        if ch == "$":
            end = text.find("$", i + 1)
            tag = text[i : end + 1] if end > 0 else ""
            if tag and all(c.isalnum() or c == "_" for c in tag[1:-1]):
                close = text.find(tag, end + 1)
                i = n if close < 0 else close + len(tag)
                yield " "
                continue
        yield ch
        i += 1


def expression_problem(text: str) -> str | None:
    """Why ``text`` cannot be one row filter expression; None if it may be one.

    It is placed inside ``WHERE (…)`` of a statement: a ``;`` would start
    another statement, and a ``)`` closing more than it opened would end the
    filter early (``true), other_table WHERE (true`` adds a table).
    """
    chars = list(_code_chars(text))
    if ";" in chars:
        return "it holds a ; (one SQL boolean expression, not statements)"
    if not _balanced("".join(chars)):
        return "its parentheses do not balance"
    return None


# -- validation against the server version ----------------------------------------------


def require_publication_features(version_num: int, pg: PostgresConfig) -> None:
    """Refuse a setting the server lacks (one line, exit 2), before anything is created."""
    at = f"the server is PostgreSQL {version_text(version_num)}"
    if version_num < ROW_FILTER_SINCE:
        for entry in pg.tables or ():
            if isinstance(entry, str):
                continue
            for key, value in (("where", entry.where), ("columns", entry.columns)):
                if value is not None:
                    what = "row filters" if key == "where" else "column lists"
                    raise ConfigError(
                        f"postgres.tables: {entry.name} sets {key}, which needs PostgreSQL 15 or "
                        f"newer ({what}), but {at}",
                        hint=f"remove {key} from its entry, or upgrade the server",
                    )
    if pg.origin == "none" and version_num < ORIGIN_SINCE:
        raise ConfigError(
            f"postgres.origin none needs PostgreSQL 16 or newer (pgoutput's origin option), "
            f"but {at}",
            hint="set postgres.origin: any",
        )
    if pg.publish_generated_columns and version_num < GENERATED_COLUMNS_SINCE:
        raise ConfigError(
            f"postgres.publish_generated_columns needs PostgreSQL 18 or newer, but {at}",
            hint="set postgres.publish_generated_columns: false",
        )


def publication_options(version_num: int, pg: PostgresConfig) -> list[str]:
    """The WITH options of CREATE PUBLICATION, only those the server has."""
    options = []
    if version_num >= VIA_ROOT_SINCE:
        options.append(
            f"publish_via_partition_root = {'true' if pg.publish_via_partition_root else 'false'}"
        )
    if version_num >= GENERATED_COLUMNS_SINCE:
        options.append(
            f"publish_generated_columns = {'stored' if pg.publish_generated_columns else 'none'}"
        )
    return options


# -- table patterns -----------------------------------------------------------------------

#: Tables a pattern can match: ordinary and partitioned tables that are not
#: partitions (a partition is captured through its root), permanent, outside
#: the system schemas -- what a publication can hold.
_CANDIDATES = (
    "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relpersistence = 'p' "
    "AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname !~ '^pg_' "
    "ORDER BY 1, 2"
)


def resolve_tables(
    query: Query, pg: PostgresConfig, exclude: Iterable[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """``postgres.tables`` as ``(schema, table)`` pairs, patterns expanded against the catalog.

    Named tables stay as listed (one that does not exist is the caller's to
    report); each pattern adds the tables it matches (see ``_CANDIDATES``),
    sorted, but never one of ``exclude`` (cdcd's signal table). A pattern
    that matches nothing is a configuration error.
    """
    entries = [e if isinstance(e, str) else e.name for e in pg.tables or ()]
    if not any(table_globs(e) for e in entries):
        return [parse_or_fail(e) for e in entries]
    skip = set(exclude)
    candidates = [(str(s), str(t)) for s, t in query(_CANDIDATES, None)]
    out: list[tuple[str, str]] = []
    for entry in entries:
        globs = table_globs(entry)
        if globs is None:
            found = [parse_or_fail(entry)]
        else:
            found = [c for c in candidates if matches_table(globs, *c) and c not in skip]
            if not found:
                raise ConfigError(
                    f"postgres.tables: pattern {entry} matches no table",
                    hint="fix the pattern, or create the tables first",
                )
        out.extend(t for t in found if t not in out)
    return out


def parse_or_fail(name: str) -> tuple[str, str]:
    parsed = parse_table(name)
    if parsed is None:  # the config model already refused it
        raise ConfigError(f"postgres.tables: {name!r} is not schema.table")
    return parsed


# -- what the publication has ---------------------------------------------------------------


def read_rel_states(query: Query, publication_oid: int) -> dict[tuple[str, str], RelState]:
    """Each listed table's row filter and column list (PostgreSQL 15+)."""
    rows = query(
        "SELECT n.nspname, c.relname, pg_get_expr(r.prqual, r.prrelid), "
        "(SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a "
        "WHERE a.attrelid = r.prrelid AND a.attnum = ANY(r.prattrs::int2[])) "
        "FROM pg_publication_rel r JOIN pg_class c ON c.oid = r.prrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE r.prpubid = %s",
        (publication_oid,),
    )
    return {
        (str(s), str(t)): RelState(
            None if where is None else str(where), None if cols is None else tuple(cols)
        )
        for s, t, where, cols in rows
    }


def table_columns(query: Query, oid: int) -> list[tuple[str, bool]]:
    """The table's columns in order, each with whether it is a generated column."""
    rows = query(
        "SELECT attname::text, attgenerated <> '' FROM pg_attribute WHERE attrelid = %s "
        "AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (oid,),
    )
    return [(str(name), bool(generated)) for name, generated in rows]


@dataclass(frozen=True, slots=True)
class FilterProbe:
    """A row filter as PostgreSQL reads it against its table."""

    definition: str | None  # the probe view's definition; None: PostgreSQL refused it
    columns: tuple[str, ...]  # the columns it reads
    error: str | None = None  # PostgreSQL's first line when it refused it


#: SQLSTATE classes of PostgreSQL refusing a filter itself: syntax or an
#: unknown column (42), data (22), a construct a filter may not use (0A).
#: A missing privilege (42501) is no answer about the filter.
_REFUSED_CLASSES = ("42", "22", "0A")


def refused_filter(exc: BaseException) -> bool:
    code = str(getattr(exc, "pgcode", None) or "")
    return code[:2] in _REFUSED_CLASSES and code != "42501"


def probe_filters(cursor: Any, items: list[tuple[str, str]]) -> list[FilterProbe]:
    """Deparse each ``(quoted table, expression)`` through a temporary view (module docstring).

    Runs inside a transaction the caller opened and rolls back; each probe
    has its own savepoint, so one refused expression does not spoil the rest.
    """
    probes = []
    for n, (table, expr) in enumerate(items):
        cursor.execute(f"SAVEPOINT cdcd_probe_{n}")
        try:
            cursor.execute(_PROBE_VIEW.format(n=n, table=table, expr=expr))
        except Exception as exc:
            if not refused_filter(exc):
                raise
            cursor.execute(f"ROLLBACK TO SAVEPOINT cdcd_probe_{n}")
            first = str(exc).strip().splitlines()
            probes.append(FilterProbe(None, (), first[0] if first else type(exc).__name__))
            continue
        view = f"pg_temp.cdcd_filter_probe_{n}"
        cursor.execute(
            "SELECT pg_get_viewdef(%s::regclass), ARRAY(SELECT a.attname::text FROM pg_rewrite r "
            "JOIN pg_depend d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid "
            "JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid "
            "WHERE r.ev_class = %s::regclass AND d.refobjid = %s::regclass "
            "AND d.refobjsubid > 0 ORDER BY a.attnum)",
            (view, view, table),
        )
        definition, columns = cursor.fetchone()
        probes.append(FilterProbe(str(definition), tuple(columns or ())))
    return probes


def target_sql(sql_name: str, spec: TableSpec) -> str:
    """One table of ``FOR TABLE`` / ``SET TABLE`` / ``ADD TABLE``, with its column list and filter."""
    out = sql_name
    if spec.columns is not None:
        out += " (" + ", ".join(quote_ident(c) for c in spec.columns) + ")"
    if spec.where is not None:
        out += f" WHERE ({spec.where}\n)"
    return out
