"""``cdcd demo`` end to end, the way a newcomer or a CI job runs it.

The demo is the README's first command, so these tests run the real thing as a
child process without a terminal: it must start PostgreSQL and the broker,
print decoded envelopes of several tables and every op, print status lines
with live figures, exit 0 when its ``--duration`` is up or on Ctrl-C, and leave
nothing behind -- no directory, no process, no listening port.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg2
import pytest
import yaml
from confluent_kafka.admin import AdminClient

pytestmark = pytest.mark.integration

PROJECT_ROOT = Path(__file__).resolve().parents[1]

#: ``  orders     u id=12     0/0192F858 #0   status: 'new' -> 'paid'``
CHANGE = re.compile(
    r"^  (?P<table>customers|orders)\s+(?P<op>[cudt]) (?P<key>\S+)\s+"
    r"(?P<lsn>[0-9A-F]+/[0-9A-F]{8}) #(?P<seq>\d+)\s+(?P<text>.*)$"
)
STATUS = re.compile(
    r"(?P<rate>\d+\.\d) events/s .*?(?P<events>\d+) events \(.*?\) in (?P<txns>\d+) txns"
    r".*?confirmed LSN (?P<confirmed>[0-9A-F]+/[0-9A-F]{8})"
    r".*?slot lag (?P<lag>[\d.]+ [kMG]?B)"
    r".*?commit->Kafka (?P<latency>\d+ ms avg|-)",
    re.DOTALL,
)
FILES = re.compile(r"(?P<addr>127\.0\.0\.1:\d+)\s+files in (?P<dir>/\S+)")


@dataclass
class Change:
    table: str
    op: str
    key: str
    lsn: str
    seq: int
    text: str


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return int(high, 16) << 32 | int(low, 16)


def _changes(output: str) -> list[Change]:
    found = []
    for line in output.splitlines():
        match = CHANGE.match(line)
        if match:
            found.append(
                Change(
                    match["table"],
                    match["op"],
                    match["key"],
                    match["lsn"],
                    int(match["seq"]),
                    match["text"],
                )
            )
    return found


def _status_blocks(output: str) -> list[re.Match[str]]:
    """Status lines, each joined with its continuation lines (three-space indent)."""
    blocks: list[str] = []
    for line in output.splitlines():
        if line.startswith("-- "):
            blocks.append(line)
        elif line.startswith("   ") and blocks and blocks[-1]:
            blocks[-1] += " | " + line.strip()
        elif blocks:
            blocks.append("")  # any other line ends the status block
    return [m for m in (STATUS.search(b) for b in blocks if b) if m is not None]


def _processes_mentioning(paths: list[str]) -> list[str]:
    """Processes whose command line or working directory is inside one of ``paths``."""
    hits = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if any(p in cmdline or cwd.startswith(p) for p in paths):
            hits.append(f"{entry.name}: {cmdline.strip()} (cwd {cwd})")
    return hits


def _listening(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def _assert_nothing_left(output: str) -> None:
    """The cluster and broker directories, processes and ports the demo printed are gone."""
    started = FILES.findall(output)
    assert len(started) == 2, f"expected PostgreSQL and broker lines with 'files in':\n{output}"
    dirs = [d for _, d in started]
    for directory in dirs:
        assert f"removed {directory}" in output, output
        assert not Path(directory).exists(), f"{directory} left behind"
    assert not _processes_mentioning(dirs)
    metrics = re.search(r"http://(127\.0\.0\.1:\d+)/metrics", output)
    assert metrics is not None, output
    for addr in [a for a, _ in started] + [metrics.group(1)]:
        assert not _listening(addr), f"something still listens on {addr}"


def _assert_changes_shown(output: str) -> list[Change]:
    changes = _changes(output)
    assert len(changes) >= 20, output
    tables = {c.table for c in changes}
    assert tables == {"customers", "orders"}, output
    ops = {c.op for c in changes}
    assert {"c", "u", "d"} <= ops, f"ops seen: {ops}\n{output}"
    assert {c.op for c in changes if c.table == "orders"} >= {"c", "u", "d"}, output
    # Decoded with the writer schemas: numeric, timestamptz, jsonb, text[].
    orders_c = [c.text for c in changes if c.table == "orders" and c.op == "c"]
    assert any(re.search(r"amount=\d+\.\d\d\b", t) for t in orders_c), orders_c
    assert any(re.search(r"created_at=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", t) for t in orders_c)
    assert any('payload=\'{"items": ' in t for t in orders_c), orders_c
    customers_c = [c.text for c in changes if c.table == "customers" and c.op == "c"]
    assert any(re.search(r"tags=\[", t) for t in customers_c), customers_c
    # REPLICA IDENTITY FULL on orders: updates show old -> new.
    assert any(
        "status: 'new' -> 'paid'" in c.text for c in changes if c.table == "orders" and c.op == "u"
    )
    # A multi-row transaction: several changes share one commit LSN, numbered in order.
    by_lsn: dict[str, list[int]] = {}
    for c in changes:
        by_lsn.setdefault(c.lsn, []).append(c.seq)
    assert any(len(seqs) >= 3 for seqs in by_lsn.values()), by_lsn
    for seqs in by_lsn.values():
        assert seqs == sorted(seqs), "changes of a transaction are shown in order"
    return changes


def _by_op(text: str) -> dict[str, int]:
    """``c 83, d 62, u 78`` as a dict."""
    return {op: int(n) for op, n in (item.split() for item in text.split(", ") if item)}


def _assert_summary(output: str, changes: list[Change]) -> None:
    written = re.search(
        r"writer\s+committed (\d+) changes in (\d+) transactions \(([^)]*)\)", output
    )
    published = re.search(r"cdcd\s+turned (\d+) changes into envelopes \(([^)]*)\)", output)
    decoded = re.search(
        r"consumer\s+decoded (\d+) envelopes and (\d+) tombstones from Kafka \(([^)]*)\)", output
    )
    assert written and published and decoded, output
    assert int(written[1]) == int(published[1]) == int(decoded[1]) == len(changes)
    # The same per op: the writer's rowcounts, cdcd_events_total, the consumer.
    shown: dict[str, int] = {}
    for c in changes:
        shown[c.op] = shown.get(c.op, 0) + 1
    assert _by_op(written[3]) == _by_op(published[2]) == _by_op(decoded[3]) == shown, output
    assert "disagree" not in output, output
    deletes = sum(1 for c in changes if c.op == "d")
    assert int(decoded[2]) == deletes, "one tombstone per delete of a keyed table"
    assert re.search(
        r"cdcd\s+drained and stopped; slot cdcd_demo confirmed up to [0-9A-F]+/", output
    )


def test_demo_with_duration_prints_envelopes_and_status_then_cleans_up() -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "cdcd", "demo", "--duration", "20"],
        cwd=PROJECT_ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    elapsed = time.monotonic() - started
    output = result.stdout
    assert result.returncode == 0, f"stdout:\n{output}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    assert "\x1b[" not in output, "no colors without a terminal"
    assert elapsed < 20 + 90, f"took {elapsed:.0f} s"
    assert "starting PostgreSQL 15 ..." in output and "starting the Kafka broker" in output

    changes = _assert_changes_shown(output)
    _assert_summary(output, changes)

    statuses = _status_blocks(output)
    assert len(statuses) >= 3, f"expected a status line every 5 s:\n{output}"
    last = statuses[-1]
    assert float(last["rate"]) > 0
    assert int(last["events"]) > 0 and int(last["txns"]) > 0
    assert last["confirmed"] != "0/00000000"
    assert last["latency"] != "-"
    confirmed = [_lsn(s["confirmed"]) for s in statuses]
    assert confirmed == sorted(confirmed) and confirmed[-1] > confirmed[0], "confirmed LSN advances"

    _assert_nothing_left(output)


def test_demo_stops_cleanly_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcd", "demo"],
        cwd=PROJECT_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        # Interrupt once the stream is well under way: a delete has been shown.
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "demo exited on its own:\n" + "".join(seen)
            assert time.monotonic() < deadline, "no delete within 120 s:\n" + "".join(seen)
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            seen.append(line)
            match = CHANGE.match(line.rstrip("\n"))
            if match and match["op"] == "d":
                break
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    while not lines.empty():
        seen.append(lines.get())
    output = "".join(seen)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert code == 0, f"stdout:\n{output}\nstderr:\n{stderr}"
    assert "\nstopping\n" in output
    changes = _changes(output)
    _assert_summary(output, changes)
    _assert_nothing_left(output)


def test_count_mismatches_compares_per_table_and_op() -> None:
    from cdcd.tools.demo.feed import count_mismatches

    written = {("public.orders", "c"): 58, ("public.orders", "u"): 10}
    # Equal totals, but five inserts missing behind five extra updates.
    published = {("public.orders", "c"): 53, ("public.orders", "u"): 15}
    assert count_mismatches(written, published, published) == [
        "public.orders c: written 58, published 53, decoded 53"
    ]
    # The consumer must decode exactly what was published.
    assert count_mismatches(written, written, {("public.orders", "c"): 58}) == [
        "public.orders u: written 10, published 10, decoded 0"
    ]
    # More published than written is someone else's change (psql): fine.
    more = {**written, ("public.customers", "d"): 1}
    assert count_mismatches(written, more, more) == []


def test_local_up_keeps_the_servers_and_down_removes_them(tmp_path: Path) -> None:
    """``cdcd local up`` (issue 29): both servers outlive the command, with a config that works."""
    directory = tmp_path / "local"

    def cdcd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cdcd", *args], capture_output=True,
                              text=True, timeout=120, cwd=PROJECT_ROOT)

    up = cdcd("local", "up", "--dir", str(directory))
    state = json.loads((directory / "local.json").read_text()) if up.returncode == 0 else None
    try:
        assert up.returncode == 0, up.stderr
        config = yaml.safe_load((directory / "cdcd.yaml").read_text())
        assert config["postgres"]["dsn"] in up.stdout and "cdcd local down" in up.stdout
        # The command has exited; both servers still answer, at the printed addresses.
        with psycopg2.connect(config["postgres"]["dsn"]) as conn, conn.cursor() as cur:
            cur.execute("SHOW wal_level")
            assert cur.fetchone() == ("logical",)
        admin = AdminClient({"bootstrap.servers": config["kafka"]["bootstrap_servers"]})
        assert admin.list_topics(timeout=10).brokers
        again = cdcd("local", "up", "--dir", str(directory))
        assert again.returncode == 2 and "already has servers running" in again.stderr
    finally:
        down = cdcd("local", "down", "--dir", str(directory))
    assert down.returncode == 0, down.stderr
    assert state is not None
    for server in ("postgres", "broker"):
        assert not Path(state[server]["base_dir"]).exists(), state[server]
        assert not _listening(f"127.0.0.1:{state[server]['port']}"), f"{server} still listens"
    assert not (directory / "local.json").exists()
    assert cdcd("local", "down", "--dir", str(directory)).returncode == 2
