"""One naming module (issue 15): topic names and specs, ``schema.table``, headers, magic bytes.

``cdcd.naming`` is the only place these names are spelled; the grammar of
``schema.table`` has one parser and one formatter, used by the configuration,
the source, snapshots, ``cdcd mirror`` and ``read_changes`` alike.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cdcd import naming
from cdcd.config.model import PostgresConfig
from cdcd.errors import DefiniteError
from cdcd.naming import (
    TopicSpec,
    format_table,
    message_topic,
    parse_table,
    schemas_topic,
    split_table,
    table_topic,
    table_topic_pattern,
    topic_spec,
    transaction_topic,
)

CDCD = Path(naming.__file__).parent

#: PostgreSQL identifiers: anything but NUL; dots, quotes and spaces included.
identifiers = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1
)
#: The same, biased to the characters the grammar treats specially.
tricky = st.text(st.sampled_from('a.". Z_é\n'), min_size=1, max_size=8)
names = identifiers | tricky


# ------------------------------------------------------------- schema.table


@given(names, names)
@example("public", "orders")
@example("a.b", "c")
@example("a", "b.c")
@example('we"ird', 'q"."x')
@example("my schema", " spaced table ")
@example('"', ".")
def test_format_then_parse_round_trips(schema: str, table: str) -> None:
    text = format_table(schema, table)
    assert parse_table(text) == (schema, table)
    assert split_table(text) == (schema, table)
    assert parse_table(text, default_schema="other") == (schema, table)


@given(names)
def test_lone_name_with_default_schema(table: str) -> None:
    lone = format_table("s", table).removeprefix("s.")
    assert parse_table(lone, default_schema="public") == ("public", table)


@given(st.text(st.sampled_from('ab."'), max_size=10))
def test_parse_accepts_exactly_what_format_produces(text: str) -> None:
    parsed = parse_table(text)
    if parsed is not None:
        # Different spellings of one name parse alike and re-parse alike.
        assert parse_table(format_table(*parsed)) == parsed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("public.orders", ("public", "orders")),
        ("Sales.Orders", ("Sales", "Orders")),  # taken literally, not case-folded
        ('"public"."orders"', ("public", "orders")),
        ('"a.b".c', ("a.b", "c")),
        ('a."b.c"', ("a", "b.c")),
        ('"we""ird"."x y"', ('we"ird', "x y")),
        ('"."."."', (".", ".")),
        ("my schema.my table", ("my schema", "my table")),
    ],
)
def test_parse_examples(text: str, expected: tuple[str, str]) -> None:
    assert parse_table(text) == expected


@pytest.mark.parametrize(
    "text",
    ["orders", "a.b.c", '"a.b', 'a"b.c', '"a".b"', "a.", ".b", "", '"".t', '"a"x.b'],
)
def test_parse_rejects(text: str) -> None:
    assert parse_table(text) is None
    with pytest.raises(DefiniteError, match="is not schema.table"):
        split_table(text)


def test_format_quotes_only_when_needed() -> None:
    assert format_table("public", "orders") == "public.orders"
    assert format_table("a.b", 'c"d') == '"a.b"."c""d"'
    with pytest.raises(ValueError):
        format_table("", "t")


# ---------------------------------------------- the grammar, as every module reads it


@given(names, names)
def test_configuration_accepts_every_formatted_name(schema: str, table: str) -> None:
    text = format_table(schema, table)
    pg = PostgresConfig(dsn="host=x", tables=[text, {"name": "other.t", "replica_identity": "full"}])
    assert pg.table_names == [text, "other.t"]


@given(st.text(st.sampled_from('ab."'), max_size=8))
def test_configuration_accepts_what_the_parser_accepts(text: str) -> None:
    if parse_table(text) is None:
        with pytest.raises(ValueError, match="is not schema.table"):
            PostgresConfig(dsn="host=x", tables=[text])
    else:
        assert PostgresConfig(dsn="host=x", tables=[text]).table_names == [text]


def test_configuration_compares_names_not_spellings() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        PostgresConfig(dsn="host=x", tables=["public.t", '"public"."t"'])
    pg = PostgresConfig(
        dsn="host=x", tables=[{"name": '"a.b"."t"', "replica_identity": "full"}]
    )
    # The source looks settings up by the formatted name of the table it found.
    assert pg.table_config(format_table("a.b", "t")).replica_identity == "full"
    assert pg.table_config("public.t").replica_identity is None


def test_mirror_subscribes_to_the_topics_of_quoted_names() -> None:
    from cdcd.config.model import parse_config
    from cdcd.spark.cli import _subscription

    tables = ['"a.b".c', 'public."x""y"', "plain.t"]
    config = parse_config(
        {
            "postgres": {"dsn": "host=x", "tables": tables},
            "kafka": {"bootstrap_servers": "b:9092", "topic_prefix": "p"},
        }
    )
    subscribed = _subscription(config)["subscribe"].split(",")
    assert subscribed == [
        table_topic("p", "a.b", "c"),
        table_topic("p", "public", 'x"y'),
        "p.plain.t",
    ]


# ------------------------------------------------------------------- topics


def test_table_topic_names() -> None:
    assert table_topic("pg", "public", "orders") == "pg.public.orders"
    assert table_topic("pg", "Sales", "Order-Items_2") == "pg.Sales.Order-Items_2"
    # Names Kafka cannot carry are rewritten and disambiguated by a hash.
    assert table_topic("pg", "a.b", "c") != table_topic("pg", "a", "b.c")
    assert len(table_topic("pg", "s" * 63, "t" * 300)) == 249


@given(st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,20}", fullmatch=True), names, names)
@example("pg", "public", "transaction")
@example("pg", "public", "message")
@example("pg", "public", "_schemas")
def test_topic_spec_by_what_the_topic_is(prefix: str, schema: str, table: str) -> None:
    topic = table_topic(prefix, schema, table)
    assert re.fullmatch(r"[A-Za-z0-9._-]{1,249}", topic)
    assert re.fullmatch(table_topic_pattern(prefix), topic)
    spec = topic_spec(prefix, topic, table_partitions=6, replication_factor=3)
    assert spec == TopicSpec(topic, 6, 3)
    for auxiliary in (transaction_topic(prefix), message_topic(prefix)):
        assert topic_spec(prefix, auxiliary, table_partitions=6, replication_factor=3) == (
            TopicSpec(auxiliary, 1, 3)
        )
        assert not re.fullmatch(table_topic_pattern(prefix), auxiliary)
    schemas = schemas_topic(prefix)
    assert topic_spec(prefix, schemas, table_partitions=6, replication_factor=3) == TopicSpec(
        schemas, 1, 3, {"cleanup.policy": "compact"}
    )
    assert not re.fullmatch(table_topic_pattern(prefix), schemas)


def test_wire_names() -> None:
    # Published contract (SPEC §4, §5): consumers depend on these exact bytes.
    assert (naming.LSN_HEADER, naming.SEQ_HEADER) == ("cdcd.lsn", "cdcd.seq")
    assert naming.SINGLE_OBJECT_MAGIC == bytes([0xC3, 0x01])
    assert naming.CONFLUENT_MAGIC == bytes([0])
    assert schemas_topic("pg") == "pg._schemas"
    assert transaction_topic("pg") == "pg.transaction"
    assert message_topic("pg") == "pg.message"


def test_publisher_headers_are_built_from_the_names() -> None:
    from cdcd.pipeline import publisher

    assert publisher._SEQ_HEADERS[7] == (naming.SEQ_HEADER, b"7")


# ------------------------------------------- nobody else spells these names


_NAMES = {
    naming.LSN_HEADER,
    naming.SEQ_HEADER,
    naming.HEARTBEAT_PREFIX,
    naming.WATERMARK_PREFIX,
    naming.ORIGINAL_NAME_ATTRIBUTE,
}
#: A topic name or f-string fragment ending in one of the auxiliary topics (no spaces: prose is not).
_AUXILIARY = re.compile(r"\S*\.(?:transaction|message|_schemas)")


def _docstrings(tree: ast.AST) -> set[int]:
    """Bare string statements (docstrings, attribute docs): prose, not names."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def _spellings(path: Path, root: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    prose = _docstrings(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and id(node) not in prose:
            value = node.value
            if isinstance(value, str) and (value in _NAMES or _AUXILIARY.fullmatch(value)):
                found.append(f"{where}: {value!r}")
            if isinstance(value, str) and '[^".]' in value:
                found.append(f"{where}: a schema.table regex {value!r}")
            if isinstance(value, bytes) and naming.SINGLE_OBJECT_MAGIC in value:
                found.append(f"{where}: single-object magic {value!r}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            # part.strip('"'): an ad-hoc unquoting of schema.table
            if node.func.attr in ("strip", "removeprefix", "removesuffix") and any(
                isinstance(arg, ast.Constant) and arg.value == '"' for arg in node.args
            ):
                found.append(f"{where}: .{node.func.attr}('\"')")
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and "MAGIC" in target.id:
                    found.append(f"{where}: defines {target.id}")
    return found


def test_no_module_but_naming_spells_the_names() -> None:
    sources = sorted(p for p in CDCD.rglob("*.py") if p != Path(naming.__file__))
    assert len(sources) > 50
    found = [hit for path in sources for hit in _spellings(path, CDCD.parent)]
    assert found == []


def test_the_scan_finds_a_spelling(tmp_path: Path) -> None:
    """The scan above can fail: each kind of spelling is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""A docstring may say <prefix>._schemas and cdcd.lsn."""\n'
        'TOPIC = f"{prefix}._schemas"\n'
        'HEADER = ("cdcd.lsn", b"0/0")\n'
        'MAGIC = b"\\xc3\\x01"\n'
        "schema, table = (p.strip('\"') for p in name.split('.', 1))\n",
        encoding="utf-8",
    )
    found = _spellings(probe, tmp_path)
    assert len(found) == 5, found
