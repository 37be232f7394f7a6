"""Issue 24's pure pieces, no PostgreSQL: same-shape rewrites, the horizon, the check's signatures.

``classify`` is given a state, the version the stream (or the catalog check)
sees and the catalog, as ``SchemaChanges`` reads them; ``kept`` is the answer
of the row-age proof (``CatalogReader.rows_kept``), which needs a server.
"""

from __future__ import annotations

from cdcd.decode.oids import INT4, TEXT
from cdcd.decode.relations import RelationCache
from cdcd.decode.types import StaticCatalog
from cdcd.pipeline.schema_changes.classify import classify
from cdcd.pipeline.schema_changes.idle import _catalog_signature, _signature
from cdcd.pipeline.schema_changes.state import (
    ADD_NULL,
    ADD_REWRITE,
    REWRITE,
    CatalogColumn,
    CatalogTable,
    TableState,
)
from cdcd.protocol.messages import IDENTITY_DEFAULT, Column, Relation

RELID = 16_600
OLD_FILES, NEW_FILES = (16_601,), (16_700,)
HORIZON = (7 << 32) + 1_000  # an epoch-extended xid, as pg_snapshot_xmin gives it

VERSION, _ = RelationCache(StaticCatalog()).on_relation(
    Relation(None, RELID, "public", "t", IDENTITY_DEFAULT,
             (Column(1, "id", INT4, -1), Column(0, "qty", INT4, -1)))
)
WIDER, _ = RelationCache(StaticCatalog()).on_relation(
    Relation(None, RELID, "public", "t", IDENTITY_DEFAULT,
             (Column(1, "id", INT4, -1), Column(0, "qty", INT4, -1), Column(0, "note", TEXT, -1)))
)
COLUMNS = (CatalogColumn(1, "id", INT4, -1, None), CatalogColumn(2, "qty", INT4, -1, None))


def catalog(files: tuple[int, ...], horizon: int = HORIZON + 50, extra: bool = False) -> CatalogTable:
    columns = COLUMNS + ((CatalogColumn(3, "note", TEXT, -1, None),) if extra else ())
    return CatalogTable(RELID, files, columns, horizon=horizon)


def state() -> TableState:
    change = classify(None, VERSION, catalog(OLD_FILES, HORIZON), 100)
    assert change.state.horizon == HORIZON and change.state.storage == OLD_FILES
    return change.state


def test_the_horizon_is_recorded_and_survives_the_signal_table() -> None:
    recorded = state()
    assert TableState.from_json(recorded.to_json()) == recorded
    legacy = recorded.to_json()
    del legacy["horizon"]  # a state written before issue 24
    assert TableState.from_json(legacy).horizon is None


def test_same_shape_over_new_files_is_a_rewrite_that_heals() -> None:
    change = classify(state(), VERSION, catalog(NEW_FILES), 200)
    assert change.kinds == (REWRITE,) and change.heal and change.save
    assert change.state.storage == NEW_FILES and change.state.horizon == HORIZON + 50
    assert change.state.lsn == 200


def test_same_shape_over_new_files_with_rows_kept_records_them_without_heal() -> None:
    change = classify(state(), VERSION, catalog(NEW_FILES), 200, kept=True)
    assert not change.kinds and not change.heal and change.save
    assert change.state.storage == NEW_FILES


def test_same_shape_and_files_is_no_change() -> None:
    recorded = state()
    change = classify(recorded, VERSION, catalog(OLD_FILES), 200)
    assert not change.kinds and not change.save and change.state == recorded


def test_a_replay_older_than_the_state_never_heals() -> None:
    change = classify(state(), VERSION, catalog(NEW_FILES), 50)
    assert change.replay and not change.heal and not change.save


def test_a_column_added_over_files_whose_rows_were_kept_is_no_rewrite() -> None:
    # VACUUM FULL, then ADD COLUMN note: without the proof it looks like a rewrite.
    assert classify(state(), WIDER, catalog(NEW_FILES, extra=True), 200).kinds == (ADD_REWRITE,)
    change = classify(state(), WIDER, catalog(NEW_FILES, extra=True), 200, kept=True)
    assert change.kinds == (ADD_NULL,) and not change.heal


def test_the_checks_first_pass_matches_a_state_with_its_catalog_row() -> None:
    recorded = state()
    row = (RELID, "d", list(OLD_FILES), ["id"], ["id:23:-1", "qty:23:-1"])
    assert _signature(recorded) == _catalog_signature(row)
    for changed in ((RELID + 1, *row[1:]), (*row[:2], list(NEW_FILES), *row[3:]),
                    (*row[:3], ["id", "qty"], row[4]), (*row[:4], ["id:23:-1", "qty:20:-1"]),
                    (row[0], "f", *row[2:])):
        assert _signature(recorded) != _catalog_signature(changed), changed


def test_the_old_version_met_after_an_add_column_rewrite_leaves_the_files_to_the_new_one() -> None:
    # ALTER TABLE t ADD COLUMN note text DEFAULT random()::text committed before the
    # stream reached the old version's first use: the catalog is ahead, so the new
    # files belong to the later version (add_column_rewrite), not to this one.
    recorded = state()
    met = classify(recorded, VERSION, catalog(NEW_FILES, extra=True), 200)
    assert not met.kinds and not met.heal and met.state == recorded
    assert classify(met.state, WIDER, catalog(NEW_FILES, extra=True), 210).kinds == (ADD_REWRITE,)
