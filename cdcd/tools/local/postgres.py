"""A throwaway PostgreSQL cluster for tests, ``cdcd demo`` and ``cdcd bench``.

The cluster is created with ``initdb`` in a fresh directory, listens on a free
loopback port and on a Unix socket in its own directory, and is configured for
logical replication (``wal_level=logical``, replication slots, wal senders and
prepared transactions). Authentication is ``trust`` and the superuser is
``postgres``: it is meant to live for the length of one test session or one
demo, never to hold data anyone cares about.

PostgreSQL refuses to run as root. When this process is root, every server
command runs as the ``postgres`` system user (created by the Debian package)
through ``runuser`` (or ``su``), and the directories the cluster needs are
created under ``/tmp`` and handed to that user: pytest's own temporary
directories (``/tmp/pytest-of-root``) are mode 700 and the server could not
traverse them.

Everything this module starts it stops by data directory (``pg_ctl stop -D``),
so it never signals a server it did not create.

One concern, one class: :class:`LocalPostgres` and what its lifecycle needs
(the binaries it runs are found by :mod:`cdcd.tools.local.binaries`).
"""

from __future__ import annotations

import atexit
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from cdcd.tools.local.binaries import (
    PostgresSetupError,
    find_bindir,
    has_server_binaries,
    installed_versions,
    server_env,
    server_major,
    server_user,
    versions_dir,
)
from cdcd.tools.local.databases import drop_database
from cdcd.tools.local.process import Throwaway, proc_stat_fields

__all__ = [
    "DEFAULT_SETTINGS",
    "LocalPostgres",
    "PostgresSetupError",
    "SettingValue",
    "find_bindir",
    "free_port",
    "installed_versions",
    "server_major",
    "versions_dir",
]

#: Type of a value in ``settings``: written to the configuration file as text.
SettingValue = str | int | float | bool

#: Settings every throwaway cluster gets; ``settings=`` adds to or overrides them.
#: ``fsync=off`` makes tests fast and is only acceptable because the cluster is
#: disposable; ``synchronous_commit`` and ``wal_sender_timeout`` stay at their
#: defaults so that tests see the behaviour of a real server.
DEFAULT_SETTINGS: Mapping[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "20",
    "max_wal_senders": "20",
    "max_prepared_transactions": "10",
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
}

#: The host every DSN of a local cluster points at (TCP, not the socket, so
#: that clients running as any user can connect).
HOST = "127.0.0.1"

_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_PORT_ATTEMPTS = 5
_START_TIMEOUT_S = 60
_RELOAD_TIMEOUT_S = 10.0


