"""One error hierarchy for the whole daemon.

Every failure is either *transient* (the daemon retries with capped backoff and
resumes from the last confirmed LSN: connection loss, broker unavailable,
PostgreSQL restarting) or *definite* (retrying cannot help: the daemon stops
with exit code 3 and one line telling the operator what to change: slot lost,
a value that cannot be encoded, credentials refused). Configuration problems
are definite and map to exit code 2. Exit code 1 is a runtime failure that a
restart may cure (``StartupRetriesExhausted``). SPEC §2: a supervisor should
not restart on 2 or 3.
"""

from __future__ import annotations


class CdcdError(Exception):
    """Base of every error cdcd raises on purpose."""

    exit_code = 1


class TransientError(CdcdError):
    """Retrying later may succeed; progress resumes from the last confirmed LSN."""


class HintedError(CdcdError):
    """An error whose one line ends with ``hint``: what the operator should do."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}; {self.hint}" if self.hint else base


class StartupRetriesExhausted(HintedError):
    """Transient failures lasted the whole startup retry window (exit code 1).

    Not definite: an unreachable server may come back, so a supervisor's
    restart may cure it.
    """


class DefiniteError(HintedError):
    """Retrying cannot help (exit code 3). ``hint`` names what the operator must change."""

    exit_code = 3


class ConfigError(DefiniteError):
    """The configuration file or command line is invalid (exit code 2)."""

    exit_code = 2


class ProtocolError(DefiniteError):
    """The pgoutput byte stream could not be decoded.

    ``offset`` is the byte position within the message where decoding failed;
    the stream is never skipped past an undecodable message.
    """

    def __init__(self, message: str, offset: int, data: bytes | None = None) -> None:
        self.offset = offset
        self.data = data
        super().__init__(
            f"{message} at offset {offset}",
            hint="this is a bug or an unsupported server version; report it with the server version",
        )


class EncodeError(DefiniteError):
    """A value could not be represented in the envelope; names table, column and LSN."""
