"""Schema-change classification, defaults and the encoding of ``[T, "null"]`` fields (no PostgreSQL).

``classify`` is given the recorded state, the version the stream sent and
what the catalog says, as cdcd.pipeline.schema_changes reads them; the
encoder tests decode what cdcd writes with plain fastavro and resolve old
records with the new schema, as any consumer would.
"""

from __future__ import annotations

import io
import json
from decimal import Decimal
from typing import Any

import fastavro
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcd.decode.oids import BOOL, DATE, FLOAT8, INT4, INT8, NUMERIC, TEXT, TIMESTAMPTZ, VARCHAR
from cdcd.decode.relations import ColumnDefault, RelationCache, TableVersion
from cdcd.decode.types import StaticCatalog
from cdcd.envelope.encoder import OP_CREATE, TableEncoder, make_stamp
from cdcd.envelope.schemas import envelope_schema
from cdcd.pipeline.schema_changes.catalog import _element_text, _missing_default
from cdcd.pipeline.schema_changes.classify import annotate, classify
from cdcd.pipeline.schema_changes.state import (
    ADD_DEFAULT,
    ADD_NULL,
    ADD_REWRITE,
    DROP,
    IDENTITY,
    RECREATE,
    RENAME,
    TYPE,
    TYPE_REWRITE,
    UNKNOWN,
    CatalogColumn,
    CatalogTable,
    TableState,
)
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import (
    IDENTITY_DEFAULT,
    KIND_NULL,
    KIND_TEXT,
    Column,
    Relation,
    TupleData,
)

CATALOG = StaticCatalog()
RELID = 16_500
STORAGE = (16_501,)
NUMERIC_12_2 = ((12 << 16) | 2) + 4


def version(
    columns: list[tuple[str, int]] | list[tuple[str, int, int]],
    *,
    relid: int = RELID,
    key: tuple[str, ...] = ("id",),
    number: int = 1,
) -> TableVersion:
    cols = tuple(
        Column(1 if c[0] in key else 0, c[0], c[1], c[2] if len(c) > 2 else -1)  # type: ignore[misc]
        for c in columns
    )
    table, _ = RelationCache(CATALOG).on_relation(
        Relation(None, relid, "public", "orders", IDENTITY_DEFAULT, cols)
    )
    return table if number == 1 else TableVersion(**{**_fields(table), "version": number})


def _fields(table: TableVersion) -> dict[str, Any]:
    return {name: getattr(table, name) for name in TableVersion.__slots__}  # type: ignore[attr-defined]


def catalog(
    columns: list[tuple[int, str, int]] | list[tuple[int, str, int, Any]],
    *,
    relid: int = RELID,
    storage: tuple[int, ...] = STORAGE,
    typmods: dict[str, int] | None = None,
    dropped: tuple[int, ...] | None = None,
) -> CatalogTable:
    out = []
    for c in columns:
        default = ColumnDefault(c[3]) if len(c) > 3 else None  # type: ignore[misc]
        out.append(CatalogColumn(c[0], c[1], c[2], (typmods or {}).get(c[1], -1), default))
    return CatalogTable(relid, storage, tuple(out), dropped=dropped)


BASE = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2)])
BASE_CATALOG = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC)],
                       typmods={"amount": NUMERIC_12_2})  # fmt: skip


def baseline(at: int = 100) -> TableState:
    change = classify(None, BASE, BASE_CATALOG, at)
    assert change.save and not change.kinds and not change.heal
    return change.state


# ----------------------------------------------------------------------------- classify


def test_baseline_records_attnums_and_storage() -> None:
    state = baseline()
    assert [c.attnum for c in state.columns] == [1, 2, 3]
    assert state.storage == STORAGE and state.key == ("id",) and state.lsn == 100
    assert TableState.from_json(state.to_json()) == state


def test_same_shape_is_no_change_and_needs_no_catalog() -> None:
    state = baseline()
    change = classify(state, BASE, None, 200)
    assert not change.kinds and not change.save and not change.truncate and change.state == state


