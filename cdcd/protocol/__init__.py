"""pgoutput protocol: bytes to typed messages. No I/O, no database or Kafka imports."""

from cdcd.errors import ProtocolError
from cdcd.protocol.decoder import PgOutputDecoder
from cdcd.protocol.lsn import INVALID_LSN, Lsn
from cdcd.protocol.messages import *  # noqa: F403
from cdcd.protocol.messages import Message, TupleData, pg_timestamp_to_unix_ms

__all__ = [
    "INVALID_LSN",
    "Lsn",
    "Message",
    "PgOutputDecoder",
    "ProtocolError",
    "TupleData",
    "pg_timestamp_to_unix_ms",
]
