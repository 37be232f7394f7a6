"""A server that answers in German gets the same outcome as one that answers in English.

cdcd sorts a failed connection by the SQLSTATE the server sent, never by its
words (``cdcd.source.sqlstate``). The cluster here runs with
``lc_messages = 'de_DE.UTF-8'`` (Debian's PostgreSQL 15 ships the
translations; ``.ci/setup`` generates the locale): a wrong password, an
unknown role, an unknown database, no or a rejecting ``pg_hba.conf`` entry
are definite (exit 3 with the hint); shutting down / starting up (57P03) and
too many connections (53300) are transient (retried). Each case first checks
that the server's text really is German, so the test cannot pass by an
English message.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from support.cdc import PROJECT_ROOT, cdcd_argv, wait_for, write_config
from support.pg import drop_slot

from cdcd.errors import DefiniteError, TransientError
from cdcd.source.connection import connect
from cdcd.source.database import SourceDatabase
from cdcd.tools.local import LocalPostgres

GERMAN = "de_DE.UTF-8"
# cdc needs a password; the roles ghost (password) and phantom (trust) do not
# exist; "nobody" is rejected; "stranger" has no entry at all (the cluster's
# own connections, as postgres, stay trusted).
HBA = """\
host all cdc 127.0.0.1/32 scram-sha-256
host replication cdc 127.0.0.1/32 scram-sha-256
host all ghost 127.0.0.1/32 scram-sha-256
host all phantom 127.0.0.1/32 trust
host all nobody 127.0.0.1/32 reject
host all postgres 127.0.0.1/32 trust
host replication postgres 127.0.0.1/32 trust
"""


def _german_available() -> str | None:
    """Why this machine cannot run a German server, or None."""
    if not Path("/usr/share/locale/de/LC_MESSAGES/postgres-15.mo").exists():
        return "PostgreSQL's German message catalog is not installed"
    listed = subprocess.run(["locale", "-a"], capture_output=True, text=True).stdout.lower()
    if "de_de.utf8" not in listed.split():
        return "locale de_DE.UTF-8 is not generated (.ci/setup with CDCD_TEST_TOOLS=1 does it)"
    return None


pytestmark = pytest.mark.skipif(_german_available() is not None, reason=str(_german_available()))


def _german_cluster(**settings: Any) -> LocalPostgres:
    cluster = LocalPostgres.start(
        settings={"lc_messages": GERMAN, "password_encryption": "scram-sha-256", **settings},
        version=15,
    )
    cluster.execute("CREATE ROLE cdc LOGIN REPLICATION PASSWORD 'right'")
    cluster.execute("CREATE DATABASE app")
    hba = cluster.datadir / "pg_hba.conf"
    hba.write_text(HBA, encoding="utf-8")
    cluster.reload()
    return cluster


@pytest.fixture(scope="module")
def german() -> Iterator[LocalPostgres]:
    # Few connections, so that "too many connections" is cheap to reach.
    cluster = _german_cluster(max_connections=6, max_wal_senders=4, superuser_reserved_connections=0)
    try:
        yield cluster
    finally:
        cluster.cleanup()


def _dsn(cluster: LocalPostgres, **parts: str) -> str:
    values = {"host": "127.0.0.1", "port": str(cluster.port), "dbname": "app", "user": "cdc",
              "password": "right", **parts}
    return " ".join(f"{k}={v}" for k, v in values.items())


def _server_text(dsn: str) -> str:
    """What psycopg2 says for a connection attempt (the server's words, via libpq)."""
    try:
        psycopg2.connect(dsn).close()
    except psycopg2.OperationalError as exc:
        return str(exc)
    return "connected"


REFUSED = {
    # case: (dsn parts, a German word the server's message must contain)
    "wrong password": ({"password": "wrong"}, "Passwort-Authentifizierung"),
    "unknown role": ({"user": "ghost"}, "Passwort-Authentifizierung"),
    "unknown role, trusted": ({"user": "phantom"}, "Rolle"),
    "unknown database": ({"dbname": "nowhere"}, "existiert nicht"),
    "no pg_hba entry": ({"user": "stranger"}, "kein pg_hba.conf-Eintrag"),
    "rejecting pg_hba entry": ({"user": "nobody"}, "lehnt Verbindung ab"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("replication", [False, True], ids=["metadata", "walsender"])
def test_a_refused_connection_is_definite_in_german(
    german: LocalPostgres, case: str, replication: bool
) -> None:
    parts, word = REFUSED[case]
    dsn = _dsn(german, **parts)
    if not replication:
        assert word in _server_text(dsn), "the server does not answer in German"
    with pytest.raises(DefiniteError) as raised:
        connect(dsn, replication=replication, timeout_s=5)
    assert raised.value.exit_code == 3
    assert raised.value.hint
    assert "SQLSTATE" in str(raised.value)
    assert "wrong" not in str(raised.value)  # the password stays out of the message


def test_too_many_connections_is_transient_in_german(german: LocalPostgres) -> None:
    held: list[Any] = []
    try:
        # Fill every slot (max_connections=6, none reserved): the next one is refused.
        while True:
            try:
                held.append(psycopg2.connect(_dsn(german)))
            except psycopg2.OperationalError as exc:
                assert "zu viele" in str(exc), f"not German: {exc}"
                break
            assert len(held) <= 6, "max_connections is not in effect"
        with pytest.raises(TransientError) as raised:
            connect(_dsn(german), timeout_s=5)
        assert "53300" in str(raised.value)
    finally:
        for conn in held:
            conn.close()
    # And once a slot is free, the same connection works.
    wait_for(lambda: _server_text(_dsn(german)) == "connected", timeout_s=30,
             what="a free connection slot")


def test_a_server_shutting_down_is_transient_in_german() -> None:
    # 57P03 (cannot_connect_now) is "the database system is starting up" as
    # well as "... is shutting down": a smart shutdown that waits for one open
    # session keeps the server refusing new connections for as long as needed.
    cluster = _german_cluster()
    try:
        holder = psycopg2.connect(cluster.dsn())
        try:
            postmaster = cluster.pid
            assert postmaster is not None
            os.kill(postmaster, signal.SIGTERM)  # smart shutdown
            wait_for(lambda: "herunter" in _server_text(_dsn(cluster)), timeout_s=30,
                     what="the server to refuse connections while shutting down")
            with pytest.raises(TransientError) as raised:
                SourceDatabase(_dsn(cluster), timeout_s=5)
            assert "57P03" in str(raised.value)
        finally:
            holder.close()
    finally:
        cluster.cleanup()


def test_the_daemon_exits_3_for_a_wrong_password_in_german(
    german: LocalPostgres, tmp_path: Path
) -> None:
    """What a user sees: exit 3 and one line with the hint, at once, not retries."""
    config = write_config(
        tmp_path / "cdcd.yaml", _dsn(german, password="wrong"), "127.0.0.1:1", prefix="de"
    )
    result = subprocess.run(
        cdcd_argv("run", "-c", str(config), hooks={"cdcd.daemon.STARTUP_RETRY_S": 20.0}),
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120,
        # Today's text patterns would retry this for the whole (shortened) window, then exit 1.
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("cdcd: error")]
    assert result.returncode == 3, result.stderr
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "refused the connection" in errors[0] and "28P01" in errors[0], errors[0]
    assert "check the user, password and database" in errors[0], errors[0]


def test_stream_errors_are_sorted_by_sqlstate_in_german(german: LocalPostgres) -> None:
    """A missing slot stops (definite); a slot another connection streams from is retried."""
    from cdcd.protocol.lsn import Lsn
    from cdcd.source.replication import ReplicationStream

    dsn = german.dsn("app")
    german.execute("CREATE PUBLICATION pub FOR ALL TABLES", dbname="app")
    german.execute("SELECT pg_create_logical_replication_slot('busy', 'pgoutput')", dbname="app")
    missing = ReplicationStream(dsn, "nowhere", "pub", 1, timeout_s=5)
    first = ReplicationStream(dsn, "busy", "pub", 1, timeout_s=5)
    second = ReplicationStream(dsn, "busy", "pub", 1, timeout_s=5)
    try:
        with pytest.raises(DefiniteError) as raised:
            missing.start(Lsn(0))
        assert "existiert nicht" in str(raised.value) and "42704" in str(raised.value)
        first.start(Lsn(0))
        with pytest.raises(TransientError) as busy:
            second.start(Lsn(0))
        assert "in use by another connection" in str(busy.value), busy.value
    finally:
        for stream in (missing, first, second):
            stream.close()
        # The walsender lets the slot go a moment after its connection closes.
        with german.connection("app") as conn:
            drop_slot(conn, "busy")
