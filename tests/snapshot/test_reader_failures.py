"""A snapshot reader thread that fails with an exception of any type fails the snapshot, named.

No PostgreSQL: the readers' collaborators are replaced by fakes whose chunk
read raises ``RuntimeError`` (a stand-in for any bug: a decode error, an
assertion). The initial snapshot must raise an error that names the table,
instead of taking the dead reader for a finished one and waiting forever for
rows that never come (while /healthz stays green); the incremental
snapshot's worker must hand the failure to the main thread, named, instead
of dying with the request never answered.

Both run the code under test in a thread and wait for it with a generous
deadline: that deadline only turns a hang into a failure.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cdcd.decode.oids import INT4, TEXT
from cdcd.decode.relations import RelationCache
from cdcd.decode.types import StaticCatalog
from cdcd.errors import CdcdError
from cdcd.protocol.lsn import Lsn
from cdcd.protocol.messages import Column, Relation
from cdcd.snapshot import chunks, initial, ranges
from cdcd.snapshot.rows import TablePlan

HANG_GUARD_S = 60.0


def _plan() -> TablePlan:
    relation = Relation(None, 16_400, "public", "orders", "d",
                        (Column(1, "id", INT4, -1), Column(0, "note", TEXT, -1)))
    version, _ = RelationCache(StaticCatalog()).on_relation(relation)
    return TablePlan(version, '"id", "note"', ('"id"',), ("integer",),
                     catalog_columns=(("id", INT4, -1), ("note", TEXT, -1)))


class _Cursor:
    description: Any = None

    def execute(self, sql: str, params: Any = None) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Conn:
    closed = False
    server_version = 150000

    def cursor(self) -> _Cursor:
        return _Cursor()

    def close(self) -> None:
        pass


class _Db:
    conn = _Conn()

    def scalar(self, sql: str, params: Any = None) -> Any:
        return None


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("boom")


def _run_in_thread(target: Any, stop: threading.Event) -> list[Any]:
    """[result] or [exception] of ``target()``; a hang is stopped and reported."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    if thread.is_alive():
        stop.set()  # today's code: spins until stopped, then says "stopped"
        thread.join(HANG_GUARD_S)
        outcome.insert(0, "hung")
    return outcome


def test_initial_snapshot_reader_exception_fails_the_snapshot_naming_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = _plan()
    monkeypatch.setattr(initial, "plan_table", lambda *a, **k: plan)
    monkeypatch.setattr(initial, "estimate_rows", lambda *a, **k: 10)
    monkeypatch.setattr(ranges, "read_copy", _boom)
    # The lock-and-compare step reads the catalog: not what this test is about.
    monkeypatch.setattr(ranges, "_check", lambda *a: None)

    class Publisher:
        def snapshot_encoder(self, version: Any) -> Any:
            return object()

    class Tracker:
        failure = None

    stop = threading.Event()
    snapshot = initial.InitialSnapshot(
        initial.ExportedSnapshot("slot", Lsn(100), "snap", [_Db()]),  # type: ignore[list-item]
        [("public", "orders")],
        publisher=Publisher(),  # type: ignore[arg-type]
        tracker=Tracker(),  # type: ignore[arg-type]
        poll=lambda timeout: None,
        relations=RelationCache(StaticCatalog()),
        publication="cdcd",
        chunk_rows=100,
        metrics=None,
        stop=stop,
        beat=lambda: None,
        on_table_done=lambda name: None,
    )
    outcome = _run_in_thread(snapshot.run, stop)
    assert outcome and outcome[0] != "hung", (
        f"the initial snapshot did not end after its reader failed: {outcome}"
    )
    (error,) = outcome
    assert isinstance(error, CdcdError), f"expected a cdcd error naming the table, got {error!r}"
    assert "public.orders" in str(error) and "RuntimeError: boom" in str(error)


def test_incremental_chunk_worker_exception_fails_the_request_naming_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chunks, "connect", lambda *a, **k: _Conn())
    monkeypatch.setattr(chunks.ChunkWorker, "_chunk", _boom)
    worker = chunks.ChunkWorker("dbname=unused", 5.0)
    request = chunks.ChunkRequest("run:1", _plan(), None, 100)
    try:
        worker.submit(request)
        answered = request.ready.wait(HANG_GUARD_S)
        assert answered, "the chunk worker died without answering the request"
        assert isinstance(request.error, CdcdError)
        assert "public.orders" in str(request.error) and "RuntimeError: boom" in str(request.error)
        assert worker.alive, "the worker must keep serving requests"
    finally:
        worker.close()