def free_port(host: str = HOST) -> int:
    """Return a TCP port on ``host`` that nothing listens on right now.

    Binding to port 0 lets the kernel pick; the socket is closed again, so the
    port may in principle be taken before the caller binds it. Callers retry
    when their bind fails.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _conf_value(value: SettingValue) -> str:
    """Render a setting value as a quoted postgresql.conf literal."""
    if isinstance(value, bool):
        text = "on" if value else "off"
    else:
        text = str(value)
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def _check_setting_name(name: str) -> None:
    """Reject names that could break out of a configuration line."""
    if not _SETTING_NAME.match(name):
        raise ValueError(f"not a PostgreSQL setting name: {name!r}")


class LocalPostgres(Throwaway):
    """One throwaway PostgreSQL cluster started by this process.

    Create it with :meth:`start`; use it as a context manager (or call
    :meth:`cleanup`) to stop the server and remove its directories. Layout of
    ``base_dir``: ``data/`` (the cluster), ``sock/`` (the Unix socket),
    ``postgres.log`` (server log), ``cdcd_local.conf`` (our settings,
    included from ``postgresql.conf``; ``ALTER SYSTEM`` still overrides it).
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        bindir: Path,
        run_as: str | None,
        owns_base_dir: bool,
        settings: Mapping[str, SettingValue],
    ) -> None:
        """Record where the cluster lives; use :meth:`start` to create one."""
        super().__init__(base_dir)
        self._bindir = bindir
        self._run_as = run_as
        self._owns_base = owns_base_dir
        self._settings: dict[str, SettingValue] = dict(settings)
        self._proc: subprocess.Popen[bytes] | None = None
        self._version: int | None = None

    # ------------------------------------------------------------------ creation

    @classmethod
    def start(
        cls,
        settings: Mapping[str, SettingValue] | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        version: int | None = None,
        bindir: str | os.PathLike[str] | None = None,
    ) -> LocalPostgres:
        """Create, configure and start a new cluster; return it once it accepts connections.

        ``version`` (a major, e.g. ``12``) picks that server from
        :func:`installed_versions`; ``bindir`` names a bin directory outright;
        neither: :func:`find_bindir`. ``settings`` adds to or overrides
        :data:`DEFAULT_SETTINGS` (for example
        ``{"logical_decoding_work_mem": "64kB"}`` or ``{"wal_level": "replica"}``;
        a setting the server version lacks makes it refuse to start).
        ``base_dir`` is created if missing, must be empty, and when running as
        root is handed to the ``postgres`` user (so its parents must be
        traversable by that user); :meth:`cleanup` then removes only what was
        created inside it. By default a fresh directory under ``/tmp`` is used
        and removed entirely.
        """
        if version is not None and bindir is not None:
            raise ValueError("give version or bindir, not both")
        if bindir is not None:
            chosen = Path(bindir)
            if not has_server_binaries(chosen):
                raise PostgresSetupError(f"{chosen} does not contain initdb, pg_ctl and postgres")
        else:
            chosen = find_bindir(version)
        run_as = server_user()
        merged: dict[str, SettingValue] = dict(DEFAULT_SETTINGS)
        for name, value in (settings or {}).items():
            _check_setting_name(name)
            merged[name] = value
        for reserved in ("port", "unix_socket_directories"):
            if reserved in merged:
                raise ValueError(f"{reserved} is chosen by LocalPostgres and cannot be set")

        owns = base_dir is None
        if base_dir is None:
            base = Path(tempfile.mkdtemp(prefix="cdcd-pg-", dir="/tmp"))
        else:
            base = Path(base_dir).resolve()
            base.mkdir(parents=True, exist_ok=True)
            if any(base.iterdir()):
                raise PostgresSetupError(f"base_dir {base} is not empty")
        cluster = cls(base, bindir=chosen, run_as=run_as, owns_base_dir=owns, settings=merged)
        cluster._bring_up(cluster._init, cluster._start_on_free_port)
        return cluster

    def _init(self) -> None:
        """Run initdb and write our configuration."""
        base = self._base
        base.chmod(0o755)
        self.sockdir.mkdir(mode=0o755, exist_ok=True)
        if self._run_as is not None:
            pw = pwd.getpwnam(self._run_as)
            for path in (base, self.sockdir):
                os.chown(path, pw.pw_uid, pw.pw_gid)
            probe = self._run(["test", "-w", str(base), "-a", "-x", str(base)], check=False)
            if probe.returncode != 0:
                raise PostgresSetupError(
                    f"user {self._run_as!r} cannot write to {base}: a parent directory is "
                    "not traversable by it (pytest's /tmp/pytest-of-root is mode 700); "
                    "use a directory directly under /tmp"
                )
        self._run(
            [
                str(self._bindir / "initdb"),
                "-D",
                str(self.datadir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]
        )
        with open(self.datadir / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("\n# added by cdcd.tools.local.postgres\ninclude = 'cdcd_local.conf'\n")

    def _write_local_conf(self) -> None:
        """Write ``cdcd_local.conf`` (settings, port and socket directory)."""
        lines = ["# written by cdcd.tools.local.postgres; ALTER SYSTEM overrides these"]
        for name, value in self._settings.items():
            lines.append(f"{name} = {_conf_value(value)}")
        lines.append(f"port = {self._port}")
        lines.append(f"unix_socket_directories = {_conf_value(str(self.sockdir))}")
        path = self.datadir / "cdcd_local.conf"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        if self._run_as is not None:
            pw = pwd.getpwnam(self._run_as)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _start_on_free_port(self) -> None:
        """Pick a free port and start; pick another if somebody took it meanwhile."""
        last_error: PostgresSetupError | None = None
        for _ in range(_PORT_ATTEMPTS):
            self._port = free_port()
            self._write_local_conf()
            try:
                self._launch()
                return
            except PostgresSetupError as exc:
                if "Address already in use" not in str(exc):
                    raise
                last_error = exc
        raise PostgresSetupError(
            f"no free port after {_PORT_ATTEMPTS} attempts: {last_error}"
        ) from last_error

    def _launch(self) -> None:
        """Start the postmaster and wait until it accepts connections.

        Not ``pg_ctl start``: that daemonizes the postmaster, which is then
        reparented to PID 1, and where PID 1 does not reap children (as in
        this project's CI containers) every stopped cluster stays behind as a
        zombie. Started with ``Popen`` (through ``runuser`` when root), the
        server stays in our process tree and is reaped by :meth:`stop`. It gets
        its own session so that a Ctrl-C aimed at ``cdcd demo`` does not reach
        it before the demo has cleaned up in order.
        """
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        argv = [str(self._bindir / "postgres"), "-D", str(self.datadir)]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._wrap(argv),
                cwd=self._base,
                env=server_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self._proc
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self._ready_pid() is not None:
                return
            if proc.poll() is not None:
                self._proc = None
                raise PostgresSetupError(
                    f"postgres exited with status {proc.returncode} while starting "
                    f"({self.datadir}); server log:\n{self._log_since(log_offset)}"
                )
            if time.monotonic() > deadline:
                self.stop("immediate")
                raise PostgresSetupError(
                    f"postgres did not become ready within {_START_TIMEOUT_S} s "
                    f"({self.datadir}); server log:\n{self._log_since(log_offset)}"
                )
            time.sleep(0.02)

    def _ready_pid(self) -> int | None:
        """The postmaster's PID if it is ours and reports ``ready`` in postmaster.pid.

        A ``postmaster.pid`` left by a killed server can say ``ready`` too, so
        the PID in it must belong to the process tree we started.
        """
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        try:
            lines = (self.datadir / "postmaster.pid").read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return None
        if len(lines) < 8 or not lines[0].strip().isdigit():
            return None
        pid = int(lines[0])
        if lines[7].strip() != "ready" or not _descends_from(pid, proc.pid):
            return None
        return pid

    def _log_since(self, offset: int) -> str:
        """The server log from ``offset`` on (for error messages)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                log.seek(offset)
                return log.read()[-4000:]
        except FileNotFoundError:
            return "(no server log)"

    def _wrap(self, argv: list[str]) -> list[str]:
        """Prefix ``argv`` so that it runs as the ``postgres`` user when we are root."""
        if self._run_as is None:
            return argv
        if shutil.which("runuser") is not None:
            return ["runuser", "-u", self._run_as, "--", *argv]
        return ["su", self._run_as, "-s", "/bin/sh", "-c", "exec " + shlex.join(argv)]

    def _run(self, argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a server command to completion, as the ``postgres`` user when we are root."""
        # cwd must be reachable by the server user: initdb fails with "could
        # not identify current directory" when started from /root.
        result = subprocess.run(
            self._wrap(argv),
            cwd=self._base,
            env=server_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )
        if check and result.returncode != 0:
            raise PostgresSetupError(
                f"{shlex.join(argv)} failed (exit {result.returncode}):\n"
                f"{result.stdout.strip()}\n{result.stderr.strip()}"
            )
        return result

    # ---------------------------------------------------------------- properties

    @property
    def host(self) -> str:
        """Address the server listens on (loopback TCP)."""
        return HOST

    @property
    def bindir(self) -> Path:
        """Directory of the server binaries in use (also has ``pg_recvlogical``)."""
        return self._bindir

    @property
    def version(self) -> int:
        """The server's major version (``postgres --version`` of :attr:`bindir`), e.g. ``12``."""
        if self._version is None:
            self._version = server_major(self._bindir)
        return self._version

    @property
    def datadir(self) -> Path:
        """The cluster's data directory (``PGDATA``)."""
        return self._base / "data"

    @property
    def sockdir(self) -> Path:
        """Directory of the server's Unix socket."""
        return self._base / "sock"

    @property
    def log_path(self) -> Path:
        """The server log file."""
        return self._base / "postgres.log"

    @property
    def settings(self) -> Mapping[str, SettingValue]:
        """Settings written at creation (``ALTER SYSTEM`` changes are not reflected)."""
        return dict(self._settings)

    @property
    def pid(self) -> int | None:
        """PID of the running postmaster, or ``None`` when it is not running."""
        return self._ready_pid()

    @property
    def running(self) -> bool:
        """Whether the server this object started is up and accepting connections."""
        return self._ready_pid() is not None

    # ------------------------------------------------------------------- clients

    def dsn(self, dbname: str = "postgres", **extra: object) -> str:
        """A libpq keyword/value DSN for ``dbname`` as superuser ``postgres``.

        ``extra`` adds or overrides keywords, e.g. ``application_name="x"`` or
        ``replication="database"``.
        """
        params: dict[str, Any] = {
            "host": HOST,
            "port": self._port,
            "dbname": dbname,
            "user": "postgres",
        }
        params.update(extra)
        # libpq quoting (make_dsn), in this order: what a reader of the DSN expects.
        dsn: str = psycopg2.extensions.make_dsn(**params)
        return dsn

    def connect(self, dbname: str = "postgres") -> psycopg2.extensions.connection:
        """A new autocommit psycopg2 connection; the caller closes it."""
        conn = psycopg2.connect(self.dsn(dbname))
        conn.autocommit = True
        return conn

    @contextmanager
    def connection(self, dbname: str = "postgres") -> Iterator[psycopg2.extensions.connection]:
        """Context manager around :meth:`connect` that closes the connection."""
        conn = self.connect(dbname)
        try:
            yield conn
        finally:
            conn.close()

    def execute(
        self,
        query: str | sql.Composable,
        params: Any = None,
        dbname: str = "postgres",
    ) -> list[tuple[Any, ...]]:
        """Run one statement in autocommit on a short-lived connection.

        Returns the result rows, or an empty list for statements without a
        result set.
        """
        with self.connection(dbname) as conn, conn.cursor() as cur:
            cur.execute(query, params)
            if cur.description is None:
                return []
            return [tuple(row) for row in cur.fetchall()]

    def create_database(self, name: str, template: str = "template1") -> None:
        """``CREATE DATABASE name``."""
        self.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )

    def drop_database(self, name: str) -> None:
        """Drop ``name`` with everything that would block it (:func:`drop_database`)."""
        drop_database(self.connection, name)

    # --------------------------------------------------------------- lifecycle

    def stop(self, mode: Literal["smart", "fast", "immediate"] = "fast") -> None:
        """Stop the server if it runs; a no-op otherwise (idempotent).

        ``pg_ctl stop -D`` on our own data directory signals only the server
        this object started; the process is then reaped.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            result = self._run(
                [
                    str(self._bindir / "pg_ctl"),
                    "stop",
                    "-D",
                    str(self.datadir),
                    "-m",
                    mode,
                    "-w",
                    "-t",
                    str(_START_TIMEOUT_S),
                ],
                check=False,
            )
            if result.returncode != 0 and proc.poll() is None:
                # No usable postmaster.pid yet (still starting): signal our
                # own child, which runuser forwards to the server.
                proc.terminate()
            try:
                proc.wait(timeout=_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise PostgresSetupError(
                    f"postgres for {self.datadir} did not stop: "
                    f"{result.stdout.strip()} {result.stderr.strip()}"
                ) from None
        self._proc = None

    def start_again(self) -> None:
        """Start a stopped cluster on the same port (after :meth:`stop`)."""
        if self._cleaned:
            raise PostgresSetupError("cluster was cleaned up; create a new one")
        if self.running:
            return
        # After a crash (SIGKILL of the postmaster) its children may still be
        # attached to shared memory for a moment: the new postmaster refuses
        # to start until they have gone.
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                self._launch()
                return
            except PostgresSetupError as exc:
                if "pre-existing shared memory block" not in str(exc):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def restart(self, mode: Literal["smart", "fast", "immediate"] = "fast") -> None:
        """Stop and start on the same port.

        ``mode="immediate"`` is a crash as far as the server is concerned: it
        aborts without a checkpoint and runs crash recovery on start.
        """
        self.stop(mode)
        self.start_again()

    def reload(self) -> None:
        """Re-read the configuration files and wait until new sessions see it.

        ``pg_reload_conf()`` only signals the postmaster; waiting on
        ``pg_conf_load_time()`` in fresh sessions makes the change visible to
        every connection opened after this returns.
        """
        before = self.execute("SELECT pg_conf_load_time()")[0][0]
        self.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + _RELOAD_TIMEOUT_S
        while self.execute("SELECT pg_conf_load_time()")[0][0] <= before:
            if time.monotonic() > deadline:
                raise PostgresSetupError("server did not reload its configuration within 10 s")
            time.sleep(0.02)

    def set_setting(self, name: str, value: SettingValue) -> bool:
        """``ALTER SYSTEM SET name = value``, then reload or restart as the setting needs.

        Returns ``True`` when a restart was needed (the setting has
        ``postmaster`` context, e.g. ``wal_level``).
        """
        _check_setting_name(name)
        text = ("on" if value else "off") if isinstance(value, bool) else str(value)
        context_rows = self.execute("SELECT context FROM pg_settings WHERE name = %s", (name,))
        if not context_rows:
            raise ValueError(f"unknown PostgreSQL setting: {name!r}")
        self.execute(
            sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(text))
        )
        if context_rows[0][0] == "postmaster":
            self.restart()
            return True
        self.reload()
        return False

    def show(self, name: str, dbname: str = "postgres") -> str:
        """``current_setting(name)`` as seen by a new session."""
        rows = self.execute("SELECT current_setting(%s)", (name,), dbname=dbname)
        value: str = rows[0][0]
        return value

    def cleanup(self) -> None:
        """Stop the server and remove the directories this object created (idempotent)."""
        if self._cleaned:
            return
        try:
            self.stop("immediate")
        finally:
            self._cleaned = True
            atexit.unregister(self._atexit_cleanup)
            if self._owns_base:
                shutil.rmtree(self._base, ignore_errors=True)
            else:
                for path in (self.datadir, self.sockdir):
                    shutil.rmtree(path, ignore_errors=True)
                self.log_path.unlink(missing_ok=True)

    def detach(self) -> dict[str, Any]:
        """Leave the server running after this process exits (``cdcd local up``).

        Returns what :meth:`stop_detached` needs to stop it later, from any
        process: nothing here stops or removes it any more.
        """
        atexit.unregister(self._atexit_cleanup)
        self._cleaned = True
        return {
            "base_dir": str(self._base),
            "owns_base_dir": self._owns_base,
            "bindir": str(self._bindir),
            "run_as": self._run_as,
            "port": self._port,
            "pid": self._ready_pid(),
        }

    @classmethod
    def stop_detached(cls, state: Mapping[str, Any]) -> None:
        """Stop a server :meth:`detach` left running (``pg_ctl stop`` on its data directory)
        and remove its directories."""
        cluster = cls(
            Path(state["base_dir"]),
            bindir=Path(state["bindir"]),
            run_as=state.get("run_as"),
            owns_base_dir=bool(state.get("owns_base_dir")),
            settings={},
        )
        atexit.unregister(cluster._atexit_cleanup)
        if (cluster.datadir / "postmaster.pid").exists():
            cluster._run(
                [str(cluster._bindir / "pg_ctl"), "stop", "-D", str(cluster.datadir), "-m", "fast",
                 "-w", "-t", str(_START_TIMEOUT_S)],
            )  # fmt: skip
        cluster._cleaned = False
        cluster.cleanup()  # nothing runs any more: only the directories go

    def __repr__(self) -> str:
        """Where the cluster listens and lives."""
        return f"LocalPostgres(port={self._port}, datadir={str(self.datadir)!r})"


def _descends_from(pid: int, ancestor: int, max_depth: int = 4) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (via ``/proc``)."""
    current = pid
    for _ in range(max_depth):
        if current == ancestor:
            return True
        fields = proc_stat_fields(current)
        if fields is None or fields[0] == "Z":
            return False
        current = int(fields[1])
    return current == ancestor
