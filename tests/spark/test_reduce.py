"""Executors reduce a batch before the driver sees it, and nothing changes in the mirror (issue 28).

:func:`cdcd.spark.decode.reduce_native` collapses each key's runs of
upserts to their last change (unchanged TOAST values filled from the run).
A seeded random stream of inserts, updates (half of them leaving a TOASTed
column unchanged), deletes, key changes and re-inserts, encoded by the
daemon's own encoder (:mod:`spark.envelopes`), is applied in batches to two
mirrors with history, one fed the decoded changes as they are and one fed
them reduced: the tables and the history tables must be equal, and the
reduced batches smaller.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")

from cdcd.consumer import SchemaCatalog  # noqa: E402
from cdcd.spark.decode import decode_native, reduce_native  # noqa: E402
from cdcd.spark.mirror import HistoryOptions, MirrorJob, MirrorStore, read_mirror  # noqa: E402
from spark.envelopes import UNCHANGED, Col, EnvelopeFactory, Message, kafka_batch  # noqa: E402
from spark.envelopes import table_version as make_table  # noqa: E402

TABLE = make_table("public", "t", [Col("id", 23, key=True), Col("n", 23), Col("big", 25)])


def _stream(seed: int) -> tuple[EnvelopeFactory, list[list[Message]]]:
    rng = random.Random(seed)
    factory = EnvelopeFactory()
    live: dict[int, tuple[int, str]] = {}
    batches: list[list[Message]] = []
    lsn = 100
    for _ in range(4):
        start = len(factory.messages)
        for _ in range(60):
            lsn += 16
            seq = 0
            for _ in range(rng.randint(1, 3)):  # several changes per transaction
                target = rng.choice(sorted(live)) if live and rng.random() < 0.8 else None
                roll = rng.random()
                if target is None:
                    key = rng.randrange(12)
                    if key in live:
                        continue
                    live[key] = (rng.randrange(100), f"big {lsn}")
                    factory.change(TABLE, "c", after=[key, *live[key]], lsn=lsn, seq=seq)
                elif roll < 0.6:
                    n, big = live[target]
                    keep = rng.random() < 0.5
                    live[target] = (n + 1, big if keep else f"big {lsn}.{seq}")
                    value = UNCHANGED if keep else live[target][1]
                    factory.change(TABLE, "u", after=[target, n + 1, value], lsn=lsn, seq=seq)
                elif roll < 0.8:
                    factory.change(TABLE, "d", before=[target, None, None], lsn=lsn, seq=seq)
                    del live[target]
                else:  # a key change keeps the TOASTed value: delete, tombstone, create
                    new = 100 + rng.randrange(50)
                    if new in live:
                        continue
                    n, big = live.pop(target)
                    factory.change(TABLE, "d", before=[target, None, None], lsn=lsn, seq=seq)
                    factory.change(TABLE, "c", after=[new, n, UNCHANGED], lsn=lsn, seq=seq + 2)
                    live[new] = (n, big)
                    seq += 2
                seq += 2
        batches.append(factory.messages[start:])
    return factory, batches


def _apply(root: Path, factory: EnvelopeFactory, batches: list[list[Message]], reduce: bool) -> int:
    catalog = SchemaCatalog("pg")
    for fingerprint, text in factory.published.items():
        import json

        from cdcd.consumer import fingerprint_header

        catalog.add(fingerprint_header(fingerprint), json.loads(text))
    store = MirrorStore(root)
    store.open()
    job = MirrorJob(store, catalog, history=HistoryOptions(all_tables=True))
    sent = 0
    for batch_id, messages in enumerate(batches):
        natives = decode_native(kafka_batch(messages), catalog.schema)
        if reduce:
            natives = [reduce_native(n, per_commit=True) for n in natives]
        sent += sum(n.changes.num_rows for n in natives)
        decoded: dict[str, list[Any]] = {}
        for native in natives:
            decoded.setdefault(native.topic, []).append(native)
        job.apply(batch_id, decoded)
    return sent


def _contents(root: Path) -> tuple[list[Any], list[Any]]:
    from deltalake import DeltaTable

    table = sorted(tuple(r.values()) for r in read_mirror(str(root / "public.t")).to_pylist())
    history = DeltaTable(str(root / "public.t" / "_history")).to_pyarrow_table()
    hidden = ["_cdcd_lsn", "_cdcd_seq", "__op"]  # which change of a transaction wrote it
    versions = sorted(tuple(r.values()) for r in history.drop_columns(hidden).to_pylist())
    return table, versions


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reduced_batches_make_the_same_mirror_and_history(seed: int, tmp_path: Path) -> None:
    factory, batches = _stream(seed)
    full = _apply(tmp_path / "full", factory, batches, reduce=False)
    reduced = _apply(tmp_path / "reduced", factory, batches, reduce=True)
    assert _contents(tmp_path / "reduced") == _contents(tmp_path / "full")
    assert reduced < full
    assert _contents(tmp_path / "full")[0]  # the table is not empty


def test_runs_collapse_to_their_last_change_without_history(tmp_path: Path) -> None:
    factory = EnvelopeFactory()
    for lsn in range(10, 60, 10):
        factory.change(TABLE, "c" if lsn == 10 else "u",
                       after=[1, lsn, "big" if lsn == 10 else UNCHANGED], lsn=lsn, seq=0)  # fmt: skip
    catalog = SchemaCatalog("pg")
    import json

    from cdcd.consumer import fingerprint_header

    for fingerprint, text in factory.published.items():
        catalog.add(fingerprint_header(fingerprint), json.loads(text))
    (native,) = decode_native(kafka_batch(factory.messages), catalog.schema)
    (row,) = reduce_native(native).changes.to_pylist()
    assert (row["op"], row["lsn"], row["after"], row["unchanged_toast"]) == (
        "c", 50, {"id": 1, "n": 50, "big": "big"}, [])  # fmt: skip
    assert reduce_native(native, per_commit=True).changes.num_rows == 5