def test_fast_default_is_carried_without_heal() -> None:
    state = baseline()
    new = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("region", TEXT)])
    now = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "region", TEXT, "eu")],
                  typmods={"amount": NUMERIC_12_2})  # fmt: skip
    change = classify(state, new, now, 200)
    assert change.kinds == (ADD_DEFAULT,) and not change.heal and change.save
    assert change.state.columns[3].default == ColumnDefault("eu")
    annotated = annotate(new, change.state)
    assert annotated.defaults[3] == ColumnDefault("eu")
    # Sticky: a later unrelated change keeps the default.
    later = version([("id", INT8), ("region", TEXT), ("amount", NUMERIC, NUMERIC_12_2)])
    later_catalog = catalog([(1, "id", INT8), (3, "amount", NUMERIC), (4, "region", TEXT)],
                            typmods={"amount": NUMERIC_12_2})  # fmt: skip
    after = classify(change.state, later, later_catalog, 300)
    assert after.kinds == (DROP,)
    assert [c.default for c in after.state.columns] == [None, ColumnDefault("eu"), None]


def test_column_without_default() -> None:
    new = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("note", TEXT)])
    now = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "note", TEXT)],
                  typmods={"amount": NUMERIC_12_2})  # fmt: skip
    change = classify(baseline(), new, now, 200)
    assert change.kinds == (ADD_NULL,) and not change.heal


def test_column_added_by_a_rewrite_heals() -> None:
    new = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("r", FLOAT8)])
    now = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "r", FLOAT8)],
                  typmods={"amount": NUMERIC_12_2}, storage=(17_000,))  # fmt: skip
    change = classify(baseline(), new, now, 200)
    assert change.kinds == (ADD_REWRITE,) and change.heal
    assert change.state.storage == (17_000,)


def test_default_avro_cannot_carry_heals() -> None:
    new = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("f", FLOAT8)])
    columns = [*BASE_CATALOG.columns, CatalogColumn(4, "f", FLOAT8, -1, None, missing_unexpressible=True)]
    now = CatalogTable(RELID, STORAGE, tuple(columns))
    change = classify(baseline(), new, now, 200)
    assert change.kinds == (ADD_DEFAULT,) and change.heal


def test_rename_keeps_earlier_names_as_aliases() -> None:
    renamed = version([("id", INT8), ("state", TEXT), ("amount", NUMERIC, NUMERIC_12_2)])
    now = catalog([(1, "id", INT8), (2, "state", TEXT), (3, "amount", NUMERIC)], typmods={"amount": NUMERIC_12_2})
    change = classify(baseline(), renamed, now, 200)
    assert change.kinds == (RENAME,) and not change.heal
    assert change.state.columns[1].aliases == ("status",)
    twice = version([("id", INT8), ("phase", TEXT), ("amount", NUMERIC, NUMERIC_12_2)])
    now2 = catalog([(1, "id", INT8), (2, "phase", TEXT), (3, "amount", NUMERIC)], typmods={"amount": NUMERIC_12_2})
    again = classify(change.state, twice, now2, 300)
    assert again.kinds == (RENAME,) and again.state.columns[1].aliases == ("status", "state")
    # Renamed back: the current name is never its own alias.
    back = classify(again.state, BASE, BASE_CATALOG, 400)
    assert back.state.columns[1].aliases == ("state", "phase")


def test_drop_then_add_same_place_is_not_a_rename() -> None:
    new = version([("id", INT8), ("status", TEXT), ("total", NUMERIC, NUMERIC_12_2)])
    now = catalog([(1, "id", INT8), (2, "status", TEXT), (4, "total", NUMERIC)], typmods={"total": NUMERIC_12_2})
    change = classify(baseline(), new, now, 200)
    assert set(change.kinds) == {ADD_NULL, DROP} and RENAME not in change.kinds
    assert change.state.columns[2].aliases == ()


