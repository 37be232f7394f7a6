"""The rooms of ``cdcd.source`` without a server: the composed connection, row mapping, libpq.

The server-backed behaviour of each room is tested where the behaviour is
(tests/publication, tests/failover, tests/errors, ...); these pin what the
split into rooms must keep: every method callers use on ``SourceDatabase``,
the catalog row read in column order, one libpq shared by its two users.
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from cdcd.errors import DefiniteError
from cdcd.source import feedback, libpq, sqlstate
from cdcd.source.catalog import RelIdentity, _rel_identity
from cdcd.source.database import SourceDatabase
from cdcd.source.publication_plan import KEEP, SET_FULL, TableVerdict, listing

#: What the daemon, check, snapshots, resync and the tests call on a
#: ``SourceDatabase``, with the parameters they pass.
CALLED = {
    "close": "()",
    "unbounded": "()",
    "query": "(sql, params=None, *, purpose=None, passthrough=())",
    "scalar": "(sql, params=None)",
    "setting": "(name)",
    "current_wal_lsn": "()",
    "wal_sender_timeout_s": "()",
    "require_logical": "()",
    "publication_exists": "(name)",
    "publication_tables": "(name)",
    "table_exists": "(schema, table)",
    "identities": "(tables)",
    "tables_without_identity": "()",
    "resolve_tables": "(pg, exclude=())",
    "plan_publication": "(pg, *, exclude=())",
    "ensure_publication": "(pg, *, exclude=())",
    "slot_info": "(slot)",
    "slot_health": "(slot)",
    "lost_slot_error": "(info)",
    "ensure_slot": "(slot, create, two_phase, *, failover=False, beat=None, stop=None)",
    "create_slot": "(slot, two_phase, *, failover=False, beat=None, stop=None)",
    "set_failover": "(slot)",
    "verify_slot": "(info, two_phase)",
    "drop_slot": "(slot)",
    "primary_key": "(schema, table)",
    "relation_cache": "(catalog, *, snapshot=False)",
    "emit_heartbeat": "(prefix='cdcd.heartbeat', markers=None)",
}


def _parameters(function: Callable[..., Any]) -> str:
    """The parameters after ``self``, without annotations: ``(slot, two_phase, *, failover=False)``."""
    signature = inspect.signature(function)
    bare = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=bare[1:], return_annotation=signature.empty))


@pytest.mark.parametrize("name", sorted(CALLED))
def test_the_composed_connection_keeps_every_method_callers_use(name: str) -> None:
    assert _parameters(getattr(SourceDatabase, name)) == CALLED[name]


def test_the_composed_connection_keeps_its_properties_and_constructor() -> None:
    for name in ("server_version", "database"):
        assert isinstance(inspect.getattr_static(SourceDatabase, name), property), name
    assert _parameters(SourceDatabase.__init__) == "(dsn, timeout_s=10.0, *, bounded=True)"


def test_a_catalog_row_becomes_the_identity_in_column_order() -> None:
    # As _IDENTITY_COLUMNS selects them.
    row = ("shop", "orders", 'shop."orders"', 16401, "r", "i", "orders_ref", ["ref", "n"], True, "app")
    assert _rel_identity(row) == RelIdentity(
        schema="shop",
        table="orders",
        sql_name='shop."orders"',
        oid=16401,
        kind="r",
        identity="i",
        index="orders_ref",
        columns=("ref", "n"),
        has_primary_key=True,
        owner="app",
    )
    assert _rel_identity((*row[:7], None, False, "app")).columns == ()


def _relation(identity: str, columns: tuple[str, ...]) -> RelIdentity:
    return RelIdentity("s", "t", "s.t", 16400, "r", identity, None, columns, False, "o")


def test_a_filter_may_use_only_identity_columns_unless_the_identity_is_full() -> None:
    keyed = TableVerdict("s", "t", KEEP, _relation("d", ("id",)))
    assert keyed.outside_identity(("id", "region"), "updates and deletes") == ["region"]
    assert keyed.outside_identity(("id", "region"), "") == []
    assert keyed.identity_columns("updates", ["id", "region"]) == ("id",)
    opted_in = TableVerdict("s", "t", SET_FULL, _relation("d", ()))
    assert opted_in.outside_identity(("region",), "updates") == []
    assert opted_in.identity_columns("updates", ["id", "region"]) == ("id", "region")
    assert opted_in.identity_columns("", ["id", "region"]) == ()


def test_long_lists_are_cut_short() -> None:
    assert listing(["a", "b"]) == "a, b"
    assert listing([str(n) for n in range(8)]) == "0, 1, 2, 3, 4 and 3 more"


def test_feedback_and_sqlstate_share_one_libpq() -> None:
    put = libpq.function(
        "PQputCopyData", (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int), ctypes.c_int
    )
    assert put is not None
    assert feedback._put_copy_data() is put
    verbosity = sqlstate._set_error_verbosity()
    assert verbosity is not None
    # One handle, psycopg2's, serves both.
    library = libpq._library()
    assert library is not None and library.PQsetErrorVerbosity is verbosity


def test_a_missing_libpq_function_is_a_definite_error() -> None:
    assert libpq.function("PQnoSuchFunction", (), ctypes.c_int) is None
    with pytest.raises(DefiniteError, match="PQnoSuchFunction"):
        libpq.required("PQnoSuchFunction", (), ctypes.c_int)
