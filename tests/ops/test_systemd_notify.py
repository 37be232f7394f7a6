"""sd_notify against a real unix datagram socket, path and abstract namespace."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcd.observability import systemd


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    try:
        yield sock
    finally:
        sock.close()


def receive(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_ready_watchdog_stopping_status(notify_socket: socket.socket) -> None:
    assert systemd.notify_ready()
    assert receive(notify_socket) == "READY=1"
    assert systemd.notify_ready("streaming from slot cdcd")
    assert receive(notify_socket) == "READY=1\nSTATUS=streaming from slot cdcd"
    assert systemd.notify_watchdog()
    assert receive(notify_socket) == "WATCHDOG=1"
    assert systemd.notify_stopping("draining 12 messages")
    assert receive(notify_socket) == "STOPPING=1\nSTATUS=draining 12 messages"
    assert systemd.notify_status("snapshot public.orders\n40%")
    # A newline would start a new assignment; the status stays one line.
    assert receive(notify_socket) == "STATUS=snapshot public.orders 40%"


def test_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"cdcd-test-{os.getpid()}-{id(monkeypatch)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify_ready()
        assert receive(sock) == "READY=1"


def test_noop_without_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not systemd.notify_ready()
    assert not systemd.notify_watchdog()
    assert not systemd.notify_stopping()
    assert not systemd.notify_status("x")


def test_unreachable_socket_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "missing.sock"))
    with caplog.at_level(logging.WARNING, logger="cdcd.observability.systemd"):
        assert not systemd.notify_ready()
    assert "sd_notify failed" in caplog.text


def test_relative_socket_path_is_ignored(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "relative.sock")
    with caplog.at_level(logging.WARNING, logger="cdcd.observability.systemd"):
        assert not systemd.notify_ready()
    assert "ignoring NOTIFY_SOCKET" in caplog.text


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "60000000"}, 30.0),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "garbage"}, None),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert systemd.watchdog_interval_s(env) == expected


def test_watchdog_interval_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert systemd.watchdog_interval_s() == 2.0
    assert systemd.Watchdog().enabled


def test_watchdog_paces_pings() -> None:
    now = [0.0]
    sent: list[float] = []

    def send() -> bool:
        sent.append(now[0])
        return True

    watchdog = systemd.Watchdog(10.0, clock=lambda: now[0], send=send)
    assert watchdog.kick()  # first kick pings at once
    for step in range(1, 25):
        now[0] = float(step)
        watchdog.kick()
    assert sent == [0.0, 10.0, 20.0]


def test_watchdog_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    watchdog = systemd.Watchdog()
    assert not watchdog.enabled
    assert not watchdog.kick()


def test_watchdog_sends_real_datagrams(notify_socket: socket.socket) -> None:
    watchdog = systemd.Watchdog(0.0)
    assert watchdog.kick()
    assert receive(notify_socket) == "WATCHDOG=1"