def test_type_change_binary_coercible_and_rewritten() -> None:
    widened = version([("id", INT8), ("status", VARCHAR, 54), ("amount", NUMERIC, NUMERIC_12_2)])
    now = catalog([(1, "id", INT8), (2, "status", VARCHAR), (3, "amount", NUMERIC)],
                  typmods={"status": 54, "amount": NUMERIC_12_2})  # fmt: skip
    change = classify(baseline(), widened, now, 200)
    assert change.kinds == (TYPE,) and not change.heal
    rewritten = catalog([(1, "id", INT8), (2, "status", VARCHAR), (3, "amount", NUMERIC)],
                        typmods={"status": 54, "amount": NUMERIC_12_2}, storage=(18_000,))  # fmt: skip
    change = classify(baseline(), widened, rewritten, 200)
    assert change.kinds == (TYPE_REWRITE,) and change.heal


def test_recreated_table_truncates_and_replays_truncate() -> None:
    fresh = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2)], relid=RELID + 10)
    now = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC)],
                  relid=RELID + 10, typmods={"amount": NUMERIC_12_2})  # fmt: skip
    change = classify(baseline(), fresh, now, 500)
    assert change.kinds == (RECREATE,) and change.truncate and not change.heal
    assert change.state.recreated_lsn == 500
    # After a crash the stream replays the transaction: the truncate goes out again ...
    assert classify(change.state, fresh, None, 500).truncate
    # ... but not for a later session that starts after it.
    assert not classify(change.state, fresh, None, 600).truncate


def test_identity_change() -> None:
    rekeyed = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2)], key=("id", "status"))
    change = classify(baseline(), rekeyed, BASE_CATALOG, 200)
    assert change.kinds == (IDENTITY,) and not change.heal
    assert change.state.key == ("id", "status")


def test_catalog_moved_on_heals() -> None:
    new = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("region", TEXT)])
    # The catalog already lost "region" again (a later DDL): nothing can be ruled out.
    change = classify(baseline(), new, BASE_CATALOG, 200)
    assert UNKNOWN in change.kinds and change.heal
    # The table is gone, or another table has its name now: nothing to heal
    # (a table created again truncates its topic at its first change).
    gone = classify(baseline(), new, None, 200)
    assert UNKNOWN in gone.kinds and not gone.heal and not gone.truncate
    recreated = catalog([(1, "id", INT8)], relid=RELID + 10)
    assert not classify(baseline(), new, recreated, 200).heal


