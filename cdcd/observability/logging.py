"""Structured logs on stderr: one line per record, text or JSON.

Why stderr and one line: systemd's journal and Kubernetes both collect a
process's stderr line by line; a multi-line record (except a traceback) would be
split into unrelated entries.

Text (the default) is for humans reading ``journalctl``::

    2026-11-21T19:34:27.123Z INFO cdcd.pipeline slot caught up lsn=16/B374D848 slot=cdcd

JSON lines are for log shippers. In both, context passed with
``log.info("...", extra={"lsn": lsn, "table": "public.orders"})`` appears as
fields; ``Lsn`` values print in their ``X/XXXXXXXX`` form.

Secrets are kept out of logs by never logging them (configuration is logged via
``CdcdConfig.redacted()``); ``SecretFilter`` masks ``password=…`` and URL
credentials in whatever reaches a handler anyway, as defence in depth.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, Literal, TextIO

__all__ = ["JsonFormatter", "SecretFilter", "TextFormatter", "mask_secrets", "setup_logging"]

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
) | {"message", "asctime", "taskName"}

_SECRET_VALUE = re.compile(
    r"""(?ix)
    (\b[\w.-]*(?:password|passwd|secret|token)["']?\s*[=:]\s*)  # key and separator
    ('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s,;&'"}\]\)]+)        # quoted or bare value
    """
)
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/:@\s]+:)([^@\s]+)(@)")
_MASK = "***"

_HANDLER_NAME = "cdcd-stderr"


def mask_secrets(text: str) -> str:
    """Replace ``password=…``-style values and ``scheme://user:pass@`` credentials with ``***``."""
    if not text:
        return text
    # An already masked value keeps its quotes, so the redacted configuration
    # logged as JSON at startup stays valid JSON.
    text = _SECRET_VALUE.sub(
        lambda m: m.group(0) if m.group(2).strip("'\"") == _MASK else m.group(1) + _MASK, text
    )
    return _URL_CREDENTIALS.sub(lambda m: m.group(1) + _MASK + m.group(3), text)


class SecretFilter(logging.Filter):
    """Masks secrets in the message and in string ``extra`` fields; never drops a record.

    The message is rendered here (``msg % args``) so that a secret passed as an
    argument is masked too; the record then carries the masked text and no args.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_secrets(message)
        if masked != message or record.args:
            record.msg = masked
            record.args = None
        for key, value in _extras(record).items():
            if isinstance(value, str):
                setattr(record, key, mask_secrets(value))
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS and not k.startswith("_")
    }


def _timestamp(record: logging.LogRecord) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z"
    )


def _plain(value: Any) -> Any:
    """JSON-native values stay as they are; anything else (``Lsn``, paths…) becomes its ``str``."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def _text_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """``<UTC time> <LEVEL> <logger> <message> key=value …``, traceback on following lines."""

    def format(self, record: logging.LogRecord) -> str:
        # An embedded newline would split the record into two journal entries.
        message = record.getMessage().replace("\n", "\\n")
        parts = [_timestamp(record), record.levelname, record.name, message]
        parts.extend(f"{key}={_text_value(value)}" for key, value in _extras(record).items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + mask_secrets(self.formatException(record.exc_info))
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message``, extras, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _extras(record).items():
            data.setdefault(key, _plain(value))
        if record.exc_info:
            data["exc"] = mask_secrets(self.formatException(record.exc_info))
        if record.stack_info:
            data["stack"] = self.formatStack(record.stack_info)
        return json.dumps(data, ensure_ascii=False)


def setup_logging(
    format: Literal["text", "json"] = "text",
    level: str | int = "INFO",
    *,
    stream: TextIO | None = None,
) -> logging.Handler:
    """Route every logger to one stderr handler in ``format`` at ``level``.

    Idempotent: calling it again (config reload, tests) replaces the handler it
    installed before instead of adding a second one. Python warnings are routed
    into the log too, so they get the same format.
    """
    if format == "json":
        formatter: logging.Formatter = JsonFormatter()
    elif format == "text":
        formatter = TextFormatter()
    else:
        raise ValueError(f"log format must be 'text' or 'json', not {format!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    handler.addFilter(SecretFilter())

    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == _HANDLER_NAME:
            root.removeHandler(old)
            old.close()
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)
    return handler
