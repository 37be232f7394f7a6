"""Sorting errors by SQLSTATE, without a server: what libpq's verbose text holds, by code.

The server-backed cases are in test_server_language.py; these pin the parsing
and the decisions for texts in other languages and for several hosts.
"""

from __future__ import annotations

import psycopg2
import psycopg2.errors
import pytest

from cdcd.errors import DefiniteError, TransientError
from cdcd.source.replication import classify_stream_error
from cdcd.source.sqlstate import error_code, is_refused_at_connect, sqlstates_in


def test_codes_are_read_from_verbose_text_in_any_language() -> None:
    text = (
        'connection to server at "10.0.0.1", port 5432 failed: Connection refused\n'
        'connection to server at "10.0.0.2", port 5432 failed: FATAL:  53300: '
        "tut mir leid, schon zu viele Verbindungen\n"
        'connection to server at "10.0.0.3", port 5432 failed: ВАЖНО:  28P01: '
        "пользователь не прошёл проверку подлинности\nLOCATION:  auth_failed, auth.c:334\n"
    )
    assert sqlstates_in(text) == ("53300", "28P01")
    assert sqlstates_in("FATAL:  Passwort-Authentifizierung fehlgeschlagen") == ()
    # A message that merely contains five capitals and a colon is not a code.
    assert sqlstates_in("FATAL:  could not open ABCDE: file") == ()


@pytest.mark.parametrize(
    ("code", "refused"),
    [("28P01", True), ("28000", True), ("3D000", True), ("42501", True), ("55000", True),
     ("57P03", False), ("53300", False), ("08006", False), ("57P01", False), ("XX000", False)],
)
def test_which_codes_refuse_a_connection_for_good(code: str, refused: bool) -> None:
    assert is_refused_at_connect(code) is refused


def test_error_code_falls_back_to_the_class() -> None:
    assert error_code(psycopg2.errors.UndefinedObject("irgendwas")) == "42704"
    assert error_code(psycopg2.OperationalError("server closed the connection")) == ""


@pytest.mark.parametrize(
    ("exc", "outcome"),
    [
        (psycopg2.errors.UndefinedObject("FEHLER:  Publikation »p« existiert nicht"), DefiniteError),
        (psycopg2.errors.ObjectNotInPrerequisiteState(
            "FEHLER:  kann nicht aus logischem Replikations-Slot »s« lesen"), DefiniteError),
        (psycopg2.errors.FeatureNotSupported("FEHLER:  proto_version nicht unterstützt"),
         DefiniteError),
        (psycopg2.errors.ObjectInUse("FEHLER:  Replikations-Slot »s« ist aktiv für PID 7"),
         TransientError),
        (psycopg2.errors.AdminShutdown("FATAL:  Verbindung wird abgebrochen"), TransientError),
        (psycopg2.OperationalError("server closed the connection unexpectedly"), TransientError),
    ],
    ids=["no publication", "slot invalidated", "protocol", "slot busy", "shutdown", "no code"],
)
def test_stream_errors_are_sorted_by_code_not_words(
    exc: psycopg2.Error, outcome: type[Exception]
) -> None:
    assert type(classify_stream_error(exc, "s")) is outcome