def test_catalog_ahead_without_columns_coming_and_going_places_by_position() -> None:
    """A version met after a later DDL committed (the cause of issue 24's needless heals).

    The state knows attnums 1-3; since then ``status`` became varchar(50)
    (the version), then text and was renamed, and ``region`` was added with
    a fast default: the catalog no longer names the version's types, but no
    column came and went, so each column is where its position says.
    """
    widened = version([("id", INT8), ("status", VARCHAR, 54), ("amount", NUMERIC, NUMERIC_12_2),
                       ("region", TEXT)])  # fmt: skip
    now = catalog([(1, "id", INT8), (2, "phase", TEXT), (3, "amount", NUMERIC), (4, "region", TEXT, "eu")],
                  typmods={"amount": NUMERIC_12_2}, dropped=())  # fmt: skip
    change = classify(baseline(), widened, now, 200)
    assert change.kinds == (TYPE, ADD_DEFAULT) and not change.heal, change.details
    assert [c.attnum for c in change.state.columns] == [1, 2, 3, 4]
    assert change.state.columns[3].default == ColumnDefault("eu") and change.state.unpublished == ()
    # The catalog's version comes next: it is compared with the state just made.
    current = version([("id", INT8), ("phase", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("region", TEXT)])
    after = classify(change.state, current, now, 300)
    assert set(after.kinds) == {TYPE, RENAME} and not after.heal
    assert after.state.columns[1].aliases == ("status",)
    # The same with the table rewritten since: its type change heals.
    rewritten = CatalogTable(RELID, (19_000,), now.columns, dropped=())
    assert classify(baseline(), widened, rewritten, 200).heal


def test_a_version_older_than_the_baseline_read_is_not_placed_by_position() -> None:
    """A baseline read from the catalog after its LSN (at start): versions in between may be older.

    The catalog read at start has x (3, added) where the version committed
    before the read still has y (2, dropped since); by position y would
    pass for a rename of x.
    """
    x = version([("id", INT8), ("x", TEXT)])
    read = catalog([(1, "id", INT8), (3, "x", TEXT)], dropped=(2,))
    state = replace_fields(classify(None, x, read, 100).state, read_lsn=150)
    assert state.gone == (2,) and TableState.from_json(state.to_json()) == state
    older = version([("id", INT8), ("y", INT4)])
    change = classify(state, older, read, 120)
    assert UNKNOWN in change.kinds and change.heal
    # Committed after the read: a rename (of x, retyped) it is.
    assert classify(state, older, read, 150).kinds == (RENAME, TYPE)


def test_a_column_dropped_before_the_state_is_no_candidate() -> None:
    """DROP COLUMN of the last column, then ADD COLUMN: the new one is plainly new."""
    dropped = version([("id", INT8), ("status", TEXT)])
    now = catalog([(1, "id", INT8), (2, "status", TEXT)], dropped=(3,))
    first = classify(baseline(), dropped, now, 200)
    assert first.kinds == (DROP,) and first.state.gone == (3,)
    added = version([("id", INT8), ("status", TEXT), ("note", TEXT)])
    now2 = catalog([(1, "id", INT8), (2, "status", TEXT), (4, "note", TEXT)], dropped=(3,))
    change = classify(first.state, added, now2, 300)
    assert change.kinds == (ADD_NULL,) and not change.heal


@pytest.mark.parametrize(
    ("met", "now"),
    [
        # The dropped columns of the catalog were not read: nothing is provable.
        ([("id", INT8), ("status", VARCHAR, 54), ("amount", NUMERIC, NUMERIC_12_2)],
         catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC)],
                 typmods={"amount": NUMERIC_12_2})),
        # region (attnum 4) was added, then dropped and added again as 5.
        ([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("region", TEXT)],
         catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (5, "region", INT4)],
                 typmods={"amount": NUMERIC_12_2}, dropped=(4,))),
        # amount, known to the state, is gone: which column the version's third is, is unknown.
        ([("id", INT8), ("status", VARCHAR, 54), ("total", NUMERIC, NUMERIC_12_2)],
         catalog([(1, "id", INT8), (2, "status", TEXT), (4, "total", NUMERIC)],
                 typmods={"total": NUMERIC_12_2}, dropped=(3,))),
        # A column was added after the version: fewer columns than the catalog has.
        ([("id", INT8), ("status", VARCHAR, 54), ("amount", NUMERIC, NUMERIC_12_2)],
         catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "x", INT4)],
                 typmods={"amount": NUMERIC_12_2}, dropped=())),
        # Retyped since, with a fast default the catalog holds in the newer type.
        ([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("n", INT4)],
         catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "n", INT8, 7)],
                 typmods={"amount": NUMERIC_12_2}, dropped=())),
    ],
    ids=["dropped-unknown", "re-added", "known-dropped", "added-after", "retyped-default"],
)
def test_catalog_ahead_with_columns_coming_and_going_heals(met: Any, now: CatalogTable) -> None:
    change = classify(baseline(), version(met), now, 200)
    assert UNKNOWN in change.kinds and change.heal


def test_a_name_taken_by_another_column_since_the_version_heals() -> None:
    """The catalog names the version's columns, but one name moved to another attnum since."""
    added = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("region", TEXT)])
    # region (4) was renamed to area and added again (5) before the stream met the version.
    renamed = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "area", TEXT, "eu"),
                       (5, "region", TEXT, "us")], typmods={"amount": NUMERIC_12_2}, dropped=())  # fmt: skip
    change = classify(baseline(), added, renamed, 200)
    assert UNKNOWN in change.kinds and change.heal
    # region (4) was dropped and added again (5) with the same type.
    readded = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (5, "region", TEXT, "us")],
                      typmods={"amount": NUMERIC_12_2}, dropped=(4,))  # fmt: skip
    change = classify(baseline(), added, readded, 200)
    assert UNKNOWN in change.kinds and change.heal
    # The same catalog describing the version itself: a plain addition.
    plain = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "region", TEXT, "eu")],
                    typmods={"amount": NUMERIC_12_2}, dropped=())  # fmt: skip
    assert classify(baseline(), added, plain, 200).kinds == (ADD_DEFAULT,)


