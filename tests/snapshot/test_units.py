"""Unit tests: COPY text parsing, snapshot visibility and the chunk window's decisions."""

from __future__ import annotations

import pytest

from cdcd.config.model import SnapshotConfig
from cdcd.errors import DefiniteError
from cdcd.protocol.messages import KIND_NULL, KIND_TEXT
from cdcd.snapshot.incremental import ChunkWindow, Visibility
from cdcd.snapshot.rows import parse_copy

T, N = KIND_TEXT, KIND_NULL


def test_parse_copy_plain_rows_share_the_fast_path() -> None:
    rows = parse_copy(b"1\tabc\t\n2\t\\N\tx\n", 3, "t")
    assert [r.values for r in rows] == [(b"1", b"abc", b""), (b"2", None, b"x")]
    assert rows[0].kinds == bytes((T, T, T)) and rows[1].kinds == bytes((T, N, T))


def test_parse_copy_unescapes_every_escape_postgres_writes() -> None:
    # PostgreSQL doubles literal backslashes: the value  a\N  is written a\\N, not a NULL.
    line = b"tab\\there\tnl\\nx\\r\tback\\\\slash\ta\\\\N\t\\\\x41\t\\b\\f\\v\n"
    (row,) = parse_copy(line, 6, "t")
    assert row.values == (b"tab\there", b"nl\nx\r", b"back\\slash", b"a\\N", b"\\x41", b"\b\f\v")
    assert row.kinds == bytes((T,) * 6)


def test_parse_copy_rejects_a_row_of_the_wrong_width() -> None:
    with pytest.raises(DefiniteError, match="2 fields, expected 3"):
        parse_copy(b"1\t2\n", 3, "public.t")
    assert parse_copy(b"", 3, "t") == []


def test_visibility_of_in_progress_future_and_past_xids() -> None:
    snap = Visibility.parse("100:110:103,105")
    assert snap.sees(99) and snap.sees(104) and snap.sees(109)
    assert not snap.sees(103) and not snap.sees(105) and not snap.sees(110) and not snap.sees(5000)
    # 64-bit xids (epoch 3) compare with pgoutput's 32-bit ones modulo 2^32.
    epoch = Visibility.parse(f"{(3 << 32) + 100}:{(3 << 32) + 110}:{(3 << 32) + 103}")
    assert epoch.sees(104) and not epoch.sees(103) and not epoch.sees(111)
    # Around wraparound: xmax just past 2^32.
    wrap = Visibility.parse(f"{(1 << 32) - 5}:{(1 << 32) + 5}:")
    assert wrap.sees((1 << 32) - 2) and wrap.sees(3) and not wrap.sees(7)


def test_window_drops_keys_changed_after_the_low_watermark() -> None:
    window = ChunkWindow()
    window.record(50, b"k1")  # before the low watermark, visible to the read: kept
    window.low_seen = True
    window.record(60, b"k2")  # after it: the read may have missed it, the stream wins
    keys, truncated = window.superseded(Visibility.parse("55:70:"))
    assert keys == {b"k2"} and not truncated


def test_window_drops_keys_of_commits_that_raced_the_low_watermark() -> None:
    # xid 57 committed before the low watermark in the WAL but was still in
    # progress for the read's snapshot: the chunk holds the older row.
    window = ChunkWindow()
    window.record(57, b"raced")
    window.record(52, b"seen")
    window.low_seen = True
    keys, _ = window.superseded(Visibility.parse("55:70:57"))
    assert keys == {b"raced"}


def test_window_truncate_drops_the_chunk() -> None:
    window = ChunkWindow()
    window.low_seen = True
    window.record(61, None)
    assert window.superseded(Visibility.parse("55:70:")) == (set(), True)
    before = ChunkWindow()
    before.record(40, None)  # visible truncate before the read: the chunk is after it
    assert before.superseded(Visibility.parse("55:70:")) == (set(), False)
    before.record(58, None)  # invisible to the read: drop
    assert before.superseded(Visibility.parse("55:70:58"))[1]


def test_window_ignores_transactions_older_than_its_horizon() -> None:
    window = ChunkWindow(horizon=50)
    window.record(40, b"old")  # finished before the read began: not even kept
    window.record(57, b"raced")
    window.record(45, None)
    assert window.before_low == [(57, b"raced")] and window.truncates_before_low == []
    window.low_seen = True
    window.record(41, b"late")  # after the low watermark every change counts
    keys, truncated = window.superseded(Visibility.parse("55:70:57"))
    assert keys == {b"raced", b"late"} and not truncated


def test_incremental_chunks_default_to_three_initial_chunks_unless_set() -> None:
    assert SnapshotConfig().incremental_rows == 30_000
    assert SnapshotConfig(chunk_rows=500).incremental_rows == 1_500
    assert SnapshotConfig(chunk_rows=500, incremental_chunk_rows=200).incremental_rows == 200


def test_a_read_that_missed_a_transaction_published_before_its_window_is_found() -> None:
    read = Visibility.parse("100:110:104,107")
    # 104 was streamed before the window opened and the read still saw it in progress.
    assert ChunkWindow.unseen_earlier(read, [99, 104, 105]) == [104]
    # 107 was not streamed before the window (still running, or later: the window has it).
    assert ChunkWindow.unseen_earlier(read, [99, 105]) == []
    # 64-bit snapshot xids (epoch 1) against pgoutput's 32-bit ones.
    wide = Visibility.parse(f"{2**32 + 100}:{2**32 + 110}:{2**32 + 104}")
    assert ChunkWindow.unseen_earlier(wide, [104]) == [104]
    assert ChunkWindow.unseen_earlier(Visibility.parse("100:110:"), [104]) == []
