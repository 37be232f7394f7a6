"""Test hooks that shorten waits: unset means production timing, bad values are refused.

Integration tests that check the exit-1 path (a slot held by another
consumer, PostgreSQL unreachable) set ``CDCD_TEST_STARTUP_RETRY_S`` so they
do not wait the whole 30 s window; those of slot creation set
``CDCD_TEST_SLOT_WAIT_LOG_INTERVAL_S`` so the first report of what the
creation waits for comes after 1 s, not 5. A hook must never lengthen a
wait, and a value that is not a number must stop the daemon (exit 2)
instead of being ignored.
"""

from __future__ import annotations

import pytest

from cdcd.daemon import STARTUP_RETRY_ENV, STARTUP_RETRY_S, startup_retry_s
from cdcd.errors import ConfigError
from cdcd.source import database


def test_unset_or_empty_is_the_production_window() -> None:
    assert STARTUP_RETRY_S == 30.0
    assert startup_retry_s({}) == STARTUP_RETRY_S
    assert startup_retry_s({STARTUP_RETRY_ENV: " "}) == STARTUP_RETRY_S


def test_a_shorter_window_is_taken() -> None:
    assert startup_retry_s({STARTUP_RETRY_ENV: "4"}) == 4.0
    assert startup_retry_s({STARTUP_RETRY_ENV: "0.5"}) == 0.5


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "31", "nan", "inf"])
def test_other_values_are_a_config_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError) as error:
        startup_retry_s({STARTUP_RETRY_ENV: raw})
    assert STARTUP_RETRY_ENV in str(error.value) and error.value.exit_code == 2


def test_slot_wait_report_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    env = database.SLOT_WAIT_LOG_INTERVAL_ENV
    monkeypatch.delenv(env, raising=False)
    assert database._slot_wait_log_interval_s() == database.SLOT_WAIT_LOG_INTERVAL_S == 5.0
    monkeypatch.setenv(env, "1")
    assert database._slot_wait_log_interval_s() == 1.0
    for raw in ("soon", "0.5", "6", "nan"):
        monkeypatch.setenv(env, raw)
        with pytest.raises(ConfigError, match=env):
            database._slot_wait_log_interval_s()