@pytest.mark.parametrize(
    ("met", "now", "kinds"),
    [
        ([("id", INT8), ("amount", NUMERIC, NUMERIC_12_2)],
         catalog([(1, "id", INT8), (3, "amount", NUMERIC)], typmods={"amount": NUMERIC_12_2}, dropped=(2,)),
         (DROP,)),
        ([("id", INT8), ("state", TEXT), ("amount", NUMERIC, NUMERIC_12_2)],
         catalog([(1, "id", INT8), (2, "state", TEXT), (3, "amount", NUMERIC)],
                 typmods={"amount": NUMERIC_12_2}, dropped=(5,)),
         (RENAME,)),
        ([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("x", INT4)],
         catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "x", INT4)],
                 typmods={"amount": NUMERIC_12_2}, dropped=()),
         (ADD_NULL,)),
    ],
    ids=["drop", "rename", "add"],
)
def test_a_catalog_describing_the_version_is_taken_by_name(
    met: Any, now: CatalogTable, kinds: tuple[str, ...]
) -> None:
    # Dropped attnums before the state (5 in "rename" is one that came and
    # went after it: harmless when no column of the version is new).
    change = classify(baseline(), version(met), now, 200)
    assert change.kinds == kinds and not change.heal


def test_older_shape_replayed_after_restart_is_not_a_change() -> None:
    state = baseline(at=100)
    renamed = version([("id", INT8), ("state", TEXT), ("amount", NUMERIC, NUMERIC_12_2)])
    now = catalog([(1, "id", INT8), (2, "state", TEXT), (3, "amount", NUMERIC)], typmods={"amount": NUMERIC_12_2})
    recorded = classify(state, renamed, now, 300).state
    # Restart at LSN 200: the stream sends the shape before the rename first.
    replay = classify(recorded, BASE, now, 250)
    assert replay.replay and not replay.kinds and not replay.save and not replay.heal
    assert [c.name for c in replay.state.columns] == ["id", "status", "amount"]
    # Then the renamed shape, at its own LSN: known, nothing new.
    assert not classify(recorded, renamed, None, 300).kinds


def test_rewrite_with_unknown_storage_heals() -> None:
    state = classify(None, BASE, None, 100).state  # first seen with no catalog to match
    assert state.storage is None and all(c.attnum is None for c in state.columns)
    new = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("x", INT4)])
    now = catalog([(1, "id", INT8), (2, "status", TEXT), (3, "amount", NUMERIC), (4, "x", INT4)],
                  typmods={"amount": NUMERIC_12_2})  # fmt: skip
    assert classify(state, new, now, 200).heal


# ----------------------------------------------------------------------------- defaults


@pytest.mark.parametrize(
    ("text", "element"),
    [("{eu}", b"eu"), ('{"a,b"}', b"a,b"), ('{"x \\"y\\""}', b'x "y"'), ('{""}', b""),
     ('{"NULL"}', b"NULL"), ("{NULL}", None), ("{{1,2}}", None), ("eu", None),
     ("{(1,1),(0,0)}", b"(1,1),(0,0)")],
)  # fmt: skip
def test_element_text(text: str, element: bytes | None) -> None:
    assert _element_text(text) == element


@pytest.mark.parametrize(
    ("type_oid", "typmod", "text", "value"),
    [
        (TEXT, -1, "{eu}", "eu"),
        (INT4, -1, "{42}", 42),
        (INT8, -1, "{-9000000000}", -9_000_000_000),
        (BOOL, -1, "{t}", True),
        (NUMERIC, NUMERIC_12_2, "{12.50}", (1250).to_bytes(2, "big", signed=True).decode("latin-1")),
        (DATE, -1, "{2000-01-02}", 10_958),
        (TIMESTAMPTZ, -1, '{"2000-01-01 00:00:01+00"}', 946_684_801_000_000),
        (FLOAT8, -1, "{1.5}", 1.5),
        (FLOAT8, -1, "{NaN}", None),  # no JSON form: heals instead
    ],
)
def test_missing_default(type_oid: int, typmod: int, text: str, value: Any) -> None:
    default = _missing_default(CATALOG, type_oid, typmod, text)
    assert (default.value if default is not None else None) == value


