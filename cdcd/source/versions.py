"""What the connected PostgreSQL offers cdcd, decided by its version (12 to 18).

cdcd never asks for a pgoutput option or reads a catalog column the server
lacks: every such choice is made here from ``server_version_num`` (psycopg2's
``connection.server_version``), not by trying and parsing the error.

=====================================  =====  ==============================
feature                                since  cdcd without it
=====================================  =====  ==============================
pgoutput protocol 1                    10
``pg_replication_slots.wal_status``    13     (12 never invalidates a slot:
                                              no ``max_slot_wal_keep_size``)
``logical_decoding_work_mem``          13     (12 decodes with a fixed limit)
``pg_current_snapshot()``              13     ``txid_current_snapshot()``
pgoutput ``messages`` option           14     heartbeats and watermarks are
                                              recognised by transaction id
                                              (:mod:`cdcd.source.markers`)
protocol 2 (``streaming``)             14     refused at startup
two-phase slots (``two_phase`` column) 14
protocol 3 (``two_phase``)             15     refused at startup
protocol 4 (``streaming parallel``)    16     refused at startup
``pg_replication_slots.conflicting``   16
failover slots, ``synced``,            17     ``postgres.failover`` refused
``invalidation_reason``,                      at startup
``inactive_since``
``publish_via_partition_root``         13     option not emitted (12 cannot
                                              publish a partitioned table)
row filters, column lists              15     ``where``/``columns`` refused
pgoutput ``origin`` option             16     ``origin: none`` refused
``publish_generated_columns``          18     refused (``true``)
=====================================  =====  ==============================
"""

from __future__ import annotations

from cdcd.errors import DefiniteError

__all__ = [
    "CONFLICTING_SINCE",
    "FAILOVER_SINCE",
    "GENERATED_COLUMNS_SINCE",
    "MESSAGES_SINCE",
    "ORIGIN_SINCE",
    "PROTOCOL_SINCE",
    "ROW_FILTER_SINCE",
    "VIA_ROOT_SINCE",
    "WAL_STATUS_SINCE",
    "has_decoding_work_mem",
    "has_failover_slots",
    "has_messages",
    "has_two_phase_slots",
    "has_wal_status",
    "max_protocol",
    "require_failover",
    "require_protocol",
    "version_text",
]

#: pgoutput protocol version -> the first server_version_num that speaks it.
PROTOCOL_SINCE: dict[int, int] = {1: 100000, 2: 140000, 3: 150000, 4: 160000}
#: pgoutput's ``messages`` option (``pg_logical_emit_message`` output).
MESSAGES_SINCE = 140000
#: ``pg_replication_slots.wal_status``.
WAL_STATUS_SINCE = 130000
_DECODING_WORK_MEM_SINCE = 130000
_TWO_PHASE_SLOTS_SINCE = 140000
#: ``pg_replication_slots.conflicting``.
CONFLICTING_SINCE = 160000
#: Failover slots and the slot columns that came with them (``failover``,
#: ``synced``, ``invalidation_reason``, ``inactive_since``).
FAILOVER_SINCE = 170000
#: The publication option ``publish_via_partition_root`` (``pg_publication.pubviaroot``).
VIA_ROOT_SINCE = 130000
#: Row filters and column lists (``pg_publication_rel.prqual``, ``prattrs``).
ROW_FILTER_SINCE = 150000
#: pgoutput's ``origin`` option (``none``: skip changes replicated from elsewhere).
ORIGIN_SINCE = 160000
#: ``publish_generated_columns`` (``pg_publication.pubgencols``).
GENERATED_COLUMNS_SINCE = 180000


def version_text(version_num: int) -> str:
    """``130023`` -> ``'13.23'`` (``90624`` -> ``'9.6.24'``)."""
    if version_num >= 100000:
        return f"{version_num // 10000}.{version_num % 10000}"
    return f"{version_num // 10000}.{version_num // 100 % 100}.{version_num % 100}"


def max_protocol(version_num: int) -> int:
    """The highest pgoutput protocol version the server speaks."""
    return max((p for p, since in PROTOCOL_SINCE.items() if version_num >= since), default=1)


def has_messages(version_num: int) -> bool:
    """Whether pgoutput sends logical decoding messages (the ``messages`` option)."""
    return version_num >= MESSAGES_SINCE


def has_wal_status(version_num: int) -> bool:
    """Whether ``pg_replication_slots`` has ``wal_status``."""
    return version_num >= WAL_STATUS_SINCE


def has_decoding_work_mem(version_num: int) -> bool:
    """Whether the server has ``logical_decoding_work_mem``."""
    return version_num >= _DECODING_WORK_MEM_SINCE


def has_two_phase_slots(version_num: int) -> bool:
    """Whether slots can be two-phase (``pg_replication_slots.two_phase``)."""
    return version_num >= _TWO_PHASE_SLOTS_SINCE


def has_failover_slots(version_num: int) -> bool:
    """Whether slots can be failover slots (and ``pg_replication_slots`` says why one was lost)."""
    return version_num >= FAILOVER_SINCE


def require_failover(version_num: int, failover: bool) -> None:
    """Refuse ``postgres.failover: true`` on a server without failover slots (one line, definite)."""
    if failover and not has_failover_slots(version_num):
        raise DefiniteError(
            f"postgres.failover needs PostgreSQL 17 or newer (failover slots), but the server is "
            f"PostgreSQL {version_text(version_num)}",
            hint="set postgres.failover: false (a promotion then needs 'cdcd resync', "
            "docs/failover.md)",
        )


def require_protocol(version_num: int, protocol_version: int) -> None:
    """Refuse a ``postgres.protocol_version`` the server does not speak (one line, definite).

    Said at startup, before a slot is created or anything is published:
    the walsender would refuse ``START_REPLICATION`` only after all that.
    """
    highest = max_protocol(version_num)
    if protocol_version <= highest:
        return
    since = version_text(PROTOCOL_SINCE[protocol_version]).split(".")[0]
    raise DefiniteError(
        f"postgres.protocol_version {protocol_version} needs PostgreSQL {since} or newer, "
        f"but the server is PostgreSQL {version_text(version_num)}, which speaks pgoutput "
        f"protocol {highest} at most",
        hint=f"set postgres.protocol_version to {highest}",
    )
