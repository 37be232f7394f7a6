"""postgres.tables entries as the model reads them, and what needs no server to decide.

Patterns, the entry a table's settings come from, refused shapes (a topic on
a pattern, a column twice), the version refusals of the publication
settings, the filter text guard and pattern expansion over a catalog.
"""

from __future__ import annotations

from typing import Any

import pytest

from cdcd.config.model import PostgresConfig, parse_config
from cdcd.errors import ConfigError
from cdcd.source.publication import (
    Drift,
    TableSpec,
    expression_problem,
    publication_options,
    require_publication_features,
    resolve_tables,
    target_sql,
)
from cdcd.source.replication import ReplicationStream


def _pg(**postgres: Any) -> PostgresConfig:
    return PostgresConfig(dsn="host=x", **postgres)


def _parse_error(tables: list[Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config({"postgres": {"dsn": "host=x", "tables": tables},
                      "kafka": {"bootstrap_servers": "x:9092"}})
    return str(caught.value)


def test_patterns_and_the_entry_a_table_takes_its_settings_from() -> None:
    pg = _pg(
        tables=[
            {"name": "public.*", "where": "id > 0"},
            {"name": "public.orders", "where": "id > 5", "columns": ["id", "region"]},
            "public.plain",
            {"name": "sales.order_?", "columns": ["id"]},
            {"name": "sales.*", "where": "id < 0"},
        ]
    )
    assert pg.patterns == ["public.*", "sales.order_?", "sales.*"]
    # The exact entry wins over a pattern listed before it.
    assert pg.table_config("public.orders").where == "id > 5"
    assert pg.table_config('"public"."orders"').columns == ["id", "region"]
    # A plain name entry means "no settings", whatever pattern matches it.
    assert pg.table_config("public.plain").where is None
    assert pg.table_config("public.other").where == "id > 0"
    # Among patterns, the first that matches.
    assert pg.table_config("sales.order_1").columns == ["id"]
    assert pg.table_config("sales.order_1").where is None
    assert pg.table_config("sales.x").where == "id < 0"
    assert pg.table_config("other.x").where is None


def test_refused_entries_are_one_line() -> None:
    assert _parse_error([{"name": "public.*", "topic": "t"}]) == (
        "configuration: 'postgres.tables': 'public.*' is a pattern: topic names one table's topic"
    )
    assert _parse_error([{"name": "public.o", "columns": ["a", "b", "a"]}]) == (
        "configuration: 'postgres.tables.0.columns': a column is listed twice"
    )
    assert _parse_error([{"name": "public.o", "columns": []}]).startswith(
        "configuration: 'postgres.tables.0.columns': List should have at least 1 item"
    )
    assert _parse_error([{"name": "public.o", "wher": "x"}]) == (
        "configuration: unknown key 'postgres.tables.0.wher' (did you mean 'where'?)"
    )
    assert _parse_error(["public.o", {"name": '"public".o', "where": "x"}]) == (
        "configuration: 'postgres.tables': tables are listed twice"
    )


@pytest.mark.parametrize(
    ("version", "settings", "message"),
    [
        (
            140010,
            {"tables": [{"name": "public.orders", "where": "id > 1"}]},
            "postgres.tables: public.orders sets where, which needs PostgreSQL 15 or newer "
            "(row filters), but the server is PostgreSQL 14.10; remove where from its entry, "
            "or upgrade the server",
        ),
        (
            140010,
            {"tables": [{"name": "public.orders", "columns": ["id"]}]},
            "postgres.tables: public.orders sets columns, which needs PostgreSQL 15 or newer "
            "(column lists), but the server is PostgreSQL 14.10; remove columns from its "
            "entry, or upgrade the server",
        ),
        (
            150018,
            {"origin": "none"},
            "postgres.origin none needs PostgreSQL 16 or newer (pgoutput's origin option), but "
            "the server is PostgreSQL 15.18; set postgres.origin: any",
        ),
        (
            170006,
            {"publish_generated_columns": True},
            "postgres.publish_generated_columns needs PostgreSQL 18 or newer, but the server "
            "is PostgreSQL 17.6; set postgres.publish_generated_columns: false",
        ),
    ],
)
def test_a_setting_the_server_lacks_is_refused(
    version: int, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        require_publication_features(version, _pg(**settings))
    assert str(caught.value) == message
    assert caught.value.exit_code == 2


def test_what_each_version_accepts() -> None:
    require_publication_features(150000, _pg(tables=[{"name": "a.b", "where": "x"}]))
    require_publication_features(160000, _pg(origin="none"))
    require_publication_features(180000, _pg(publish_generated_columns=True))
    require_publication_features(120000, _pg())  # the defaults work everywhere
    assert publication_options(120000, _pg()) == []
    assert publication_options(150000, _pg(publish_via_partition_root=False)) == [
        "publish_via_partition_root = false"
    ]
    assert publication_options(180000, _pg(publish_generated_columns=True)) == [
        "publish_via_partition_root = true",
        "publish_generated_columns = stored",
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("region = 'eu'", None),
        ("note = 'a;b' AND x = (1)", None),
        ("\"odd;name\" = 1", None),
        ("body = $$x;)$$", None),
        ("e = E'it\\'s;'", None),
        ("id > 1; DROP TABLE t", "it holds a ; (one SQL boolean expression, not statements)"),
        ("true), public.secret WHERE (true", "its parentheses do not balance"),
        ("(id > 1", "its parentheses do not balance"),
    ],
)
def test_a_filter_is_one_expression(text: str, problem: str | None) -> None:
    assert expression_problem(text) == problem


def test_targets_and_drift_lines() -> None:
    spec = TableSpec("region = 'eu'", ("id", 'we"ird'))
    assert target_sql("public.orders", spec) == (
        "public.orders (\"id\", \"we\"\"ird\") WHERE (region = 'eu'\n)"
    )
    assert target_sql("public.orders", TableSpec()) == "public.orders"
    drift = Drift("public.orders", "row filter", "((region = 'us'::text))", "(region = 'eu')")
    assert drift.describe("cdcd") == (
        "publication cdcd: public.orders has row filter ((region = 'us'::text)), "
        "postgres.tables says (region = 'eu')"
    )
    assert Drift("public.orders", "row filter", "no row filter", "(id > 1)").describe("p") == (
        "publication p: public.orders has no row filter, postgres.tables says (id > 1)"
    )


def test_patterns_expand_against_the_catalog() -> None:
    catalog = [("public", "a"), ("public", "b"), ("public", "cdcd_signal"), ("sales", "o1")]

    def query(sql: str, params: Any) -> list[tuple[Any, ...]]:
        assert "relispartition" in sql  # partitions come through their root
        return list(catalog)

    pg = _pg(tables=["sales.o1", "public.*", "public.zzz"])
    found = resolve_tables(query, pg, exclude=[("public", "cdcd_signal")])
    # Named tables stay where they are listed (a missing one is reported later).
    assert found == [("sales", "o1"), ("public", "a"), ("public", "b"), ("public", "zzz")]
    with pytest.raises(ConfigError) as caught:
        resolve_tables(query, _pg(tables=["public.a", "nope.*"]))
    assert str(caught.value) == (
        "postgres.tables: pattern nope.* matches no table; fix the pattern, or create the "
        "tables first"
    )
    # Without a pattern the catalog is not read.
    assert resolve_tables(lambda *_: pytest.fail("read"), _pg(tables=["x.y"])) == [("x", "y")]


def test_origin_none_is_asked_of_pgoutput() -> None:
    stream = ReplicationStream.__new__(ReplicationStream)  # options() needs no connection
    stream.protocol_version = 4
    stream.publication = "cdcd"
    stream.server_version = 160000
    assert "origin" not in stream.options()
    stream.origin = "none"
    assert stream.options()["origin"] == "none"


def _config(tables: list[Any]) -> Any:
    return parse_config(
        {"postgres": {"dsn": "host=x", "tables": tables},
         "kafka": {"bootstrap_servers": "b:9092", "topic_prefix": "pg"}}
    )


def test_a_topic_override_is_the_tables_topic_for_producer_and_consumers() -> None:
    config = _config(["public.a", {"name": "public.b", "topic": "custom.b"}])
    assert config.table_topic("public", "a") == "pg.public.a"
    assert config.table_topic("public", "b") == "custom.b"
    assert config.subscription() == (["pg.public.a", "custom.b"], None)


def test_consumers_subscribe_to_a_pattern_by_regex_over_topic_components() -> None:
    import re

    config = _config(["public.a", {"name": "sales.ord?r_*"}, {"name": "x.y", "topic": "custom.t"}])
    topics, pattern = config.subscription()
    assert topics == [] and pattern is not None
    regex = re.compile(pattern)
    matched = ["pg.sales.order_1", "pg.sales.ordxr_", "pg.public.a", "custom.t"]
    unmatched = ["pg.sales.order_1.x", "pg.sales.orders", "pg.public.b", "pg._schemas", "pg.x.y"]
    assert [t for t in matched + unmatched if regex.fullmatch(t)] == matched
    # No list at all: every table topic of the prefix.
    assert _config([]).subscription()[1] is not None