# ----------------------------------------------------------------------------- encoding


def _encoded(table: TableVersion, values: list[bytes | None]) -> tuple[dict[str, Any], bytes]:
    wire = _Wire()
    encoder = TableEncoder(table, "pg.public.orders", "pg", "app", wire)  # type: ignore[arg-type]
    data = TupleData(
        tuple(KIND_NULL if v is None else KIND_TEXT for v in values), tuple(values)
    )
    _key, value = encoder.change(OP_CREATE, None, data, make_stamp(7, Lsn(0x10), 0), 0)
    return encoder.value_schema, value[len(encoder.value_header) :]


class _Wire:
    def header(self, topic: str, kind: str, schema: Any) -> bytes:
        return b""


def _read(schema: Any, body: bytes, reader: Any = None) -> dict[str, Any]:
    parsed = fastavro.parse_schema(schema)
    result: dict[str, Any] = fastavro.schemaless_reader(
        io.BytesIO(body), parsed, fastavro.parse_schema(reader) if reader is not None else None
    )
    return result


DEFAULTED = TableVersion(
    **{
        **_fields(version([("id", INT8), ("region", TEXT), ("n", INT4), ("flag", BOOL),
                           ("amount", NUMERIC, NUMERIC_12_2)])),  # fmt: skip
        "defaults": (None, ColumnDefault("eu"), ColumnDefault(7), ColumnDefault(True),
                     ColumnDefault((1250).to_bytes(2, "big", signed=True).decode("latin-1"))),  # fmt: skip
        "aliases": ((), ("area",), (), (), ()),
    }
)


def test_schema_lists_the_type_first_with_the_default_and_aliases() -> None:
    schema = envelope_schema("pg.public.orders", DEFAULTED)
    fields = {f["name"]: f for f in schema["fields"][0]["type"][1]["fields"]}
    assert fields["region"]["type"] == ["string", "null"] and fields["region"]["default"] == "eu"
    assert fields["region"]["aliases"] == ["area"]
    assert fields["n"]["type"] == ["int", "null"] and fields["n"]["default"] == 7
    assert fields["id"]["type"] == "long"
    fastavro.parse_schema(schema)  # a legal schema: every default matches its first branch


values = st.one_of(st.none(), st.text(max_size=20).map(lambda s: s.encode()))
ints = st.one_of(st.none(), st.integers(-(1 << 31), (1 << 31) - 1).map(lambda i: str(i).encode()))


@given(region=values, n=ints, flag=st.sampled_from([None, b"t", b"f"]),
       amount=st.sampled_from([None, b"0.00", b"-12.34", b"9999999999.99"]))  # fmt: skip
def test_value_first_fields_round_trip(
    region: bytes | None, n: bytes | None, flag: bytes | None, amount: bytes | None
) -> None:
    schema, body = _encoded(DEFAULTED, [b"1", region, n, flag, amount])
    after = _read(schema, body)["after"]
    assert after["region"] == (region.decode() if region is not None else None)
    assert after["n"] == (int(n) if n is not None else None)
    assert after["flag"] == ({b"t": True, b"f": False}[flag] if flag is not None else None)
    assert after["amount"] == (Decimal(amount.decode()) if amount is not None else None)


def test_old_record_resolves_to_the_default_and_renamed_field() -> None:
    old = version([("id", INT8), ("area", TEXT)])
    schema, body = _encoded(old, [b"5", b"north"])
    after = _read(schema, body, envelope_schema("pg.public.orders", DEFAULTED))["after"]
    assert after["region"] == "north"  # the alias
    assert after["n"] == 7 and after["flag"] is True
    # fastavro hands a default over in its Avro JSON form (no logical type applied):
    assert after["amount"] == (1250).to_bytes(2, "big", signed=True).decode("latin-1")


# ----------------------------------------------------------------------------- reuse and keys


