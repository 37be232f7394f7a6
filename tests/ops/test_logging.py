"""Text and JSON log lines, context fields, and secret masking."""

from __future__ import annotations

import io
import json
import logging
import re
import warnings
from collections.abc import Iterator

import pytest

from cdcd.observability.logging import mask_secrets, setup_logging
from cdcd.protocol.lsn import Lsn

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ .*$"
)


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
        logging.captureWarnings(False)


def capture(fmt: str = "text", level: str = "INFO") -> io.StringIO:
    stream = io.StringIO()
    setup_logging(fmt, level, stream=stream)  # type: ignore[arg-type]
    return stream


def test_text_format() -> None:
    stream = capture()
    logging.getLogger("cdcd.pipeline").info(
        "slot caught up",
        extra={"lsn": Lsn(0x16_B374D848), "slot": "cdcd", "table": "public.orders"},
    )
    line = stream.getvalue().rstrip("\n")
    assert TEXT_LINE.match(line), line
    assert (
        " INFO cdcd.pipeline slot caught up lsn=16/B374D848 slot=cdcd table=public.orders" in line
    )


def test_text_quotes_values_with_spaces_and_escapes_newlines() -> None:
    stream = capture()
    logging.getLogger("cdcd.x").warning("two\nlines", extra={"topic": "a b", "empty": ""})
    (line,) = stream.getvalue().splitlines()
    assert 'two\\nlines topic="a b" empty=""' in line


def test_json_format() -> None:
    stream = capture("json")
    logging.getLogger("cdcd.sink").error(
        "delivery failed for %s",
        "pg.public.orders",
        extra={"topic": "pg.public.orders", "lsn": Lsn(0x1_00000010), "partition": 3},
    )
    record = json.loads(stream.getvalue())
    assert record["level"] == "ERROR"
    assert record["logger"] == "cdcd.sink"
    assert record["message"] == "delivery failed for pg.public.orders"
    assert record["topic"] == "pg.public.orders"
    assert record["lsn"] == "1/00000010"  # not the integer: Lsn prints as text
    assert record["partition"] == 3
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", record["ts"])


def test_json_exception_is_one_line() -> None:
    stream = capture("json")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("cdcd").exception("failed")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert "RuntimeError: boom" in json.loads(lines[0])["exc"]


def test_level_and_idempotent_setup() -> None:
    capture("text", "WARNING")
    stream = capture("text", "WARNING")
    root = logging.getLogger()
    assert sum(1 for h in root.handlers if h.get_name() == "cdcd-stderr") == 1
    logging.getLogger("cdcd").info("hidden")
    logging.getLogger("cdcd").warning("shown")
    assert stream.getvalue().count("\n") == 1
    assert "shown" in stream.getvalue()


def test_warnings_are_logged() -> None:
    stream = capture()
    warnings.warn("deprecated thing", UserWarning, stacklevel=1)
    assert "deprecated thing" in stream.getvalue()


def test_bad_format_rejected() -> None:
    with pytest.raises(ValueError):
        setup_logging("xml", "INFO")  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_secrets_are_masked(fmt: str) -> None:
    stream = capture(fmt)
    log = logging.getLogger("cdcd.source")
    log.info("connecting with host=db password=hunter2 user=cdc")
    log.info("dsn %s", "host=db password='s3 cret' dbname=app")
    log.info("retry", extra={"dsn": "postgresql://cdc:hunter3@db/app"})
    try:
        raise ConnectionError("could not connect: password=hunter4")
    except ConnectionError:
        log.exception("failed")
    out = stream.getvalue()
    for secret in ("hunter2", "s3 cret", "hunter3", "hunter4"):
        assert secret not in out
    assert "password=***" in out
    assert "cdc:***@db" in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("password=abc", "password=***"),
        ("PASSWORD = abc rest", "PASSWORD = *** rest"),
        ("sasl.password=abc,next=1", "sasl.password=***,next=1"),
        ("{'password': 'abc'}", "{'password': ***}"),
        ('{"db_password": "a b"}', '{"db_password": ***}'),
        ("token: xyz", "token: ***"),
        ("https://user:pw@registry:8081/x", "https://user:***@registry:8081/x"),
        ("nothing secret here lsn=0/16", "nothing secret here lsn=0/16"),
        ("", ""),
    ],
)
def test_mask_secrets(text: str, expected: str) -> None:
    assert mask_secrets(text) == expected