def test_re_added_dropped_name_heals() -> None:
    dropped = version([("id", INT8), ("amount", NUMERIC, NUMERIC_12_2)])
    now = catalog([(1, "id", INT8), (3, "amount", NUMERIC)], typmods={"amount": NUMERIC_12_2})
    first = classify(baseline(), dropped, now, 200)
    assert first.kinds == (DROP,) and not first.heal and first.state.retired == ("status",)
    again = version([("id", INT8), ("amount", NUMERIC, NUMERIC_12_2), ("status", TEXT)])
    now2 = catalog([(1, "id", INT8), (3, "amount", NUMERIC), (4, "status", TEXT)],
                   typmods={"amount": NUMERIC_12_2})  # fmt: skip
    change = classify(first.state, again, now2, 300)
    # Older records carry "status" with the dropped column's values: heal.
    assert change.heal and change.state.retired == ()
    assert TableState.from_json(change.state.to_json()) == change.state


def test_new_column_under_an_alias_takes_it_over_and_heals() -> None:
    renamed = version([("id", INT8), ("state", TEXT), ("amount", NUMERIC, NUMERIC_12_2)])
    now = catalog([(1, "id", INT8), (2, "state", TEXT), (3, "amount", NUMERIC)], typmods={"amount": NUMERIC_12_2})
    first = classify(baseline(), renamed, now, 200).state
    assert first.columns[1].aliases == ("status",)
    reused = version([("id", INT8), ("state", TEXT), ("amount", NUMERIC, NUMERIC_12_2), ("status", TEXT)])
    now2 = catalog([(1, "id", INT8), (2, "state", TEXT), (3, "amount", NUMERIC), (4, "status", TEXT)],
                   typmods={"amount": NUMERIC_12_2})  # fmt: skip
    change = classify(first, reused, now2, 300)
    assert change.heal and change.state.columns[1].aliases == ()


def test_column_joining_the_key_stays_nullable_in_the_row() -> None:
    rekeyed = version([("id", INT8), ("status", TEXT), ("amount", NUMERIC, NUMERIC_12_2)], key=("id", "status"))
    state = classify(baseline(), rekeyed, BASE_CATALOG, 200).state
    annotated = annotate(rekeyed, state)
    assert annotated.nullable(1) and not annotated.nullable(0)
    schema = envelope_schema("pg.public.orders", annotated)
    fields = {f["name"]: f for f in schema["fields"][0]["type"][1]["fields"]}
    assert fields["status"]["type"] == ["null", "string"] and fields["id"]["type"] == "long"
    # A delete of the old identity (status null in its before image) resolves.
    old_schema, body = _encoded(BASE, [b"3", None, None])
    assert _read(old_schema, body, schema)["after"]["status"] is None
    # The key is the plain key record, whether joined from the row or not.
    wire = _Wire()
    encoder = TableEncoder(annotated, "pg.public.orders", "pg", "app", wire)  # type: ignore[arg-type]
    data = TupleData((KIND_TEXT, KIND_TEXT, KIND_NULL), (b"3", b"open", None))
    key, value = encoder.change(OP_CREATE, None, data, make_stamp(7, Lsn(0x10), 0), 0)
    assert key == encoder.key(data, make_stamp(7, Lsn(0x10), 0))
    assert key is not None and _read(encoder.key_schema, key) == {"id": 3, "status": "open"}
    assert _read(schema, value)["after"] == {"id": 3, "status": "open", "amount": None}


def test_nul_in_a_bytes_default_survives_the_state_record() -> None:
    state = baseline()
    nul = ColumnDefault("\x00\x01ab")
    with_default = TableState(**{**{f: getattr(state, f) for f in TableState.__slots__},  # type: ignore[attr-defined]
                                 "columns": (replace_default(state.columns[0], nul), *state.columns[1:])})
    data = with_default.to_json()


    assert "\\u0000" not in json.dumps(data)  # jsonb refuses NUL
    assert TableState.from_json(json.loads(json.dumps(data))) == with_default


def replace_fields(state: TableState, **changes: Any) -> TableState:
    from dataclasses import replace

    return replace(state, **changes)


def replace_default(column: Any, default: ColumnDefault) -> Any:
    from dataclasses import replace

    return replace(column, default=default)
